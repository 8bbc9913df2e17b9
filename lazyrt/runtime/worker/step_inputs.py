"""StepInputs: a StepPlan flattened to host-side int arrays (token ids, page tables, store slots).

A decode step at batch 64 over 10k-token RAG contexts has ~40k page-table entries; building them
in Python each step would cost as much as the GPU step. Each Segment caches its numpy table (valid
while its length is unchanged), so a step only concatenates arrays and rebuilds the growing runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain

import numpy as np

from lazyrt.kernels.shared_chunk import (
    concat_flat,
    finish_arrays,
    flatten_segments,
    group_segments,
    row_index,
    run_pieces,
    split_last_round,
    work_items,
)
from lazyrt.runtime.scheduler.plan import ForwardItem, StepPlan
from lazyrt.runtime.scheduler.request import Segment

_I32 = np.int32
_I64 = np.int64


_TABLES = ("kv_indices", "pos_base", "valid_len")


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

    def __getattr__(self, name: str):
        # Only reached for an attribute not set: a patched decode step's page tables, made on first
        # use (decode_inputs; a step through shared-chunk attention never reads them).
        patch = self.__dict__.get("_tables")
        if patch is None or name not in _TABLES:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        self.kv_indices, self.pos_base, self.valid_len = patch.tables()
        del self.__dict__["_tables"]
        return self.__dict__[name]

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
    def from_plan(cls, plan: StepPlan, page_size: int, layout: DecodeLayout | None = None) -> StepInputs:
        """layout: kept by the caller across steps; a pure decode step over the same batch as the
        last one is then patched from the last step's arrays (decode_inputs) instead of rebuilt."""
        if layout is not None:
            s = decode_inputs(plan, page_size, layout)
            if s is not None:
                return s
        ids, positions, store_pages, store_slots = [], [], [], []
        q_lens, kv_lens, tables = [], [], []
        # with document attention in the step: (entries, logit scale, log mass) of every segment
        doc_logits = any(item.doc_logits is not None for item in plan.items)
        entry_logits: list[tuple[int, float, float]] = []
        ends: list[int] = []  # per item: one past its target's entries (-1: the target is not attended)
        total = 0
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
            entries, end = 0, -1
            for seg in item.segments:
                t = segment_table(seg, page_size)
                tables.append(t)
                entries += len(t[0])
                if seg is item.target:
                    end = total + entries
                if doc_logits:
                    on = item.doc_logits is not None and seg.is_doc
                    entry_logits.append((len(t[0]), *(item.doc_logits if on else (1.0, 0.0))))
            kv_lens.append(entries)
            ends.append(end)
            total += entries
        s = cls()
        if layout is not None:
            layout.hit, layout.s = False, None
            layout.version += 1  # the batch may have changed: groupings kept for the old one are stale
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
        decode_shaped = len(s.input_ids) == len(plan.items) and s.max_q_len == 1 and min(ends) >= 0
        if layout is not None and decode_shaped and not doc_logits:
            layout.record(plan, s, np.asarray(ends, dtype=_I64), page_size)
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


def _insert(a: np.ndarray, at: np.ndarray | list[int], values: np.ndarray) -> np.ndarray:
    """np.insert(a, at, values) for sorted `at`, by slices (np.insert's general path took ~50 us for
    a few entries into 41k)."""
    pieces, prev = [], 0
    for k, i in enumerate(at if isinstance(at, list) else at.tolist()):
        pieces += [a[prev:i], values[k : k + 1]]
        prev = i
    pieces.append(a[prev:])
    return np.concatenate(pieces)


def _other_runs(items: list) -> list[tuple]:
    """Every run of the items other than their targets, as what its page table depends on."""
    return [(g.pages, g.num_tokens, g.start_pos) for it in items for g in it.segments if g is not it.target]


