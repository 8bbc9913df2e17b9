"""Sink fix (`recompute_head_pages`): each doc after the first gets its first pages recomputed in context.

The reference is Hugging Face transformers with an explicit 4-D mask that spells out what the
option means (no lazyrt code on its compute path): every doc's chunk KV computed after a private
copy of the prefix, and for each doc after the first its head tokens again, at their real positions,
attending to the prefix, the earlier docs as the request sees them (recomputed heads + chunk tails)
and themselves. The suffix sees the prefix, that view of every doc, and itself.
"""

from __future__ import annotations

import random

import pytest
import torch
from conftest import load_hf
from hf_reference import assert_no_leaked_pages, capture_recomputed_kv, hf_greedy, masked_greedy, masked_kv

from lazyrt import Engine, RagPrompt, SamplingParams
from lazyrt.cache.page_pool import PagePool
from lazyrt.config import EngineConfig
from lazyrt.launch import build_parser, main
from lazyrt.runtime.scheduler.scheduler import Scheduler

PS = 16
GREEDY = SamplingParams(max_tokens=8)


def _ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(100, vocab) for _ in range(n)]


def _prompt(rng: random.Random, vocab: int, n_docs: int = 4, lo: int = 5, hi: int = 60):
    prefix = _ids(rng, rng.randint(8, 30), vocab)
    docs = [_ids(rng, rng.randint(lo, hi), vocab) for _ in range(n_docs)]
    return prefix, docs, _ids(rng, rng.randint(2, 9), vocab)


def head_lens(docs: list[list[int]], n_pages: int) -> list[int]:
    return [0] + [min(n_pages * PS, len(d)) for d in docs[1:]]


def head_layout(prefix, docs, suffix, heads):
    """Token ids, positions, [N, N] bool mask (True = may attend) and the index of every head token."""
    ids, pos, groups = [], [], []  # group: (kind, doc, offset in doc)
    P = len(prefix)
    ids += prefix
    pos += list(range(P))
    groups += [("prefix", -1, i) for i in range(P)]
    starts, start = [], P
    for j, d in enumerate(docs):
        starts.append(start)
        ids += prefix  # the chunk's private copy of the prefix, ending where the doc starts
        pos += list(range(start - P, start))
        groups += [("copy", j, i) for i in range(P)]
        ids += d  # the chunk: the doc computed after its copy of the prefix
        pos += list(range(start, start + len(d)))
        groups += [("doc", j, i) for i in range(len(d))]
        start += len(d)
    head_index = {}
    for j, (d, h) in enumerate(zip(docs, heads)):
        head_index[j] = list(range(len(ids), len(ids) + h))
        ids += d[:h]
        pos += list(range(starts[j], starts[j] + h))
        groups += [("head", j, i) for i in range(h)]
    ids += suffix
    pos += list(range(start, start + len(suffix)))
    groups += [("suffix", -1, i) for i in range(len(suffix))]

    def seen_by_request(g, before_doc: int) -> bool:
        """Is key g part of what the request sees of the docs before `before_doc`?"""
        kind, j, i = g
        if kind == "prefix":
            return True
        if kind == "doc":
            return j < before_doc and i >= heads[j]  # a chunk's tail (all of it without a head)
        return kind == "head" and j < before_doc

    def may_attend(q: int, k: int) -> bool:
        kind, j, _ = groups[q]
        gk = groups[k]
        same = gk[:2] == (kind, j) and k <= q
        if kind in ("prefix", "copy"):
            return same
        if kind == "doc":
            return same or gk[:2] == ("copy", j)
        if kind == "head":
            return same or seen_by_request(gk, j)
        return same or seen_by_request(gk, len(docs))

    # built as Python lists, then one tensor (setting [N, N] tensor elements one by one is slow)
    n = len(ids)
    mask = torch.tensor([[may_attend(q, k) for k in range(n)] for q in range(n)], dtype=torch.bool)
    return ids, pos, mask, head_index


