"""Inverted-file index over one chunk's keys, valid for the chunk at any position.

A chunk's keys rotated at chunk-LOCAL positions, R(s) k_s, are the same for every request that uses
the chunk: a query at position p, where the chunk starts at pos_base b, scores R(p - b) q . R(s) k_s.
So one index per (chunk, layer) serves every request; the caller turns the query into the chunk's
frame (by p - b) before searching.

Each KV head's keys are clustered by k-means (`kmeans`: torch, every KV head at once, on the keys'
device) into lists. A query scans the lists in order of its inner product with their centroids until
it has scanned `scan` of the keys, and keeps the exact top-k of what it scanned. On the default
model's real keys (2,048-token chunk, 4 keys a list) that finds 92% of the exact top-10 scanning 5%
of the keys (lists of 8: 86%, and 94% at 10%; `benchmarks/experiments/retrieval_recall.py --lists
256 512`). The first `sink` keys
(the chunk's first tokens draw a large share of attention) are not indexed: the caller attends to
them exactly.

Attention-aware build (`queries=`, the chunk's own prefill queries R(i) q_i with the RoPE cache):
queries and keys are differently distributed, and the centroid order is the weak part (probing lists
in order of their true best key would find 99% of the top-10 at the same scan). The chunk's queries
are turned to the offsets where later queries will meet the chunk (log-uniform in [n, the RoPE
cache's positions)); keys are clustered after whitening by those queries' second moment (k-means
then groups keys whose scores differ little for such queries), two levels deep: lists of ~4 keys in
groups of 16 lists; each group and each list gets a probe vector and bias fit by least squares so
that q . probe + bias predicts its best score q . k (centred per query). A query scores the group
probes, then the list probes of its best groups only (those holding 5x the keys it will scan), and
scans lists in that order. On two texts (6 layers, 2,048-token chunk), at 4.9% of the keys scanned:
0.94-0.95 of the exact top-10 (plain build 0.87-0.88 at 4.7%), top-32 0.83-0.87 (0.74-0.78), with
8% of the keys' count in probe products (plain: 12.5%, one per centroid); one level with lists of 8:
0.92; whitening alone: 0.90 (`benchmarks/experiments/retrieval_recall_aware.py`). Build (torch
k-means, one CPU thread, 3 KV heads): ~0.9-1.0 s per chunk-layer vs 0.12-0.14 s (faiss: 1.1-1.25 s
vs 0.06-0.09 s).

Why not faiss's k-means (used before): faiss-cpu runs on the CPU only and one problem a call, while
a 128K context needs ~1,800 chunk-layer builds of 8 KV heads each; the keys are on the GPU when a
chunk leaves it, where one batched k-means over several layers' heads takes milliseconds. faiss-gpu
has no wheel on PyPI. Lloyd's iterations are a few torch ops; the search itself is ours either way
(queries are turned per chunk, lists scanned by a share of keys, batched over chunks).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

from lazyrt.kernels.rope import RopeCache, apply_rope_ref

# lists of ~4 keys: finer lists give higher recall at the same scanned share (the default model,
# 2,048-token chunk, 5% scanned: recall@10 0.92 with lists of 4, 0.86 with lists of 8), at one
# centroid product a list (25% of the keys' count; a GPU's small cost)
KEYS_PER_LIST = 4
AWARE_KEYS_PER_LIST = 4  # attention-aware: lists of ~4 keys, 16 lists a group (two-level probing)
LISTS_PER_GROUP = 16


@dataclass
class KeyIndex:
    """One chunk, one layer, every KV head. Keys are the chunk's slots sink..num_keys-1."""

    centroids: torch.Tensor  # [kv_heads, lists, head_dim] fp32
    slots: torch.Tensor  # [kv_heads, num_keys - sink] int64: key slots, list by list
    offsets: torch.Tensor  # [kv_heads, lists + 1] int64: list i = slots[h, offsets[h, i] : offsets[h, i + 1]]
    list_of: torch.Tensor  # [kv_heads, num_keys - sink] int64: the list of each indexed slot (slot - sink)
    sink: int
    num_keys: int
    probes: torch.Tensor | None = None  # [kv_heads, lists, head_dim + 1] fp32: list score = q . p[:d] + p[d]
    # two levels (attention-aware build): lists in groups; a query scores the groups' probes, then only
    # the lists of its best groups, until those hold group_scan x the keys it will scan
    group_probes: torch.Tensor | None = None  # [kv_heads, groups, head_dim + 1] fp32
    group_of: torch.Tensor | None = None  # [kv_heads, lists] int64: the group of each list
    group_scan: float = 5.0

    @property
    def num_indexed(self) -> int:
        return self.num_keys - self.sink


