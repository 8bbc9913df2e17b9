"""Citations (issue 16): each document's share of the attention the generated tokens pay, against Hugging
Face transformers' own attention probabilities (eager attention, output_attentions) under the RagPrompt
mask of hf_reference.rag_layout, on tiny random models, in lazy and block mode, overlap on and off."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import DEVICES, load_hf, random_rag_ids
from hf_reference import rag_layout

from lazyrt import Engine, RagPrompt, SamplingParams


def hf_citations(model, prefix, docs, suffix, out: list[int]) -> list[float]:
    """Mean over layers, heads and the rows that produced `out` of the probability mass on each doc."""
    ids, pos, mask = rag_layout(prefix, docs, suffix + out[:-1])
    # eager attention adds a 4-D mask to the logits: give it as 0 / -inf (a bool one would leak)
    additive = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))[None, None]
    model.config._attn_implementation = "eager"
    with torch.inference_mode():
        res = model(torch.tensor([ids]), attention_mask=additive, position_ids=torch.tensor([pos]),
                    output_attentions=True)  # fmt: skip
    assert float(torch.stack(res.attentions)[..., ~mask].abs().max()) == 0  # nothing on masked keys
    probs = torch.stack([a[0] for a in res.attentions]).float()  # [layers, heads, N, N]
    rows = probs[:, :, len(ids) - len(out) :]  # the last prompt token, then each generated one but the last
    # the columns of doc d (its real keys, not its private prefix copy): rag_layout's order
    start, cols = len(prefix), []
    for d in docs:
        start += len(prefix)  # the copy
        cols.append(range(start, start + len(d)))
        start += len(d)
    return [float(rows[..., list(c)].sum(-1).mean()) for c in cols]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_citations_equal_hf_attention_mass(family, tiny_model_dir, device):
    path = tiny_model_dir(family)
    hf = load_hf(path)  # the reference stays on the CPU
    rng = random.Random()
    for mode, overlap in (("lazy", True), ("block", False)):
        engine = Engine(path, device=device, dtype="float32", kv_cache_tokens=4096, cache_mode=mode,
                        overlap_schedule=overlap)  # fmt: skip
        vocab = engine.model_config.vocab_size
        for _ in range(2):
            prefix, docs, suffix = random_rag_ids(rng, vocab)
            prompt = RagPrompt(prefix, docs, suffix)
            got = engine.generate(prompt, SamplingParams(max_tokens=5, citations=True))[0]
            want = hf_citations(hf, prefix, docs, suffix, got["token_ids"])
            cites = got["meta"]["citations"]
            assert sorted(c["document"] for c in cites) == list(range(len(docs)))
            assert [c["score"] for c in cites] == sorted((c["score"] for c in cites), reverse=True)
            by_doc = {c["document"]: c["score"] for c in cites}
            assert [by_doc[i] for i in range(len(docs))] == pytest.approx(want, abs=2e-5), (mode, overlap)
            # without citations: the same tokens, and no citations in meta
            plain = engine.generate(prompt, SamplingParams(max_tokens=5))[0]
            assert plain["token_ids"] == got["token_ids"] and "citations" not in plain["meta"]


def test_citations_bad_value():
    with pytest.raises(ValueError, match="citations"):
        SamplingParams(citations="yes")