def hf_head_greedy(model, prefix, docs, suffix, heads, max_new: int, eos_ids: set[int]) -> list[int]:
    return masked_greedy(model, lambda sfx: head_layout(prefix, docs, sfx, heads), suffix, max_new, eos_ids)


def hf_head_kv(model, prefix, docs, suffix, heads):
    """Per layer: {doc: (unrotated K, rotated K, V)} of each recomputed head, [h, kv_heads, head_dim]."""
    return masked_kv(model, *head_layout(prefix, docs, suffix, heads))


def _engine(path, mode, n, **kw):
    return Engine(path, device="cpu", cache_mode=mode, kv_cache_tokens=8192, recompute_head_pages=n, **kw)


# (a) off = today ------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["lazy", "block"])
def test_off_is_block_attention_as_before(mode, tiny_model_dir):
    path = tiny_model_dir("llama")
    hf = load_hf(path)
    engine = _engine(path, mode, 0)
    rng = random.Random()
    prefix, docs, suffix = _prompt(rng, engine.model_config.vocab_size)
    for order in ([0, 1, 2, 3], [3, 1, 0, 2]):
        d = [docs[i] for i in order]
        out = engine.generate(RagPrompt(prefix, d, suffix), GREEDY)[0]
        assert (
            engine.scheduler.head_lens(engine._make_request(RagPrompt(prefix, d, suffix), GREEDY)) == [0] * 4
        )
        # heads of length 0 in the reference layout = plain block attention
        assert out["token_ids"] == hf_head_greedy(hf, prefix, d, suffix, [0] * 4, 8, engine.eos_ids)
    assert out["meta"]["cached_tokens"] == len(prefix) + sum(map(len, docs))
    assert_no_leaked_pages(engine)


# (b) the head pages hold in-context K/V; the chunks are untouched -----------------------------------
@pytest.mark.parametrize("mode", ["lazy", "block"])
@pytest.mark.parametrize("n_pages", [1, 2])
def test_head_pages_hold_in_context_kv(mode, n_pages, tiny_model_dir):
    path = tiny_model_dir("llama")
    hf = load_hf(path)
    engine = _engine(path, mode, n_pages)
    snaps = capture_recomputed_kv(engine)
    rng = random.Random()
    prefix, docs, suffix = _prompt(rng, engine.model_config.vocab_size, lo=5, hi=70)
    heads = head_lens(docs, n_pages)
    first = engine.generate(RagPrompt(prefix, docs, suffix), GREEDY)[0]
    got = snaps[0]
    ref = hf_head_kv(hf, prefix, docs, suffix, heads)
    starts = [len(prefix) + sum(len(d) for d in docs[:j]) for j in range(len(docs))]
    for layer, (segs, ref_layer) in enumerate(zip(got, ref)):
        assert [s for s, _, _ in segs] == [starts[j] for j in ref_layer]  # one head segment per doc 1..
        for (_, k, v), (k_raw, k_rot, v_ref) in zip(segs, ref_layer.values()):
            k_ref = k_raw if mode == "lazy" else k_rot  # lazy stores keys unrotated, block rotated
            torch.testing.assert_close(k, k_ref, rtol=1e-4, atol=1e-4, msg=f"layer {layer} K")
            torch.testing.assert_close(v, v_ref, rtol=1e-4, atol=1e-4, msg=f"layer {layer} V")
    # Doc 1's head sees the prefix and doc 0 (whose chunk is exact): it equals full causal attention.
    full = hf(torch.tensor([prefix + sum(docs, []) + suffix]), use_cache=True).past_key_values
    a, b = starts[1], starts[1] + heads[1]
    for layer, segs in enumerate(got):
        torch.testing.assert_close(
            segs[0][2], full.layers[layer].values[0, :, a:b].transpose(0, 1), rtol=1e-4, atol=1e-4
        )

    # The shared chunk pages are untouched: snapshot them, run the docs reordered (every chunk hits,
    # heads recomputed for other docs), compare; then a doc that had its head recomputed goes first.
    chunk_kv = {c.key: [kv[c.pages].clone() for kv in engine.pool.kv] for c in engine.scheduler.chunks}
    for order in ([2, 0, 3, 1], [1, 2, 3, 0]):
        d = [docs[i] for i in order]
        out = engine.generate(RagPrompt(prefix, d, suffix), GREEDY)[0]
        h = head_lens(d, n_pages)
        assert out["token_ids"] == hf_head_greedy(hf, prefix, d, suffix, h, 8, engine.eos_ids)
        assert out["meta"]["chunk_hits"] == 4 and out["meta"]["chunk_misses"] == 0
        # cached_tokens drops by the recomputed head tokens
        assert out["meta"]["cached_tokens"] == len(prefix) + sum(map(len, docs)) - sum(h)
    for c in engine.scheduler.chunks:
        for before, kv in zip(chunk_kv[c.key], engine.pool.kv):
            assert torch.equal(before, kv[c.pages])
    assert first["token_ids"] == hf_head_greedy(hf, prefix, docs, suffix, heads, 8, engine.eos_ids)
    assert_no_leaked_pages(engine)


