"""Engine.score (the logprobs behind select) against an independent HF transformers computation."""

from __future__ import annotations

import pytest
import torch
from conftest import load_hf
from hf_reference import rag_layout

from lazyrt import Engine, RagPrompt


@torch.inference_mode()
def hf_continuation_logprobs(model, prefix, docs, suffix, cont, causal: bool) -> list[float]:
    """log P(cont[k] | everything before) by one HF forward: RagPrompt semantics, or plain causal."""
    model.config._attn_implementation = "sdpa"
    if causal:
        ids = prefix + [t for d in docs for t in d] + suffix + cont
        pos = list(range(len(ids)))
        mask = torch.ones(len(ids), len(ids), dtype=torch.bool).tril()
    else:
        ids, pos, mask = rag_layout(prefix, docs, suffix + cont)
    logits = model(
        torch.tensor([ids]), attention_mask=mask[None, None], position_ids=torch.tensor([pos])
    ).logits
    lp = torch.log_softmax(logits[0].float(), -1)
    n = len(ids)
    return [float(lp[n - len(cont) - 1 + k, cont[k]]) for k in range(len(cont))]


@pytest.mark.parametrize("mode", ["lazy", "block", "none"])
def test_score_matches_hf_logprobs(mode, tiny_model_dir):
    path = tiny_model_dir("llama3")
    hf = load_hf(path)
    eng = Engine(path, device="cpu", cache_mode=mode, kv_cache_tokens=4096)
    tok = eng.tokenizer
    prompt = RagPrompt(
        "System: be brief.\n", ["Doc one is about cats.\n", "Doc two is about dogs.\n"], "Q: pets?\nA:"
    )
    conts = [" cats", " dogs and cats", " no"]
    ids = lambda s: tok(s, add_special_tokens=False).input_ids  # noqa: E731
    got_sum = eng.score(prompt, conts, normalize=False)
    got_mean = eng.score(prompt, conts)
    for c, s, m in zip(conts, got_sum, got_mean):
        ref = hf_continuation_logprobs(
            hf, ids(prompt.prefix), [ids(d) for d in prompt.docs], ids(prompt.suffix), ids(c), mode == "none"
        )
        assert s == pytest.approx(sum(ref), abs=2e-3)
        assert m == pytest.approx(sum(ref) / len(ref), abs=2e-3)
    # scoring leaves nothing held, and docs went through the chunk table in chunk modes
    stats = eng.cache_stats()
    assert stats["held_pages"] == 0 and stats["running_requests"] == 0
    if mode != "none":
        assert stats["chunk_hits"] >= 2


def test_score_plain_prompt_and_bad_input(tiny_model_dir):
    path = tiny_model_dir("llama3")
    hf = load_hf(path)
    eng = Engine(path, device="cpu", kv_cache_tokens=4096)
    tok = eng.tokenizer
    p = tok("The quick brown fox", add_special_tokens=True).input_ids
    c = tok(" jumps over", add_special_tokens=False).input_ids
    ref = hf_continuation_logprobs(hf, [], [], p, c, causal=True)
    # twice: the second time the prompt's pages are in the radix cache, the continuation must not be
    for _ in range(2):
        assert eng.score("The quick brown fox", [" jumps over"], normalize=False)[0] == pytest.approx(
            sum(ref), abs=2e-3
        )
    with pytest.raises(ValueError):
        eng.score("x", [""])
    with pytest.raises(TypeError):
        eng.score("x", " jumps")
