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

import numpy as np
import torch

from lazyrt.kernels.host_copy import to_device
from lazyrt.kernels.rope import RopeCache, apply_rope_ref


@dataclass
class SharedChunkMeta:
    """A step's segments and the queries using each.

    Segment c owns page-table entries chunk_kv_indptr[c]:chunk_kv_indptr[c + 1] of chunk_kv_indices
    (its pages, every one full but the last) and chunk_len[c] tokens; its pairs are
    pair_indptr[c]:pair_indptr[c + 1]: pair p is query row pair_row[p] of the step's q, with the
    segment starting at position pair_start[p] in that query's request (key j sits at
    pair_start[p] + j and is visible when that is <= the query's position).

    The kernel's work items: item w is segment work_chunk[w] with its pairs work_pair[w] ..
    work_pair[w] + block_pairs - 1 (those of the segment); items sorted longest segment first, so a
    persistent grid that takes them round-robin ends close together; num_work[0] items are live (a
    device scalar: CUDA graphs replay one launch over buffers sized for the largest step). The merge
    reads row t's parts row_parts[row_part_indptr[t]:row_part_indptr[t + 1]] (pair ids)."""

    chunk_kv_indptr: torch.Tensor  # [C + 1] int32
    chunk_kv_indices: torch.Tensor  # [E] int32
    chunk_len: torch.Tensor  # [C] int32
    pair_indptr: torch.Tensor  # [C + 1] int32
    pair_row: torch.Tensor  # [P] int32
    pair_start: torch.Tensor  # [P] int32
    work_chunk: torch.Tensor  # [W] int32
    work_pair: torch.Tensor  # [W] int32
    num_work: torch.Tensor  # [1] int32
    row_part_indptr: torch.Tensor  # [T + 1] int32
    row_parts: torch.Tensor  # [P] int32
    block_pairs: int  # pairs per work item
    num_work_host: int  # = num_work[0], for sizing an eager launch without a sync
    programs: int | None = None  # persistent grid size to launch (None: the kernel picks; graphs fix it)
    # what the kernel's launch settings go by (wave_items; None: num_work_host)
    wave_items_host: int | None = None

    @property
    def num_chunks(self) -> int:
        return self.chunk_len.numel()

    @property
    def num_pairs(self) -> int:
        return self.pair_row.numel()

    @property
    def num_rows(self) -> int:
        return self.row_part_indptr.numel() - 1

    @classmethod
    def build(
        cls,
        segments: Sequence[tuple[Sequence[int], int, Sequence[tuple[int, int]]]],
        page_size: int,
        num_rows: int | None = None,
        block_pairs: int = 16,
        device: torch.device | str = "cpu",
    ) -> SharedChunkMeta:
        """segments: (pages, num_tokens, [(query row, start position), ...]) per segment; num_rows:
        the step's query rows (default: 1 + the largest row used); block_pairs: pairs per work item."""
        return cls.from_arrays(build_arrays(segments, page_size, num_rows, block_pairs), block_pairs, device)

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray], block_pairs: int, device) -> SharedChunkMeta:
        """From `build_arrays`' host arrays (one H2D copy each)."""
        t = {k: to_device(v, device) for k, v in arrays.items()}
        return cls(**t, block_pairs=block_pairs, num_work_host=int(arrays["num_work"][0]),
                   wave_items_host=wave_items(arrays))  # fmt: skip