# (c) lazy = block, both = the reference --------------------------------------------------------------
@pytest.mark.parametrize("family", ["llama3", "qwen2", "qwen3"])
def test_lazy_and_block_with_heads_agree_with_reference(family, tiny_model_dir):
    path = tiny_model_dir(family)
    hf = load_hf(path)
    lazy, block = _engine(path, "lazy", 1), _engine(path, "block", 1)
    rng = random.Random()
    prompts = [_prompt(rng, lazy.model_config.vocab_size, n_docs=rng.randint(2, 4)) for _ in range(3)]
    # batched together: heads of several requests share steps
    rag = [RagPrompt(*p) for p in prompts]
    out_lazy, out_block = lazy.generate(rag, GREEDY), block.generate(rag, GREEDY)
    for (prefix, docs, suffix), a, b in zip(prompts, out_lazy, out_block):
        assert a["token_ids"] == b["token_ids"]
        ref = hf_head_greedy(hf, prefix, docs, suffix, head_lens(docs, 1), 8, lazy.eos_ids)
        assert a["token_ids"] == ref
    assert_no_leaked_pages(lazy)
    assert_no_leaked_pages(block)


# (d) heads covering whole docs = full attention --------------------------------------------------------
@pytest.mark.parametrize("mode", ["lazy", "block"])
def test_whole_doc_heads_equal_full_attention(mode, tiny_model_dir):
    path = tiny_model_dir("llama")
    hf = load_hf(path)
    engine = _engine(path, mode, 8)  # 128 tokens: more than any doc here
    none = Engine(path, device="cpu", cache_mode="none", kv_cache_tokens=8192)
    rng = random.Random()
    vocab = engine.model_config.vocab_size
    for _ in range(2):
        prefix, docs, suffix = _prompt(rng, vocab, n_docs=rng.randint(2, 5), hi=100)
        sp = SamplingParams(max_tokens=10)
        out = engine.generate(RagPrompt(prefix, docs, suffix), sp)[0]
        ref = none.generate(RagPrompt(prefix, docs, suffix), sp)[0]
        assert out["token_ids"] == ref["token_ids"]
        assert out["token_ids"] == hf_greedy(hf, prefix + sum(docs, []) + suffix, 10, engine.eos_ids)
    assert_no_leaked_pages(engine)


