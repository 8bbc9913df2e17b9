"""Inverted-file index over one chunk's keys, valid for the chunk at any position.

A chunk's keys rotated at chunk-LOCAL positions, R(s) k_s, are the same for every request that uses
the chunk: a query at position p, where the chunk starts at pos_base b, scores R(p - b) q . R(s) k_s.
So one index per (chunk, layer) serves every request; the caller turns the query into the chunk's
frame (by p - b) before searching.

Each KV head's keys are clustered by k-means (faiss) into lists. A query scans the lists in order of
its inner product with their centroids until it has scanned `scan` of the keys, and keeps the exact
top-k of what it scanned. On the default model's real keys (2,048-token chunk, 8 keys a list) that
finds 86% of the exact top-10 scanning 5% of the keys and 94% at 10%
(`benchmarks/experiments/retrieval_recall.py`). The first `sink` keys (the chunk's first tokens draw
a large share of attention) are not indexed: the caller attends to them exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

KEYS_PER_LIST = 8  # lists of ~8 keys: finer lists gave higher recall at the same scanned share


@dataclass
class KeyIndex:
    """One chunk, one layer, every KV head. Keys are the chunk's slots sink..num_keys-1."""

    centroids: torch.Tensor  # [kv_heads, lists, head_dim] fp32
    slots: torch.Tensor  # [kv_heads, num_keys - sink] int64: key slots, list by list
    offsets: torch.Tensor  # [kv_heads, lists + 1] int64: list i = slots[h, offsets[h, i] : offsets[h, i + 1]]
    list_of: torch.Tensor  # [kv_heads, num_keys - sink] int64: the list of each indexed slot (slot - sink)
    sink: int
    num_keys: int

    @property
    def num_indexed(self) -> int:
        return self.num_keys - self.sink


def build_key_index(
    keys: torch.Tensor, sink: int = 4, keys_per_list: int = KEYS_PER_LIST, seed: int = 0
) -> KeyIndex:
    """keys [num_keys, kv_heads, head_dim]: the chunk's keys rotated at local positions 0..n-1."""
    import faiss  # optional dependency: pip install lazyrt[retrieval]

    if keys.dim() != 3:
        raise ValueError(f"keys must be [num_keys, kv_heads, head_dim], got {tuple(keys.shape)}")
    n, kv_heads, d = keys.shape
    if not 0 <= sink < n:
        raise ValueError(f"sink={sink}: must be in [0, {n}) for a chunk of {n} keys")
    if keys_per_list < 1:
        raise ValueError(f"keys_per_list={keys_per_list}: must be >= 1")
    m = n - sink
    lists = max(1, m // keys_per_list)
    cents, slots, offsets, list_of = [], [], [], []
    for h in range(kv_heads):
        x = np.ascontiguousarray(keys[sink:, h].float().cpu().numpy())
        if lists > 1:
            km = faiss.Kmeans(d, lists, niter=20, seed=seed, verbose=False, min_points_per_centroid=1)
            km.train(x)
            c = torch.from_numpy(km.centroids.copy())
            _, assign = km.index.search(x, 1)
            a = torch.from_numpy(assign[:, 0].astype(np.int64))
        else:
            c, a = torch.from_numpy(x.mean(0, keepdims=True)), torch.zeros(m, dtype=torch.int64)
        order = torch.argsort(a, stable=True)
        cents.append(c)
        slots.append(order + sink)
        counts = torch.bincount(a, minlength=lists)
        offsets.append(torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]))
        list_of.append(a)
    stack = torch.stack
    return KeyIndex(stack(cents), stack(slots), stack(offsets), stack(list_of), sink, n)


def search_key_index(
    index: KeyIndex, keys: torch.Tensor, q: torch.Tensor, top_k: int, scan: float
) -> tuple[torch.Tensor, float]:
    """Top-k indexed key slots of each query head: ([m, q_heads, top_k] int64, -1 where fewer keys were
    scanned; the share of indexed keys scanned). q [m, q_heads, head_dim] in the chunk's frame; keys
    [num_keys, kv_heads, head_dim] rotated at local positions (the ones the index was built from)."""
    if not 0.0 < scan <= 1.0:
        raise ValueError(f"scan={scan}: must be in (0, 1]")
    if top_k < 1:
        raise ValueError(f"top_k={top_k}: must be >= 1")
    m, q_heads, d = q.shape
    kv_heads = index.centroids.shape[0]
    group = q_heads // kv_heads
    k = min(top_k, index.num_indexed)
    out = torch.full((m, q_heads, top_k), -1, dtype=torch.int64)
    scanned = 0
    for h in range(kv_heads):
        qh = q[:, h * group : (h + 1) * group].reshape(-1, d).float()  # [m * group, d]
        sizes = index.offsets[h, 1:] - index.offsets[h, :-1]
        order = (qh @ index.centroids[h].T).argsort(-1, descending=True)
        # lists in centroid order until `scan` of the keys; at least the best list
        take = sizes[order].cumsum(-1) <= scan * index.num_indexed
        take[:, 0] = True
        probed = torch.zeros_like(take).scatter(1, order, take)
        cand = probed[:, index.list_of[h]]  # [m * group, num_indexed]: slot sink + j scanned?
        qi, kj = cand.nonzero(as_tuple=True)
        scores = torch.full(cand.shape, float("-inf"))
        scores[qi, kj] = (qh[qi] * keys[kj + index.sink, h].float()).sum(-1)  # only the scanned keys
        scanned += len(kj)
        best = scores.topk(k, -1)
        slots = torch.where(best.values > float("-inf"), best.indices + index.sink, -1)
        out[:, h * group : (h + 1) * group, :k] = slots.view(m, group, k)
    return out, scanned / max(1, m * q_heads * index.num_indexed)