def wave_items(arrays: dict[str, np.ndarray]) -> int:
    """A step's work items counted in the longest item's keys (ceil(keys all items read / the
    longest item's)): how many programs the launch keeps busy for the whole of its longest one, what
    its launch settings go by (triton_shared_chunk.launch_settings; a short item, an own run or a
    document's tail, hardly counts)."""
    n = int(arrays["num_work"][0])
    if n == 0:
        return 0
    lens = arrays["chunk_len"][arrays["work_chunk"][:n]].astype(np.int64)
    return int(-(-lens.sum() // lens.max()))


def build_arrays(
    segments: Sequence[tuple[Sequence[int], int, Sequence[tuple[int, int]]]],
    page_size: int,
    num_rows: int | None,
    block_pairs: int,
) -> dict[str, np.ndarray]:
    """Host int32 arrays of SharedChunkMeta (see there) for `segments`; raises ValueError on a
    segment whose pages cannot hold its tokens."""
    return finish_arrays(flatten_segments(segments, page_size), num_rows, block_pairs)


def flatten_segments(
    segments: Sequence[tuple[Sequence[int], int, Sequence[tuple[int, int]]]], page_size: int
) -> dict[str, np.ndarray]:
    """The segments' pages, lengths and pairs as int32 arrays (kv_indptr, indices, lens, pair_indptr,
    rows, starts); concat_flat joins two such parts (a step's cached document part and its own runs)."""
    kv_indptr, indices, lens, pair_indptr, rows, starts = [0], [], [], [0], [], []
    for pages, n, pairs in segments:
        if not 0 < n <= len(pages) * page_size or len(pages) != -(-n // page_size):
            raise ValueError(f"a shared segment of {n} tokens cannot have {len(pages)} pages of {page_size}")
        indices += pages
        kv_indptr.append(len(indices))
        lens.append(n)
        for row, start in pairs:
            rows.append(row)
            starts.append(start)
        pair_indptr.append(len(rows))
    a = lambda x: np.asarray(x, dtype=np.int32)  # noqa: E731
    return dict(kv_indptr=a(kv_indptr), indices=a(indices), lens=a(lens), pair_indptr=a(pair_indptr),
                rows=a(rows), starts=a(starts))  # fmt: skip


def concat_flat(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """a's segments then b's, as one flatten_segments result."""
    cat = np.concatenate
    return dict(
        kv_indptr=cat([a["kv_indptr"], b["kv_indptr"][1:] + len(a["indices"])]),
        indices=cat([a["indices"], b["indices"]]),
        lens=cat([a["lens"], b["lens"]]),
        pair_indptr=cat([a["pair_indptr"], b["pair_indptr"][1:] + len(a["rows"])]),
        rows=cat([a["rows"], b["rows"]]),
        starts=cat([a["starts"], b["starts"]]),
    )


def finish_arrays(
    flat: dict[str, np.ndarray], num_rows: int | None, block_pairs: int
) -> dict[str, np.ndarray]:
    """SharedChunkMeta's arrays from flatten_segments' (work items longest segment first, the
    merge's per-row index)."""
    if block_pairs < 1:
        raise ValueError(f"block_pairs={block_pairs}: must be >= 1")
    rows_a = flat["rows"]
    T = int(rows_a.max(initial=-1)) + 1 if num_rows is None else num_rows
    row_parts, row_part_indptr = row_index(rows_a, T)
    blocks = -(-np.diff(flat["pair_indptr"]) // block_pairs)
    work_chunk, work_pair = work_items(flat["lens"], flat["pair_indptr"], blocks, block_pairs)
    return dict(
        chunk_kv_indptr=flat["kv_indptr"],
        chunk_kv_indices=flat["indices"],
        chunk_len=flat["lens"],
        pair_indptr=flat["pair_indptr"],
        pair_row=rows_a,
        pair_start=flat["starts"],
        work_chunk=work_chunk,
        work_pair=work_pair,
        num_work=np.asarray([len(work_chunk)], dtype=np.int32),
        row_part_indptr=row_part_indptr,
        row_parts=row_parts,
    )


def row_index(rows: np.ndarray, num_rows: int) -> tuple[np.ndarray, np.ndarray]:
    """(row_parts, row_part_indptr) of SharedChunkMeta for pairs on query rows `rows`."""
    if len(rows) and (rows.min() < 0 or rows.max() >= num_rows):
        raise ValueError(f"pair rows must lie in [0, {num_rows})")
    row_parts = np.argsort(rows, kind="stable").astype(np.int32)
    row_part_indptr = np.concatenate([[0], np.cumsum(np.bincount(rows, minlength=num_rows))]).astype(np.int32)
    return row_parts, row_part_indptr


def work_items(
    lens: np.ndarray, pair_indptr: np.ndarray, blocks: np.ndarray, block_pairs: int
) -> tuple[np.ndarray, np.ndarray]:
    """(work_chunk, work_pair) of SharedChunkMeta: blocks[c] items of block_pairs pairs for segment
    c, longest segments first."""
    i32 = np.int32
    order = np.argsort(-lens, kind="stable")  # longest segments first
    work_chunk = np.repeat(order, blocks[order]).astype(i32)
    first = np.concatenate([[0], np.cumsum(blocks[order])])[:-1]
    k = np.arange(len(work_chunk)) - np.repeat(first, blocks[order])  # block index within its segment
    work_pair = (pair_indptr[work_chunk] + k * block_pairs).astype(i32)
    return work_chunk, work_pair


class PieceKey:
    """A piece of a run: its pages and token count; equal keys hold the same keys and values. Its
    hash is computed once (a run's pieces are cached across the steps that reuse the run)."""

    __slots__ = ("pages", "num_tokens", "_hash")

    def __init__(self, pages: tuple[int, ...], num_tokens: int):
        self.pages, self.num_tokens = pages, num_tokens
        self._hash = hash((pages, num_tokens))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, PieceKey) and self.num_tokens == other.num_tokens and self.pages == other.pages
        )


def run_pieces(
    pages: Sequence[int], n: int, page_size: int, piece_tokens: int, intern: dict | None = None
) -> list[tuple[PieceKey, int]]:
    """A run of n tokens on `pages` (all full but the last; extra pages ignored) cut into pieces of
    piece_tokens (rounded down to whole pages): (key, offset of its first token in the run). intern:
    a dict that makes equal keys one object (group_segments' lookups then match by identity instead
    of comparing page tuples: each request's copy of a document's run has its own keys)."""
    piece_pages = max(1, piece_tokens // page_size)
    n_pages = -(-n // page_size)
    out = []
    for k in range(0, n_pages, piece_pages):
        m = min(n, (k + piece_pages) * page_size) - k * page_size
        key = PieceKey(tuple(pages[k : min(n_pages, k + piece_pages)]), m)
        out.append((intern.setdefault(key, key) if intern is not None else key, k * page_size))
    return out


def group_segments(
    seqs: Sequence[tuple[Sequence[int], Sequence[tuple]]],
    page_size: int,
    piece_tokens: int,
) -> tuple[list[tuple[list[int], int, list[tuple[int, int]]]], int, int]:
    """A step's per-sequence page runs grouped by physical pages, for SharedChunkMeta.build.

    seqs: per sequence (its query rows, its runs (pages, num_tokens, start position[, pieces])),
    every run's pages full but the last (extra pages past num_tokens are ignored); pieces, when
    given, is run_pieces(pages, num_tokens, page_size, piece_tokens) (cached by the caller). Each
    run is cut into pieces of piece_tokens (a page multiple; a long document gives the grid several
    items, and its pieces are shared even where two runs overlap only in part); pieces on the same
    pages with the same length are one segment, with a pair per (row, piece start). Returns
    (segments, pages the per-request kernel would read, pages the segments read)."""
    index: dict[PieceKey, int] = {}
    segments: list[tuple[list[int], int, list[tuple[int, int]]]] = []
    per_request = 0
    for rows, runs in seqs:
        for run in runs:
            pages, n, start = run[:3]
            pieces = run[3] if len(run) > 3 else run_pieces(pages, n, page_size, piece_tokens)
            per_request += -(-n // page_size)
            for key, off in pieces:
                i = index.setdefault(key, len(segments))
                if i == len(segments):
                    segments.append((list(key.pages), key.num_tokens, []))
                at = start + off
                pairs = segments[i][2]
                for row in rows:
                    pairs.append((row, at))
    shared = sum(len(pages) for pages, _, _ in segments)
    return segments, per_request, shared


# A launch's last round may hold at most this share of a round's items before
# split_last_round cuts them (a mostly empty round costs about half a full one: below).
LAST_ROUND_SPLIT_SHARE = 0.5
LAST_ROUND_PARTS = 4


def split_last_round(
    segments: list[tuple[list[int], int, list[tuple[int, int]]]],
    page_size: int,
    block_pairs: int,
    kv_heads: int,
    round_items: int,
    parts: int = LAST_ROUND_PARTS,
    share: float = LAST_ROUND_SPLIT_SHARE,
) -> list[tuple[list[int], int, list[tuple[int, int]]]]:
    """group_segments' segments with a few of the longest cut in `parts` when the longest ones' work
    items (ceil(pairs / block_pairs) x kv_heads each, run longest first) spill a few past a multiple
    of round_items (waves.round_items: the programs resident at once) by at most share x round_items:
    those would run a last round of long items nearly alone. Cut, the spill runs as short items
    beside the other runs' tails. The segments cut are those with the fewest items (each cut adds
    parts - 1 parts to its rows' merge).
    H200, Llama-3.1-8B heads, one layer of a batch-64 decode step (`experiments/lone_question.py
    --q-len 1 --batches 64 --seeds 6 8 0 --pieces 1024`): 848 long items against rounds of 396 took
    172.8 us, 784 took 137.5, 688 130.7; in the engine a draw with 800 ran its step 11% slower than
    draws with 720-768 (`decode_roofline.py`, 2026-11-29). Cut in quarters (best or within 1.2% of
    halves and eighths), the spilling draws' layer ran 10-16% faster and that engine step 11.15 -> 10.28
    ms; draws that do not spill are left as they are (`gpu_run.sh rounds`). The outputs do not
    change: a cut segment's pairs read the same keys at the same positions, in parts merged by
    log-sum-exp."""
    if round_items <= 0 or not segments:
        return segments
    longest = max(n for _, n, _ in segments)
    long_pages = -(-longest // page_size)
    piece_pages = -(-long_pages // parts)
    works = [-(-len(pairs) // block_pairs) for _, _, pairs in segments]
    long = [i for i, (_, n, _) in enumerate(segments) if n == longest]
    items = sum(works[i] for i in long) * kv_heads
    spill = items - (items - 1) // round_items * round_items  # items in the last round: 1..round_items
    if items <= round_items or spill > share * round_items or piece_pages >= long_pages:
        return segments
    cut: set[int] = set()
    for i in sorted(long, key=lambda i: works[i]):
        if spill <= 0:
            break
        cut.add(i)
        spill -= works[i] * kv_heads
    out = []
    for i, seg in enumerate(segments):
        if i not in cut:
            out.append(seg)
            continue
        pages, n, pairs = seg
        for key, off in run_pieces(pages, n, page_size, piece_pages * page_size):
            out.append((list(key.pages), key.num_tokens, [(row, start + off) for row, start in pairs]))
    return out


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


def shared_chunk_attention_torch(
    q: torch.Tensor,
    kv: torch.Tensor,
    positions: torch.Tensor,
    meta: SharedChunkMeta,
    rope: RopeCache,
    sm_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The CPU path's version of shared_chunk_attention_ref, by the identity in the module
    docstring: per segment, keys rotated once at their local index j and all its pairs' queries
    rotated back by their start (not per pair at absolute positions, as the reference does)."""
    page_size, kv_heads = kv.shape[2], kv.shape[3]
    T, H, D = q.shape
    group = H // kv_heads
    rd, half = rope.rotary_dim, rope.rotary_dim // 2
    o = torch.zeros(meta.num_pairs, H, D, dtype=torch.float32, device=q.device)
    lse = torch.full((meta.num_pairs, H), float("-inf"), dtype=torch.float32, device=q.device)
    kvp, pp = meta.chunk_kv_indptr.tolist(), meta.pair_indptr.tolist()
    for c in range(meta.num_chunks):
        p0, p1 = pp[c], pp[c + 1]
        if p0 == p1:
            continue
        n = int(meta.chunk_len[c])
        pages = meta.chunk_kv_indices[kvp[c] : kvp[c + 1]].long()
        j = torch.arange(n, device=kv.device)
        k = apply_rope_ref(kv[pages[j // page_size], 0, j % page_size].float(), j, rope)
        v = kv[pages[j // page_size], 1, j % page_size].float()
        rows, start = meta.pair_row[p0:p1].long(), meta.pair_start[p0:p1].long()
        qp = q[rows].float()  # [p, H, D] rotated at the query's position: rotate back by start
        cos, sin = rope.cos[start, None, :half], rope.sin[start, None, :half]  # [p, 1, half]
        q1, q2 = qp[..., :half], qp[..., half:rd]
        qp = torch.cat([q1 * cos + q2 * sin, q2 * cos - q1 * sin, qp[..., rd:]], dim=-1)
        qg = qp.view(p1 - p0, kv_heads, group, D)
        scores = torch.einsum("pkgd,nkd->pkgn", qg, k) * sm_scale
        visible = j[None, :] <= (positions[rows] - start)[:, None]  # [p, n]
        scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
        part_lse = torch.logsumexp(scores, dim=-1)  # [p, kvh, g]
        seen = part_lse > float("-inf")
        probs = torch.exp(scores - torch.where(seen, part_lse, 0)[..., None])
        out = torch.einsum("pkgn,nkd->pkgd", probs, v)
        o[p0:p1] = torch.where(seen[..., None], out, 0).view(p1 - p0, H, D)
        lse[p0:p1] = part_lse.view(p1 - p0, H)
    return o, lse


def merge_parts_ref(o_parts: torch.Tensor, lse_parts: torch.Tensor, meta: SharedChunkMeta) -> torch.Tensor:
    """Each query row's attention over all its parts (pairs): o [T, H, D] fp32; a row that sees no
    key gets zeros."""
    T, (H, D) = meta.num_rows, o_parts.shape[1:]
    zero = torch.zeros(T, H, D, dtype=torch.float32, device=o_parts.device)
    none = torch.full((T, H), float("-inf"), dtype=torch.float32, device=o_parts.device)
    return merge_partials(zero, none, o_parts, lse_parts, meta.pair_row)[0]