def check_tensor(name: str, x: object, layout: str) -> None:
    """ValueError naming the argument unless x is a float tensor with as many dims as layout names
    ("[n, kv_heads, head_dim]")."""
    dims = layout.count(",") + 1
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a float tensor {layout}, got {type(x).__name__}")
    if x.dim() != dims:
        raise ValueError(f"{name} must be {layout}, got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"{name} must be a float tensor {layout}, got {x.dtype}")


def check_int(name: str, v: object, low: int | None) -> None:
    """ValueError naming the argument unless v is an integer (not a bool) >= low (None: any)."""
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or (low is not None and v < low):
        raise ValueError(f"{name}={v!r}: must be an integer" + ("" if low is None else f" >= {low}"))


def check_scan(scan: object) -> None:
    if isinstance(scan, bool) or not isinstance(scan, numbers.Real) or not 0.0 < scan <= 1.0:
        raise ValueError(f"scan={scan!r}: must be a number in (0, 1]")


def check_index(index: object, keys: torch.Tensor, name: str = "keys") -> None:
    """ValueError unless index is a KeyIndex over keys [num_keys, kv_heads, head_dim]."""
    if not isinstance(index, KeyIndex):
        raise ValueError(f"index must be a KeyIndex (build_key_index), got {type(index).__name__}")
    n, kv_heads, d = keys.shape
    if (index.num_keys, *index.centroids.shape[::2]) != (n, kv_heads, d):
        raise ValueError(
            f"index covers {index.num_keys} keys of {index.centroids.shape[0]} KV heads of dim "
            f"{index.centroids.shape[2]}; {name} {tuple(keys.shape)} are {n} keys of {kv_heads} of dim {d}"
        )


def build_key_index(
    keys: torch.Tensor,
    sink: int = 4,
    keys_per_list: int | None = None,
    seed: int = 0,
    queries: torch.Tensor | None = None,
    rope: RopeCache | None = None,
    ridge: float = 1e-2,
    lists_per_group: int = LISTS_PER_GROUP,
    group_scan: float = 5.0,
) -> KeyIndex:
    """keys [num_keys, kv_heads, head_dim]: the chunk's keys rotated at local positions 0..n-1.

    queries [num_queries, q_heads, head_dim] (optional): the chunk's prefill queries rotated at local
    positions 0..num_queries-1, with `rope` (the cache they were rotated with; its length bounds the
    offsets trained for): the attention-aware build (module docstring): lists of `keys_per_list` keys
    (default 4) in groups of `lists_per_group` lists (1: one level). Without them: k-means on the keys
    into lists of `keys_per_list` keys (default 8), probed by centroid."""
    check_tensor("keys", keys, "[num_keys, kv_heads, head_dim]")
    n, kv_heads, d = keys.shape
    if n < 1 or kv_heads < 1 or d < 1:
        raise ValueError(f"keys must be [num_keys, kv_heads, head_dim], none 0, got {tuple(keys.shape)}")
    check_int("sink", sink, 0)
    if not 0 <= sink < n:
        raise ValueError(f"sink={sink}: must be in [0, {n}) for a chunk of {n} keys")
    if keys_per_list is None:
        keys_per_list = KEYS_PER_LIST if queries is None else AWARE_KEYS_PER_LIST
    check_int("keys_per_list", keys_per_list, 1)
    check_int("lists_per_group", lists_per_group, 1)
    check_int("seed", seed, None)
    if isinstance(group_scan, bool) or not isinstance(group_scan, numbers.Real) or not group_scan >= 1:
        raise ValueError(f"group_scan={group_scan!r}: must be a number >= 1")
    if isinstance(ridge, bool) or not isinstance(ridge, numbers.Real) or not ridge >= 0:
        raise ValueError(f"ridge={ridge!r}: must be a number >= 0")
    m = n - sink
    lists = max(1, m // keys_per_list)
    groups = lists // lists_per_group if queries is not None else 0  # two levels: 2+ groups
    if queries is None:  # every KV head clustered at once, on the keys' device
        a, c = kmeans(keys[sink:].transpose(0, 1), lists, seed)
        # centroids held at bf16 precision: the device fill keeps them in bf16 (half the memory) and
        # scores lists exactly as the CPU fill does
        a, c = a.cpu(), c.to(torch.bfloat16).float().cpu()
        counts = _cluster_counts(a, lists)
        return KeyIndex(
            c,
            a.argsort(dim=1, stable=True) + sink,
            torch.cat([torch.zeros(kv_heads, 1, dtype=torch.int64), counts.cumsum(1)], 1),
            a,
            sink,
            n,
        )
    train = _training_queries(queries, rope, n, kv_heads, d, seed)  # [kv_heads, N, d]
    kh = keys[sink:].float().cpu().transpose(0, 1)  # [kv_heads, m, d]
    # whiten by the queries' second moment: E_q (q . (k - c))^2 = |W^T (k - c)|^2
    e, v = torch.linalg.eigh(train.transpose(1, 2) @ train / train.shape[1])
    x = kh @ (v * e.clamp(min=1e-6 * e.amax(-1, keepdim=True)).sqrt()[:, None, :])  # per head
    cents, slots, offsets, list_of, probes, group_probes, group_of = [], [], [], [], [], [], []
    flat = kmeans(x, lists, seed)[0] if groups < 2 else None  # one level: every KV head at once
    for h in range(kv_heads):
        if flat is not None:
            a = flat[h]
        else:
            ga, a, go = _two_level_kmeans(x[h], groups, lists, seed)
            group_probes.append(_fit_probes(train[h], kh[h], ga, torch.bincount(ga, minlength=groups), ridge))
            group_of.append(go)
        counts = torch.bincount(a, minlength=lists)
        # the lists' means in the keys' space (the clusters were made in the whitened one)
        c = torch.zeros(lists, d).index_add_(0, a, kh[h]) / counts.clamp(min=1)[:, None]
        probes.append(_fit_probes(train[h], kh[h], a, counts, ridge))
        order = torch.argsort(a, stable=True)
        cents.append(c)
        slots.append(order + sink)
        offsets.append(torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]))
        list_of.append(a)
    stack = torch.stack
    return KeyIndex(
        stack(cents),
        stack(slots),
        stack(offsets),
        stack(list_of),
        sink,
        n,
        stack(probes),
        stack(group_probes) if group_probes else None,
        stack(group_of) if group_of else None,
        group_scan,
    )


