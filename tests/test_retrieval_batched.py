"""The batched HostAttention.fill (every host part of a layer at once) against its per-part torch
reference (fill_reference: retrieval_attention_ref part by part, the previous fill): ragged parts
(different tokens, top-k and sink, several query rows, pages out of order), exact and approximate."""

from __future__ import annotations

import random

import pytest
import torch

from lazyrt.kernels.rope import RopeCache
from lazyrt.retrieval import host_attention
from lazyrt.retrieval.host_attention import HostAttention, HostIndexCache, HostPart, RetrievalOptions


class _Rope:
    rope_theta, rope_scaling = 10000.0, None

    def __init__(self, rotary_dim: int):
        self.rotary_dim = rotary_dim


def _parts(rng: random.Random, num_pages: int, ps: int, shapes: list[tuple[int, int, int | None]]):
    """HostParts over disjoint random (not consecutive) pages: shapes (tokens, query rows, top_k)."""
    free = list(range(num_pages))
    rng.shuffle(free)
    parts, row, pair = [], 0, 0
    for n, m, top_k in shapes:
        pages = tuple(free.pop() for _ in range(-(-n // ps)))
        parts.append(HostPart(range(row, row + m), pages, n, rng.randint(n, 900), pair, top_k))
        row, pair = row + m, pair + m
    return parts, row


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("exact", [False, True])
def test_batched_fill_equals_the_per_part_reference(dtype, exact, monkeypatch):
    rng = random.Random()
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    ps, layers, kvh, group, d = 8, 2, 2, 3, 32
    rope = RopeCache.build(_Rope(rng.choice([d, d // 2])), 1024)  # partial rotary too
    host_kv = torch.randn(200, layers, 2, ps, kvh, d, generator=g).to(dtype)
    big = 10**6 if exact else None
    # the engine's top-k (None) and a request's own; some chunks twice the size; one tiny (top-k covers it)
    shapes = [(rng.randint(150, 200), rng.randint(1, 3), big) for _ in range(3)]
    shapes += [(shapes[0][0], 2, big or 12), (rng.randint(300, 360), 1, big), (5, 2, None)]
    shapes += [(shapes[0][0], 1, big)]
    parts, rows = _parts(rng, host_kv.shape[0], ps, shapes)
    top_k = 10**6 if exact else 20
    opts = RetrievalOptions(top_k, sink=rng.choice([1, 4]), scan=0.05, exact_prefill=False)
    q = torch.randn(rows, kvh * group, d, generator=g)
    cache = HostIndexCache()
    for layer in range(layers):
        monkeypatch.setattr(host_attention, "WORK_ELEMENTS", 1 << 22)
        want_o, want_l = torch.zeros(rows, kvh * group, d), torch.zeros(rows, kvh * group)
        HostAttention(parts, host_kv, rope, d**-0.5, opts, cache).fill_reference(layer, q, want_o, want_l)
        o, lse = torch.full_like(want_o, float("nan")), torch.full_like(want_l, float("nan"))
        ha = HostAttention(parts, host_kv, rope, d**-0.5, opts, cache)
        for blocks in (False, True):  # the second call reuses the step's plan and the cached stacks
            if blocks:  # and scores / sums a few query heads at a time
                monkeypatch.setattr(host_attention, "WORK_ELEMENTS", 40 * d)  # 1-2 rows a block
            ha.fill(layer, q, o, lse)
            if exact:
                torch.testing.assert_close(o, want_o, atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(lse, want_l, atol=1e-5, rtol=1e-5)
            else:
                _assert_same(o, lse, want_o, want_l)
    assert cache.builds == (0 if exact else 2 * (len(parts) - 1))  # the tiny chunk is always exact


def _assert_same(o, lse, want_o, want_l) -> None:
    """Approximate retrieval equals its reference: both take the same lists (the budget is a whole
    number of keys where it is 2 x top-k, so a list ending exactly there is scanned by both; before
    that was so, rounding made the two paths differ in 1-11 (row, head) pairs of ~5% of runs)."""
    assert torch.isfinite(o).all() and torch.isfinite(lse).all()
    torch.testing.assert_close(o, want_o, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, want_l, atol=1e-5, rtol=1e-5)


def test_largest_is_topk():
    """_largest (numpy partition / sort of packed keys) picks what torch.topk does: ordered, and as a
    set, with negative scores and -inf (unscanned) entries."""
    from lazyrt.retrieval.host_attention import _largest

    x = torch.randn(3, 5, 40) * 10
    x[..., 25:] = float("-inf")
    for k in (1, 7, 25, 40):
        want = x.topk(k, -1)
        if k <= 25:  # ties (-inf) aside, the order is the same
            assert torch.equal(_largest(x, k, ordered=True), want.indices)
        got = _largest(x, k, ordered=False)
        assert torch.equal(x.gather(-1, got).sort(-1).values, want.values.sort(-1).values)


def _setup(rng: random.Random, dtype=torch.float32):
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    ps, layers, kvh, group, d = 8, 2, 2, 3, 32
    rope = RopeCache.build(_Rope(d), 1024)
    host_kv = torch.randn(120, layers, 2, ps, kvh, d, generator=g).to(dtype)
    shapes = [(rng.randint(150, 200), rng.randint(1, 2), None) for _ in range(4)]
    parts, rows = _parts(rng, host_kv.shape[0], ps, shapes)
    q = torch.randn(rows, kvh * group, d, generator=g)
    return host_kv, rope, parts, rows, q, d


def test_background_builds_attend_exactly_until_the_index_is_ready():
    """build_threads=1: while a part's index is queued the part is attended exactly (= the fill with
    top-k covering every key); once built, the fill searches (= the per-part reference over the same
    indexes). The builder is held busy first, so nothing is built before the first fill."""
    import threading

    rng = random.Random()
    host_kv, rope, parts, rows, q, d = _setup(rng)
    heads = q.shape[1]
    approx = RetrievalOptions(20, 4, 0.05, build_threads=1, exact_prefill=False)
    exact = RetrievalOptions(10**6, 4, 0.05)
    cache = HostIndexCache(build_threads=1)
    hold = threading.Event()
    assert cache.ready(((), 0, 0, 0), lambda: hold.wait(30) and None) is None  # occupies the builder
    for layer in range(2):
        o, lse = torch.zeros(rows, heads, d), torch.zeros(rows, heads)
        HostAttention(parts, host_kv, rope, d**-0.5, approx, cache).fill(layer, q, o, lse)
        want_o, want_l = torch.zeros_like(o), torch.zeros_like(lse)
        ref = HostAttention(parts, host_kv, rope, d**-0.5, exact, HostIndexCache())
        ref.fill_reference(layer, q, want_o, want_l)
        torch.testing.assert_close(o, want_o, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse, want_l, atol=1e-5, rtol=1e-5)
    assert cache.builds == 0 and cache.pending == 1 + 2 * len(parts)
    hold.set()
    assert cache.wait(60) and cache.builds == 2 * len(parts)
    for layer in range(2):
        ha = HostAttention(parts, host_kv, rope, d**-0.5, approx, cache)
        o, lse = torch.zeros(rows, heads, d), torch.zeros(rows, heads)
        ha.fill(layer, q, o, lse)
        want_o, want_l = torch.zeros_like(o), torch.zeros_like(lse)
        ha.fill_reference(layer, q, want_o, want_l)
        _assert_same(o, lse, want_o, want_l)
    assert cache.builds == 2 * len(parts)  # nothing rebuilt


def test_an_index_whose_pages_are_rewritten_while_it_builds_is_dropped():
    import threading

    rng = random.Random()
    host_kv, rope, parts, _, _, d = _setup(rng)
    opts = RetrievalOptions(20, 4, 0.05, build_threads=1, exact_prefill=False)
    cache = HostIndexCache(build_threads=1)
    ha = HostAttention(parts, host_kv, rope, d**-0.5, opts, cache)
    part = parts[0]
    key = (part.pages, part.num_tokens, 0, 4)
    started, hold = threading.Event(), threading.Event()

    def slow_build():
        started.set()
        hold.wait(30)
        return ha._builder_of(part, 0, 4)()

    assert cache.ready(key, slow_build) is None
    assert started.wait(30)
    cache.invalidate([part.pages[-1]])  # an offload writes one of its pages while it builds
    hold.set()
    assert cache.wait(60) and cache.builds == 0
    assert cache.ready(key, ha._builder_of(part, 0, 4)) is None  # queued again
    assert cache.wait(60) and cache.builds == 1 and cache.ready(key, None) is not None


def test_a_failed_background_build_raises_in_the_step_that_asks_next():
    cache = HostIndexCache(build_threads=1)
    key = ((3, 4), 20, 0, 4)

    def broken():
        raise RuntimeError("the build failed")

    assert cache.ready(key, broken) is None
    assert cache.wait(60)
    with pytest.raises(RuntimeError, match="the build failed"):
        cache.ready(key, broken)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("exact", [False, True])
def test_device_fill_equals_the_cpu_fill(dtype, exact, monkeypatch):
    """DeviceFill (the CUDA path: candidate keys from the key tables laid over the host pages, values
    from the host pages by slot, index data stacked per group) runs the same torch ops on the CPU
    here: it equals HostAttention's CPU fill (which reads each index entry's own table)."""
    from lazyrt.retrieval import device_fill

    rng = random.Random()
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    ps, layers, kvh, group, d = 8, 2, 2, 3, 32
    rope = RopeCache.build(_Rope(rng.choice([d, d // 2])), 1024)
    host_kv = torch.randn(200, layers, 2, ps, kvh, d, generator=g).to(dtype)
    big = 10**6 if exact else None
    shapes = [(rng.randint(150, 200), rng.randint(1, 3), big) for _ in range(3)]
    shapes += [(shapes[0][0], 2, big or 12), (rng.randint(300, 360), 1, big), (5, 2, None)]
    parts, rows = _parts(rng, host_kv.shape[0], ps, shapes)
    for src in (parts[0], parts[1]):  # chunks that two requests attend (the device stacks them once)
        parts.append(HostPart(range(rows, rows + 2), src.pages, src.num_tokens, rng.randint(400, 900), rows))
        rows += 2
    top_k = 10**6 if exact else 20
    opts = RetrievalOptions(top_k, sink=rng.choice([1, 4]), scan=0.05, exact_prefill=False)
    q = torch.randn(rows, kvh * group, d, generator=g)
    cache = HostIndexCache()
    for layer in range(layers):
        want_o, want_l = torch.zeros(rows, kvh * group, d), torch.zeros(rows, kvh * group)
        HostAttention(parts, host_kv, rope, d**-0.5, opts, cache).fill(layer, q, want_o, want_l)
        ha = HostAttention(parts, host_kv, rope, d**-0.5, opts, cache, device_rope=rope)
        o, lse = torch.full_like(want_o, float("nan")), torch.full_like(want_l, float("nan"))
        for blocks in (False, True):  # the second call reuses the device stacks, a part or two a block
            stacks = len(cache.device_stacks._stacks)
            if blocks:
                monkeypatch.setattr(device_fill, "DEVICE_WORK_ELEMENTS", 4 * kvh * group * 60 * d)
            ha.fill_device(layer, q, o, lse)
            if exact:  # every key read from the pages and turned (bf16: by each path's own ops)
                tol = 1e-5 if dtype == torch.float32 else 2e-3
                torch.testing.assert_close(o, want_o, atol=tol, rtol=tol)
                torch.testing.assert_close(lse, want_l, atol=tol, rtol=tol)
            else:  # both score the index tables' keys (turned, then stored in the pages' dtype)
                _assert_same(o, lse, want_o, want_l)
        assert len(cache.device_stacks._stacks) == stacks  # the second call built none
    assert (len(cache.device_stacks._stacks) > 0) != exact
    stacks = cache.device_stacks._stacks.values()
    assert exact or all(st.centroids.shape[0] < len(parts) for st in stacks)  # repeated chunks: once


def test_device_view_of_a_cpu_tensor_is_itself():
    from lazyrt.retrieval.device_fill import device_view

    t = torch.randn(3, 4)
    assert device_view(t, torch.device("cpu")) is t


def test_device_fill_with_shared_lists_equals_a_brute_force_reference():
    """share_lists: per (part, KV head, token) lists ranked by the sum of the KV head's query heads'
    scores, taken best first while they hold at most SHARED_BUDGET x the scan budget (at least one);
    each query head then keeps its own top-k of those keys, plus the sink keys. Checked against loops
    over the index."""
    from lazyrt.retrieval.device_fill import SHARED_BUDGET

    rng = random.Random()
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    ps, kvh, group, d = 8, 2, 3, 32
    rope = RopeCache.build(_Rope(d), 1024)
    host_kv = torch.randn(120, 1, 2, ps, kvh, d, generator=g)
    n = rng.randint(150, 200)
    parts, rows = _parts(rng, host_kv.shape[0], ps, [(n, rng.randint(1, 3), None) for _ in range(3)])
    opts = RetrievalOptions(top_k=12, sink=4, scan=0.1, share_lists=True, exact_prefill=False)
    q = torch.randn(rows, kvh * group, d, generator=g)
    cache = HostIndexCache()
    ha = HostAttention(parts, host_kv, rope, d**-0.5, opts, cache, device_rope=rope)
    o, lse = torch.full((rows, kvh * group, d), float("nan")), torch.full((rows, kvh * group), float("nan"))
    ha.fill_device(0, q, o, lse)
    want_o, want_l = torch.empty_like(o), torch.empty_like(lse)
    # (row, query head) pairs whose selection hangs on a near-tie (two list ranks or the k-th and
    # (k+1)-th key score within rounding): the fill sums in another order and may pick either
    tied = torch.zeros(rows, kvh * group, dtype=torch.bool)
    half = d // 2
    for part in parts:
        entry = cache.get((part.pages, n, 0, 4), None)  # built by the fill
        keys, slot_of = entry.local().float(), entry.slot_of  # [n, kvh, d] at local positions
        _, kv = ha._part_kv(part, 0)
        budget = min(n - 4, SHARED_BUDGET * max(0.1 * (n - 4), 2 * 12))  # keys (a whole number here)
        for r in part.rows:
            c, s_ = rope.cos[part.start_pos, :half], rope.sin[part.start_pos, :half]
            x1, x2 = q[r, :, :half], q[r, :, half:]
            qr = torch.cat([x1 * c + x2 * s_, x2 * c - x1 * s_], -1)  # the chunk's frame
            for h in range(kvh):
                heads = qr[h * group : (h + 1) * group]
                best = (heads @ entry.index.centroids[h].T).sum(0)
                taken, size = [], 0
                ranked = best.argsort(descending=True).tolist()
                for lst in ranked:
                    k = int(entry.sizes[h, lst])
                    if taken and size + k > budget:
                        break
                    taken.append(lst)
                    size += k
                list_tie = _near_tie(best[ranked[: len(taken) + 1]])
                runs = [(4 + int(entry.starts[h, lst]), int(entry.sizes[h, lst])) for lst in taken]
                cand = torch.cat([slot_of[h, a : a + k] for a, k in runs])
                for j, qh in enumerate(heads):
                    sc = keys[cand, h] @ qh
                    ranked_sc = sc.sort(descending=True).values
                    top = cand[sc.topk(min(12, len(cand))).indices]
                    sel = torch.cat([torch.arange(4), top])
                    s = (keys[sel, h] @ qh) * d**-0.5
                    want_o[r, h * group + j] = torch.softmax(s, 0) @ kv[sel, h].float()
                    want_l[r, h * group + j] = torch.logsumexp(s, 0)
                    tied[r, h * group + j] = list_tie or _near_tie(ranked_sc[11:13])
    assert torch.isfinite(o).all() and torch.isfinite(lse).all()
    same = torch.isclose(o, want_o, atol=1e-5, rtol=1e-5).all(-1)
    same &= torch.isclose(lse, want_l, atol=1e-5, rtol=1e-5)
    assert bool(same[~tied].all()), f"{int((~same[~tied]).sum())} pairs with no near-tie differ"
    assert int(tied.sum()) <= same.numel() // 4  # most pairs are checked


def _near_tie(values: torch.Tensor) -> bool:
    """Whether two of these scores (sorted, descending) lie within fp32 summation rounding."""
    if values.numel() < 2:
        return False
    gaps = values[:-1] - values[1:]
    return bool((gaps <= 1e-5 * max(1.0, float(values.abs().max()))).any())


@pytest.mark.parametrize("device_fill", [False, True])
@pytest.mark.parametrize("share_lists", [False, True])
def test_parts_of_several_rows_attend_every_key(device_fill, share_lists):
    """exact_prefill (the default): a part with more than one query row (a question's prefill) equals
    attention to all of its chunk's keys; a part of one row (decode) still searches: it equals the
    fill with exact_prefill off. Chunks that several parts attend are read once for them all (checked
    against the per-part reference). The CPU and the device fill (its torch ops on the CPU)."""
    rng = random.Random()
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    ps, kvh, group, d = 8, 2, 3, 32
    rope = RopeCache.build(_Rope(d), 1024)
    host_kv = torch.randn(200, 1, 2, ps, kvh, d, generator=g)
    shapes = [(rng.randint(150, 200), m, None) for m in (1, 4, 1, 2, 3)]
    parts, rows = _parts(rng, host_kv.shape[0], ps, shapes)
    for src, m in ((parts[1], 3), (parts[1], 2), (parts[0], 1)):  # other requests over the same chunks
        parts.append(HostPart(range(rows, rows + m), src.pages, src.num_tokens, rng.randint(400, 900), rows))
        rows += m
    q = torch.randn(rows, kvh * group, d, generator=g)
    opts = RetrievalOptions(top_k=12, sink=4, scan=0.05, share_lists=share_lists)
    assert opts.exact_prefill
    cache = HostIndexCache()

    def fill(options, ref=False):
        o, lse = torch.full((rows, kvh * group, d), float("nan")), torch.full((rows, kvh * group), 0.0)
        ha = HostAttention(parts, host_kv, rope, d**-0.5, options, cache, device_rope=rope)
        if ref:
            ha.fill_reference(0, q, o, lse)
        else:
            (ha.fill_device if device_fill else ha.fill)(0, q, o, lse)
        return o, lse

    o, lse = fill(opts)
    every_o, every_l = fill(RetrievalOptions(top_k=10**6, sink=4, scan=0.05), ref=True)
    search_o, search_l = fill(RetrievalOptions(12, 4, 0.05, share_lists=share_lists, exact_prefill=False))
    several = [r for p in parts if len(p.rows) > 1 for r in p.rows]
    single = [p.rows.start for p in parts if len(p.rows) == 1]
    torch.testing.assert_close(o[several], every_o[several], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse[several], every_l[several], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(o[single], search_o[single], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(o[single], every_o[single], atol=1e-3)  # the single rows did search
    groups = HostAttention(parts, host_kv, rope, d**-0.5, opts, cache)._plan()
    assert sum(gr.same_chunk is not None for gr in groups if gr.exact) == 1  # the repeated chunk read once


def test_key_tables_follow_pages_that_hold_another_chunk():
    """The key tables (the device fill's copy of each index's keys, laid over the chunk's host pages)
    hold the new chunk's keys once its pages are rewritten and its index rebuilt: the device fill still
    equals the CPU fill, and every built index's table is where the key tables say."""
    rng = random.Random()
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    ps, kvh, group, d = 8, 2, 3, 32
    rope = RopeCache.build(_Rope(d), 1024)
    host_kv = torch.randn(120, 2, 2, ps, kvh, d, generator=g).to(torch.bfloat16)
    parts, rows = _parts(rng, host_kv.shape[0], ps, [(rng.randint(150, 200), 1, None) for _ in range(3)])
    opts = RetrievalOptions(top_k=12, sink=4, scan=0.05)
    cache = HostIndexCache()
    q = torch.randn(rows, kvh * group, d, generator=g)

    def both(layer):
        want_o, want_l = torch.zeros(rows, kvh * group, d), torch.zeros(rows, kvh * group)
        HostAttention(parts, host_kv, rope, d**-0.5, opts, cache).fill(layer, q, want_o, want_l)
        o, lse = torch.zeros_like(want_o), torch.zeros_like(want_l)
        on_device = HostAttention(parts, host_kv, rope, d**-0.5, opts, cache, device_rope=rope)
        on_device.fill_device(layer, q, o, lse)
        _assert_same(o, lse, want_o, want_l)

    both(0)
    tables = cache.key_tables
    new = torch.randn(len(parts[1].pages), *host_kv.shape[1:], generator=g)
    host_kv[list(parts[1].pages)] = new.to(host_kv.dtype)
    cache.invalidate(list(parts[1].pages))  # (the runner does this when an offload rewrites pages)
    for layer in (0, 1):
        both(layer)
    assert cache.key_tables is tables  # allocated once
    for (pages, n, layer, _), entry in cache._indexes.items():
        laid = tables[list(pages), layer].transpose(0, 1).reshape(kvh, -1, d)[:, :n]
        assert torch.equal(laid, entry.table)


def test_a_dropped_stack_drops_the_graphs_that_read_it(monkeypatch):
    """FillGraphs keeps what a captured graph reads alive; a stack that DeviceStacks drops (over its
    byte budget, or pages rewritten) takes those graphs with it, so the budget bounds the memory."""
    from lazyrt.retrieval import device_fill
    from lazyrt.retrieval.host_attention import IndexEntry
    from lazyrt.retrieval.key_index import build_key_index

    cache = HostIndexCache()
    graphs, stacks = cache.fill_graphs, cache.device_stacks
    keys = [torch.randn(300, 2, 16) for _ in range(3)]
    entries = [IndexEntry(build_key_index(k, sink=4), k) for k in keys]
    part = [((p,), 300, 0, 4) for p in range(3)]  # (pages, tokens, layer, sink) of three chunks
    t = torch.zeros(1)
    held = []
    for i in range(2):
        st = stacks.get((part[i],), [entries[i]], 30.0, "cpu")
        graphs._graphs[(i,)] = device_fill._FillGraph(None, t, t, t, t, [[], [], [st]])
        held.append(st)
    monkeypatch.setattr(device_fill, "DEVICE_STACK_BYTES", held[0].nbytes + held[1].nbytes)
    stacks.get((part[2],), [entries[2]], 30.0, "cpu")  # over the budget: the oldest stack goes
    assert list(graphs._graphs) == [(1,)]
    cache.invalidate([1])  # chunk 1's page rewritten: its stack, and the graph reading it, go
    assert not graphs._graphs
