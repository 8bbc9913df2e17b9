"""A model step that raises (e.g. CUDA out of memory on a large batch): the running requests fail, no
page leaks, no KV the failed step (or, with overlap, the step in flight with it) was writing is ever
read again, waiting requests are served, and later requests get a fresh engine's tokens."""

from __future__ import annotations

import random
import threading

import pytest
import torch
from conftest import cpu_engine

from lazyrt import RagPrompt, SamplingParams
from lazyrt.runtime.scheduler.request import RequestState

VOCAB = 49152


def inject_failure(engine, fail_call: int, overlap: bool) -> list[set[tuple[int, ...]]]:
    """Makes the runner's `fail_call`-th forward raise, after filling the KV slots that step writes
    (and, with overlap, the step before it, still in flight) with garbage, as a step that died half
    way could leave them. Returns the token tuples of each forward's items."""
    runner, pool = engine.runner, engine.pool
    execute, seen = runner.execute, []
    written: list[list] = []

    def slots(plan) -> list[tuple[int, int]]:
        out = []
        for it in plan.items:
            first = it.start_pos - it.target.start_pos
            for i in range(first, first + len(it.token_ids)):
                out.append((it.target.pages[i // pool.page_size], i % pool.page_size))
        return out

    def flaky(plan):
        seen.append({tuple(it.token_ids) for it in plan.items})
        written.append(slots(plan))
        if len(seen) != fail_call:
            return execute(plan)
        untrusted = written[-1] + (written[-2] if overlap and len(written) > 1 else [])
        for page, slot in untrusted:
            pool.kv_all[:, page, :, slot].normal_(0, 50)
        raise RuntimeError("injected")

    runner.execute = flaky
    return seen


def ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, VOCAB) for _ in range(n)]


@pytest.mark.parametrize("mode", ["lazy", "prefix"])
@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("fail_call", [1, 2, 3])  # lazy: the prefix chunk, the docs, the questions
def test_a_failed_step_fails_the_running_requests_and_serves_on(mode, overlap, fail_call, tiny_model_dir):
    path = tiny_model_dir("llama")
    rng = random.Random()
    if mode == "lazy":
        prefix, d = ids(rng, 12), [ids(rng, rng.randint(20, 40)) for _ in range(4)]
        prompts = [RagPrompt(prefix, [d[0], d[1]], ids(rng, 5)), RagPrompt(prefix, [d[2]], ids(rng, 6))]
        waiting = RagPrompt(prefix, [d[3], d[0]], ids(rng, 5))  # shares d[0] with a failed request
    else:
        prompts = [ids(rng, 40), ids(rng, 37)]
        waiting = prompts[0][:32] + ids(rng, 6)  # would reuse the first request's pages from the radix
    sp = SamplingParams(max_tokens=5, ignore_eos=True)
    eng = cpu_engine(path, mode, overlap_schedule=overlap, max_running_requests=2)
    total = eng.pool.num_free
    seen = inject_failure(eng, fail_call, overlap)
    reqs = [eng._make_request(p, sp) for p in [*prompts, waiting]]
    for r in reqs:
        eng.core.add(r)
    with pytest.raises(RuntimeError, match="injected"):
        while eng.core.has_work:
            eng.core.step()
    failed, queued = reqs[:2], reqs[2]
    assert sorted(eng.core.failed_rids) == [r.rid for r in failed]
    assert all(r.state is RequestState.FINISHED and r.finish_reason == "error" for r in failed)
    assert queued.state is RequestState.WAITING and list(eng.scheduler.waiting) == [queued]
    # Only what steps before the failed one (and the one in flight with it) computed stays cached.
    trusted = set().union(*seen[: len(seen) - (2 if overlap else 1)])
    if mode == "lazy":
        for doc in [prefix, *d[:3]]:
            chunk = eng.scheduler.chunks.lookup(() if doc is prefix else prefix, doc, record=False)
            assert (chunk is not None) == (tuple(doc) in trusted)
            assert chunk is None or chunk.ready
    else:
        assert eng.scheduler.radix.num_pages == 0  # the failed requests' KV is not cached
    # The waiting request is served; then the failed ones again, each as a fresh engine serves it.
    del eng.runner.execute  # the class's own again
    while eng.core.has_work:
        eng.core.step()
    fresh = cpu_engine(path, mode, overlap_schedule=overlap)
    assert queued.output_ids == fresh.generate([waiting], sp)[0]["token_ids"]
    if mode == "lazy":  # a document the failed steps computed is computed again, not reused
        assert queued.chunk_misses == 1 + (tuple(d[0]) not in trusted)
    for p in prompts:
        got, want = eng.generate([p], sp)[0], fresh.generate([p], sp)[0]
        assert got["token_ids"] == want["token_ids"]
        if mode == "lazy":  # (d[0] is cached again by the waiting request)
            again = [doc for doc in p.docs if tuple(doc) not in trusted and doc != d[0]]
            assert got["meta"]["chunk_misses"] == len(again)
    assert eng.cache_stats()["held_pages"] == 0
    eng.flush_cache()
    assert eng.pool.num_free == total


def test_worker_out_of_memory_frees_the_cache_and_raises(monkeypatch, tiny_model_dir):
    """ModelWorker hands the CUDA cache back after an out-of-memory step (a no-op without CUDA)."""
    eng = cpu_engine(tiny_model_dir("llama"), "lazy")
    emptied = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(1))

    def oom(plan):
        raise torch.cuda.OutOfMemoryError("injected")

    eng.runner.execute = oom
    with pytest.raises(torch.cuda.OutOfMemoryError):
        eng.generate([[5, 6, 7]], SamplingParams(max_tokens=2))
    assert emptied == [1]


def test_engine_loop_fails_only_the_failed_steps_requests(tiny_model_dir):
    """EngineLoop (the in-process server loop): the requests of a failed step get its exception, a
    request still waiting then is served with a fresh engine's tokens."""
    from lazyrt.runtime.engine.engine_loop import EngineLoop

    path = tiny_model_dir("llama")
    rng = random.Random()
    prompts = [ids(rng, 30), ids(rng, 33), ids(rng, 29)]
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    eng = cpu_engine(path, "prefix", max_running_requests=2)
    execute, calls = eng.runner.execute, []

    def flaky(plan):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected")
        return execute(plan)

    eng.runner.execute = flaky
    reqs = [eng._make_request(p, sp) for p in prompts]
    loop, gate = EngineLoop(eng), threading.Event()

    def first():  # holds the loop's admission until all three are queued: one step holds two
        gate.wait(timeout=60)
        return reqs[0]

    futures = [loop.submit(first)] + [loop.submit(lambda r=r: r) for r in reqs[1:]]
    gate.set()
    for f in futures[:2]:
        with pytest.raises(RuntimeError, match="injected"):
            f.result(timeout=300)
    fresh = cpu_engine(path, "prefix")
    assert futures[2].result(timeout=300)["token_ids"] == fresh.generate([prompts[2]], sp)[0]["token_ids"]
