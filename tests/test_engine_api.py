"""Engine's public calls on bad input: a request the scheduler rejects leaves nothing behind, and
sampling_params is SamplingParams, a dict of its fields, or a TypeError naming it."""

from __future__ import annotations

import random

import pytest

from lazyrt import Engine, SamplingParams
from lazyrt.runtime.scheduler.scheduler import RequestRejected

DOCS = ["Quenta is the capital of Arvania.", "Mount Feller is 5,210 metres tall."]


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    """(engine under test, a fresh reference engine) on the same tiny random model."""
    path = tiny_model_dir("llama")
    return Engine(path, device="cpu", kv_cache_tokens=4096), Engine(path, device="cpu", kv_cache_tokens=4096)


def _no_leaks(engine: Engine) -> None:
    s = engine.cache_stats()
    assert s["held_pages"] == 0 and not engine.scheduler.waiting and not engine.core.requests


def test_a_rejected_request_leaves_the_engine_clean(engines):
    engine, ref = engines
    rng = random.Random()
    words = [f"word{rng.randrange(10_000)}" for _ in range(4)]
    sp = SamplingParams(max_tokens=5)
    bad = SamplingParams(max_tokens=5, retrieval_top_k=5)  # no retrieval attention on this engine
    with pytest.raises(RequestRejected, match="retrieval_top_k"):
        engine.generate([words[0], words[1]], [sp, bad])  # the first one was queued when the second failed
    _no_leaks(engine)
    with pytest.raises(RequestRejected, match="retrieval_top_k"):
        engine.rag_batch([{"docs": DOCS, "question": words[2]},
                          {"docs": DOCS[:1], "question": words[3], "sampling_params": {"retrieval_top_k": 5}},
                          ])  # fmt: skip
    _no_leaks(engine)
    # later calls work (a KeyError before) and answer as a fresh engine does
    got = engine.generate(words[:2], sp)
    assert [g["token_ids"] for g in got] == [r["token_ids"] for r in ref.generate(words[:2], sp)]
    q = engine.rag(DOCS, words[2], sampling_params=sp)
    assert q["token_ids"] == ref.rag(DOCS, words[2], sampling_params=sp)["token_ids"]
    _no_leaks(engine)


def test_sampling_params_as_a_dict_or_a_type_error_naming_it(engines):
    engine, _ = engines
    want = engine.generate("Hi", SamplingParams(max_tokens=3))[0]["token_ids"]
    assert len(want) == 3
    assert engine.generate("Hi", {"max_tokens": 3})[0]["token_ids"] == want
    two = engine.generate(["Hi", "Hi"], [{"max_tokens": 3}, SamplingParams(max_tokens=3)])
    assert [t["token_ids"] for t in two] == [want, want]
    assert engine.rag(DOCS, "Hi", sampling_params={"max_tokens": 2})["meta"]["completion_tokens"] == 2
    for bad, name in [("max_tokens=3", "sampling_params"), (3, "sampling_params"),
                      ([{"max_tokens": 3}, "x"], r"sampling_params\[1\]")]:  # fmt: skip
        prompts = ["Hi", "Ho"] if isinstance(bad, list) else "Hi"
        with pytest.raises(TypeError, match=name):
            engine.generate(prompts, bad)
    with pytest.raises(ValueError, match="max_tokens"):
        engine.generate("Hi", {"max_tokens": 0})
    _no_leaks(engine)
