"""Retrieval attention, documents not yet computed that do not fit the device together (issue 15):
the scheduler computes them in rounds while the request waits (each round's chunks move to the host
tier), then admits it attending the host-resident ones through retrieval. With top-k covering every
key the tokens equal a roomy engine's; no pages leak; a request too large for the tiers is refused
naming the option to raise."""

from __future__ import annotations

import random

import pytest

from lazyrt import Engine, RagPrompt, SamplingParams
from lazyrt.runtime.scheduler.scheduler import RequestTooLarge

VOCAB = 49152
pytest.importorskip("faiss")


def ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, VOCAB) for _ in range(n)]


def _small(path: str, **kw) -> Engine:
    # 12 pages: prefix 2 + own 1 leave 9 for documents of 2-3 pages: about 3 of a request's 9
    kw = {"kv_cache_tokens": 16 * 12, "host_kv_cache_tokens": 16 * 40, **kw}
    return Engine(
        path, device="cpu", retrieval_attention=True, retrieval_top_k=10**6, retrieval_sink=4,
        retrieval_build_threads=0, **kw,
    )  # fmt: skip


def _prompts(rng: random.Random, n: int) -> list[RagPrompt]:
    prefix, docs = ids(rng, 20), [ids(rng, rng.randint(30, 44)) for _ in range(9)]
    return [RagPrompt(prefix, rng.sample(docs, 9), ids(rng, 5)) for _ in range(n)]


def _no_leaks(eng: Engine) -> None:
    assert eng.cache_stats()["held_pages"] == 0
    eng.flush_cache()
    host = eng.scheduler.chunks.host_pool
    assert eng.pool.num_free == eng.pool.num_pages and host.num_free == host.num_pages


@pytest.mark.parametrize("overlap", [True, False])
def test_fresh_request_larger_than_the_device_is_served(overlap, tiny_model_dir):
    path = tiny_model_dir("llama")
    (prompt,) = _prompts(random.Random(), 1)
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    want = Engine(path, device="cpu", kv_cache_tokens=8192).generate(prompt, sp)[0]["token_ids"]
    eng = _small(path, overlap_schedule=overlap)
    out = eng.generate(prompt, sp)[0]
    assert out["token_ids"] == want
    meta = out["meta"]
    assert meta["host_attended_chunks"] >= 1 and meta["chunk_rounds"] >= 2
    # every document was computed for it: misses, not hits
    assert meta["chunk_misses"] == 9 and meta["chunk_hits"] == 0
    _no_leaks(eng)


def test_several_fresh_requests_at_once(tiny_model_dir):
    path = tiny_model_dir("llama")
    prompts = _prompts(random.Random(), 3)
    sp = SamplingParams(max_tokens=5, ignore_eos=True)
    roomy = Engine(path, device="cpu", kv_cache_tokens=8192)
    want = [roomy.generate(p, sp)[0]["token_ids"] for p in prompts]
    eng = _small(path, max_running_requests=4)
    outs = eng.generate(prompts, sp)
    assert [o["token_ids"] for o in outs] == want
    assert all(o["meta"].get("host_attended_chunks", 0) >= 1 for o in outs)
    _no_leaks(eng)


def test_requests_too_large_for_the_tiers_name_the_option(tiny_model_dir):
    path = tiny_model_dir("llama")
    rng = random.Random()
    prefix = ids(rng, 20)
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    eng = _small(path, host_kv_cache_tokens=16 * 8)  # host + device hold fewer pages than 9 documents
    with pytest.raises(RequestTooLarge, match="host_kv_cache_tokens"):
        eng.generate(RagPrompt(prefix, [ids(rng, 40) for _ in range(9)], ids(rng, 5)), sp)
    with pytest.raises(RequestTooLarge, match="kv_cache_tokens"):  # one document larger than the device
        eng.generate(RagPrompt(prefix, [ids(rng, 16 * 11)], ids(rng, 5)), sp)
    plain = Engine(path, device="cpu", kv_cache_tokens=16 * 12)  # no retrieval: unchanged
    with pytest.raises(RequestTooLarge, match="raise kv_cache_tokens or shorten the prompt"):
        plain.generate(RagPrompt(prefix, [ids(rng, 40) for _ in range(9)], ids(rng, 5)), sp)
    _no_leaks(eng)
