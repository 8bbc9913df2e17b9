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
    """n requests over the same 9 documents (about 2.6 pages each), in shuffled order."""
    prefix, docs = ids(rng, 20), [ids(rng, rng.randint(30, 44)) for _ in range(9)]
    return [RagPrompt(prefix, rng.sample(docs, 9), ids(rng, 5)) for _ in range(n)]


def _no_leaks(eng: Engine) -> None:
    assert eng.cache_stats()["held_pages"] == 0
    eng.flush_cache()
    host = eng.scheduler.chunks.host_pool
    assert eng.pool.num_free == eng.pool.num_pages and host.num_free == host.num_pages


def test_fresh_request_larger_than_the_device_is_served(tiny_model_dir):
    path = tiny_model_dir("llama")
    (prompt,) = _prompts(random.Random(), 1)
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    want = Engine(path, device="cpu", kv_cache_tokens=8192).generate(prompt, sp)[0]["token_ids"]
    eng = _small(path)  # overlapped scheduling (the default): a round's chunks are ready a step early
    out = eng.generate(prompt, sp)[0]
    assert out["token_ids"] == want
    meta = out["meta"]
    assert meta["host_attended_chunks"] >= 1 and meta["chunk_rounds"] >= 2
    # every document was computed for it: misses, not hits (the prefix too: nothing cached)
    assert meta["chunk_misses"] == 9 and meta["chunk_hits"] == 0 and meta["cached_tokens"] == 0
    assert eng.cache_stats()["chunk_misses"] == 10  # 9 documents and the prefix, each counted once
    _no_leaks(eng)


def test_several_fresh_requests_at_once(tiny_model_dir):
    """Two requests over 9 documents each, 3 shared (both fit the host tier), both running at once:
    each is computed in rounds, the second's beside the first's decode, without overlapped
    scheduling this time."""
    path = tiny_model_dir("llama")
    rng = random.Random()
    prefix, docs = ids(rng, 20), [ids(rng, rng.randint(30, 44)) for _ in range(15)]
    prompts = [RagPrompt(prefix, docs[:9], ids(rng, 5)), RagPrompt(prefix, docs[6:][::-1], ids(rng, 5))]
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    roomy = Engine(path, device="cpu", kv_cache_tokens=8192)
    want = [roomy.generate(p, sp)[0]["token_ids"] for p in prompts]
    eng = _small(path, max_running_requests=2, overlap_schedule=False)
    outs = eng.generate(prompts, sp)
    assert [o["token_ids"] for o in outs] == want
    assert all(o["meta"].get("host_attended_chunks", 0) >= 1 and o["meta"]["chunk_rounds"] for o in outs)
    _no_leaks(eng)


def test_requests_too_large_for_the_tiers_name_the_option(tiny_model_dir):
    path = tiny_model_dir("llama")
    rng = random.Random()
    prefix = ids(rng, 20)
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    eng = _small(path, host_kv_cache_tokens=16 * 8)  # host + device hold fewer pages than 9 documents
    with pytest.raises(RequestTooLarge, match="raise host_kv_cache_tokens"):
        eng.generate(RagPrompt(prefix, [ids(rng, 40) for _ in range(9)], ids(rng, 5)), sp)
    # one document larger than the device beside the rest of the request
    with pytest.raises(RequestTooLarge, match="largest document.*raise kv_cache_tokens"):
        eng.generate(RagPrompt(prefix, [ids(rng, 16 * 11)], ids(rng, 5)), sp)
    plain = Engine(path, device="cpu", kv_cache_tokens=16 * 12)  # no retrieval: unchanged
    with pytest.raises(RequestTooLarge, match="raise kv_cache_tokens or shorten the prompt"):
        plain.generate(RagPrompt(prefix, [ids(rng, 40) for _ in range(9)], ids(rng, 5)), sp)
    _no_leaks(eng)


# ---- the scheduler alone: rounds keep what they computed, and give up when documents get lost ----
def _sched():
    import torch

    from lazyrt.cache.page_pool import PagePool
    from lazyrt.runtime.scheduler.scheduler import Scheduler

    pool = PagePool(1, 12, 16, 1, 1, torch.float32, "meta")
    return Scheduler(pool, "lazy", "m", host_kv_pages=40, retrieval_attention=True)


def _request(rng: random.Random, rid: int = 0):
    from lazyrt.runtime.scheduler.request import Request

    docs = [ids(rng, rng.randint(30, 44)) for _ in range(9)]
    return Request(rid, SamplingParams(max_tokens=6), prefix=ids(rng, 20), docs=docs, suffix=ids(rng, 5),
                   max_new_tokens=6)  # fmt: skip


def test_rounds_keep_every_document_they_computed():
    from lazyrt.runtime.scheduler.request import RequestState

    s, rng = _sched(), random.Random()
    req = _request(rng)
    s.add(req)
    computed: list = []
    for _ in range(20):
        plan = s.schedule()
        s.on_step_done(plan)
        computed += [it.job.chunk.tokens for it in plan.items if it.job is not None and it.job.cond]
        # each document computed so far still exists (device or host), none twice
        assert all(s.chunks.lookup(tuple(req.prefix), d, record=False) is not None for d in computed)
        assert len(set(computed)) == len(computed)
        if req.state is not RequestState.WAITING:
            break
    assert req.state is not RequestState.WAITING and 2 <= req.chunk_rounds <= 9
    # every document computed exactly once (the last ones by the admission itself)
    assert len(computed) == len({tuple(d) for d in req.docs})
    assert req.host_chunks >= 1 and not req.host_pins
    assert sum(seg.host for seg in req.segments) == req.host_chunks  # whole documents attended there


def test_rounds_give_up_when_their_documents_are_lost():
    """A failed step loses the chunks it was computing each time: after a bounded number of rounds
    the request stops asking for more and the engine reports why instead of computing forever."""
    from lazyrt.runtime.scheduler.engine_core import EngineCore, NoProgress
    from lazyrt.runtime.scheduler.request import RequestState

    s, rng = _sched(), random.Random()
    req = _request(rng)
    s.add(req)
    for _ in range(100):
        plan = s.schedule()
        if not plan.items:
            break
        s.fail_running([plan])  # its chunks are dropped: the next round computes them again
    assert req.state is RequestState.WAITING and req.error and "host_kv_cache_tokens" in req.error
    assert req.chunk_rounds == s._max_rounds(req)
    with pytest.raises(NoProgress, match="waits for its documents"):
        EngineCore(s, worker=None, eos_ids=set()).step()
    s.finish(req, "abort")
    s.flush()
    assert s.pool.num_free == s.pool.num_pages and s.chunks.host_pool.num_free == s.chunks.host_pool.num_pages