# (e) page accounting ---------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["lazy", "block"])
def test_reservation_matches_pages_used(mode, tiny_model_dir):
    """With nothing cached, a request holds exactly worst_case_pages (chunks + heads + copies + own)."""
    path = tiny_model_dir("llama")
    engine = _engine(path, mode, 1)
    rng = random.Random()
    prefix, docs, suffix = _prompt(rng, engine.model_config.vocab_size, hi=50)
    req = engine._make_request(RagPrompt(prefix, docs, suffix), GREEDY)
    used = []
    orig = engine.scheduler.finish

    def finish(r, reason):
        used.append(engine.pool.num_pages - engine.pool.num_free)
        orig(r, reason)

    engine.scheduler.finish = finish
    engine._run([req])
    assert used == [engine.scheduler.worst_case_pages(req)]
    heads = sum(-(-h // PS) for h in head_lens(docs, 1))
    assert heads > 0 and len(req.recomputed_pages) == 0  # released at finish
    assert_no_leaked_pages(engine)


@pytest.mark.parametrize("mode", ["lazy", "block"])
def test_tight_budget_no_leaks_and_same_tokens(mode, tiny_model_dir):
    path = tiny_model_dir("llama")
    rng = random.Random()
    # Worst request: prefix 2 pages + 3 docs of <= 3 pages + 2 head pages (+ 9 block copies) + 1 own.
    budget_pages = 24 if mode == "block" else 16
    engine = Engine(
        path,
        device="cpu",
        cache_mode=mode,
        kv_cache_tokens=PS * budget_pages,
        max_running_requests=4,
        max_step_tokens=48,
        recompute_head_pages=1,
    )
    vocab = engine.model_config.vocab_size
    prefix = _ids(rng, 20, vocab)
    pool = [_ids(rng, rng.randint(10, 45), vocab) for _ in range(8)]
    prompts = []
    for _ in range(40):
        if rng.random() < 0.2:
            prompts.append(_ids(rng, rng.randint(5, 40), vocab))
        else:
            prompts.append(
                RagPrompt(prefix, rng.sample(pool, rng.randint(1, 3)), _ids(rng, rng.randint(1, 8), vocab))
            )
    sp = SamplingParams(max_tokens=6)
    outs = engine.generate(prompts, sp)
    assert_no_leaked_pages(engine)
    assert engine.scheduler.chunks.stats.evictions > 0
    ref = _engine(path, mode, 1)
    for p, out in zip(prompts, outs):
        ref.flush_cache()
        assert out["token_ids"] == ref.generate(p, sp)[0]["token_ids"]
    assert_no_leaked_pages(ref)


# (f) bad values ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [-1, 1.5, True, "2"])
def test_invalid_option_raises_clear_error(bad, tiny_model_dir):
    with pytest.raises(ValueError, match="recompute_head_pages"):
        EngineConfig(recompute_head_pages=bad).validate()
    with pytest.raises(ValueError, match="recompute_head_pages"):
        Engine(tiny_model_dir("llama"), device="cpu", recompute_head_pages=bad)
    with pytest.raises(ValueError, match="recompute_head_pages"):
        Scheduler(PagePool(1, 4, PS, 1, 1, torch.float32, "meta"), "lazy", "m", recompute_head_pages=bad)


def test_cli_flag(capsys):
    help_text = build_parser().format_help()
    assert "--recompute-head-pages" in help_text and "sink fix" in help_text
    assert build_parser().parse_args(["--recompute-head-pages", "2"]).recompute_head_pages == 2
    with pytest.raises(SystemExit):
        main(["--recompute-head-pages", "-1"])
    assert "recompute_head_pages" in capsys.readouterr().err


@pytest.mark.parametrize("mode", ["lazy", "block"])
def test_small_step_budget_splits_suffix_after_heads(mode, tiny_model_dir):
    """Heads go with the first piece of a chunked suffix prefill; tokens equal a roomy run's."""
    path = tiny_model_dir("llama")
    small = _engine(path, mode, 1, max_step_tokens=24)
    roomy = _engine(path, mode, 1)
    rng = random.Random()
    vocab = small.model_config.vocab_size
    prompts = []
    for _ in range(3):
        prefix, docs, _ = _prompt(rng, vocab, n_docs=3)
        prompts.append(RagPrompt(prefix, docs, _ids(rng, rng.randint(20, 50), vocab)))
    outs = small.generate(prompts, GREEDY)
    for p, out in zip(prompts, outs):
        assert out["token_ids"] == roomy.generate(p, GREEDY)[0]["token_ids"]
    assert_no_leaked_pages(small)
