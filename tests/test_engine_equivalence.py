"""End-to-end greedy equivalence: lazyrt Engine vs Hugging Face transformers, every model family."""

from __future__ import annotations

import random

import pytest
from conftest import FAMILIES, load_hf
from hf_reference import hf_greedy, hf_rag_greedy

from lazyrt import Engine, RagPrompt, SamplingParams

GREEDY = SamplingParams(max_tokens=10)


def _random_text(rng: random.Random, n_words: int) -> str:
    words = [
        "river",
        "mountain",
        "blue",
        "seven",
        "city",
        "quantum",
        "bread",
        "the",
        "of",
        "and",
        "runs",
        "north",
        "Zorblat",
        "engine",
        "paper",
        "light",
        "cold",
        "market",
        "stone",
        "under",
    ]
    return " ".join(rng.choice(words) for _ in range(n_words))


@pytest.mark.parametrize("family", FAMILIES)
def test_plain_prompts_match_hf_generate(family, tiny_model_dir):
    path = tiny_model_dir(family)
    hf = load_hf(path)
    engine = Engine(path, device="cpu", kv_cache_tokens=4096)
    rng = random.Random()
    prompts = [_random_text(rng, n) for n in (3, 17, 40)]
    ids = [engine.tokenizer(p).input_ids for p in prompts]
    outs = engine.generate(prompts, GREEDY)  # batched together: continuous batching must not mix them
    for p_ids, out in zip(ids, outs):
        assert out["token_ids"] == hf_greedy(hf, p_ids, GREEDY.max_tokens, engine.eos_ids)


@pytest.mark.parametrize("mode", ["lazy", "block", "prefix", "none"])
def test_plain_prompts_same_in_every_mode(mode, tiny_model_dir):
    path = tiny_model_dir("llama3")
    hf = load_hf(path)
    engine = Engine(path, device="cpu", cache_mode=mode, kv_cache_tokens=4096)
    rng = random.Random()
    base = _random_text(rng, 40)
    prompts = [base, base + " " + _random_text(rng, 5), _random_text(rng, 9)]
    for round_ in range(2):  # second round hits the radix cache in prefix/lazy/block modes
        outs = engine.generate(prompts, GREEDY)
        for p, out in zip(prompts, outs):
            assert out["token_ids"] == hf_greedy(hf, engine.tokenizer(p).input_ids, 10, engine.eos_ids), (
                round_
            )
    if mode != "none":
        assert outs[1]["meta"]["cached_tokens"] > 0


@pytest.mark.parametrize("family", ["llama", "llama3", "qwen2", "qwen3"])
def test_rag_lazy_block_match_hf_mask_reference(family, tiny_model_dir):
    path = tiny_model_dir(family)
    hf = load_hf(path)
    lazy = Engine(path, device="cpu", cache_mode="lazy", kv_cache_tokens=8192)
    block = Engine(path, device="cpu", cache_mode="block", kv_cache_tokens=8192)
    tok = lazy.tokenizer
    rng = random.Random()
    prefix = tok(_random_text(rng, 12), add_special_tokens=False).input_ids
    docs = [tok(_random_text(rng, rng.randint(5, 60)), add_special_tokens=False).input_ids for _ in range(4)]
    suffix = tok(_random_text(rng, 8), add_special_tokens=False).input_ids
    for order in ([0, 1, 2, 3], [2, 0, 3, 1]):
        d = [docs[i] for i in order]
        ref = hf_rag_greedy(hf, prefix, d, suffix, GREEDY.max_tokens, lazy.eos_ids)
        out_lazy = lazy.generate(RagPrompt(prefix, d, suffix), GREEDY)[0]
        out_block = block.generate(RagPrompt(prefix, d, suffix), GREEDY)[0]
        assert out_lazy["token_ids"] == ref
        assert out_block["token_ids"] == ref
    # second order: every doc (and the prefix) came from the chunk table
    for out in (out_lazy, out_block):
        assert out["meta"]["chunk_hits"] == 4 and out["meta"]["chunk_misses"] == 0
        assert out["meta"]["cached_tokens"] == len(prefix) + sum(map(len, docs))


def test_rag_default_model_reordered_docs_hit_and_match(default_model, tokenizer):
    hf = load_hf(default_model.path)
    engine = Engine(device="cpu", kv_cache_tokens=16384)
    docs = [
        "The Zorblat river flows through Quenta. It is 420 km long and freezes every January.",
        "Mount Feller is the tallest peak in Arvania, at 5,210 metres, first climbed in 1931.",
        "Quenta is the capital of Arvania and has two million inhabitants and a famous glass market.",
        "The Arvanian currency is the lumen; one lumen is divided into 100 sparks.",
    ]
    sp = SamplingParams(max_tokens=16)
    first = engine.rag(docs, "What is the capital of Arvania?", sampling_params=sp)
    assert first["meta"]["chunk_misses"] == 4
    computed_before = engine.scheduler.chunks.num_pages
    for order, q in (([3, 1, 0, 2], "How tall is Mount Feller?"), ([2, 3, 1, 0], "What is the currency?")):
        d = [docs[i] for i in order]
        out = engine.rag(d, q, sampling_params=sp)
        assert out["meta"]["chunk_hits"] == 4 and out["meta"]["chunk_misses"] == 0
        assert engine.scheduler.chunks.num_pages == computed_before  # nothing recomputed or re-stored
        rp = engine.rag_prompt(d, q)
        prefix = tokenizer(rp.prefix, add_special_tokens=False).input_ids
        dd = [tokenizer(x, add_special_tokens=False).input_ids for x in rp.docs]
        suffix = tokenizer(rp.suffix, add_special_tokens=False).input_ids
        assert out["token_ids"] == hf_rag_greedy(hf, prefix, dd, suffix, 16, engine.eos_ids)


def test_default_model_plain_prompt_matches_hf(default_model):
    hf = load_hf(default_model.path)
    engine = Engine(device="cpu", kv_cache_tokens=4096)
    msgs = [{"role": "user", "content": "Name three primary colors."}]
    ids = engine.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    out = engine.generate(ids, SamplingParams(max_tokens=20))[0]
    assert out["token_ids"] == hf_greedy(hf, ids, 20, engine.eos_ids)
    assert out["text"].strip()
