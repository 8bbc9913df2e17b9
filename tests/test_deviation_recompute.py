"""Deviation-guided selective recompute (recompute_policy="deviation", CacheBlend-style).

A probe step runs each document after the first in its request's context through layer 0 and
scores each page by how far its layer-1 K/V move from the chunk's. The independent reference is
Hugging Face transformers: layer 1's K/V are the layer's k/v projections of the hidden state that
the HF model's layer 0 outputs, once over the whole prompt (in context) and once over prefix + the
document alone (what the chunk was computed from). The pages the engine then recomputes are checked
against the HF masked-attention reference of selective recompute (tests/hf_reference.py).
"""

from __future__ import annotations

import random

import pytest
import torch
from conftest import load_hf
from hf_reference import assert_no_leaked_pages, hf_greedy, hf_recompute_greedy

from lazyrt import Engine, RagPrompt, SamplingParams
from lazyrt.runtime.scheduler.recompute import PROBE_LAYER, select_pages

PS = 16
GREEDY = SamplingParams(max_tokens=6)


def _ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(100, vocab) for _ in range(n)]


def _prompt(rng: random.Random, vocab: int, n_docs: int, lo: int = 20, hi: int = 80):
    prefix = _ids(rng, rng.randint(8, 30), vocab)
    docs = [_ids(rng, rng.randint(lo, hi), vocab) for _ in range(n_docs)]
    return prefix, docs, _ids(rng, rng.randint(2, 9), vocab)