@dataclass
class DecodeLayout:
    """The last step's batch and inputs, kept by ModelRunner across steps. In a run of decode steps
    each item is the same request with the same runs; only its target (own) run is one token longer.
    Then the step's inputs follow from the last step's in O(items) numpy work (decode_inputs)
    instead of concatenating ~6 tables a request (from_plan took ~1.4 ms a step at b64 x 10k
    tokens): the targets' pages are kept apart (own_pages), and the full page tables (41k entries)
    are patched only when read (_TablePatch: each target's last entry updated, an entry inserted
    where it crossed into a new page); a step through shared-chunk attention never reads them.

    Assumes what the worker's StepDecoder guarantees: a run's pages list is not rewritten in place
    (a changed run comes as a new Segment or a new list; lengths and positions are compared, and a
    target's last page, as segment_table does)."""

    s: StepInputs | None = None  # the last step's inputs (None: nothing to patch)
    segs: list = field(default_factory=list)  # per item: its segments list (compared by identity)
    targets: list = field(default_factory=list)  # per item: its target Segment (identity)
    pages: list = field(default_factory=list)  # per item: its target's pages list (identity)
    others: list = field(default_factory=list)  # _other_runs of the items
    num: np.ndarray = field(default_factory=lambda: _empty(_I64))  # targets' tokens
    start: np.ndarray = field(default_factory=lambda: _empty(_I64))  # targets' start positions
    end: np.ndarray = field(default_factory=lambda: _empty(_I64))  # one past each target's entries
    own_pages: np.ndarray = field(default_factory=_empty)  # each target's pages in use, item by item
    own_indptr: np.ndarray = field(default_factory=lambda: np.zeros(1, dtype=_I64))  # [items + 1]
    # the last page tables made (kv_indices, pos_base, valid_len) and the targets' num and end then
    base: tuple | None = None
    hit: bool = False  # the last from_plan patched (same batch as the step before it)
    hits: int = 0  # steps patched so far (tests, stats)
    version: int = 0  # bumped by every rebuild: a grouping made at this version fits the batch

    def record(self, plan: StepPlan, s: StepInputs, ends: np.ndarray, page_size: int) -> None:
        """Keep a decode-shaped step (one token an item, its target attended, no document
        attention) that from_plan built from scratch."""
        items = plan.items
        self.s, self.end = s, ends
        self.segs = [it.segments for it in items]
        self.targets = [it.target for it in items]
        self.pages = [t.pages for t in self.targets]
        self.others = _other_runs(items)
        n = len(items)
        self.num = np.fromiter((t.num_tokens for t in self.targets), _I64, n)
        self.start = np.fromiter((t.start_pos for t in self.targets), _I64, n)
        self.own_pages, self.own_indptr = _gather_runs(s.kv_indices, ends, -(-self.num // page_size))
        self.base = (s.kv_indices, s.pos_base, s.valid_len, self.num, ends)


def _gather_runs(a: np.ndarray, ends: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The runs a[end - count : end], one after another, and their indptr."""
    indptr = np.concatenate([[0], np.cumsum(counts)])
    return a[np.repeat(ends - counts - indptr[:-1], counts) + np.arange(indptr[-1])], indptr


def _repeat_ranges(lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(i, j) for every j in lo[i]..hi[i] - 1, i in order."""
    counts = hi - lo
    i = np.repeat(np.arange(len(lo)), counts)
    return i, np.arange(len(i)) - np.repeat(np.cumsum(counts) - counts, counts) + lo[i]


class _TablePatch:
    """A patched decode step's page tables, made when read: the layout's last tables (base) with
    the entries each target gained since inserted after its old ones and its last page's fill set.
    Holds everything it needs (arrays are never changed in place), so a late read is still right;
    the tables it makes become the layout's base if that is still the one it started from."""

    def __init__(self, lay: DecodeLayout, ps: int):
        self.lay, self.ps, self.base = lay, ps, lay.base
        self.num, self.start, self.end = lay.num, lay.start, lay.end
        self.own_pages, self.own_indptr = lay.own_pages, lay.own_indptr

    def tables(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        kv, pos_base, valid, base_num, base_end = self.base
        ps, num, end = self.ps, self.num, self.end
        new_np = -(-num // ps)
        grow = new_np - -(-base_num // ps)  # entries gained since the base
        if grow.any():
            at = np.repeat(base_end, grow)  # right after each target's entries in the base
            i, j = _repeat_ranges(new_np - grow, new_np)  # the new entries: item, page in its run
            pages = self.own_pages[self.own_indptr[i] + j]
            kv = _insert(kv, at, pages)
            pos_base = _insert(pos_base, at, (self.start[i] + j * ps).astype(_I32))
            valid = _insert(valid, at, np.full(len(at), ps, dtype=_I32))
        else:
            valid = valid.copy()
        valid[end - grow - 1] = ps  # each target's last page in the base, full if it grew
        valid[end - 1] = num - (new_np - 1) * ps  # its last page holds the rest
        if self.lay.base is self.base:
            self.lay.base = (kv, pos_base, valid, num, end)
        return kv, pos_base, valid


def decode_inputs(plan: StepPlan, page_size: int, lay: DecodeLayout) -> StepInputs | None:
    """The step's StepInputs from lay's last step (see DecodeLayout), or None when the step is not
    a pure decode of the same batch (new token at the end of each target, nothing else changed);
    equal to what from_plan builds from scratch (tests/test_step_inputs_decode.py)."""
    items, prev = plan.items, lay.s
    lay.hit = False
    n = len(items)
    if prev is None or n != len(lay.segs):
        return None
    for it, segs, target, pages in zip(items, lay.segs, lay.targets, lay.pages):
        if (
            it.segments is not segs or it.target is not target or target.pages is not pages
            or len(it.token_ids) != 1 or it.doc_logits is not None
        ):  # fmt: skip
            return None
    if _other_runs(items) != lay.others:
        return None
    ps = page_size
    old_np = -(-lay.num // ps)
    if not np.all(old_np > 0):
        return None
    # every per-item value in one pass (six generators into numpy cost ~60 us at b64); last: the
    # page the target's last entry had, to catch pages rewritten in place (as segment_table)
    try:
        v = np.fromiter(chain.from_iterable([
            (t.num_tokens, t.start_pos, it.start_pos, len(p), p[k - 1], it.token_ids[0])
            for it, t, p, k in zip(items, lay.targets, lay.pages, old_np.tolist())
        ]), _I64, 6 * n).reshape(n, 6).T  # fmt: skip
    except IndexError:  # a target's pages shrank
        return None
    num, start, pos, npages, last, ids = v
    new_np = -(-num // ps)
    own_pages, own_indptr = lay.own_pages, lay.own_indptr
    ok = (start == lay.start) & (pos == start + num - 1) & (num >= lay.num) & (new_np <= npages)
    if not (ok & (last == own_pages[own_indptr[1:] - 1])).all():
        return None
    grow = new_np - old_np  # entries each target gains (it crossed into new pages)
    growing = np.flatnonzero(grow).tolist()
    if growing:  # a few items a step: their new pages in Python (fewer small numpy calls)
        o, m, ends = old_np.tolist(), new_np.tolist(), own_indptr[1:].tolist()
        at = [ends[i] for i in growing for _ in range(o[i], m[i])]
        new_pages = np.array([lay.pages[i][k] for i in growing for k in range(o[i], m[i])], dtype=_I32)
        own_pages = _insert(own_pages, at, new_pages)
        shift = np.zeros(n + 1, dtype=_I64)
        np.cumsum(grow, out=shift[1:])
        own_indptr, end = own_indptr + shift, lay.end + shift[1:]
        kv_indptr = prev.kv_indptr + shift.astype(_I32)
    else:
        kv_indptr, end = prev.kv_indptr, lay.end
    s = StepInputs(
        input_ids=np.ascontiguousarray(ids),
        positions=np.ascontiguousarray(pos),
        store_pages=own_pages[own_indptr[1:] - 1].astype(_I64),
        store_slots=(num - 1) % ps,
        qo_indptr=prev.qo_indptr,
        kv_indptr=kv_indptr,
        sample_rows=[i for i, it in enumerate(items) if it.request is not None],
    )
    lay.s, lay.num, lay.end, lay.own_pages, lay.own_indptr = s, num, end, own_pages, own_indptr
    for name in _TABLES:  # made when read (StepInputs.__getattr__)
        del s.__dict__[name]
    s._tables = _TablePatch(lay, ps)
    lay.hit = True
    lay.hits += 1
    return s


# Shared-chunk attention (kernels/shared_chunk.py) for a step when its page tables repeat runs of
# pages (documents used by several requests), used for steps of at most SHARED_MAX_Q_LEN new tokens
# per sequence (decode, questions; a long prompt's own causal run is the per-request kernel's work)
# when it reads at most 1/SHARED_MIN_SAVING of the pages. Runs are cut into pieces of
# SHARED_PIECE_TOKENS, or half that when the step's documents (its runs other than the items' own,
# which are short and cheap) give few programs at the full size: waves.half_piece_items, under 1.5
# an SM, counting a program per full piece's worth of the keys the work items read and per kv head
# (a document's short tail piece hardly counts; a tensor-parallel rank holds fewer kv heads, so takes
# more). With few long programs the SMs that drew none wait for the last ones; with many, larger
# pieces cost less. One layer, us with the merge, half / full pieces (document programs an SM at the
# full size):
# - H100, 8 kv heads, 5 x 2,048-token documents a request (b8311eb, 2026-11-27,
#   `experiments/lone_question.py --engine-tile --pieces 512 1024 [--q-len 1]`): a lone question 34.8
#   vs 46.9 (0.61), a decode step of 2 33.8 vs 45.5 (0.73); 4 questions 83.2 vs 73.1 (2.42), 8
#   questions 152.5 vs 130.7 (4.85), a decode step of 16 83.2 vs 77.2 (2.30);
# - H200, 4 kv heads (a TP=2 rank, 6ea295c, the same with `--kv-heads 4`): decode steps of 4 28.3 vs
#   37.4 (0.61), 8 32.1 vs 44.2 (0.79), 16 41.3 vs 51.3 (1.15); 32 65.4 vs 61.7 (1.64), 64 76.7 vs
#   72.5 (2.61);
# - H200, an engine's own decode step at batch 16 on a rank's shape (2,070-token documents, a 22-token
#   tail piece each; 1.11; `experiments/step_replay.py --model RANK_CONFIG`, 2026-11-28): 41.8 vs
#   61.1 (256-token pieces 44.3). The rule before counted work items, the own runs and tails too,
#   against one wave of 2 an SM: this step's 280 programs took the full size.
SHARED_PIECE_TOKENS = 1024
SHARED_MAX_Q_LEN = 64
SHARED_MIN_SAVING = 1.25


def shared_segments(
    plan: StepPlan, s: StepInputs, page_size: int, piece_tokens: int | None = None, intern: dict | None = None
) -> list | None:
    """The step's segments for SharedChunkMeta.build when sharing pays (see above), else None, its
    runs cut into pieces of piece_tokens (default SHARED_PIECE_TOKENS). intern: kept by the caller
    across steps (run_pieces)."""
    if s.entry_logit_scale is not None or s.num_seqs < 2 or s.max_q_len > SHARED_MAX_Q_LEN:
        return None  # one sequence has nobody to share with: skip the grouping on batch-1 steps
    qo, ps, pt = s.qo_indptr, page_size, piece_tokens or SHARED_PIECE_TOKENS
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
    pages) are the same at the same rows, so their grouping and flattened arrays are reused and only
    the own runs, one token longer each step, are grouped again (vectorised when the step was
    patched by decode_inputs: then its batch is known unchanged, with no key to build)."""

    key: tuple | None = None
    flat: dict | None = None
    per_request: int = 0
    shared: int = 0
    version: int = -1  # DecodeLayout.version the key was last checked at
    own: _OwnPieces | None = None  # patched steps: how the own runs are cut (_patched_arrays)


def shared_arrays(
    plan: StepPlan, s: StepInputs, page_size: int, block_pairs: int, cache: SharedGrouping,
    intern: dict | None = None, layout: DecodeLayout | None = None, force: bool = False,
    half_items: int = 0, kv_heads: int = 1, round_items: int = 0,
) -> dict[str, np.ndarray] | None:  # fmt: skip
    """build_arrays for the step's shared-chunk segments when sharing pays (as shared_segments), the
    segments ordered: the other runs' (grouped, cached in `cache`), then the items' own runs.
    layout: the DecodeLayout s was built with (from_plan), if any. force: whether it pays or not
    (a step replayed from a shared CUDA graph: one sequence alone included). half_items: a step whose
    documents' (the runs other than the items' own) work items read no more than this many full
    pieces' worth of keys takes half-size pieces (waves.half_piece_items; 0: always the full size). A
    batch keeps the size picked when its documents were grouped while it decodes."""
    if s.entry_logit_scale is not None or s.max_q_len > SHARED_MAX_Q_LEN or (s.num_seqs < 2 and not force):
        return None
    ps, qo, full = page_size, s.qo_indptr, SHARED_PIECE_TOKENS
    if len(plan.items) == 1:  # a lone question step (forced): nothing to group
        item, rows1 = plan.items[0], range(int(qo[0]), int(qo[1]))
        pt = piece_tokens_for(_unshared_keys(item, rows1, block_pairs), half_items)
        lone = lone_arrays(item, rows1, ps, pt, len(s.input_ids), block_pairs)
        if lone is not None:
            return lone
    patched = layout is not None and layout.hit and layout.s is s  # same batch as the last step
    if not (patched and cache.version == layout.version and cache.key is not None):
        rows = [range(int(qo[i]), int(qo[i + 1])) for i in range(len(plan.items))]
        body = tuple(
            (r.start, r.stop, tuple((g.pages, g.num_tokens, g.start_pos)
                                    for g in it.segments if g is not it.target and g.num_tokens))
            for r, it in zip(rows, plan.items)
        )  # fmt: skip
        if cache.key is None or cache.key[1] != body:
            # the keys the documents' work items read were nothing shared: when even these are few
            # enough, so are the grouped ones' (a segment of several users has no more items than
            # theirs alone)
            items, bp = plan.items, block_pairs
            unshared = sum(_unshared_keys(it, r, bp) for r, it in zip(rows, items))
            pt = piece_tokens_for(unshared, half_items)
            rounds = (bp, kv_heads, round_items)
            if pt == full:  # group at full size and count
                _group_documents(plan, rows, ps, full, intern, cache, body, rounds)
                pt = piece_tokens_for(_work_keys(cache.flat, bp), half_items)
            if pt != full:
                _group_documents(plan, rows, ps, pt, intern, cache, body, rounds)
        cache.version = layout.version if layout is not None else -1
    pt = cache.key[0]
    if patched:
        arrays = _patched_arrays(cache, layout, ps, pt, len(s.input_ids), block_pairs)
        if arrays or (arrays is not None and not force):
            return arrays or None  # {}: sharing does not pay
    rows = [range(int(qo[i]), int(qo[i + 1])) for i in range(len(plan.items))]
    own_seqs = [
        (r, [segment_run(it.target, ps, pt)] if it.target.num_tokens and _holds(it.segments, it.target)
         else [])
        for r, it in zip(rows, plan.items)
    ]  # fmt: skip
    segments, per_request, shared = group_segments(own_seqs, ps, pt)
    own_flat = flatten_segments(segments, ps)
    if cache.per_request + per_request < SHARED_MIN_SAVING * (cache.shared + shared) and not force:
        return None
    return finish_arrays(concat_flat(cache.flat, own_flat), len(s.input_ids), block_pairs)


def piece_tokens_for(doc_keys: int, half_items: int) -> int:
    """A step's piece size by the keys its documents' work items read (a key once per item reading
    it; the same at any piece size): at most half_items full pieces' worth take half-size pieces."""
    return SHARED_PIECE_TOKENS // 2 if doc_keys <= half_items * SHARED_PIECE_TOKENS else SHARED_PIECE_TOKENS


def _unshared_keys(item: ForwardItem, rows: range, block_pairs: int) -> int:
    """Keys the work items of an item's runs other than its own read, none shared with another."""
    tokens = sum(g.num_tokens for g in item.segments if g is not item.target)
    return tokens * -(-len(rows) // block_pairs)


def _work_keys(flat: dict[str, np.ndarray], block_pairs: int) -> int:
    """Keys the work items of flattened segments read (as finish_arrays: block_pairs pairs an item)."""
    return int((flat["lens"] * -(-np.diff(flat["pair_indptr"]) // block_pairs)).sum())


def _group_documents(
    plan: StepPlan, rows: list[range], ps: int, pt: int, intern: dict | None, cache: SharedGrouping,
    body: tuple, rounds: tuple[int, int, int] = (1, 1, 0),
) -> None:  # fmt: skip
    """Groups the step's runs other than the items' own in pieces of pt tokens into `cache`, the
    longest fitted to rounds = (block_pairs, kv_heads, round_items) by split_last_round."""
    seqs = [
        (r, [segment_run(g, ps, pt, intern) for g in it.segments if g is not it.target and g.num_tokens])
        for r, it in zip(rows, plan.items)
    ]
    segments, cache.per_request, cache.shared = group_segments(seqs, ps, pt)
    segments = split_last_round(segments, ps, *rounds)
    cache.flat, cache.key = flatten_segments(segments, ps), (pt, body)


def lone_arrays(
    item: ForwardItem, rows: range, ps: int, pt: int, num_rows: int, block_pairs: int
) -> dict[str, np.ndarray] | None:
    """shared_arrays of a step with one item, in numpy: its runs (documents etc., then its own) cut
    into pieces of pt tokens, each piece one segment with a pair per query row. This is what the
    grouping gives when no two pieces are equal, without its Python loops (0.59 ms of host time on
    the H100 machine for a lone question over 5 documents, in front of its first token); None when
    two pieces start on the same page (a document twice in the prompt: the grouping decides)."""
    runs = [g for g in item.segments if g is not item.target and g.num_tokens]
    if item.target.num_tokens and _holds(item.segments, item.target):
        runs.append(item.target)
    pp = max(1, pt // ps)  # pages a piece
    pages, counts, lens, starts = [], [], [], []
    for g in runs:
        n = g.num_tokens
        n_pages = -(-n // ps)
        k = np.arange(0, n_pages, pp)
        pages.append(np.asarray(g.pages[:n_pages], dtype=_I32))
        counts.append(np.minimum(k + pp, n_pages) - k)
        lens.append(np.minimum(n, (k + pp) * ps) - k * ps)
        starts.append(g.start_pos + k * ps)
    cat = lambda xs: np.concatenate(xs).astype(_I32) if xs else np.zeros(0, _I32)  # noqa: E731
    indices, counts, lens, starts = cat(pages), cat(counts), cat(lens), cat(starts)
    kv_indptr = np.concatenate([[0], np.cumsum(counts)]).astype(_I32)
    if len(np.unique(indices[kv_indptr[:-1]])) != len(lens):
        return None
    r, n_pieces = len(rows), len(lens)
    flat = dict(
        kv_indptr=kv_indptr, indices=indices, lens=lens,
        pair_indptr=(np.arange(n_pieces + 1) * r).astype(_I32),
        rows=np.tile(np.arange(rows.start, rows.stop, dtype=_I32), n_pieces),
        starts=np.repeat(starts, r).astype(_I32),
    )  # fmt: skip
    return finish_arrays(flat, num_rows, block_pairs)


@dataclass
class _OwnPieces:
    """How a patched step's own runs are cut (_patched_arrays), with what follows from it alone:
    valid while the layout's batch (version) and each run's piece count hold."""

    key: tuple  # (layout version, piece tokens, rows, block pairs)
    doc: dict  # the document grouping's flat arrays it extends (SharedGrouping.flat)
    pieces: np.ndarray  # pieces of each item's run
    item: np.ndarray  # each own piece's item
    k: np.ndarray  # each own piece's first page in its run
    pair_indptr: np.ndarray  # the step's (documents' then own pieces')
    rows: np.ndarray
    starts: np.ndarray
    blocks: np.ndarray  # work items of each segment
    row_parts: np.ndarray
    row_part_indptr: np.ndarray


def _patched_arrays(
    cache: SharedGrouping, lay: DecodeLayout, ps: int, pt: int, num_rows: int, block_pairs: int
) -> dict[str, np.ndarray] | None:
    """shared_arrays for a step decode_inputs patched (item i is query row i), in numpy: the kept
    document grouping (cache.flat) then each item's own run cut into pieces of pt tokens (as
    run_pieces + group_segments: one segment a piece, one pair on its item's row). What depends only
    on how the runs are cut (pairs, rows, the merge's index) is kept in cache.own until a run gains
    a piece or the batch changes. None: two pieces share a first page (they might be one segment:
    group_segments decides); {}: sharing does not pay."""
    n_pages = np.diff(lay.own_indptr)
    pp = max(1, pt // ps)  # pages a piece
    pieces = -(-n_pages // pp)
    doc = cache.flat
    own, key = cache.own, (lay.version, pt, num_rows, block_pairs)
    if own is None or own.key != key or own.doc is not doc or not np.array_equal(own.pieces, pieces):
        item = np.repeat(np.arange(len(n_pages)), pieces)  # in group_segments' order
        k = (np.arange(len(item)) - np.repeat(np.cumsum(pieces) - pieces, pieces)) * pp
        if len(np.unique(lay.own_pages[lay.own_indptr[item] + k])) != len(item):
            return None
        i32 = lambda x: np.asarray(x, dtype=_I32)  # noqa: E731
        npairs = len(doc["rows"])
        pair_indptr = np.concatenate([doc["pair_indptr"], i32(npairs + np.arange(1, len(item) + 1))])
        rows = np.concatenate([doc["rows"], i32(item)])
        starts = np.concatenate([doc["starts"], i32(lay.start[item] + k * ps)])
        blocks = -(-np.diff(pair_indptr) // block_pairs)
        own = cache.own = _OwnPieces(key, doc, pieces, item, k, pair_indptr, rows, starts, blocks,
                                     *row_index(rows, num_rows))  # fmt: skip
    total = int(lay.own_indptr[-1])  # own pages, each in one piece: read once either way
    if cache.per_request + total < SHARED_MIN_SAVING * (cache.shared + total):
        return {}
    item, k = own.item, own.k
    counts = np.minimum(k + pp, n_pages[item]) - k  # each piece's pages
    kv_indptr = np.concatenate([doc["kv_indptr"], (doc["kv_indptr"][-1] + np.cumsum(counts)).astype(_I32)])
    lens = np.concatenate([doc["lens"], (np.minimum(lay.num[item], (k + pp) * ps) - k * ps).astype(_I32)])
    work_chunk, work_pair = work_items(lens, own.pair_indptr, own.blocks, block_pairs)
    return dict(
        chunk_kv_indptr=kv_indptr,
        chunk_kv_indices=np.concatenate([doc["indices"], lay.own_pages]),  # pieces split runs in order
        chunk_len=lens,
        pair_indptr=own.pair_indptr,
        pair_row=own.rows,
        pair_start=own.starts,
        work_chunk=work_chunk,
        work_pair=work_pair,
        num_work=np.asarray([len(work_chunk)], dtype=_I32),
        row_part_indptr=own.row_part_indptr,
        row_parts=own.row_parts,
    )


def _holds(segments: list[Segment], seg: Segment) -> bool:
    return any(g is seg for g in segments)
