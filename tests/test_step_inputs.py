"""StepInputs.dense_pages: true exactly for the page tables plain paged attention can take."""

from __future__ import annotations

import random

import pytest

from lazyrt import Engine, RagPrompt, SamplingParams


def _record_dense(engine: Engine) -> list[tuple[int, bool]]:
    seen: list[tuple[int, bool]] = []
    build = engine.runner.build_metadata

    def wrapped(s):
        ids, meta = build(s)
        seen.append((meta.max_q_len, meta.dense_pages))
        return ids, meta

    engine.runner.build_metadata = wrapped
    return seen


@pytest.mark.parametrize("mode, dense", [("prefix", True), ("none", True), ("lazy", False), ("block", False)])
def test_dense_pages_flag_by_mode(mode, dense, tiny_model_dir):
    engine = Engine(tiny_model_dir("llama"), device="cpu", cache_mode=mode, kv_cache_tokens=4096)
    rng = random.Random()
    seen = _record_dense(engine)
    doc = lambda n: [rng.randrange(100, 40000) for _ in range(n)]  # noqa: E731
    prefix = doc(21)  # partial last page: a chunk tail in the middle of the table in lazy/block modes
    engine.generate(
        [RagPrompt(prefix, [doc(19), doc(30)], doc(5)) for _ in range(2)], SamplingParams(max_tokens=3)
    )
    plain = doc(40)
    engine.generate([plain, plain + doc(3)], SamplingParams(max_tokens=3))  # radix reuse in prefix mode
    rag_prefills = [d for q, d in seen[:-3] if q > 1]
    plain_prefills = [d for q, d in seen[-3:] if q > 1]
    if mode == "lazy":  # keys rotate in-kernel: never FlashInfer's, so never flagged
        assert not any(d for _, d in seen)
        return
    # prefix/none: every prefill; block: doc chunks after a partly filled prefix page and the suffix
    # over chunk tails are not dense (the prefix chunk computed on its own is)
    assert rag_prefills and (all(rag_prefills) if dense else not all(rag_prefills))
    assert plain_prefills and all(plain_prefills)  # plain prompts are dense in non-lazy modes
    assert not any(d for q, d in seen if q == 1)  # decode steps never go to FlashInfer prefill


def test_dense_pages_unit_cases():
    from lazyrt.runtime.worker.step_inputs import StepInputs

    def inputs(pos_base, valid_len, indptr):
        return StepInputs(kv_indptr=indptr, pos_base=pos_base, valid_len=valid_len)

    assert inputs([0, 4, 8], [4, 4, 1], [0, 3]).dense_pages(4)
    assert inputs([0, 4, 0, 4], [4, 2, 4, 4], [0, 2, 4]).dense_pages(4)  # two sequences
    assert not inputs([0, 4, 8], [4, 3, 4], [0, 3]).dense_pages(4)  # partly filled page mid-table
    assert not inputs([0, 5, 9], [4, 4, 1], [0, 3]).dense_pages(4)  # chunk at a shifted offset
    assert not inputs([4, 8], [4, 1], [0, 2]).dense_pages(4)  # table not starting at position 0


