"""Selective recompute (recompute_policy + recompute_pages / recompute_ratio): any set of a doc's pages
recomputed in the request's context, the rest shared from the chunk (page-granular copy-on-write).

The reference is Hugging Face transformers with an explicit 4-D mask spelling out the semantics
(tests/hf_reference.py recompute_layout; no lazyrt code on its compute path). Selections come from
the policies or are drawn at random and injected into the scheduler, so arbitrary run patterns
(first page, middle pages, a partly filled last page, whole docs, none) are covered.
"""

from __future__ import annotations

import math
import random
import sys
from pathlib import Path

import pytest
import torch
from conftest import load_hf
from hf_reference import (
    assert_no_leaked_pages,
    capture_recomputed_kv,
    hf_greedy,
    hf_recompute_greedy,
    hf_recompute_kv,
)

from lazyrt import Engine, RagPrompt, SamplingParams
from lazyrt.cache.page_pool import PagePool
from lazyrt.config import EngineConfig
from lazyrt.launch import build_parser, main
from lazyrt.runtime.scheduler.recompute import page_budget, page_runs, question_page_scores, select_pages
from lazyrt.runtime.scheduler.scheduler import Scheduler

PS = 16
GREEDY = SamplingParams(max_tokens=6)


def _ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(100, vocab) for _ in range(n)]


def _prompt(rng: random.Random, vocab: int, n_docs: int = 4, lo: int = 5, hi: int = 90):
    prefix = _ids(rng, rng.randint(8, 30), vocab)
    docs = [_ids(rng, rng.randint(lo, hi), vocab) for _ in range(n_docs)]
    return prefix, docs, _ids(rng, rng.randint(2, 9), vocab)


def _offsets(doc: list[int], pages: list[int]) -> set[int]:
    """Token offsets of the given pages of a doc."""
    return {i for p in pages for i in range(p * PS, min((p + 1) * PS, len(doc)))}


def _inject(engine: Engine, by_doc: dict[tuple[int, ...], list[int]]) -> None:
    """Make the scheduler recompute the given pages of each doc (by content; first doc never)."""
    sched = engine.scheduler

    def selection(req):
        if req.recompute_sel is None:
            req.recompute_sel = [[] if j == 0 else by_doc.get(tuple(d), []) for j, d in enumerate(req.docs)]
        return req.recompute_sel

    sched.recompute_selection = selection


def _engine(path, mode: str, **kw) -> Engine:
    return Engine(path, device="cpu", cache_mode=mode, kv_cache_tokens=8192, **kw)


