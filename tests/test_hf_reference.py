"""The Hugging Face references themselves: hf_rag_greedy decodes on HF's KV cache; that equals
re-forwarding the whole RagPrompt layout (rag_layout with the generated tokens in the suffix) for
every token, the reference's plain definition."""

from __future__ import annotations

import random

import pytest
from conftest import load_hf, random_rag_ids
from hf_reference import hf_rag_greedy, masked_greedy, rag_layout


@pytest.mark.parametrize("family", ["llama", "llama3", "qwen2", "qwen3"])
def test_cached_rag_greedy_equals_full_reforward(family, tiny_model_dir):
    hf = load_hf(tiny_model_dir(family))
    rng = random.Random()
    eos = {hf.config.eos_token_id} if isinstance(hf.config.eos_token_id, int) else set()
    for _ in range(2):
        prefix, docs, suffix = random_rag_ids(rng, hf.config.vocab_size)
        full = masked_greedy(hf, lambda sfx: rag_layout(prefix, docs, sfx), suffix, 12, eos)  # noqa: B023
        assert hf_rag_greedy(hf, prefix, docs, suffix, 12, eos) == full
        assert len(full) == 12 or full[-1] in eos