def kmeans(x: torch.Tensor, k: int, seed: int = 0, niter: int = 20) -> tuple[torch.Tensor, torch.Tensor]:
    """Lloyd's k-means of B independent problems at once, in fp32 on x's device.

    x [B, n, d] (B problems, e.g. KV heads, or layers x KV heads; any float dtype), 1 <= k <= n.
    Returns (assign [B, n] int64, centroids [B, k, d] fp32): every cluster holds at least one point and
    each centroid is the mean of its points. Starts from k distinct points drawn by a CPU generator
    seeded with `seed`: the same draw for every problem, so a problem gets the same clusters batched
    as alone. Runs at most `niter` rounds (assign each point to its nearest centroid, then move each
    centroid to its points' mean), fewer once no point changes cluster: then each point's cluster is
    also its nearest centroid. Deterministic for a given seed on a given device."""
    check_tensor("x", x, "[B, n, d]")
    b, n, _ = x.shape
    check_int("k", k, 1)
    if not 1 <= k <= n:
        raise ValueError(f"k={k}: must be in [1, n={n}]")
    check_int("niter", niter, 1)
    check_int("seed", seed, None)
    x = x.float()
    first = torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:k].to(x.device)
    cents = x[:, first]
    xx = x.square().sum(-1)  # [B, n]
    assign = None
    for _ in range(niter):
        # |x - c|^2 less |x|^2 (the same for every centroid of a point): one batched product, [B, k, n]
        # (on the CPU this layout's product is ~1.7x faster than [B, n, k])
        part = torch.baddbmm(cents.square().sum(-1)[:, :, None], cents, x.transpose(1, 2), alpha=-2.0)
        near, new = part.min(1)
        new = _fill_empty(new, near + xx, k)
        if assign is not None and torch.equal(new, assign):
            break
        assign = new
        cents = _cluster_means(x, assign, k)
    return assign, cents


