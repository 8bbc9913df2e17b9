"""Shared-chunk attention: one pass over a shared document's pages serves every query that uses it.

Keys are stored unrotated, so a query at position p over a chunk placed at position S scores
    (R(p) q) . (R(S + j) k_j) = (R(p - S) q) . (R(j) k_j),
i.e. the chunk's keys need only their local rotation R(j), the same for every request, and each
query is rotated back by its own S. A step groups its (query, chunk segment) pairs by physical chunk
segment; one program set per segment loads and rotates each K/V tile once for all of the segment's
queries and writes a partial output and log-sum-exp per (pair, head). The rest of each query's keys
(prefix copies, question, generated tokens, recomputed pages) go through the per-request kernel, and
`merge_partials` combines everything by log-sum-exp (cascade attention, at any position).

Here: the step metadata (`SharedChunkMeta`), the torch reference (the CPU path and the kernel's
oracle, computed at absolute positions like `lazy_attention_ref`, not with the identity above), the
merge. The Triton kernel is in triton_shared_chunk.py (tests/test_shared_chunk.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lazyrt.kernels.rope import RopeCache, apply_rope_ref


@dataclass
class SharedChunkMeta:
    """A step's shared segments and the queries using each.

    Segment c owns page-table entries chunk_kv_indptr[c]:chunk_kv_indptr[c + 1] of chunk_kv_indices
    (its pages, every one full but the last) and chunk_len[c] tokens; its pairs are
    pair_indptr[c]:pair_indptr[c + 1]: pair p is query row pair_row[p] of the step's q, with the
    segment starting at position pair_start[p] in that query's request (key j sits at
    pair_start[p] + j and is visible when that is <= the query's position)."""

    chunk_kv_indptr: torch.Tensor  # [C + 1] int32
    chunk_kv_indices: torch.Tensor  # [E] int32
    chunk_len: torch.Tensor  # [C] int32
    pair_indptr: torch.Tensor  # [C + 1] int32
    pair_row: torch.Tensor  # [P] int32
    pair_start: torch.Tensor  # [P] int32
    max_pairs: int  # most pairs of one segment (host int: sizes the grid)

    @property
    def num_chunks(self) -> int:
        return self.chunk_len.numel()

    @property
    def num_pairs(self) -> int:
        return self.pair_row.numel()

    @classmethod
    def build(
        cls,
        segments: Sequence[tuple[Sequence[int], int, Sequence[tuple[int, int]]]],
        page_size: int,
        device: torch.device | str = "cpu",
    ) -> SharedChunkMeta:
        """segments: (pages, num_tokens, [(query row, start position), ...]) per shared segment."""
        kv_indptr, indices, lens, pair_indptr, rows, starts = [0], [], [], [0], [], []
        for pages, n, pairs in segments:
            if not 0 < n <= len(pages) * page_size or len(pages) != -(-n // page_size):
                raise ValueError(
                    f"a shared segment of {n} tokens cannot have {len(pages)} pages of {page_size}"
                )
            indices += pages
            kv_indptr.append(len(indices))
            lens.append(n)
            for row, start in pairs:
                rows.append(row)
                starts.append(start)
            pair_indptr.append(len(rows))
        i32 = dict(dtype=torch.int32, device=device)
        return cls(
            chunk_kv_indptr=torch.tensor(kv_indptr, **i32),
            chunk_kv_indices=torch.tensor(indices, **i32),
            chunk_len=torch.tensor(lens, **i32),
            pair_indptr=torch.tensor(pair_indptr, **i32),
            pair_row=torch.tensor(rows, **i32),
            pair_start=torch.tensor(starts, **i32),
            max_pairs=max((len(p) for _, _, p in segments), default=0),
        )


def shared_chunk_attention_ref(
    q: torch.Tensor,
    kv: torch.Tensor,
    positions: torch.Tensor,
    meta: SharedChunkMeta,
    rope: RopeCache,
    sm_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Partial attention of each pair's query row of q [T, q_heads, head_dim] (rotated at its
    position) over its segment's unrotated keys, each rotated at pair_start + j: returns o [P, q_heads,
    head_dim] and natural log-sum-exp [P, q_heads], both fp32 (o = 0, lse = -inf: nothing visible)."""
    page_size, kv_heads = kv.shape[2], kv.shape[3]
    group = q.shape[1] // kv_heads
    o = torch.zeros(meta.num_pairs, *q.shape[1:], dtype=torch.float32, device=q.device)
    lse = torch.full((meta.num_pairs, q.shape[1]), float("-inf"), dtype=torch.float32, device=q.device)
    kvp, pp = meta.chunk_kv_indptr.tolist(), meta.pair_indptr.tolist()
    for c in range(meta.num_chunks):
        n = int(meta.chunk_len[c])
        pages = meta.chunk_kv_indices[kvp[c] : kvp[c + 1]].long()
        j = torch.arange(n, device=kv.device)
        k = kv[pages[j // page_size], 0, j % page_size].float()  # [n, kv_heads, D]
        v = kv[pages[j // page_size], 1, j % page_size].float().repeat_interleave(group, dim=1)
        for p in range(pp[c], pp[c + 1]):
            row, start = int(meta.pair_row[p]), int(meta.pair_start[p])
            kr = apply_rope_ref(k, start + j, rope).repeat_interleave(group, dim=1)
            scores = torch.einsum("hd,khd->hk", q[row].float(), kr) * sm_scale
            scores = scores.masked_fill((start + j > positions[row])[None], float("-inf"))
            lse[p] = torch.logsumexp(scores, dim=-1)
            seen = lse[p] > float("-inf")
            probs = torch.exp(scores - torch.where(seen, lse[p], 0)[:, None])
            o[p] = torch.where(seen[:, None], torch.einsum("hk,khd->hd", probs, v), 0)
    return o, lse


def merge_partials(
    o: torch.Tensor, lse: torch.Tensor, o_parts: torch.Tensor, lse_parts: torch.Tensor, rows: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over the union of disjoint key sets from partial results: o [T, H, D] / lse [T, H]
    for each query row's own part, o_parts [P, H, D] / lse_parts [P, H] for parts belonging to rows
    `rows` [P]. Returns (o [T, H, D] fp32, lse [T, H] fp32). Natural log-sum-exp; a part with lse -inf
    (no visible key) weighs nothing; a row with nothing visible anywhere gets o = 0, lse = -inf."""
    rows = rows.long()
    lse, lse_parts = lse.float(), lse_parts.float()
    m = lse.clone().scatter_reduce_(0, rows[:, None].expand_as(lse_parts), lse_parts, "amax")
    m_safe = torch.where(torch.isinf(m), 0.0, m)
    w = torch.exp(lse - m_safe)  # exp(-inf) = 0
    w_parts = torch.exp(lse_parts - m_safe[rows])
    num = (o.float() * w[..., None]).index_add_(0, rows, o_parts.float() * w_parts[..., None])
    den = w.clone().index_add_(0, rows, w_parts)
    out = torch.where(den[..., None] > 0, num / den.clamp_min(1e-30)[..., None], 0.0)
    return out, m_safe + torch.log(den)