def _flatten_ref(plan, page_size):
    """Plain-Python flattening of a plan: the reference StepInputs.from_plan must equal."""
    out = {k: [] for k in ("ids", "pos", "pages", "slots", "kv", "base", "valid")}
    qo, kvp, rows = [0], [0], []
    for item in plan.items:
        n = len(item.token_ids)
        out["ids"] += item.token_ids
        qo.append(qo[-1] + n)
        if item.request is not None:
            rows.append(qo[-1] - 1)
        for p in range(item.start_pos, item.start_pos + n):
            off = p - item.target.start_pos
            out["pos"].append(p)
            out["pages"].append(item.target.pages[off // page_size])
            out["slots"].append(off % page_size)
        for seg in item.segments:
            for j in range(-(-seg.num_tokens // page_size)):
                out["kv"].append(seg.pages[j])
                out["base"].append(seg.start_pos + j * page_size)
                out["valid"].append(min(page_size, seg.num_tokens - j * page_size))
        kvp.append(len(out["kv"]))
    return out, qo, kvp, rows


def _random_plan(rng, rids, page_size, decode):
    from lazyrt.runtime.scheduler.plan import ForwardItem, StepPlan
    from lazyrt.runtime.scheduler.request import Request, Segment

    plan = StepPlan()
    for rid in rids:
        segs, pos = [], 0
        for _ in range(rng.randrange(0, 4)):
            n = rng.randrange(1, 5 * page_size)
            segs.append(Segment(rng.sample(range(1000), -(-n // page_size)), pos, n))
            pos += n
        n_new = 1 if decode else rng.randrange(1, 3 * page_size)
        done = rng.randrange(0, page_size) if decode else 0
        own = Segment(rng.sample(range(1000, 2000), -(-(done + n_new + 20) // page_size)), pos, done + n_new)
        segs.append(own)
        req = Request(rid, SamplingParams(max_tokens=4)) if rid >= 0 else None
        toks = [rng.randrange(50000) for _ in range(n_new)]
        plan.items.append(ForwardItem(toks, pos + done, segs, own, request=req))
    return plan


def test_from_plan_matches_python_reference():
    from lazyrt.runtime.worker.step_inputs import StepInputs

    rng = random.Random()
    for _ in range(30):
        ps = rng.choice([1, 4, 16])
        plan = _random_plan(rng, [rng.choice([-1, 1, 2, 3]) for _ in range(rng.randrange(1, 6))], ps, False)
        s = StepInputs.from_plan(plan, ps)
        ref, qo, kvp, rows = _flatten_ref(plan, ps)
        got = dict(ids=s.input_ids, pos=s.positions, pages=s.store_pages, slots=s.store_slots,
                   kv=s.kv_indices, base=s.pos_base, valid=s.valid_len)  # fmt: skip
        for k in ref:
            assert list(got[k]) == ref[k], k
        assert list(s.qo_indptr) == qo and list(s.kv_indptr) == kvp and s.sample_rows == rows


def test_step_wire_sends_segments_once_and_tracks_growth():
    """Decode items after a request's first carry no segments; the worker's kept copy grows with
    target_tokens, and the rebuilt plans flatten exactly like the scheduler's."""
    from lazyrt.runtime.ipc.messages import decode, encode
    from lazyrt.runtime.scheduler.step_wire import StepDecoder, StepEncoder
    from lazyrt.runtime.worker.step_inputs import StepInputs

    rng = random.Random()
    ps = 4
    enc, dec = StepEncoder(), StepDecoder()
    plan = _random_plan(rng, [0, 1, 2], ps, decode=False)
    first = encode(enc.encode(plan, []))
    got = dec.decode(decode(first))
    assert all(it.segments is not None for it in decode(first).items)
    for step in range(2 * ps + 1):
        for it in plan.items:  # the scheduler side: one more token in each request's own run
            it.token_ids = [rng.randrange(50000)]
            it.start_pos = it.target.start_pos + it.target.num_tokens
            it.target.num_tokens += 1
        msg = decode(encode(enc.encode(plan, [])))
        assert all(it.segments is None for it in msg.items)
        got = dec.decode(msg)
        a, b = StepInputs.from_plan(plan, ps), StepInputs.from_plan(got, ps)
        for f in ("input_ids", "positions", "store_pages", "store_slots", "kv_indptr", "kv_indices",
                  "pos_base", "valid_len"):  # fmt: skip
            assert list(getattr(a, f)) == list(getattr(b, f)), (step, f)
    # a released rid is forgotten on both sides: its next item carries segments again
    msg = enc.encode(_plan_of(plan.items[:1]), [plan.items[0].request.rid])
    assert msg.items[0].segments is not None
    assert len(dec.decode(msg).items) == 1 and len(dec) == 3
    dec.decode(enc.encode(_plan_of([]), [1, 2]))
    assert len(dec) == 1


def _plan_of(items):
    from lazyrt.runtime.scheduler.plan import StepPlan

    return StepPlan(items=list(items))


def test_step_decoder_rejects_unknown_request():
    from lazyrt.runtime.ipc.messages import StepItem, StepMsg
    from lazyrt.runtime.scheduler.step_wire import StepDecoder

    with pytest.raises(ValueError, match="without segments"):
        StepDecoder().decode(StepMsg([StepItem([1], 5, None, 0, rid=7, target_tokens=3)]))


def test_growing_segments_update_their_cached_tables():
    """A run that grows step by step (decode), sometimes by several tokens or onto new pages, and
    one whose pages are replaced: the cached tables always equal a fresh flattening."""
    from lazyrt.runtime.scheduler.plan import ForwardItem, StepPlan
    from lazyrt.runtime.scheduler.request import Request, Segment
    from lazyrt.runtime.worker.step_inputs import StepInputs

    rng = random.Random()
    ps = rng.choice([1, 4, 16])
    pool = iter(rng.sample(range(100000), 5000))
    items = []
    for rid in range(rng.randrange(1, 6)):
        doc = Segment([next(pool) for _ in range(3)], 0, 3 * ps - rng.randrange(ps))
        n0 = rng.randrange(1, 3 * ps)
        own = Segment([next(pool) for _ in range(-(-n0 // ps))], doc.num_tokens, n0)
        req = Request(rid, SamplingParams())
        items.append(ForwardItem([7], own.start_pos + n0 - 1, [doc, own], own, request=req))
    for step in range(60):
        plan = StepPlan(items=items)
        s = StepInputs.from_plan(plan, ps)
        ref, qo, kvp, rows = _flatten_ref(plan, ps)
        got = dict(ids=s.input_ids, pos=s.positions, pages=s.store_pages, slots=s.store_slots,
                   kv=s.kv_indices, base=s.pos_base, valid=s.valid_len)  # fmt: skip
        for k in ref:
            assert list(got[k]) == ref[k], (step, k)
        assert list(s.kv_indptr) == kvp
        for it in items:  # next step: grow by 1 (mostly) or a few tokens, adding pages as needed
            own = it.target
            grow = 1 if rng.random() < 0.8 else rng.randrange(2, 2 * ps + 2)
            own.num_tokens += grow
            while len(own.pages) * ps < own.num_tokens:
                own.pages.append(next(pool))
            if rng.random() < 0.05:  # the run moved to other pages: must not reuse the cached table
                own.pages[:] = [next(pool) for _ in own.pages]
            it.start_pos = own.start_pos + own.num_tokens - 1