def _layer_kv(hf, ids: list[int], layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """HF: K (before RoPE) and V [T, kv_heads, head_dim] of `layer` for a plain causal forward."""
    with torch.no_grad():
        out = hf(torch.tensor([ids]), output_hidden_states=True)
        blk = hf.model.layers[layer]
        x = blk.input_layernorm(out.hidden_states[layer][0])
        attn = blk.self_attn
        d = attn.head_dim
        k = attn.k_proj(x).view(len(ids), -1, d)
        if getattr(attn, "k_norm", None) is not None:
            k = attn.k_norm(k)
        v = attn.v_proj(x).view(len(ids), -1, d)
    return k, v


def hf_page_deviation(hf, prefix, docs, layer: int = PROBE_LAYER) -> list[list[float]]:
    """Per page of each doc after the first: mean over its tokens of |K_ctx - K_chunk|^2 +
    |V_ctx - V_chunk|^2 at `layer` (the first doc's list is empty: it is never recomputed)."""
    k_full, v_full = _layer_kv(hf, prefix + sum(docs, []), layer)
    scores: list[list[float]] = [[]]
    start = len(prefix) + len(docs[0])
    for d in docs[1:]:
        k_c, v_c = _layer_kv(hf, prefix + d, layer)
        dk = k_full[start : start + len(d)] - k_c[len(prefix) :]
        dv = v_full[start : start + len(d)] - v_c[len(prefix) :]
        dev = dk.square().sum((1, 2)) + dv.square().sum((1, 2))
        scores.append([float(dev[i : i + PS].mean()) for i in range(0, len(d), PS)])
        start += len(d)
    return scores


def _capture_probes(engine: Engine) -> list[list[list[float]]]:
    """Every probe_deviation call's result, in order."""
    calls: list = []
    orig = engine.runner.probe_deviation

    def probe(items, *a, **kw):
        out = orig(items, *a, **kw)
        calls.append(out)
        return out

    engine.runner.probe_deviation = probe
    return calls


@pytest.mark.parametrize("mode", ["lazy", "block"])
def test_probe_scores_match_hf_and_pick_pages(mode, tiny_model_dir):
    """The probe's per-page deviations equal the HF reference's; the engine recomputes exactly the
    top pages by them (over all later docs, within the budget); greedy tokens equal the HF
    selective-recompute reference for those pages; the chunks are untouched; nothing leaks."""
    path = tiny_model_dir("llama")
    hf = load_hf(path)
    engine = Engine(
        path, device="cpu", cache_mode=mode, kv_cache_tokens=8192, recompute_policy="deviation",
        recompute_ratio=0.3,
    )
    probes = _capture_probes(engine)
    rng = random.Random()
    vocab = engine.model_config.vocab_size
    prefix, docs, suffix = _prompt(rng, vocab, n_docs=4)
    engine.generate(RagPrompt(prefix, docs[:1], suffix), SamplingParams(max_tokens=1))  # 1 doc: no probe
    assert probes == []
    chunk_kv = None
    for order in ([0, 1, 2, 3], [3, 1, 0, 2]):
        d = [docs[i] for i in order]
        out = engine.generate(RagPrompt(prefix, d, suffix), GREEDY)[0]
        got = [[]] + probes[-1]  # one probe per doc after the first, in order
        ref = hf_page_deviation(hf, prefix, d)
        for g, r in zip(got[1:], ref[1:]):
            torch.testing.assert_close(torch.tensor(g), torch.tensor(r), rtol=1e-3, atol=1e-4)
        sel = select_pages("deviation", d, suffix, PS, ratio=0.3, page_scores=got)
        assert 0 < sum(map(len, sel))
        rec = [{i for p in s for i in range(p * PS, min((p + 1) * PS, len(x)))} for x, s in zip(d, sel)]
        assert out["token_ids"] == hf_recompute_greedy(hf, prefix, d, suffix, rec, 6, engine.eos_ids)
        assert out["meta"]["recomputed_tokens"] == sum(map(len, rec))
        if chunk_kv is None:  # chunks are in from the first order on: a probe must never write them
            chunks = engine.scheduler.chunks
            chunk_kv = {c.key: [kv[c.pages].clone() for kv in engine.pool.kv] for c in chunks}
        else:
            assert out["meta"]["cached_tokens"] == len(prefix) + sum(map(len, d)) - sum(map(len, rec))
    for c in engine.scheduler.chunks:
        for before, kv in zip(chunk_kv[c.key], engine.pool.kv):
            assert torch.equal(before, kv[c.pages])
    assert_no_leaked_pages(engine)


def test_lazy_equals_block_and_full_budget_is_full_attention(tiny_model_dir):
    """Batched requests: deviation lazy = block on every greedy token; at a budget of every page
    of the later docs it is full causal attention (HF generate)."""
    path = tiny_model_dir("qwen3")
    hf = load_hf(path)
    kw = dict(device="cpu", kv_cache_tokens=8192, recompute_policy="deviation")
    lazy = Engine(path, cache_mode="lazy", recompute_pages=2, **kw)
    block = Engine(path, cache_mode="block", recompute_pages=2, **kw)
    full = Engine(path, cache_mode="lazy", recompute_ratio=1.0, **kw)
    rng = random.Random()
    vocab = lazy.model_config.vocab_size
    prompts = [RagPrompt(*_prompt(rng, vocab, n_docs=rng.randint(2, 4))) for _ in range(3)]
    a, b, f = (e.generate(prompts, GREEDY) for e in (lazy, block, full))
    for p, x, y, z in zip(prompts, a, b, f):
        assert x["token_ids"] == y["token_ids"]
        ids = p.prefix + sum(p.docs, []) + p.suffix
        assert z["token_ids"] == hf_greedy(hf, ids, 6, lazy.eos_ids)
    for e in (lazy, block, full):
        assert_no_leaked_pages(e)


def test_tight_budget_and_abort_before_probe(tiny_model_dir):
    """Under a KV budget that forces evictions and queueing, with chunked prefill and probes split
    over steps by the step token budget, deviation requests give the same tokens as a roomy engine
    and leak nothing; a request aborted before its
    probe frees the pages reserved for its recompute."""
    path = tiny_model_dir("llama")
    rng = random.Random()
    kw = dict(device="cpu", cache_mode="lazy", recompute_policy="deviation", recompute_ratio=0.5)
    tight = Engine(path, kv_cache_tokens=PS * 24, max_running_requests=4, max_step_tokens=40, **kw)
    roomy = Engine(path, kv_cache_tokens=8192, **kw)
    vocab = tight.model_config.vocab_size
    prefix = _ids(rng, 20, vocab)
    pool = [_ids(rng, rng.randint(10, 60), vocab) for _ in range(8)]
    prompts = [RagPrompt(prefix, rng.sample(pool, rng.randint(1, 3)), _ids(rng, rng.randint(1, 20), vocab))
               for _ in range(16)]
    sp = SamplingParams(max_tokens=4)
    probe_steps = []
    schedule = tight.scheduler.schedule

    def record():
        plan = schedule()
        if plan.probes:
            probe_steps.append([len(p.token_ids) for p in plan.probes])
        return plan

    tight.scheduler.schedule = record
    want = [o["token_ids"] for o in roomy.generate(prompts, sp)]
    assert [o["token_ids"] for o in tight.generate(prompts, sp)] == want
    # probes keep to the step budget (a doc alone may exceed it), and go over several steps
    assert all(sum(n) <= 40 or len(n) == 1 for n in probe_steps)
    assert len(probe_steps) > 1
    assert tight.cache_stats()["chunk_evictions"] > 0
    assert_no_leaked_pages(tight)

    from lazyrt.runtime.scheduler.request import RequestState

    fresh = [_ids(rng, 40, vocab) for _ in range(3)]  # new chunks: computed in the first step
    req = roomy._make_request(RagPrompt(prefix, fresh, [5, 6, 7]), sp)
    roomy.core.add(req)
    roomy.core.step()
    assert req.state is RequestState.CHUNKS and req.recompute_reserve  # pages reserved, not yet picked
    roomy.core.abort(req.rid)
    assert_no_leaked_pages(roomy)


def test_select_pages_deviation_picks_top_scores():
    rng = random.Random()
    docs = [[1] * rng.randint(1, 70) for _ in range(4)]
    n_pages = [-(-len(d) // PS) for d in docs]
    scores = [[rng.random() for _ in range(n)] for n in n_pages]
    budget = 3
    sel = select_pages("deviation", docs, [], PS, pages=1, page_scores=scores)
    assert sel[0] == []
    later = sorted(((scores[j][i], j, i) for j in range(1, 4) for i in range(n_pages[j])), reverse=True)
    want = {(j, i) for _, j, i in later[:budget]}
    assert {(j, i) for j, s in enumerate(sel) for i in s} == want
    with pytest.raises(ValueError, match="probe score"):
        select_pages("deviation", docs, [], PS, pages=1)
    with pytest.raises(ValueError, match="probe score"):
        select_pages("deviation", docs, [], PS, pages=1, page_scores=[[]] + [x + [0.0] for x in scores[1:]])
