"""Resource handling under pressure: aborts, cancels and failures leave no page or chunk reference
held and no untrusted KV cached; the requests that go on answer as they would alone."""

from __future__ import annotations

import random
import threading

import pytest
from conftest import cpu_engine

from lazyrt import Engine, RagPrompt, SamplingParams
from lazyrt.runtime.scheduler.request import RequestState

VOCAB = 49152


def ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, VOCAB) for _ in range(n)]


def idle(engine: Engine) -> None:
    """Nothing queued or running, no page or chunk reference held, every page accounted for."""
    s = engine.scheduler
    assert not s.running and not s.waiting and not s.jobs and not engine.core.requests
    assert s.held_pages() == 0
    assert all(c.ref_count == 0 for c in s.chunks)
    assert all(n.lock_ref == 0 for n in s.radix._nodes())
    assert s.pool.num_free + s.chunks.num_pages + s.radix.num_pages == s.pool.num_pages


@pytest.mark.parametrize("mode", ["prefix", "lazy"])
def test_a_request_ended_while_the_failed_steps_wrote_its_last_page_is_not_cached(mode, tiny_model_dir):
    """Overlapped steps: a request aborted (a client gone, a stop string) right after its token k
    came back has its prompt + output pages put in the radix, the last one written by the step still
    in flight. When the next step fails, that step's KV is not trusted: the radix must not keep the
    page, or a later prompt continuing the conversation reads garbage KV."""
    path = tiny_model_dir("llama")
    rng = random.Random()
    p = ids(rng, 20)
    k = 32 - len(p)  # prompt + k outputs end on a page boundary: the page with token k's KV is full
    sp = SamplingParams(max_tokens=k + 8, ignore_eos=True)
    eng = cpu_engine(path, mode, overlap_schedule=True, max_running_requests=2)
    pool, execute, written = eng.pool, eng.runner.execute, []

    def slots(plan) -> list[tuple[int, int]]:
        out = []
        for it in plan.items:
            first = it.start_pos - it.target.start_pos
            for i in range(first, first + len(it.token_ids)):
                out.append((it.target.pages[i // pool.page_size], i % pool.page_size))
        return out

    def flaky(plan):  # fails the first step after the abort, as a step that died half way
        written.append(slots(plan))
        if req.state is not RequestState.FINISHED:
            return execute(plan)
        for page, slot in written[-1] + written[-2]:  # the failed step's slots and the one in flight's
            pool.kv_all[:, page, :, slot].normal_(0, 50)
        raise RuntimeError("injected")

    eng.runner.execute = flaky
    req = eng._make_request(p, sp)
    other = eng._make_request(ids(rng, 30), SamplingParams(max_tokens=40, ignore_eos=True))
    eng.core.add(req)
    eng.core.add(other)
    while len(req.output_ids) < k:
        eng.core.step()
    assert eng.core._in_flight is not None and any(it.request is req for it in eng.core._in_flight.items)
    eng.core.abort(req.rid)  # what the server does when the client goes away
    with pytest.raises(RuntimeError, match="injected"):
        eng.core.step()
    del eng.runner.execute
    idle(eng)
    # the conversation goes on: its prompt starts with the aborted request's prompt and output
    fresh = cpu_engine(path, mode)
    follow = p + req.output_ids + ids(rng, 3)
    sp2 = SamplingParams(max_tokens=6, ignore_eos=True)
    assert eng.generate(follow, sp2)[0]["token_ids"] == fresh.generate(follow, sp2)[0]["token_ids"]
    idle(eng)


def test_engine_loop_cancel_and_a_raising_callback_fail_only_their_request(tiny_model_dir):
    """EngineLoop (the frontend's local backend): `future.cancel()` of a request mid-decode or still
    queued aborts it and frees its pages, and an on_text callback that raises fails only its own
    request; the loop thread serves on (before, both killed it: every other request hung, pages held)."""
    from lazyrt.runtime.engine.engine_loop import EngineLoop

    path = tiny_model_dir("llama")
    rng = random.Random()
    eng = Engine(path, device="cpu", kv_cache_tokens=16 * 24, max_running_requests=2)
    prompts = [ids(rng, rng.randint(20, 40)) for _ in range(4)]
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    want = [r["token_ids"] for r in cpu_engine(path, "lazy").generate(prompts, sp)]
    eng.generate(prompts[0], sp)  # warm-up
    eng.flush_cache()
    total = eng.pool.num_free
    loop = EngineLoop(eng)
    started, cancelled = threading.Event(), threading.Event()

    def hold(_text: str) -> None:  # the first piece: wait (on the loop thread) until it is cancelled
        started.set()
        cancelled.wait(timeout=60)

    def boom(_text: str) -> None:
        raise KeyError("the consumer went away")

    mid_decode = loop.generate(prompts[0], SamplingParams(max_tokens=200, ignore_eos=True), on_text=hold)
    raising = loop.generate(prompts[1], SamplingParams(max_tokens=200, ignore_eos=True), on_text=boom)
    queued = loop.generate(prompts[2], sp)  # two run at once: this one waits
    plain = loop.generate(prompts[3], sp)
    assert started.wait(timeout=60)
    assert mid_decode.cancel() and queued.cancel()
    cancelled.set()
    assert plain.result(timeout=120)["token_ids"] == want[3]
    with pytest.raises(KeyError, match="consumer"):
        raising.result(timeout=60)
    # the loop serves on: every page comes back and later requests answer as they would alone
    assert [f.result(timeout=120)["token_ids"] for f in [loop.generate(p, sp) for p in prompts]] == want
    assert loop._thread.is_alive()
    idle(eng)
    eng.flush_cache()
    assert eng.pool.num_free == total


def test_generate_return_errors_fails_only_the_request_whose_constraint_broke(tiny_model_dir):
    """Engine.generate(..., return_errors=True): a grammar that outgrows the parser while decoding
    fails its own prompt ({"error": ...}, nothing held); the other prompts of the call get the
    answers they get alone. Without it the whole call raises (as before)."""
    from lazyrt.constraint import ConstraintFailed

    path = tiny_model_dir("llama")
    rng = random.Random()
    eng = cpu_engine(path, "prefix")
    alts = " | ".join(f'"opt-{rng.randrange(10**6)}-{i}"' for i in range(2001))  # past llguidance's limits
    bad = SamplingParams(max_tokens=16, grammar=f"start: {alts}")
    prompts = [ids(rng, 25), ids(rng, 30), RagPrompt(ids(rng, 8), [ids(rng, 20)], ids(rng, 5))]
    sp = SamplingParams(max_tokens=8, ignore_eos=True)
    fresh = cpu_engine(path, "prefix")
    want = [fresh.generate(p, sp)[0]["token_ids"] for p in (prompts[0], prompts[2])]
    with pytest.raises(ConstraintFailed):
        eng.generate(prompts, [sp, bad, sp])
    idle(eng)
    got = eng.generate(prompts, [sp, bad, sp], return_errors=True)
    assert got[1]["error"]["type"] == "ConstraintFailed"
    assert "structured output failed while decoding" in got[1]["error"]["message"]
    assert [got[0]["token_ids"], got[2]["token_ids"]] == want
    assert eng.generate(prompts[:1], SamplingParams(max_tokens=8, ignore_eos=True, n=2),
                        return_errors=True)[0]["outputs"][1]["token_ids"] == want[0]  # fmt: skip
    idle(eng)


def test_a_failed_step_leaves_no_pin_on_a_chunk_whose_offload_it_lost(tiny_model_dir):
    """Retrieval attention, overlapped steps: request C, added while the step that moved its document
    to the host tier is in flight, pins the document's host copy. The next step fails, so the copy
    may never have been made and the chunk leaves the table: C must let go of it (before, its stale
    pin made every later step raise "chunk is not in this table" and C could never run)."""
    path = tiny_model_dir("llama")
    rng = random.Random()
    kw = dict(
        cache_mode="lazy", kv_cache_tokens=16 * 8, host_kv_cache_tokens=16 * 16, retrieval_attention=True
    )
    eng = Engine(path, device="cpu", overlap_schedule=True, **kw)
    pre, d1, d2, d3 = ids(rng, 4), ids(rng, 40), ids(rng, 40), ids(rng, 40)
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    eng.generate(RagPrompt(pre, [d1], ids(rng, 3)), sp)  # d1's chunk on the device
    execute, fail = eng.runner.execute, []

    def flaky(plan):
        if fail:
            raise RuntimeError("injected")
        return execute(plan)

    eng.runner.execute = flaky
    eng.core.add(eng._make_request(RagPrompt(pre, [d2, d3], ids(rng, 3)), sp))
    eng.core.step()  # admits it: d1 is evicted to the host tier by this step, now in flight
    chunk = eng.scheduler.chunks.lookup(tuple(pre), d1, record=False)
    assert not chunk.pages and chunk.host_pages and eng.core._in_flight.offloads
    c = RagPrompt(pre, [d1], ids(rng, 3))
    req = eng._make_request(c, sp)
    eng.core.add(req)
    assert req.host_pins == [chunk]
    fail.append(1)
    with pytest.raises(RuntimeError, match="injected"):
        eng.core.step()
    del eng.runner.execute
    while eng.core.has_work:
        eng.core.step()
    assert req.finish_reason == "length"
    assert req.output_ids == Engine(path, device="cpu", **kw).generate(c, sp)[0]["token_ids"]
    idle(eng)
    host = eng.scheduler.chunks.host_pool
    assert host.num_pages - host.num_free == sum(len(x.host_pages) for x in eng.scheduler.chunks)


@pytest.mark.parametrize("mode", ["lazy", "block", "prefix", "none"])
def test_aborts_under_a_full_pool_free_everything_and_the_rest_answer_as_alone(mode, tiny_model_dir):
    """More requests than the pool holds, sharing documents and prompt heads: they queue; some are
    aborted while queued, in prefill or decoding. The others answer as each does alone on a roomy
    engine, and afterwards no page or chunk reference is held."""
    path = tiny_model_dir("llama")
    rng = random.Random()
    pages = 12 + (8 if mode == "block" else 0)
    eng = Engine(path, device="cpu", cache_mode=mode, kv_cache_tokens=16 * pages, max_step_tokens=32)
    eng.generate(ids(rng, 10), SamplingParams(max_tokens=2))  # warm-up
    eng.flush_cache()
    total = eng.pool.num_free
    pre, head, docs = ids(rng, 6), ids(rng, 20), [ids(rng, rng.randint(12, 36)) for _ in range(4)]
    prompts = [RagPrompt(pre, rng.sample(docs, 2), ids(rng, 4)) for _ in range(6)]
    prompts += [head + ids(rng, 12) for _ in range(3)]
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    reqs = [eng._make_request(p, sp) for p in prompts]
    for r in reqs:
        eng.core.add(r)
    doomed = {reqs[1].rid: 0, reqs[4].rid: 2, reqs[7].rid: 4, reqs[8].rid: 5}  # rid -> abort at step n
    steps = 0
    while eng.core.has_work:
        eng.core.step()
        steps += 1
        for rid in [rid for rid, at in doomed.items() if at <= steps]:
            eng.core.abort(rid)
            del doomed[rid]
    idle(eng)
    roomy = cpu_engine(path, mode)
    for p, r in zip(prompts, reqs):
        if r.finish_reason == "length":
            roomy.flush_cache()
            assert r.output_ids == roomy.generate(p, sp)[0]["token_ids"]
    assert sum(r.finish_reason == "abort" for r in reqs) >= 3
    eng.flush_cache()
    assert eng.pool.num_free == total