def _cluster_counts(assign: torch.Tensor, k: int) -> torch.Tensor:
    return torch.zeros(assign.shape[0], k, dtype=torch.int64, device=assign.device).scatter_add_(
        1, assign, torch.ones_like(assign)
    )


def _fill_empty(assign: torch.Tensor, dist: torch.Tensor, k: int) -> torch.Tensor:
    """assign [B, n] with each empty cluster given one point: the points farthest from their centroid
    (dist [B, n]) move, farthest first, to the empty clusters in order. Each non-empty cluster keeps
    its lowest-numbered point, so a move never empties another cluster and, with k <= n, there are
    always enough points to move."""
    b, n = assign.shape
    empty = _cluster_counts(assign, k) == 0
    need = empty.sum(1, keepdim=True)  # [B, 1]
    most = int(need.max())
    if most == 0:
        return assign
    idx = torch.arange(n, device=assign.device)
    keep = torch.full((b, k), n, dtype=torch.int64, device=assign.device)
    keep.scatter_reduce_(1, assign, idx.expand(b, n), "amin")
    kept = keep.gather(1, assign) == idx
    far = dist.masked_fill(kept, float("-inf")).topk(most, 1).indices  # [B, most], farthest first
    targets = torch.sort((~empty).to(torch.int8), dim=1, stable=True).indices[:, :most]  # empty ones first
    use = torch.arange(most, device=assign.device) < need
    return assign.scatter(1, far, torch.where(use, targets, assign.gather(1, far)))


def _cluster_means(x: torch.Tensor, assign: torch.Tensor, k: int) -> torch.Tensor:
    """Mean of each cluster's points, [B, k, d] fp32 (0 for an empty one)."""
    b, n, d = x.shape
    counts = _cluster_counts(assign, k)
    if x.device.type == "cpu":  # index_add_ adds in index order here: deterministic, and the fastest
        flat = (assign + torch.arange(b)[:, None] * k).view(-1)
        sums = torch.zeros(b * k, d).index_add_(0, flat, x.reshape(b * n, d)).view(b, k, d)
    else:
        sums = _sorted_sums(x, assign, counts).float()
    return sums / counts.clamp(min=1)[..., None]


