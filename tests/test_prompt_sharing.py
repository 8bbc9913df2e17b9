"""A plain prompt's pages go into the radix as soon as its prefill is done, and a request with the same
prompt waits for that: n > 1 completions (and a prompt sent twice at once) compute the prompt once.
Reference: the prompt run alone on an engine of its own (greedy tokens); seeded samples reproduce."""

from __future__ import annotations

import random

import pytest
from conftest import DEVICES

from lazyrt import Engine, SamplingParams

PAGE = 16


def _leak_free(engine: Engine) -> None:
    s = engine.cache_stats()
    assert s["held_pages"] == 0 and s["running_requests"] == 0
    assert s["free_pages"] + s["chunk_pages"] + s["radix_pages"] == s["total_pages"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode,overlap", [("prefix", True), ("prefix", False), ("lazy", True)])
def test_n_completions_share_the_prompt(tiny_model_dir, mode, overlap, device):
    path = tiny_model_dir("llama3")
    rng = random.Random()
    prompt = [rng.randrange(100, 49152) for _ in range(rng.randint(2 * PAGE + 1, 6 * PAGE))]
    full = (len(prompt) - 1) // PAGE * PAGE  # what a later request can match (>= 1 token computed)
    kw = dict(device=device, dtype="float32", kv_cache_tokens=4096, cache_mode=mode, overlap_schedule=overlap)
    alone = Engine(path, **kw)
    greedy = alone.generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True))[0]["token_ids"]
    seed = rng.randrange(10**6)

    engine = Engine(path, **kw)
    outs = engine.generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True, n=4))[0]["outputs"]
    assert [o["token_ids"] for o in outs] == [greedy] * 4
    assert sorted(o["meta"]["cached_tokens"] for o in outs) == [0, full, full, full]
    # seeded samples are reproducible (not compared with runs alone: the siblings read the prompt's
    # pages from the radix and compute only its tail, and the random model's flat distributions turn
    # those last-bit differences into other draws now and then)
    sp = SamplingParams(max_tokens=6, ignore_eos=True, temperature=1.0, seed=seed, n=3)
    runs = []
    for _ in range(2):
        engine.flush_cache()
        outs = engine.generate([prompt], sp)[0]["outputs"]
        assert sorted(o["meta"]["cached_tokens"] for o in outs) == [0, full, full]
        runs.append([o["token_ids"] for o in outs])
    assert runs[0] == runs[1]
    # the same prompt twice in one batch, beside another: computed once too; nothing leaks
    engine.flush_cache()
    other = [rng.randrange(100, 49152) for _ in range(3 * PAGE)]
    res = engine.generate([prompt, other, prompt], SamplingParams(max_tokens=6, ignore_eos=True))
    assert res[0]["token_ids"] == res[2]["token_ids"] == greedy
    assert sorted([res[0]["meta"]["cached_tokens"], res[2]["meta"]["cached_tokens"]]) == [0, full]
    _leak_free(engine)
    engine.flush_cache()
    _leak_free(engine)
