"""Decode steps patched from the last step (step_inputs.DecodeLayout / decode_inputs, and the
vectorised own-run grouping in shared_arrays) must equal a from-scratch build: over random runs of
steps whose batch changes (requests joining and finishing, runs crossing pages, several tokens at
once, mixed prefill steps, document attention, runs replaced or rewritten), every field of
StepInputs and every shared-chunk array is compared with from_plan / shared_arrays on a fresh copy
of the plan (new Segment objects, no caches)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from lazyrt.kernels.shared_chunk import build_arrays
from lazyrt.runtime.scheduler.plan import ForwardItem, StepPlan
from lazyrt.runtime.scheduler.request import Request, Segment
from lazyrt.runtime.worker import step_inputs
from lazyrt.runtime.worker.step_inputs import (
    DecodeLayout,
    SharedGrouping,
    StepInputs,
    shared_arrays,
    shared_segments,
)
from lazyrt.sampling_params import SamplingParams

FIELDS = ("input_ids", "positions", "store_pages", "store_slots", "qo_indptr", "kv_indptr", "kv_indices",
          "pos_base", "valid_len", "entry_logit_scale", "entry_log_mass")  # fmt: skip
TABLES = ("kv_indices", "pos_base", "valid_len")  # made when read on a patched step


def _fresh(plan: StepPlan) -> StepPlan:
    """The plan with new Segment objects and lists (nothing cached on them)."""
    out = StepPlan()
    for it in plan.items:
        segs = [Segment(list(g.pages), g.start_pos, g.num_tokens, g.is_doc) for g in it.segments]
        at = next((i for i, g in enumerate(it.segments) if g is it.target), None)
        target = segs[at] if at is not None else Segment(list(it.target.pages), it.target.start_pos,
                                                         it.target.num_tokens)  # fmt: skip
        out.items.append(ForwardItem(list(it.token_ids), it.start_pos, segs, target, it.request,
                                     doc_logits=it.doc_logits))  # fmt: skip
    return out


def _same(a, b, what) -> None:
    if a is None or b is None:
        assert a is None and b is None, what
        return
    assert a.dtype == b.dtype and np.array_equal(a, b), what


def _canon(a: dict) -> list:
    """build_arrays' segments as a sorted list of (pages, length, sorted pairs): the grouping,
    whatever the segment order."""
    kp, pp = a["chunk_kv_indptr"].tolist(), a["pair_indptr"].tolist()
    rows, starts = a["pair_row"].tolist(), a["pair_start"].tolist()
    return sorted(
        (tuple(a["chunk_kv_indices"][kp[c] : kp[c + 1]].tolist()), int(a["chunk_len"][c]),
         tuple(sorted(zip(rows[pp[c] : pp[c + 1]], starts[pp[c] : pp[c + 1]]))))
        for c in range(len(a["chunk_len"]))
    )  # fmt: skip


class Batch:
    """Running requests over a shared document pool, as the worker's StepDecoder keeps them: each
    request's segments list and Segment objects live across steps; its own run grows."""

    def __init__(self, rng: random.Random, ps: int):
        self.rng, self.ps = rng, ps
        self.pages = iter(rng.sample(range(1, 10**6), 50_000))
        self.docs = []
        for _ in range(3):  # few and long: sharing them pays (else shared_arrays declines)
            n = rng.randint(max(40, 4 * ps), max(120, 12 * ps))
            self.docs.append(([next(self.pages) for _ in range(-(-n // ps))], n))
        self.reqs: dict[int, tuple[list[Segment], Segment, Request]] = {}
        self.next_rid = 0

    def join(self, at: int | None = None) -> None:
        rng, ps = self.rng, self.ps
        segs, pos = [], 0
        if rng.random() < 0.7:  # a private prefix
            n = rng.randint(1, 2 * ps)
            segs.append(Segment([next(self.pages) for _ in range(-(-n // ps))], 0, n))
            pos = n
        for pages, n in rng.sample(self.docs, rng.randint(1, 3)):
            segs.append(Segment(list(pages), pos, n, is_doc=True))  # the decoder's own copy
            pos += n
        n0 = rng.randint(1, 3 * ps)
        room = n0 + 120 + 10 * ps  # tokens it may grow to
        own = Segment([next(self.pages) for _ in range(-(-room // ps))], pos, n0)
        segs.append(own)
        rid = self.next_rid
        self.next_rid += 1
        entry = (segs, own, Request(rid, SamplingParams()))
        keys = list(self.reqs)
        at = len(keys) if at is None else min(at, len(keys))
        before, after = {k: self.reqs[k] for k in keys[:at]}, {k: self.reqs[k] for k in keys[at:]}
        self.reqs = {**before, rid: entry, **after}

    def plan(self, doc_logits: int | None = None, prefill: int | None = None) -> StepPlan:
        plan = StepPlan()
        for i, (segs, own, req) in enumerate(self.reqs.values()):
            n = self.rng.randint(2, 5) if i == prefill else 1
            if i == prefill:
                own.num_tokens += n - 1
            toks = [self.rng.randrange(-1, 5000) for _ in range(n)]  # -1: PENDING_TOKEN
            dl = (0.5, -0.2) if i == doc_logits else None
            pos = own.start_pos + own.num_tokens - n
            plan.items.append(ForwardItem(toks, pos, segs, own, req, doc_logits=dl))
        return plan

    def grow(self) -> None:
        """After a step: each own run one token longer (the next decode writes there)."""
        for _, own, _ in self.reqs.values():
            own.num_tokens += 1


@pytest.mark.parametrize("seed", range(6))
def test_patched_decode_steps_equal_a_fresh_build(seed, monkeypatch):
    rng = random.Random(seed)
    ps = rng.choice([1, 4, 16])
    # small pieces: own runs span several pieces (the vectorised cut must match run_pieces')
    monkeypatch.setattr(step_inputs, "SHARED_PIECE_TOKENS", rng.choice([4 * ps, 8 * ps, 1024]))
    b = Batch(rng, ps)
    for _ in range(rng.randint(3, 7)):
        b.join()
    layout, grouping, intern = DecodeLayout(), SharedGrouping(), {}
    hits = shared_hits = 0
    unread: list[tuple[int, StepInputs, StepInputs]] = []
    for step in range(80):
        event = rng.random()
        doc_logits = prefill = None
        if event < 0.06:
            b.join(rng.randrange(len(b.reqs) + 1))
        elif event < 0.12 and len(b.reqs) > 1:
            del b.reqs[rng.choice(list(b.reqs))]
        elif event < 0.15:
            prefill = rng.randrange(len(b.reqs))
        elif event < 0.18:
            doc_logits = rng.randrange(len(b.reqs))
        elif event < 0.21:  # a request's own run jumps several tokens (onto new pages)
            own = rng.choice(list(b.reqs.values()))[1]
            own.num_tokens += rng.randint(1, 2 * ps)
        elif event < 0.23:  # a document run replaced by a shorter view (a new Segment)
            segs = rng.choice(list(b.reqs.values()))[0]
            k = rng.randrange(len(segs) - 1)
            g = segs[k]
            segs[k] = Segment(g.pages, g.start_pos, max(1, g.num_tokens - 1), g.is_doc)
        elif event < 0.25:  # a run's length changed in place
            segs = rng.choice(list(b.reqs.values()))[0]
            g = segs[rng.randrange(len(segs) - 1)]
            g.num_tokens = max(1, min(len(g.pages) * ps, g.num_tokens + rng.choice([-1, 1])))
        elif event < 0.27:  # an own run's pages rewritten in place
            own = rng.choice(list(b.reqs.values()))[1]
            own.pages[:] = [next(b.pages) for _ in own.pages]
        elif event < 0.30:  # an own run replaced by a new Segment elsewhere (same pages, length)
            rid = rng.choice(list(b.reqs))
            segs, own, req = b.reqs[rid]
            segs[-1] = Segment(list(own.pages), own.start_pos + rng.randint(1, 5), own.num_tokens)
            b.reqs[rid] = (segs, segs[-1], req)
        plan = b.plan(doc_logits, prefill)
        s = StepInputs.from_plan(plan, ps, layout)
        hits += layout.hit
        fresh = _fresh(plan)
        want = StepInputs.from_plan(fresh, ps)
        for f in FIELDS:
            if f not in TABLES:
                _same(getattr(s, f), getattr(want, f), (step, f))
        assert s.sample_rows == want.sample_rows
        # a patched step's page tables are made when read: read them now, later (after newer steps
        # were patched from tables made before them) or never
        unread.append((step, s, want))
        for k in sorted(rng.sample(range(len(unread)), min(len(unread), rng.choice([0, 0, 1, 2]))))[::-1]:
            at, old, old_want = unread.pop(k)
            for f in TABLES:
                _same(getattr(old, f), getattr(old_want, f), (step, at, f))
        if rng.random() < 0.1:  # a step the runner asks no grouping for: the kept one goes stale
            b.grow()
            continue
        got_arrays = shared_arrays(plan, s, ps, 2, grouping, intern, layout)
        shared_hits += layout.hit and got_arrays is not None
        want_arrays = shared_arrays(fresh, want, ps, 2, SharedGrouping())
        assert (got_arrays is None) == (want_arrays is None), step
        if got_arrays is not None:
            assert got_arrays.keys() == want_arrays.keys()
            for k in got_arrays:
                _same(got_arrays[k], want_arrays[k], (step, k))
            segments = shared_segments(fresh, want, ps)
            assert _canon(got_arrays) == _canon(build_arrays(segments, ps, len(want.input_ids), 2))
        b.grow()
    for at, old, old_want in unread:
        for f in TABLES:
            _same(getattr(old, f), getattr(old_want, f), (at, f))
    assert hits >= 30  # most steps were patched, not rebuilt
    assert shared_hits >= 10


def test_a_decode_step_crossing_a_page_inserts_one_entry():
    """Two requests decoding: the one whose own run crosses into a new page gets one more entry,
    right after its old ones; the other's last entry only fills up."""
    ps = 4
    doc = [10, 11]
    a = [Segment(doc, 0, 7, True), Segment([20, 21, 22], 7, 4)]  # own run: one full page
    c = [Segment(list(doc), 0, 7, True), Segment([30, 31], 7, 2)]
    ra, rc = Request(0, SamplingParams()), Request(1, SamplingParams())

    def plan() -> StepPlan:
        return StepPlan([ForwardItem([5], 7 + a[1].num_tokens - 1, a, a[1], ra),
                         ForwardItem([6], 7 + c[1].num_tokens - 1, c, c[1], rc)])  # fmt: skip

    layout = DecodeLayout()
    s0 = StepInputs.from_plan(plan(), ps, layout)
    assert not layout.hit and s0.kv_indptr.tolist() == [0, 3, 6]
    a[1].num_tokens += 1
    c[1].num_tokens += 1
    s1 = StepInputs.from_plan(plan(), ps, layout)
    assert layout.hit
    assert s1.kv_indices.tolist() == [10, 11, 20, 21, 10, 11, 30]
    assert s1.valid_len.tolist() == [4, 3, 4, 1, 4, 3, 3]
    assert s1.pos_base.tolist() == [0, 4, 7, 11, 0, 4, 7]
    assert s1.kv_indptr.tolist() == [0, 4, 7]
    assert s1.store_pages.tolist() == [21, 30] and s1.store_slots.tolist() == [0, 2]
    assert s0.valid_len.tolist() == [4, 3, 4, 4, 3, 2]  # the last step's arrays are left as they were


def test_own_runs_on_the_same_pages_stay_one_segment():
    """Two decode items whose own runs are the same pages and length (distinct Segment objects)
    are one shared segment with two pairs, patched step or not (the vectorised cut defers to
    group_segments)."""
    ps = 4
    own_pages = [50, 51, 52]
    reqs = [Request(i, SamplingParams()) for i in range(3)]
    segs = [[Segment([10, 11], 0, 8, True), Segment(own_pages if i < 2 else [60, 61, 62], 8, 5)]
            for i in range(3)]  # fmt: skip

    def plan() -> StepPlan:
        return StepPlan([ForwardItem([1], 8 + g[1].num_tokens - 1, g, g[1], r) for g, r in zip(segs, reqs)])

    layout, grouping = DecodeLayout(), SharedGrouping()
    for step in range(3):
        p = plan()
        s = StepInputs.from_plan(p, ps, layout)
        assert layout.hit == (step > 0)
        got = shared_arrays(p, s, ps, 2, grouping, {}, layout)
        fresh = _fresh(p)
        want = shared_arrays(fresh, StepInputs.from_plan(fresh, ps), ps, 2, SharedGrouping())
        for k in want:
            _same(got[k], want[k], (step, k))
        assert len(got["chunk_len"]) == 3  # the document, the two items' shared own run, the third's
        for g in segs:
            g[1].num_tokens += 1