def _sorted_sums(x: torch.Tensor, assign: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Each cluster's sum of points [B, k, d] float64, by sorting the points by cluster and differencing
    a float64 running sum: no atomics (index_add_ on CUDA adds in no fixed order, so results would vary
    run to run), and float64 keeps the differences exact to fp32 precision."""
    b, n, d = x.shape
    k = counts.shape[1]
    order = assign.argsort(dim=1, stable=True)
    run = x.gather(1, order[..., None].expand(b, n, d)).double().cumsum(1)
    run = torch.cat([run.new_zeros(b, 1, d), run], 1)  # [B, n + 1, d]
    end = counts.cumsum(1)[..., None].expand(b, k, d)
    return run.gather(1, end) - run.gather(1, end - counts[..., None])


def _kmeans(x: torch.Tensor, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """kmeans of one problem x [n, d] into k <= n clusters: (assignment [n] int64, centroids [k, d])."""
    assign, cents = kmeans(x[None], k, seed)
    return assign[0], cents[0]


def _two_level_kmeans(x: torch.Tensor, groups: int, lists: int, seed: int):
    """k-means into `groups`, then each group into lists (their number in proportion to its size, in
    all `lists`). Returns (group of each point, list of each point, group of each list)."""
    ga, _ = _kmeans(x, groups, seed)
    size = torch.bincount(ga, minlength=groups)
    want = size.double() * lists / x.shape[0]
    alloc = torch.minimum(want.floor().long().clamp(min=1), size)
    alloc[size == 0] = 0
    while int(alloc.sum()) < lists:  # largest remainders first, never more lists than keys
        i = int(torch.where(alloc < size, want - alloc, float("-inf")).argmax())
        alloc[i] += 1
    while int(alloc.sum()) > lists:
        i = int(torch.where(alloc > 1, alloc.double() - want, float("-inf")).argmax())
        alloc[i] -= 1
    a = torch.empty(x.shape[0], dtype=torch.int64)
    first = torch.cat([torch.zeros(1, dtype=torch.int64), alloc.cumsum(0)])
    for g in range(groups):
        idx = (ga == g).nonzero()[:, 0]
        if len(idx):
            sub, _ = _kmeans(x[idx], int(alloc[g]), seed)
            a[idx] = sub + first[g]
    return ga, a, torch.repeat_interleave(torch.arange(groups), alloc)


def _training_queries(
    queries: torch.Tensor, rope: RopeCache | None, n: int, kv_heads: int, d: int, seed: int
) -> torch.Tensor:
    """The chunk's queries turned from their local position i to an offset t drawn log-uniformly in
    [max(n, num_queries), rope positions): where queries of later tokens meet the chunk.
    Returns [kv_heads, num_queries * group, d]."""
    check_tensor("queries", queries, "[num_queries, q_heads, head_dim]")
    if queries.shape[2] != d or not queries.shape[1] or queries.shape[1] % kv_heads:
        raise ValueError(
            f"queries must be [num_queries, q_heads, {d}] with q_heads a multiple of {kv_heads}, "
            f"got {tuple(queries.shape)}"
        )
    if rope is None:
        raise ValueError("queries need rope: the RoPE cache they were rotated with")
    nq, q_heads, _ = queries.shape
    if nq < 1:
        raise ValueError("queries: no query rows (num_queries must be >= 1)")
    top = rope.cos.shape[0]
    if top <= max(n, nq):
        raise ValueError(f"rope covers {top} positions: needs more than the chunk's {max(n, nq)}")
    lo = max(n, nq)  # every query after every key
    g = torch.Generator().manual_seed(seed)
    t = (torch.rand(nq, generator=g) * math.log(top / lo)).exp().mul(lo).long().clamp(lo, top - 1)
    q = apply_rope_ref(queries.float().cpu(), t - torch.arange(nq), rope)  # R(t - i) R(i) q_i = R(t) q_i
    group = q_heads // kv_heads
    return q.view(nq, kv_heads, group, d).permute(1, 0, 2, 3).reshape(kv_heads, nq * group, d)


def _fit_probes(q: torch.Tensor, keys: torch.Tensor, a: torch.Tensor, counts: torch.Tensor, ridge: float):
    """Per list, (p, b) minimizing sum_q (q . p + b - y_q)^2 + ridge * N * |(p, b)|^2, y_q = the list's
    best score for q centred over the lists. [lists, d + 1]."""
    nq, lists = q.shape[0], counts.shape[0]
    best = torch.full((nq, lists), float("-inf")).scatter_reduce(
        1, a.expand(nq, -1), q @ keys.T, "amax", include_self=True
    )
    empty = counts == 0
    if empty.any():  # never probed first: score them as the worst list
        best[:, empty] = best[:, ~empty].min(1, keepdim=True).values
    y = best - best.mean(1, keepdim=True)
    x = torch.cat([q, torch.ones(nq, 1)], 1)
    gram = x.T @ x + ridge * nq * torch.eye(x.shape[1])
    return torch.linalg.solve(gram, x.T @ y).T.contiguous()


def _probe(index: KeyIndex, h: int, qh: torch.Tensor, scan: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(the lists each query of KV head h scans [queries, lists] bool: best first until `scan` of the
    keys, at least one list; the products each spent choosing them [queries])."""
    sizes = index.offsets[h, 1:] - index.offsets[h, :-1]
    budget = scan * index.num_indexed
    if index.probes is None:
        score = qh @ index.centroids[h].T
    else:
        p = index.probes[h]
        score = qh @ p[:, :-1].T + p[:, -1]
    products = torch.full((qh.shape[0],), float(score.shape[1]))
    allowed = None
    if index.group_probes is not None:  # groups best first until they hold group_scan x the budget
        gp, go = index.group_probes[h], index.group_of[h]
        gsizes = torch.zeros(gp.shape[0], dtype=torch.int64).index_add_(0, go, sizes)
        gorder = (qh @ gp[:, :-1].T + gp[:, -1]).argsort(-1, descending=True)
        held = gsizes[gorder].cumsum(-1)
        gtake = (held - gsizes[gorder]) < min(index.group_scan * budget, index.num_indexed)
        gsel = torch.zeros_like(gtake).scatter(1, gorder, gtake)
        allowed = gsel[:, go]  # [queries, lists]: only these lists' probes are scored
        score = score.masked_fill(~allowed, float("-inf"))
        products = gp.shape[0] + allowed.sum(-1).float()
    order = score.argsort(-1, descending=True)
    take = sizes[order].cumsum(-1) <= budget
    take[:, 0] = True
    if allowed is not None:
        take &= allowed.gather(1, order)
    return torch.zeros_like(take).scatter(1, order, take), products


def search_key_index(
    index: KeyIndex, keys: torch.Tensor, q: torch.Tensor, top_k: int, scan: float
) -> tuple[torch.Tensor, float]:
    """Top-k indexed key slots of each query head: ([m, q_heads, top_k] int64, -1 where fewer keys were
    scanned; the share of indexed keys scanned). q [m, q_heads, head_dim] in the chunk's frame; keys
    [num_keys, kv_heads, head_dim] rotated at local positions (the ones the index was built from)."""
    check_scan(scan)
    check_int("top_k", top_k, 1)
    check_tensor("keys", keys, "[num_keys, kv_heads, head_dim]")
    check_index(index, keys)
    check_tensor("q", q, "[m, q_heads, head_dim]")
    m, q_heads, d = q.shape
    kv_heads = index.centroids.shape[0]
    if d != keys.shape[2] or not q_heads or q_heads % kv_heads:
        raise ValueError(
            f"q must be [m, q_heads, {keys.shape[2]}] with q_heads a multiple of {kv_heads}, "
            f"got {tuple(q.shape)}"
        )
    group = q_heads // kv_heads
    k = min(top_k, index.num_indexed)
    qg = q.float().view(m, kv_heads, group, d).transpose(0, 1).reshape(kv_heads, m * group, d)
    # the lists each query scans (per KV head: the probes differ), then every head's keys at once:
    # all scores in one batched product, the unscanned ones masked (cheaper here than gathering)
    probed = torch.stack([_probe(index, h, qg[h], scan)[0] for h in range(kv_heads)])  # [H, Q, lists]
    n = index.num_indexed
    cand = torch.gather(probed, 2, index.list_of[:, None, :].expand(kv_heads, m * group, n))
    kk = keys[index.sink :].float().permute(1, 2, 0)  # [H, d, n]
    scores = torch.bmm(qg, kk).masked_fill_(~cand, float("-inf"))
    best = scores.topk(k, -1)
    slots = torch.where(best.values > float("-inf"), best.indices + index.sink, -1)  # [H, Q, k]
    out = torch.full((m, q_heads, top_k), -1, dtype=torch.int64)
    out[:, :, :k] = slots.view(kv_heads, m, group, k).transpose(0, 1).reshape(m, q_heads, k)
    return out, int(cand.sum()) / max(1, m * q_heads * n)
