"""Parallel document positions (doc_positions="parallel", APE-style; issue 13): every document starts
right after the shared prefix and the question follows the longest one. Lazy mode gets it from
pos_base alone (keys are stored unrotated); block mode from its re-rotated copies. The reference is
Hugging Face transformers with explicit position ids and a block mask (tests/hf_reference.py)."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import cpu_engine as _engine
from conftest import load_hf
from conftest import random_rag_ids as _prompt
from hf_reference import hf_doc_attention_logits, masked_greedy, rag_layout

from lazyrt import RagPrompt, SamplingParams
from lazyrt.config import EngineConfig
from lazyrt.runtime.server.protocol import ApiError, parse_generate


def _hf_parallel_greedy(hf, prefix, docs, suffix, n: int) -> list[int]:
    layout = lambda suf: rag_layout(prefix, docs, suf, parallel=True)  # noqa: E731
    return masked_greedy(hf, layout, suffix, n, set())


@pytest.mark.parametrize("mode", ["lazy", "block"])
def test_greedy_tokens_match_reference(mode, tiny_model_dir):
    """Engine-level option: greedy tokens = HF with every doc at the prefix's end; the layout changes
    the logits (so the check could fail)."""
    path = tiny_model_dir("llama")
    hf = load_hf(path)
    engine = _engine(path, mode, doc_positions="parallel")
    rng = random.Random()
    vocab = engine.model_config.vocab_size
    prompts = [_prompt(rng, vocab) for _ in range(3)]
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    outs = engine.generate([RagPrompt(p, d, s) for p, d, s in prompts], sp)
    for (p, d, s), out in zip(prompts, outs):
        assert out["token_ids"] == _hf_parallel_greedy(hf, p, d, s, 6)
    p, d, s = prompts[0]
    seq = hf_doc_attention_logits(hf, p, d, s, 1.0, 1.0)
    par = hf_doc_attention_logits(hf, p, d, s, 1.0, 1.0, parallel=True)
    assert (seq - par).abs().max() > 1e-3


def test_with_document_attention_logprobs_match_reference(tiny_model_dir):
    """Parallel positions and document attention together (APE's full recipe): scored logprobs = the
    HF reference within fp32 tolerance (qwen3: a family with q/k norms)."""
    path = tiny_model_dir("qwen3")
    hf = load_hf(path)
    temp, scale = 0.7, 0.8
    engine = _engine(
        path, "lazy", doc_positions="parallel", doc_attention_temperature=temp, doc_attention_scale=scale
    )
    rng = random.Random()
    vocab = engine.model_config.vocab_size
    prefix, docs, suffix = _prompt(rng, vocab)
    cont = [rng.randrange(100, vocab) for _ in range(4)]
    req = engine.score_request(RagPrompt(prefix, docs, suffix), "x")
    req.suffix, req.score_len = suffix + cont, len(cont)  # score token ids directly
    engine._run([req])
    logits = hf_doc_attention_logits(hf, prefix, docs, suffix + cont, temp, scale, parallel=True)
    lp = torch.log_softmax(logits.double(), -1)
    expect = [float(lp[len(suffix) - 1 + i, t]) for i, t in enumerate(cont)]
    assert req.score_logprobs == pytest.approx(expect, abs=2e-4)


def test_per_request_override_shares_chunks_across_layouts(tiny_model_dir):
    """A sequential engine serves a request asking for parallel positions like a parallel engine does,
    from the same cached chunks its sequential requests use (one physical copy, any position)."""
    path = tiny_model_dir("llama")
    seq_engine = _engine(path, "lazy")
    par_engine = _engine(path, "lazy", doc_positions="parallel")
    rng = random.Random()
    prefix, docs, suffix = _prompt(rng, seq_engine.model_config.vocab_size)
    sp = dict(max_tokens=6, ignore_eos=True)
    prompt = RagPrompt(prefix, docs, suffix)
    seq_engine.generate([prompt], SamplingParams(max_tokens=1))  # the chunks are cached
    # both layouts in one batch, over the same chunk pages
    seq_out, par_out = seq_engine.generate(
        [prompt, prompt], [SamplingParams(**sp), SamplingParams(**sp, doc_positions="parallel")]
    )
    assert par_out["meta"]["cached_tokens"] >= sum(map(len, docs))  # every doc from its chunk
    assert par_out["token_ids"] == par_engine.generate([prompt], SamplingParams(**sp))[0]["token_ids"]
    back = par_engine.generate([prompt], SamplingParams(**sp, doc_positions="sequential"))[0]
    assert back["token_ids"] == seq_out["token_ids"]


def test_segments_start_after_the_prefix(tiny_model_dir):
    """The scheduler's layout: each doc's first segment at len(prefix), the question after the longest
    doc; pages and prompt length unchanged."""
    engine = _engine(tiny_model_dir("llama"), "lazy", doc_positions="parallel")
    prefix, docs, suffix = [5] * 7, [[9] * 20, [11] * 33, [13] * 3], [17] * 4
    req = engine._make_request(RagPrompt(prefix, docs, suffix), SamplingParams(max_tokens=2))
    engine.scheduler.add(req)
    engine.scheduler.schedule()
    doc_starts = [s.start_pos for s in req.segments if s.is_doc]
    assert doc_starts == [7, 7, 7]
    assert req.own.start_pos == 7 + 33
    assert req.prompt_len == 7 + 20 + 33 + 3 + 4


def test_bad_values_name_the_option(tiny_model_dir):
    with pytest.raises(ValueError, match="doc_positions='diagonal'"):
        EngineConfig(doc_positions="diagonal").validate()
    with pytest.raises(ValueError, match="doc_positions"):
        SamplingParams(doc_positions="diagonal")
    with pytest.raises(ValueError, match="doc_positions='parallel'.*needs cache_mode lazy or block"):
        EngineConfig(cache_mode="prefix", doc_positions="parallel").validate()
    with pytest.raises(ValueError, match="doc_positions='parallel' cannot be combined with selective"):
        EngineConfig(doc_positions="parallel", recompute_policy="tail", recompute_ratio=0.1).validate()
    path = tiny_model_dir("llama")
    for engine in (_engine(path, "none"), _engine(path, "lazy", recompute_policy="tail", recompute_pages=1)):
        sp = SamplingParams(max_tokens=2, doc_positions="parallel")
        with pytest.raises(ValueError, match="sampling_params.doc_positions"):
            engine.rag(["a doc"], "q?", sampling_params=sp)
    with pytest.raises(ApiError) as e:
        parse_generate({"text": "hi", "sampling_params": {"doc_positions": "random"}})
    assert e.value.param == "sampling_params.doc_positions"
    ok = parse_generate({"text": "hi", "sampling_params": {"doc_positions": "parallel"}})
    assert ok.req.sampling.doc_positions == "parallel"
