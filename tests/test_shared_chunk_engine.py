"""Shared-chunk attention in the engine (issue 14): a step whose requests share documents reads each
shared run of pages once (kernels/shared_chunk.py); the outputs must not change. Engines with
sharing on and off run the same batches of RAG prompts over a small document pool (so documents
repeat across requests, at different offsets and orders) on fresh tiny random models; the
reference for the sharing engine is the per-request path, itself checked against HF transformers
in test_engine_equivalence.py."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import cpu_engine

from lazyrt import RagPrompt, SamplingParams
from lazyrt.kernels.shared_chunk import group_segments
from lazyrt.runtime.scheduler.plan import ForwardItem, StepPlan
from lazyrt.runtime.scheduler.request import Segment
from lazyrt.runtime.worker import step_inputs
from lazyrt.runtime.worker.step_inputs import StepInputs, shared_segments


def pool_prompts(rng: random.Random, vocab: int, n: int, doc_lens=(5, 70)) -> list[RagPrompt]:
    """n prompts over one system prefix and a pool of 4 documents: 2-3 docs each, in random order."""
    ids = lambda k: [rng.randrange(100, vocab) for _ in range(k)]  # noqa: E731
    prefix = ids(rng.randint(4, 20))
    pool = [ids(rng.randint(*doc_lens)) for _ in range(4)]
    return [RagPrompt(prefix, rng.sample(pool, rng.randint(2, 3)), ids(rng.randint(3, 9))) for _ in range(n)]


def run(path: str, shared: bool, prompts, sps, **kw):
    engine = cpu_engine(path, "lazy", shared_chunk_attention=shared, **kw)
    outs = [o["token_ids"] for o in engine.generate(prompts, sps)]
    stats = engine.cache_stats()
    assert stats["shared_chunk_steps"] == engine.runner.shared_steps  # reported to the scheduler side
    assert 0 < stats["overlapped_steps"] <= stats["steps"]  # deferred: every step of plain decodes
    assert engine.runner._layout.hits > 0  # decode steps were patched from the last one's inputs
    return outs, engine.runner.shared_steps


@pytest.mark.parametrize(
    "family,kw",
    [
        ("llama", {}),
        ("qwen3", {"page_size": 4}),  # q/k norms; short pages, partial last pages everywhere
        ("llama", {"recompute_policy": "tail", "recompute_pages": 1, "page_size": 4}),  # own pages in docs
        ("llama", {"doc_positions": "parallel"}),  # every doc at the same offset
        ("llama", {"max_step_tokens": 24}),  # chunked prefill: question rows of several steps
    ],
)
def test_greedy_tokens_same_with_sharing_on_and_off(family, kw, tiny_model_dir):
    path = tiny_model_dir(family)
    rng = random.Random()
    prompts = pool_prompts(rng, 49152, 6)
    sps = [SamplingParams(max_tokens=rng.randint(4, 10), ignore_eos=True) for _ in prompts]
    # one request outlives the others by far: its last steps are a batch that does not change, which
    # run() asserts were patched (CI once drew lengths where every decode step changed the batch)
    sps[rng.randrange(len(sps))] = SamplingParams(max_tokens=40, ignore_eos=True)
    on, steps_on = run(path, True, prompts, sps, **kw)
    off, steps_off = run(path, False, prompts, sps, **kw)
    assert on == off
    assert steps_on > 0 and steps_off == 0  # the shared path really ran (decode steps share docs)


def test_greedy_tokens_same_with_the_last_round_cut(tiny_model_dir, monkeypatch):
    """Steps whose documents' longest pieces split_last_round cuts (forced here: each step's round
    sized so that its fewest-item longest segment spills into a last round; a real round is 3 programs
    an SM, far more than a tiny batch has) give the sharing-off engine's greedy tokens."""
    path = tiny_model_dir("llama")
    real, cuts = step_inputs.split_last_round, []

    def forced(segments, page_size, block_pairs, kv_heads, round_items, parts=4):
        longest = max(n for _, n, _ in segments)
        works = [-(-len(pairs) // block_pairs) for _, n, pairs in segments if n == longest]
        out = real(segments, page_size, block_pairs, kv_heads, (sum(works) - min(works)) * kv_heads, parts)
        cuts.append(len(out) - len(segments))
        return out

    monkeypatch.setattr(step_inputs, "split_last_round", forced)
    rng = random.Random()
    prompts = pool_prompts(rng, 49152, 6, doc_lens=(64, 64))  # equal documents: each is a longest run
    sps = [SamplingParams(max_tokens=rng.randint(4, 10), ignore_eos=True) for _ in prompts]
    on, steps_on = run(path, True, prompts, sps, page_size=4)
    off, _ = run(path, False, prompts, sps, page_size=4)
    assert steps_on > 0 and any(c > 0 for c in cuts)
    assert on == off


def _keys_by_row(a: dict, ps: int) -> dict[int, list]:
    """Every (page, slot, position) each query row reads through shared-chunk arrays a."""
    out: dict[int, list] = {}
    kvp, pp = a["chunk_kv_indptr"], a["pair_indptr"]
    for c in range(len(a["chunk_len"])):
        pages, n = a["chunk_kv_indices"][kvp[c] : kvp[c + 1]], int(a["chunk_len"][c])
        for p in range(pp[c], pp[c + 1]):
            start = int(a["pair_start"][p])
            out.setdefault(int(a["pair_row"][p]), []).extend(
                (int(pages[j // ps]), j % ps, start + j) for j in range(n)
            )
    return {row: sorted(keys) for row, keys in out.items()}


def test_a_batch_64_step_whose_long_items_spill_is_cut_at_the_engine_shape():
    """The engine's grouping at the 8B shape (8 kv heads, 16 pairs an item, 16-token pages, 2,070-token
    documents in 1,024-token pieces, rounds of 3 programs on 132 SMs): on Zipf draws of a batch-64
    decode step whose long work items spill at most half a round past a multiple of it,
    shared_arrays' long items then fill whole rounds, and every query row reads the same keys at the
    same positions as without the cut; draws that do not spill keep their arrays."""
    from lazyrt.kernels.waves import round_items
    from lazyrt.runtime.worker.step_inputs import SharedGrouping, shared_arrays

    ps, bp, heads, doc = 16, 16, 8, 2070
    rounds = round_items(torch.device("cpu"))
    rng = random.Random()
    weights = [1 / (i + 1) ** 2.1 for i in range(100)]
    pages = iter(range(1, 10**6))
    doc_pages = [[next(pages) for _ in range(-(-doc // ps))] for _ in range(100)]

    def long_items(a: dict) -> int:
        n = int(a["num_work"][0])
        lens = a["chunk_len"][a["work_chunk"][:n]]
        return int((lens == lens.max()).sum()) * heads

    seen = {"cut": 0, "kept": 0}
    for _ in range(60):
        items = []
        for _ in range(64):
            picks: list[int] = []
            while len(picks) < 5:
                d = rng.choices(range(100), weights)[0]
                picks += [d] if d not in picks else []
            segs = [Segment(doc_pages[d], i * doc, doc, is_doc=True) for i, d in enumerate(picks)]
            own = 16 + rng.randint(1, 40)
            segs.append(Segment([next(pages) for _ in range(-(-own // ps))], 5 * doc, own))
            items.append(_item(1, segs))
        plan = StepPlan(items=items)
        s = StepInputs.from_plan(plan, ps)
        plain = shared_arrays(plan, s, ps, bp, SharedGrouping(), force=True, kv_heads=heads)
        cut = shared_arrays(plan, s, ps, bp, SharedGrouping(), force=True, kv_heads=heads, round_items=rounds)
        before = long_items(plain)
        spill = before - (before - 1) // rounds * rounds
        if before > rounds and spill <= rounds / 2:
            seen["cut"] += 1
            assert long_items(cut) <= before - spill  # the spill's long items now run as quarters
            assert _keys_by_row(cut, ps) == _keys_by_row(plain, ps)
        else:
            seen["kept"] += 1
            assert _canon_arrays(cut) == _canon_arrays(plain)
        if seen["cut"] >= 2 and seen["kept"] >= 2:
            break
    assert seen["cut"] >= 1 and seen["kept"] >= 1, seen


def test_logprobs_same_with_sharing_on_and_off(tiny_model_dir):
    """Scored continuations (question prefill rows over shared docs, one batch): logprobs equal within
    fp32 rounding (the two paths differ only in summation order)."""
    path = tiny_model_dir("llama")
    rng = random.Random()
    prompts = pool_prompts(rng, 49152, 5)
    conts = [[rng.randrange(100, 49152) for _ in range(4)] for _ in prompts]
    got = {}
    for shared in (True, False):
        engine = cpu_engine(path, "lazy", shared_chunk_attention=shared)
        reqs = []
        for p, c in zip(prompts, conts):
            req = engine.score_request(p, "x")
            req.suffix, req.score_len = list(p.suffix) + c, len(c)  # score token ids directly
            reqs.append(req)
        engine._run(reqs)  # one batch: the question prefills share the documents
        got[shared] = [r.score_logprobs for r in reqs]
        assert (engine.runner.shared_steps > 0) == shared
    torch.testing.assert_close(torch.tensor(got[True]), torch.tensor(got[False]), rtol=1e-5, atol=1e-5)


def _item(rows: int, segs: list[Segment]) -> ForwardItem:
    own = segs[-1]
    return ForwardItem(list(range(rows)), own.start_pos + own.num_tokens - rows, segs, own)


def test_shared_segments_groups_runs_and_declines_when_nothing_is_shared():
    ps = 4
    doc = Segment(list(range(10, 15)), 0, 18, is_doc=True)  # 5 pages, last one partial
    at = lambda s, p: Segment(s.pages, p, s.num_tokens, is_doc=True)  # noqa: E731
    own = [Segment([100 + i, 200 + i], 30, 6) for i in range(3)]
    plan = StepPlan(items=[_item(1, [at(doc, 0), own[0]]), _item(1, [at(doc, 7), own[1]]),
                           _item(2, [at(doc, 3), own[2]])])  # fmt: skip
    s = StepInputs.from_plan(plan, ps)
    segs = shared_segments(plan, s, ps, piece_tokens=8)  # pieces of 2 pages: 8, 8, 2 tokens
    assert segs is not None
    by_pages = {tuple(p): (n, sorted(pairs)) for p, n, pairs in segs}
    assert by_pages[(10, 11)] == (8, [(0, 0), (1, 7), (2, 3), (3, 3)])
    assert by_pages[(12, 13)] == (8, [(0, 8), (1, 15), (2, 11), (3, 11)])
    assert by_pages[(14,)] == (2, [(0, 16), (1, 23), (2, 19), (3, 19)])
    assert by_pages[(100, 200)] == (6, [(0, 30)])
    assert by_pages[(102, 202)] == (6, [(2, 30), (3, 30)])
    # with interned piece keys (the runner's): the same segments; equal pieces are one object
    for it in plan.items:
        for g in it.segments:
            g.pieces = None
    intern: dict = {}
    assert shared_segments(plan, s, ps, piece_tokens=8, intern=intern) == segs
    assert len(intern) == 6  # 3 document pieces + 3 own runs
    keys = [k for it in plan.items for g in it.segments[:1] for k, _ in g.pieces[1]]
    assert all(a is b for a, b in zip(keys[:3], keys[3:6])) and keys[0] is not keys[1]
    alone = StepPlan(items=[_item(1, [at(doc, 0), own[0]])])
    assert shared_segments(alone, StepInputs.from_plan(alone, ps), ps) is None  # nothing to share


def test_group_segments_counts_pages_and_never_merges_different_pages():
    segs, per_request, shared = group_segments(
        [(range(0, 1), [([1, 2, 3], 12, 0)]), (range(1, 2), [([1, 2, 4], 12, 5), ([1, 2, 3], 10, 40)])],
        page_size=4,
        piece_tokens=64,
    )
    assert per_request == 9 and shared == 9  # same first pages, other last page or length: 3 segments
    assert [(p, n) for p, n, _ in segs] == [([1, 2, 3], 12), ([1, 2, 4], 12), ([1, 2, 3], 10)]


def _canon_arrays(a: dict) -> list:
    """A step's shared-chunk arrays as a sorted list of (pages, tokens, sorted pairs)."""
    kp, pp = a["chunk_kv_indptr"], a["pair_indptr"]
    rows, starts = a["pair_row"].tolist(), a["pair_start"].tolist()
    return sorted(
        (tuple(a["chunk_kv_indices"][kp[c] : kp[c + 1]].tolist()), int(a["chunk_len"][c]),
         tuple(sorted(zip(rows[pp[c] : pp[c + 1]], starts[pp[c] : pp[c + 1]]))))
        for c in range(len(a["chunk_len"]))
    )  # fmt: skip


def test_shared_arrays_reuse_the_document_grouping_across_decode_steps():
    """shared_arrays keeps the grouping of the runs other than each item's own between steps; over
    decode steps whose own runs grow (crossing pages), a request joining and one leaving, its arrays
    describe the same segments and pairs as a from-scratch grouping (shared_segments) every step, and
    the work items and per-row index match build_arrays over those segments."""
    from lazyrt.kernels.shared_chunk import build_arrays
    from lazyrt.runtime.worker.step_inputs import SharedGrouping, shared_arrays

    rng = random.Random()
    ps = 4
    docs = [Segment(list(range(100 * d, 100 * d + rng.randint(2, 6))), 0, 0, is_doc=True) for d in range(4)]
    for d in docs:
        d.num_tokens = (len(d.pages) - 1) * ps + rng.randint(1, ps)

    def request(r: int) -> list[Segment]:
        pos, segs = 0, []
        for d in rng.sample(docs, 3):
            segs.append(Segment(d.pages, pos, d.num_tokens, is_doc=True))
            pos += d.num_tokens
        segs.append(Segment([1000 + 10 * r + i for i in range(8)], pos, rng.randint(1, 5)))  # own run
        return segs

    batch = {r: request(r) for r in range(3)}
    cache, hits = SharedGrouping(), 0
    for step in range(12):
        if step == 4:
            batch[3] = request(3)  # joins
        if step == 8:
            del batch[1]  # leaves
        plan = StepPlan(items=[_item(1, segs) for segs in batch.values()])
        s = StepInputs.from_plan(plan, ps)
        key_before = cache.key
        got = shared_arrays(plan, s, ps, 2, cache)
        hits += key_before is not None and cache.key is key_before
        want = shared_segments(plan, s, ps, piece_tokens=512)
        assert (got is None) == (want is None)
        if got is not None:
            assert _canon_arrays(got) == _canon_arrays(build_arrays(want, ps, len(s.input_ids), 2))
            T = len(s.input_ids)
            assert got["row_part_indptr"][-1] == len(got["pair_row"]) and len(got["row_part_indptr"]) == T + 1
        for segs in batch.values():
            segs[-1].num_tokens += 1  # the decode step wrote one token
    assert hits >= 8  # only the first step and the batch changes regroup the documents


@pytest.mark.parametrize("ps", [1, 3, 4])
def test_steps_with_few_document_items_take_half_size_pieces(ps, monkeypatch):
    """shared_arrays cuts a step's runs into half-size pieces when the work items of its documents (the
    runs other than the items' own) read at most half_items full pieces' worth of keys
    (waves.half_piece_items: more for a tensor-parallel rank, which holds fewer kv heads), into full
    ones past it. On random steps (documents longer than a piece shared by several requests,
    questions of several rows, lone questions; a page size that does not divide the piece), with
    half_items set just at and just under the documents' own keys (from an independent grouping of
    the documents alone), and at their keys were nothing shared (then no grouping at full size is
    needed to decide), the arrays are a from-scratch grouping of every run at the size the keys pick;
    a batch keeps its size while its documents stay the same (decode steps), whatever half_items
    says later."""
    from lazyrt.kernels.shared_chunk import build_arrays
    from lazyrt.kernels.waves import HALF_PIECE_PROGRAMS_PER_SM, half_piece_items
    from lazyrt.runtime.worker import step_inputs
    from lazyrt.runtime.worker.step_inputs import SharedGrouping, shared_arrays

    rng = random.Random()
    bp, full = 2, 32
    monkeypatch.setattr(step_inputs, "SHARED_PIECE_TOKENS", full)
    grouped_at = []
    real_group = step_inputs.group_segments
    spy = lambda seqs, p, pt: grouped_at.append(pt) or real_group(seqs, p, pt)  # noqa: E731
    monkeypatch.setattr(step_inputs, "group_segments", spy)
    pages = iter(rng.sample(range(1, 10**6), 50_000))
    picked = {full // 2: 0, full: 0}
    for trial in range(40):
        docs = []
        for _ in range(3):
            n = rng.randint(full // 2 + 1, 3 * full)
            docs.append(([next(pages) for _ in range(-(-n // ps))], n))
        items = []
        for _ in range(rng.choice([1, 2, 3, 5])):
            pos, segs = 0, []
            for pg, n in rng.sample(docs, rng.randint(1, 3)):
                segs.append(Segment(pg, pos, n, is_doc=True))
                pos += n
            q = rng.choice([1, 1, 3, 6])  # decode rows or a question's
            own = q + rng.randint(0, 40)
            segs.append(Segment([next(pages) for _ in range(-(-own // ps))], pos, own))
            items.append(_item(q, segs))
        plan = StepPlan(items=items)
        s = StepInputs.from_plan(plan, ps)
        qo, T = s.qo_indptr, len(s.input_ids)
        # independent of shared_arrays: the documents (every run but the last, the item's own) of
        # every item in one grouping; and with none shared
        runs = [[(g.pages, g.num_tokens, g.start_pos) for g in it.segments if g.num_tokens] for it in items]
        seqs = [(range(qo[i], qo[i + 1]), r) for i, r in enumerate(runs)]
        docs_only = [(rows, r[:-1]) for rows, r in seqs]
        grouped = build_arrays(group_segments(docs_only, ps, full)[0], ps, T, bp)
        keys = int(grouped["chunk_len"][grouped["work_chunk"]].sum())  # each work item reads its piece
        unshared = sum(sum(n for _, n, _ in r) * -(-len(rows) // bp) for rows, r in docs_only)
        assert unshared >= keys
        at_unshared = -(-unshared // full)
        for wave in (-(-keys // full), -(-keys // full) - 1, at_unshared):
            want_pt = full // 2 if keys <= wave * full else full
            want = build_arrays(real_group(seqs, ps, want_pt)[0], ps, T, bp)
            cache = SharedGrouping()
            grouped_at.clear()
            got = shared_arrays(plan, s, ps, bp, cache, force=True, half_items=wave)
            assert _canon_arrays(got) == _canon_arrays(want), (trial, wave)
            if wave == at_unshared:  # decided without grouping at full size
                assert full not in grouped_at, grouped_at
            picked[want_pt] += 1
            if len(items) > 1:  # the same documents next step: the size stays, the wave notwithstanding
                flip = 0 if want_pt < full else 10**6
                s2 = StepInputs.from_plan(plan, ps)
                again = shared_arrays(plan, s2, ps, bp, cache, force=True, half_items=flip)
                assert _canon_arrays(again) == _canon_arrays(got)
    assert picked[full // 2] and picked[full]
    cpu = torch.device("cpu")  # (an H100's 132 SMs off CUDA): a TP=2 rank's 4 kv heads take twice the items
    per_sm = HALF_PIECE_PROGRAMS_PER_SM
    assert half_piece_items(4, cpu) == int(132 * per_sm) // 4 >= 2 * half_piece_items(8, cpu)


@pytest.mark.parametrize("ps", [1, 4, 16])
def test_a_lone_step_skips_the_grouping_with_the_same_arrays(ps, monkeypatch):
    """A step of one item (a question over cached documents, replayed through a shared CUDA graph)
    takes step_inputs.lone_arrays instead of the grouping: over random documents (partial last pages,
    runs shorter and longer than a piece), questions of several tokens and a document used twice, its
    arrays equal the grouping's (lone_arrays switched off) in every field and order."""
    import numpy as np

    from lazyrt.runtime.worker import step_inputs
    from lazyrt.runtime.worker.step_inputs import SharedGrouping, shared_arrays

    rng = random.Random()
    pages = iter(rng.sample(range(1, 10**7), 200_000))
    lone_calls = []
    real_lone = step_inputs.lone_arrays
    for trial in range(40):
        docs = []
        for _ in range(rng.randint(0, 6)):
            n = rng.randint(1, 40 * 16 // ps + 3)
            docs.append(([next(pages) for _ in range(-(-n // ps))], n))
        if docs and trial % 4 == 0:
            docs.append(rng.choice(docs))  # the same document twice: grouped into one segment
        pos, segs = 0, []
        for pg, n in docs:
            segs.append(Segment(pg, pos, n, is_doc=True))
            pos += n
        q = rng.randint(1, 20)
        own = rng.randint(0, 30)  # a prefix of its own (radix pages) before the question
        segs.append(Segment([next(pages) for _ in range(-(-(own + q) // ps))], pos, own + q))
        plan = StepPlan(items=[_item(q, segs)])
        s = StepInputs.from_plan(plan, ps)
        pt = rng.choice([ps, 2 * ps, 512])
        monkeypatch.setattr(step_inputs, "SHARED_PIECE_TOKENS", 2 * pt)  # (a lone step: half)
        monkeypatch.setattr(step_inputs, "lone_arrays", lambda *a: lone_calls.append(a) or real_lone(*a))
        got = shared_arrays(plan, s, ps, 2, SharedGrouping(), force=True)
        monkeypatch.setattr(step_inputs, "lone_arrays", lambda *a: None)
        want = shared_arrays(plan, s, ps, 2, SharedGrouping(), force=True)
        assert set(got) == set(want)
        for k in want:
            assert got[k].dtype == want[k].dtype and np.array_equal(got[k], want[k]), (trial, k)
    assert len(lone_calls) == 40
    assert any(real_lone(*a) is None for a in lone_calls), "a document used twice must fall back"
