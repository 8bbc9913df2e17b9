"""Chunked prefill: a prompt longer than the step budget runs in pieces beside running decodes."""

from __future__ import annotations

import random

import pytest

from lazyrt import Engine, RagPrompt, SamplingParams


def _toks(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 40000) for _ in range(n)]


def _record(engine: Engine) -> list[list[tuple[int, bool]]]:
    """Per step: (new tokens, samples?) of each item."""
    steps: list[list[tuple[int, bool]]] = []
    execute = engine.runner.execute

    def wrapped(plan):
        steps.append([(len(it.token_ids), it.request is not None) for it in plan.items])
        return execute(plan)

    engine.runner.execute = wrapped
    return steps


@pytest.mark.parametrize("mode", ["prefix", "none", "lazy"])
def test_long_prompt_prefills_in_pieces_next_to_decodes(mode, tiny_model_dir):
    path = tiny_model_dir("llama")
    rng = random.Random()
    budget = 24
    engine = Engine(path, device="cpu", cache_mode=mode, kv_cache_tokens=4096, max_step_tokens=budget)
    steps = _record(engine)
    short = _toks(rng, 5)
    long = [_toks(rng, rng.randrange(70, 120)) for _ in range(2)]  # 3-5x the budget
    rag = RagPrompt(_toks(rng, 9), [_toks(rng, 20), _toks(rng, 13)], _toks(rng, 50))  # suffix > budget
    prompts = [short, *long, rag]
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    outs = engine.generate(prompts, sp)
    # every step stays within the budget (decodes count one token each)
    assert all(sum(n for n, _ in s) <= budget for s in steps), steps
    # the long prompts were split: pieces that sample nothing, in steps that also decode
    assert any(any(n > 1 and not smp for n, smp in s) and (1, True) in s for s in steps), steps
    reference = Engine(path, device="cpu", cache_mode=mode, kv_cache_tokens=4096, max_step_tokens=8192)
    for p, out in zip(prompts, outs):
        ref = reference.generate([p], sp)[0]
        assert out["token_ids"] == ref["token_ids"]
        assert out["meta"]["prompt_tokens"] == ref["meta"]["prompt_tokens"]
    stats = engine.cache_stats()
    assert stats["held_pages"] == 0


def test_scored_prompt_is_not_split(tiny_model_dir):
    """Logprobs of a scored continuation come from one prefill step: it waits for room instead."""
    path = tiny_model_dir("llama")
    rng = random.Random()
    engine = Engine(path, device="cpu", cache_mode="prefix", kv_cache_tokens=4096, max_step_tokens=16)
    ref = Engine(path, device="cpu", cache_mode="prefix", kv_cache_tokens=4096)
    text = " ".join(str(rng.randrange(1000)) for _ in range(30))
    conts = [" and the rest", " 12 13 14"]
    assert engine.score(text, conts) == pytest.approx(ref.score(text, conts), abs=1e-4)
