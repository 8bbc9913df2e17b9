"""StepInputs: a StepPlan flattened to host-side int arrays (token ids, page tables, store slots).

A decode step at batch 64 over 10k-token RAG contexts has ~40k page-table entries; building them
in Python each step would cost as much as the GPU step. Each Segment caches its numpy table (valid
while its length is unchanged), so a step only concatenates arrays and rebuilds the growing runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from lazyrt.kernels.shared_chunk import (
    concat_flat,
    finish_arrays,
    flatten_segments,
    group_segments,
    run_pieces,
)
from lazyrt.runtime.scheduler.plan import StepPlan
from lazyrt.runtime.scheduler.request import Segment

_I32 = np.int32
_I64 = np.int64


def _empty(dtype=_I32) -> np.ndarray:
    return np.zeros(0, dtype=dtype)


@dataclass
class StepInputs:
    input_ids: np.ndarray = field(default_factory=lambda: _empty(_I64))
    positions: np.ndarray = field(default_factory=lambda: _empty(_I64))
    store_pages: np.ndarray = field(default_factory=lambda: _empty(_I64))
    store_slots: np.ndarray = field(default_factory=lambda: _empty(_I64))
    qo_indptr: np.ndarray = field(default_factory=lambda: np.zeros(1, dtype=_I32))
    kv_indptr: np.ndarray = field(default_factory=lambda: np.zeros(1, dtype=_I32))
    kv_indices: np.ndarray = field(default_factory=_empty)
    pos_base: np.ndarray = field(default_factory=_empty)
    valid_len: np.ndarray = field(default_factory=_empty)
    sample_rows: list[int] = field(default_factory=list)  # last token of each item with a request
    # Per-entry (logit scale, log mass) when some item has document attention; None = plain.
    entry_logit_scale: np.ndarray | None = None
    entry_log_mass: np.ndarray | None = None
    # shared-chunk segments (shared_segments below): False = not computed yet; None = per request
    shared: list | None | bool = False
    # input rows whose token the previous step samples (plan.PENDING_TOKEN): (rows, that step's
    # sampled-token rows, its sampled tokens), device tensors; ModelRunner.step_inputs sets it
    fill: tuple | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.qo_indptr) - 1

    @property
    def max_q_len(self) -> int:
        return int(np.diff(np.asarray(self.qo_indptr)).max())

    @property
    def max_kv_entries(self) -> int:
        return int(np.diff(np.asarray(self.kv_indptr)).max())

    @property
    def is_decode(self) -> bool:
        """One new token per sequence, each sampled: the shape CUDA graphs are captured for."""
        return self.max_q_len == 1 and len(self.sample_rows) == self.num_seqs

    def dense_pages(self, page_size: int) -> bool:
        """Each table maps positions 0.. onto its pages in order, every page but the last full."""
        indptr = np.asarray(self.kv_indptr, dtype=_I64)
        pos_base = np.asarray(self.pos_base, dtype=_I64)
        valid = np.asarray(self.valid_len, dtype=_I64)
        n = len(pos_base)
        if n == 0:
            return True
        seq_start = np.repeat(indptr[:-1], np.diff(indptr))  # each entry's first entry
        if not np.array_equal(pos_base, (np.arange(n) - seq_start) * page_size):
            return False
        is_last = np.zeros(n, dtype=bool)
        is_last[indptr[1:][np.diff(indptr) > 0] - 1] = True
        return bool(np.all(is_last | (valid == page_size)))

    @classmethod
    def from_plan(cls, plan: StepPlan, page_size: int) -> StepInputs:
        ids, positions, store_pages, store_slots = [], [], [], []
        q_lens, kv_lens, tables = [], [], []
        # with document attention in the step: (entries, logit scale, log mass) of every segment
        doc_logits = any(item.doc_logits is not None for item in plan.items)
        entry_logits: list[tuple[int, float, float]] = []
        for item in plan.items:
            n = len(item.token_ids)
            ids.append(item.token_ids)
            q_lens.append(n)
            if n == 1:  # decode: no array of the whole target run for one page
                off = item.start_pos - item.target.start_pos
                positions.append((item.start_pos,))
                store_pages.append((item.target.pages[off // page_size],))
                store_slots.append((off % page_size,))
            else:
                pos = np.arange(item.start_pos, item.start_pos + n, dtype=_I64)
                off = pos - item.target.start_pos
                positions.append(pos)
                store_pages.append(np.asarray(item.target.pages, dtype=_I64)[off // page_size])
                store_slots.append(off % page_size)
            entries = 0
            for seg in item.segments:
                t = segment_table(seg, page_size)
                tables.append(t)
                entries += len(t[0])
                if doc_logits:
                    on = item.doc_logits is not None and seg.is_doc
                    entry_logits.append((len(t[0]), *(item.doc_logits if on else (1.0, 0.0))))
            kv_lens.append(entries)
        s = cls()
        if not plan.items:
            return s
        s.input_ids = np.fromiter((t for x in ids for t in x), dtype=_I64)
        s.positions = np.concatenate(positions, dtype=_I64)
        s.store_pages = np.concatenate(store_pages, dtype=_I64)
        s.store_slots = np.concatenate(store_slots, dtype=_I64)
        s.qo_indptr = np.concatenate([[0], np.cumsum(q_lens)]).astype(_I32)
        s.kv_indptr = np.concatenate([[0], np.cumsum(kv_lens)]).astype(_I32)
        if tables:
            s.kv_indices = np.concatenate([t[0] for t in tables])
            s.pos_base = np.concatenate([t[1] for t in tables])
            s.valid_len = np.concatenate([t[2] for t in tables])
        if doc_logits:
            counts = np.fromiter((n for n, _, _ in entry_logits), dtype=_I64)
            s.entry_logit_scale = np.repeat(np.array([x[1] for x in entry_logits], dtype=np.float32), counts)
            s.entry_log_mass = np.repeat(np.array([x[2] for x in entry_logits], dtype=np.float32), counts)
        s.sample_rows = [
            int(s.qo_indptr[i + 1]) - 1 for i, it in enumerate(plan.items) if it.request is not None
        ]
        return s


def segment_table(seg: Segment, page_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(page ids, pos_base, valid_len) of a segment's pages; cached on it while its length holds.
    A run that only grew since (a decoding request's own run, one token a step) is updated at its
    end instead of rebuilt: rebuilding a 4k-token run's table for 64 requests cost ~1.5 ms a step."""
    key = (seg.num_tokens, seg.start_pos, len(seg.pages))
    cached = seg.table
    if cached is not None and cached[0] == key:
        return cached[1]
    n = -(-seg.num_tokens // page_size)
    table = None
    if cached is not None:
        (old_tokens, old_start, _), (pages, base, valid) = cached
        m = len(pages)
        if old_start == seg.start_pos and 0 < old_tokens <= seg.num_tokens and m <= n:
            if m and int(pages[-1]) == seg.pages[m - 1]:  # same run, grown: touch only its end
                if n > m:
                    pages = np.concatenate([pages, np.asarray(seg.pages[m:n], dtype=_I32)])
                    base = np.concatenate([base, np.arange(m, n, dtype=_I32) * page_size + seg.start_pos])
                    valid = np.concatenate([valid, np.full(n - m, page_size, dtype=_I32)])
                else:
                    valid = valid.copy()
                valid[m - 1 :] = np.minimum(page_size, seg.num_tokens - np.arange(m - 1, n) * page_size)
                table = (pages, base, valid)
    if table is None:
        first = np.arange(n, dtype=_I32) * page_size
        table = (
            np.asarray(seg.pages[:n], dtype=_I32),
            first + seg.start_pos,
            np.minimum(page_size, seg.num_tokens - first).astype(_I32),
        )
    seg.table = (key, table)
    return table


# Shared-chunk attention (kernels/shared_chunk.py) for a step when its page tables repeat runs of
# pages (documents used by several requests): runs cut into pieces of SHARED_PIECE_TOKENS (batches
# of up to SHARED_SMALL_BATCH sequences: half that, for more work items; `shared_chunk_bench.py
# --sweep`), used for steps of at most SHARED_MAX_Q_LEN new tokens per sequence (decode, questions;
# a long prompt's own causal run is the per-request kernel's work) when it reads at most
# 1/SHARED_MIN_SAVING of the pages.
SHARED_PIECE_TOKENS = 1024
SHARED_SMALL_BATCH = 32
SHARED_MAX_Q_LEN = 64
SHARED_MIN_SAVING = 1.25


def shared_segments(
    plan: StepPlan, s: StepInputs, page_size: int, piece_tokens: int | None = None, intern: dict | None = None
) -> list | None:
    """The step's segments for SharedChunkMeta.build when sharing pays (see above), else None.
    intern: kept by the caller across steps (run_pieces)."""
    if s.entry_logit_scale is not None or s.num_seqs < 2 or s.max_q_len > SHARED_MAX_Q_LEN:
        return None  # one sequence has nobody to share with: skip the grouping on batch-1 steps
    if piece_tokens is None:
        piece_tokens = SHARED_PIECE_TOKENS // (2 if s.num_seqs <= SHARED_SMALL_BATCH else 1)
    qo, ps, pt = s.qo_indptr, page_size, piece_tokens
    seqs = [
        (range(qo[i], qo[i + 1]), [segment_run(g, ps, pt, intern) for g in it.segments if g.num_tokens])
        for i, it in enumerate(plan.items)
    ]
    segments, per_request, shared = group_segments(seqs, page_size, piece_tokens)
    return segments if per_request >= SHARED_MIN_SAVING * shared else None


def segment_run(seg: Segment, page_size: int, piece_tokens: int, intern: dict | None = None) -> tuple:
    """(pages, num_tokens, start_pos, pieces) of a segment for group_segments; the pieces are cached
    on it while its length holds (a document's run is the same every step; grouping 64 requests x
    5 documents re-cut them each step cost ~1.5 ms of host time)."""
    key = (seg.num_tokens, len(seg.pages), piece_tokens)
    if seg.pieces is None or seg.pieces[0] != key:
        seg.pieces = (key, run_pieces(seg.pages, seg.num_tokens, page_size, piece_tokens, intern))
    return seg.pages, seg.num_tokens, seg.start_pos, seg.pieces[1]


@dataclass
class SharedGrouping:
    """The document part of a step's shared-chunk grouping, kept across steps (ModelRunner): in a run
    of decode steps the batch's runs other than each item's own (prefix, documents, recomputed
    pages) are the same objects at the same rows, so their grouping and flattened arrays are reused
    and only the own runs, one token longer each step, are grouped again."""

    key: tuple | None = None
    flat: dict | None = None
    per_request: int = 0
    shared: int = 0


def shared_arrays(
    plan: StepPlan, s: StepInputs, page_size: int, block_pairs: int, cache: SharedGrouping,
    intern: dict | None = None,
) -> dict[str, np.ndarray] | None:  # fmt: skip
    """build_arrays for the step's shared-chunk segments when sharing pays (as shared_segments), the
    segments ordered: the other runs' (grouped, cached in `cache`), then the items' own runs."""
    if s.entry_logit_scale is not None or s.num_seqs < 2 or s.max_q_len > SHARED_MAX_Q_LEN:
        return None
    ps, qo = page_size, s.qo_indptr
    pt = SHARED_PIECE_TOKENS // (2 if s.num_seqs <= SHARED_SMALL_BATCH else 1)
    rows = [range(int(qo[i]), int(qo[i + 1])) for i in range(len(plan.items))]
    key = (pt, tuple(
        (r.start, r.stop, tuple((id(g), g.num_tokens, g.start_pos, len(g.pages))
                                for g in it.segments if g is not it.target and g.num_tokens))
        for r, it in zip(rows, plan.items)
    ))  # fmt: skip
    if cache.key != key:
        seqs = [
            (r, [segment_run(g, ps, pt, intern) for g in it.segments if g is not it.target and g.num_tokens])
            for r, it in zip(rows, plan.items)
        ]
        segments, cache.per_request, cache.shared = group_segments(seqs, ps, pt)
        cache.flat, cache.key = flatten_segments(segments, ps), key
    own_seqs = [
        (r, [segment_run(it.target, ps, pt)] if it.target.num_tokens and _holds(it.segments, it.target)
         else [])
        for r, it in zip(rows, plan.items)
    ]  # fmt: skip
    own, per_request, shared = group_segments(own_seqs, ps, pt)
    if cache.per_request + per_request < SHARED_MIN_SAVING * (cache.shared + shared):
        return None
    return finish_arrays(concat_flat(cache.flat, flatten_segments(own, ps)), len(s.input_ids), block_pairs)


def _holds(segments: list[Segment], seg: Segment) -> bool:
    return any(g is seg for g in segments)