# ---- engine vs the HF reference ---------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["lazy", "block"])
def test_random_page_runs_match_reference(mode, tiny_model_dir):
    """Random page subsets (alternating runs): recomputed K/V and greedy tokens equal the reference;
    the shared chunk pages are bit-identical before and after; cached_tokens drops by the recomputed
    tokens; nothing leaks."""
    path = tiny_model_dir("llama")
    hf = load_hf(path)
    engine = _engine(path, mode)
    snaps = capture_recomputed_kv(engine)
    rng = random.Random()
    prefix, docs, suffix = _prompt(rng, engine.model_config.vocab_size, lo=20, hi=90)
    pages = {}
    for d in docs:
        n = -(-len(d) // PS)
        pages[tuple(d)] = sorted(rng.sample(range(n), rng.randint(1, n)))
    pages[tuple(docs[1])] = [p for p in range(-(-len(docs[1]) // PS)) if p % 2 == 1] or [0]  # alternating
    _inject(engine, pages)

    def rec_sets(order_docs):
        return [set() if j == 0 else _offsets(d, pages[tuple(d)]) for j, d in enumerate(order_docs)]

    engine.generate(RagPrompt(prefix, docs, [suffix[0]]), SamplingParams(max_tokens=1))  # chunks in
    chunk_kv = {c.key: [kv[c.pages].clone() for kv in engine.pool.kv] for c in engine.scheduler.chunks}
    for order in ([0, 1, 2, 3], [2, 0, 3, 1]):
        d = [docs[i] for i in order]
        rid_before = set(snaps)
        out = engine.generate(RagPrompt(prefix, d, suffix), GREEDY)[0]
        rec = rec_sets(d)
        assert out["token_ids"] == hf_recompute_greedy(hf, prefix, d, suffix, rec, 6, engine.eos_ids)
        assert out["meta"]["chunk_hits"] == 4
        assert out["meta"]["cached_tokens"] == len(prefix) + sum(map(len, d)) - sum(map(len, rec))
        (rid,) = set(snaps) - rid_before
        ref = hf_recompute_kv(hf, prefix, d, suffix, rec)
        starts = [len(prefix) + sum(len(x) for x in d[:j]) for j in range(len(d))]
        for layer, (segs, ref_layer) in enumerate(zip(snaps[rid], ref)):
            # the engine's runs, in prompt order, concatenated per doc = the reference's tokens per doc
            got = {}
            for start, k, v in segs:
                j = max(i for i, s in enumerate(starts) if s <= start)
                gk, gv, gp = got.get(j, ([], [], []))
                got[j] = (gk + [k], gv + [v], gp + list(range(start - starts[j], start - starts[j] + len(k))))
            assert sorted(got) == sorted(ref_layer)
            for j, (k_raw, k_rot, v_ref) in ref_layer.items():
                gk, gv, gp = got[j]
                assert gp == sorted(rec[j])
                k_ref = k_raw if mode == "lazy" else k_rot  # lazy stores keys unrotated, block rotated
                torch.testing.assert_close(torch.cat(gk), k_ref, rtol=1e-4, atol=1e-4, msg=f"layer {layer} K")
                torch.testing.assert_close(torch.cat(gv), v_ref, rtol=1e-4, atol=1e-4, msg=f"layer {layer} V")
    for c in engine.scheduler.chunks:
        for before, kv in zip(chunk_kv[c.key], engine.pool.kv):
            assert torch.equal(before, kv[c.pages])
    assert_no_leaked_pages(engine)


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_question_policy_matches_reference_lazy_equals_block(family, tiny_model_dir):
    """The question policy end to end, batched: lazy = block = the reference with the pages the
    policy picks. Docs carry the question's tokens on known pages so the selection is not empty."""
    path = tiny_model_dir(family)
    hf = load_hf(path)
    kw = dict(recompute_policy="question", recompute_pages=1)
    lazy, block = _engine(path, "lazy", **kw), _engine(path, "block", **kw)
    rng = random.Random()
    vocab = lazy.model_config.vocab_size
    prompts = []
    for _ in range(3):
        prefix, docs, suffix = _prompt(rng, vocab, n_docs=rng.randint(2, 4), lo=30)
        for d in docs[1:]:  # plant a question token somewhere in each later doc
            d[rng.randrange(len(d))] = suffix[rng.randrange(len(suffix))]
        prompts.append((prefix, docs, suffix))
    rag = [RagPrompt(*p) for p in prompts]
    out_lazy, out_block = lazy.generate(rag, GREEDY), block.generate(rag, GREEDY)
    for (prefix, docs, suffix), a, b in zip(prompts, out_lazy, out_block):
        assert a["token_ids"] == b["token_ids"]
        sel = select_pages("question", docs, suffix, PS, pages=1)
        assert sum(map(len, sel)) > 0
        rec = [_offsets(d, s) for d, s in zip(docs, sel)]
        assert a["token_ids"] == hf_recompute_greedy(hf, prefix, docs, suffix, rec, 6, lazy.eos_ids)
    assert_no_leaked_pages(lazy)
    assert_no_leaked_pages(block)


@pytest.mark.parametrize("mode", ["lazy", "block"])
def test_every_page_selected_equals_none_mode(mode, tiny_model_dir):
    """Recomputing every page of every doc after the first (the first doc's chunk already sees
    exactly the prefix) is full causal attention: the same tokens as `none` and HF generate."""
    path = tiny_model_dir("llama")
    hf = load_hf(path)
    none = _engine(path, "none")
    rng = random.Random()
    vocab = none.model_config.vocab_size
    engines = [
        _engine(path, mode, recompute_policy="tail", recompute_ratio=1.0),
        _engine(path, mode, recompute_policy="head", recompute_ratio=1.0),
    ]
    for _ in range(2):
        prefix, docs, suffix = _prompt(rng, vocab, n_docs=rng.randint(2, 4), hi=70)
        sp = SamplingParams(max_tokens=8)
        ref = none.generate(RagPrompt(prefix, docs, suffix), sp)[0]["token_ids"]
        assert ref == hf_greedy(hf, prefix + sum(docs, []) + suffix, 8, none.eos_ids)
        for e in engines:
            out = e.generate(RagPrompt(prefix, docs, suffix), sp)[0]
            assert out["token_ids"] == ref
    for e in engines:
        assert_no_leaked_pages(e)


@pytest.mark.parametrize("mode", ["lazy", "block"])
def test_tight_budget_no_leaks_same_tokens(mode, tiny_model_dir):
    """Question policy under a KV budget that forces chunk evictions, chunked suffix prefill and
    queued requests: no leaked pages, the same tokens as a roomy engine; the reservation is exact."""
    path = tiny_model_dir("llama")
    rng = random.Random()
    kw = dict(recompute_policy="question", recompute_ratio=0.5)
    budget_pages = 32 if mode == "block" else 24
    engine = Engine(
        path, device="cpu", cache_mode=mode, kv_cache_tokens=PS * budget_pages,
        max_running_requests=4, max_step_tokens=40, **kw,
    )
    vocab = engine.model_config.vocab_size
    prefix = _ids(rng, 20, vocab)
    pool = [_ids(rng, rng.randint(10, 60), vocab) for _ in range(8)]
    prompts = []
    for _ in range(24):
        docs = rng.sample(pool, rng.randint(1, 3))
        suffix = _ids(rng, rng.randint(1, 30), vocab)
        suffix[0] = docs[-1][rng.randrange(len(docs[-1]))]  # a question token found in a doc
        prompts.append(RagPrompt(prefix, docs, suffix))
    sp = SamplingParams(max_tokens=5)
    used = []
    orig = engine.scheduler.finish

    def finish(r, reason):
        held = len(r.own.pages) + len(r.copied_pages) + len(r.recomputed_pages)
        used.append(held == engine.scheduler.worst_case_pages(r) - _chunk_pages(engine, r))
        orig(r, reason)

    engine.scheduler.finish = finish
    outs = engine.generate(prompts, sp)
    assert_no_leaked_pages(engine)
    assert engine.scheduler.chunks.stats.evictions > 0
    assert used and all(used)
    ref = _engine(path, mode, **kw)
    for p, out in zip(prompts, outs):
        assert out["token_ids"] == ref.generate(p, sp)[0]["token_ids"]
    assert_no_leaked_pages(ref)


@pytest.mark.parametrize("mode", ["lazy", "block"])
def test_large_recompute_goes_in_budget_sized_pieces(mode, tiny_model_dir):
    """Recomputes larger than the step budget are split over steps (a piece sees the earlier pieces'
    KV), beside other requests' decodes: every step's prefill stays within the budget and the tokens
    equal a roomy engine's."""
    path = tiny_model_dir("llama")
    kw = dict(recompute_policy="tail", recompute_ratio=1.0)
    small = _engine(path, mode, max_step_tokens=24, max_running_requests=3, **kw)
    roomy = _engine(path, mode, **kw)
    rng = random.Random()
    vocab = small.model_config.vocab_size
    prompts = []
    for _ in range(5):
        prefix, docs, suffix = _prompt(rng, vocab, n_docs=3, lo=20, hi=70)
        prompts.append(RagPrompt(prefix, docs, suffix + _ids(rng, rng.randint(0, 30), vocab)))
    prompts.insert(1, _ids(rng, 10, vocab))  # a plain prompt decoding beside them
    sizes = []
    orig = small.scheduler.schedule

    def schedule():
        plan = orig()
        sizes.append(sum(len(i.token_ids) for i in plan.items if i.job is None))
        for i in plan.items:  # keys end at the item's last token (dense backends align causal there)
            t = i.segments[-1]
            assert t is i.target and t.start_pos + t.num_tokens == i.start_pos + len(i.token_ids)
        return plan

    small.scheduler.schedule = schedule
    sp = SamplingParams(max_tokens=12)
    outs = small.generate(prompts, sp)
    assert max(sizes) <= 25  # budget 24 (+1: a step with no room still makes progress)
    for p, out in zip(prompts, outs):
        assert out["token_ids"] == roomy.generate(p, sp)[0]["token_ids"]
    assert_no_leaked_pages(small)


def _chunk_pages(engine: Engine, req) -> int:
    ps = engine.scheduler.page_size
    return -(-len(req.prefix) // ps) + sum(-(-len(d) // ps) for d in req.docs)


# ---- selection units ---------------------------------------------------------------------------------
def test_question_scores_are_idf_weighted():
    ps = 4
    # 4 pages: token 7 in one page, token 8 in two, token 9 in three (more than half: ignored)
    docs = [[7, 8, 9, 1], [8, 9, 2, 3], [9, 4, 5, 6, 10, 11, 12, 13]]
    question = [7, 8, 9, 99]
    s = question_page_scores(docs, question, ps)
    n = 4
    assert s[0] == [pytest.approx(math.log(n / 1) + math.log(n / 2))]
    assert s[1] == [pytest.approx(math.log(n / 2))]
    assert s[2] == [0.0, 0.0]  # token 9 is too common; 99 appears nowhere
    # duplicates in a page count once
    dup = question_page_scores([[7, 7, 7, 7], [1, 2, 3, 4]], [7], ps)
    assert dup == [[pytest.approx(math.log(2))], [0.0]]


def test_question_policy_picks_best_pages_within_budget():
    ps = 4
    rng = random.Random()
    docs = [[rng.randrange(1000, 2000) for _ in range(rng.randint(8, 30))] for _ in range(5)]
    question = [5, 6, 7]
    docs[0][0] = 5  # the first doc is never recomputed, whatever it holds
    docs[2][5] = 5
    docs[2][6] = 6  # page 1 of doc 2: two rare tokens
    docs[4][-1] = 7  # last page of doc 4: one rare token
    docs[3][0] = 6
    sel = select_pages("question", docs, question, ps, pages=1)  # budget 4 pages: only 3 score > 0
    assert sel[0] == [] and sel[2] == [1] and sel[3] == [0] and sel[4] == [-(-len(docs[4]) // ps) - 1]
    assert sel[1] == []
    assert select_pages("question", docs, question, ps, ratio=0.0001) == [[], [], [1], [], []]
    for _ in range(20):  # budget respected, sorted, in range, first doc never
        ds = [[rng.randrange(0, 40) for _ in range(rng.randint(1, 50))] for _ in range(rng.randint(1, 5))]
        q = [rng.randrange(0, 40) for _ in range(8)]
        for policy in ("head", "tail", "question"):
            for pages, ratio in ((rng.randint(1, 3), 0.0), (0, rng.random())):
                sel = select_pages(policy, ds, q, ps, pages, ratio)
                budget = page_budget([len(d) for d in ds], ps, pages, ratio)
                assert sum(map(len, sel)) <= budget + (len(ds) if policy == "head" and ratio else 0)
                assert sel[0] == []
                for d, s in zip(ds, sel):
                    assert s == sorted(set(s)) and all(0 <= i < -(-len(d) // ps) for i in s)


def test_head_and_tail_policies():
    ps = 4
    docs = [[1] * 9, [1] * 9, [1] * 3, [1] * 12]  # pages 3, 3, 1, 3
    assert select_pages("head", docs, [1], ps, pages=2) == [[], [0, 1], [0], [0, 1]]
    assert select_pages("tail", docs, [1], ps, pages=1) == [[], [], [], [0, 1, 2]]  # 3 pages in all
    assert select_pages("tail", docs, [1], ps, ratio=0.5) == [[], [], [0], [0, 1, 2]]  # crosses docs
    assert select_pages("tail", docs, [1], ps, ratio=1.0) == [[], [0, 1, 2], [0], [0, 1, 2]]
    assert select_pages("head", docs, [1], ps, ratio=1.0) == [[], [0, 1, 2], [0], [0, 1, 2]]
    assert page_budget([9, 9, 3, 12], ps, ratio=0.1) == 1  # at least one page
    assert page_budget([9], ps, pages=3) == 0  # a single doc: nothing after the first
    assert select_pages("question", docs, [1], ps) == [[], [], [], []]  # no budget


def test_page_runs():
    assert page_runs(40, 16, []) == [(False, 0, 40)]
    assert page_runs(40, 16, [0, 1, 2]) == [(True, 0, 40)]
    assert page_runs(40, 16, [1]) == [(False, 0, 16), (True, 16, 16), (False, 32, 8)]
    assert page_runs(40, 16, [0, 2]) == [(True, 0, 16), (False, 16, 16), (True, 32, 8)]


# ---- options ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kw, name",
    [
        (dict(recompute_policy="idf"), "recompute_policy"),
        (dict(recompute_pages=-1), "recompute_pages"),
        (dict(recompute_pages=1.5), "recompute_pages"),
        (dict(recompute_pages=True), "recompute_pages"),
        (dict(recompute_ratio=1.5), "recompute_ratio"),
        (dict(recompute_ratio=-0.1), "recompute_ratio"),
        (dict(recompute_ratio="0.1"), "recompute_ratio"),
        (dict(recompute_pages=1, recompute_ratio=0.2), "set one budget"),
        (dict(recompute_head_pages=1, recompute_policy="question"), "recompute_head_pages"),
        (dict(recompute_head_pages=1, recompute_pages=2), "recompute_head_pages"),
    ],
)
def test_bad_options_rejected(kw, name, tiny_model_dir):
    with pytest.raises(ValueError, match=name):
        EngineConfig(**kw).validate()
    with pytest.raises(ValueError, match=name):
        Engine(tiny_model_dir("llama"), device="cpu", **kw)
    with pytest.raises(ValueError, match=name):
        Scheduler(PagePool(1, 4, PS, 1, 1, torch.float32, "meta"), "lazy", "m", **kw)


def test_cli_flags(capsys):
    help_text = build_parser().format_help()
    for flag in ("--recompute-policy", "--recompute-pages", "--recompute-ratio"):
        assert flag in help_text
    a = build_parser().parse_args(["--recompute-policy", "question", "--recompute-ratio", "0.1"])
    assert (a.recompute_policy, a.recompute_ratio, a.recompute_pages) == ("question", 0.1, 0)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--recompute-policy", "nope"])
    with pytest.raises(SystemExit):
        main(["--recompute-pages", "1", "--recompute-ratio", "0.5"])
    assert "set one budget" in capsys.readouterr().err


def test_legacy_head_option_is_head_policy():
    pool = PagePool(1, 4, PS, 1, 1, torch.float32, "meta")
    s = Scheduler(pool, "lazy", "m", recompute_head_pages=2)
    assert (s.recompute_policy, s.recompute_pages, s.recompute_ratio) == ("head", 2, 0.0)


def test_quality_benchmark_mode_syntax():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from quality import parse_mode

    assert parse_mode("lazy") == ("lazy", {})
    assert parse_mode("lazy+head2") == ("lazy", {"recompute_policy": "head", "recompute_pages": 2})
    assert parse_mode("block+question12.5%") == (
        "block", {"recompute_policy": "question", "recompute_ratio": 0.125}
    )
    for bad in ("lazy+idf2", "none+head1", "lazy+question0", "lazy+tail1.5", "lazy+question150%"):
        with pytest.raises(Exception, match="mode"):
            parse_mode(bad)


@pytest.mark.slow
def test_server_with_recompute_flags_matches_engine():
    """The flags reach the scheduler process (and recomputed runs cross the worker wire): a real
    server's greedy tokens equal an in-process Engine's with the same options."""
    import httpx
    from server_util import DOCS, ServerProc

    docs = [" ".join([d] * 4) for d in DOCS]  # a few pages each
    flags = ["--recompute-policy", "tail", "--recompute-ratio", "0.5", "--max-step-tokens", "48"]
    srv = ServerProc("--device", "cpu", "--kv-cache-tokens", "8192", "--log-level", "warning", *flags)
    try:
        srv.wait_healthy()
        body = {"text": "What is the capital of Arvania?", "docs": docs, "sampling_params": {"max_tokens": 8}}
        got = httpx.post(srv.url + "/generate", json=body, timeout=120).json()
        stats = httpx.get(srv.url + "/cache_stats", timeout=30).json()
    finally:
        srv.stop()
    engine = Engine(device="cpu", kv_cache_tokens=8192, recompute_policy="tail", recompute_ratio=0.5)
    want = engine.rag(docs, body["text"], sampling_params=SamplingParams(max_tokens=8))
    assert got["token_ids"] == want["token_ids"]
    assert got["meta"]["cached_tokens"] == want["meta"]["cached_tokens"]
    assert stats["held_pages"] == 0
