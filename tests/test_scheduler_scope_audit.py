"""The scheduler's failures and evictions stay scoped to the request they concern.

- A waiting request that cannot go on (retrieval attention: its documents' rounds gave up) fails
  alone, with its reason; the requests queued behind it were answered 503 with it, and now keep
  waiting and get their normal answers (the scheduler process's loop and the in-process EngineLoop).
- Admission evicts cached documents and prompt pages only when that lets the request in now: a
  request that still would not fit left the cache emptied for nothing."""

from __future__ import annotations

import random
import threading
from types import SimpleNamespace

import pytest

from lazyrt import Engine, RagPrompt, SamplingParams
from lazyrt.runtime.ipc.messages import ErrorOut, TokenBatch, decode
from lazyrt.runtime.scheduler.engine_core import NoProgress
from lazyrt.runtime.scheduler.request import RequestState
from lazyrt.runtime.scheduler.scheduler import Scheduler

VOCAB = 49152
SP = SamplingParams(max_tokens=4, ignore_eos=True)


def ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, VOCAB) for _ in range(n)]


def _retrieval_engine(path: str, **kw) -> Engine:
    # 12 device pages: a request over 9 documents of 2-3 pages has them computed in rounds
    return Engine(
        path, device="cpu", kv_cache_tokens=16 * 12, host_kv_cache_tokens=16 * 40, retrieval_attention=True,
        retrieval_top_k=10**6, retrieval_sink=4, retrieval_build_threads=0, **kw,
    )  # fmt: skip


def _head_and_innocents(rng: random.Random) -> list:
    """A request whose 9 documents do not fit the device together (computed in rounds), then two
    that fit at once: a plain prompt and a one-document RAG prompt."""
    prefix = ids(rng, 20)
    head = RagPrompt(prefix, [ids(rng, rng.randint(30, 44)) for _ in range(9)], ids(rng, 5))
    return [head, ids(rng, 25), RagPrompt(prefix, [ids(rng, 30)], ids(rng, 5))]


def _solo(path: str, prompts: list) -> list[list[int]]:
    roomy = Engine(path, device="cpu", kv_cache_tokens=8192)
    out = []
    for p in prompts:
        roomy.flush_cache()
        out.append(roomy.generate(p, SP)[0]["token_ids"])
    return out


class _Outbox:
    """The scheduler loop's socket to the detokenizer: the tokens and errors it sends."""

    def __init__(self) -> None:
        self.tokens: dict[int, list[int]] = {}
        self.done: set[int] = set()
        self.errors: dict[int, ErrorOut] = {}

    def send(self, data: bytes) -> None:
        msg = decode(data)
        if isinstance(msg, ErrorOut):
            self.errors[msg.rid] = msg
            return
        assert isinstance(msg, TokenBatch), msg
        for out in msg.outs:
            self.tokens.setdefault(out.rid, []).extend(out.token_ids)
            if out.finish_reason is not None:
                self.done.add(out.rid)


def test_scheduler_loop_fails_only_the_request_whose_rounds_gave_up(tiny_model_dir):
    """Every step computing the head request's documents fails (WorkerStepError: nothing running
    is lost), so its rounds give up after their bound. It gets a 503 naming the option to raise;
    the two requests queued behind it (they fit at once) were failed with it, and are now served
    with their solo tokens."""
    from lazyrt.runtime.scheduler.process import SchedulerLoop, WorkerStepError

    path = tiny_model_dir("llama")
    rng = random.Random()
    prompts = _head_and_innocents(rng)
    eng = _retrieval_engine(path)
    reqs = [eng._make_request(p, SP) for p in prompts]
    head = reqs[0]
    worker = eng.core.worker

    class Flaky:  # the head's rounds (the only work while it waits) never complete
        def execute(self, msg):
            if head.state is RequestState.WAITING:
                raise WorkerStepError("injected", "error")
            return worker.execute(msg)

    eng.core.worker = Flaky()
    inbox = SimpleNamespace(poll=lambda timeout: False, recv=lambda: None)
    out = _Outbox()
    loop = SchedulerLoop(eng.core, "lazy", inbox, out, SimpleNamespace(check=lambda: None))
    for r in reqs:
        eng.core.add(r)
    for _ in range(200):
        if not eng.core.has_work:
            break
        loop.run_once()
    assert set(out.errors) == {head.rid}, {rid: e.message for rid, e in out.errors.items()}
    err = out.errors[head.rid]
    assert err.status == 503 and "host_kv_cache_tokens" in err.message and "documents" in err.message
    assert head.chunk_rounds == eng.scheduler._max_rounds(head)
    innocents = reqs[1:]
    assert out.done == {r.rid for r in innocents}
    assert [out.tokens[r.rid] for r in innocents] == _solo(path, prompts[1:])
    assert not eng.core.has_work and eng.cache_stats()["held_pages"] == 0


def test_engine_loop_fails_only_the_stuck_request(monkeypatch, tiny_model_dir):
    """EngineLoop: the head request's rounds give up at once (the bound that decides it cannot go
    on, forced to 0 for it alone); its future gets NoProgress with its reason, the requests queued
    behind it (submitted in the same batch) get their solo tokens."""
    from lazyrt.runtime.engine.engine_loop import EngineLoop

    path = tiny_model_dir("llama")
    rng = random.Random()
    prompts = _head_and_innocents(rng)
    eng = _retrieval_engine(path)
    reqs = [eng._make_request(p, SP) for p in prompts]
    bound = Scheduler._max_rounds
    monkeypatch.setattr(Scheduler, "_max_rounds", lambda s, r: 0 if r is reqs[0] else bound(s, r))
    loop, gate = EngineLoop(eng), threading.Event()

    def first():  # holds the loop's admission until all three are queued
        gate.wait(timeout=60)
        return reqs[0]

    futures = [loop.submit(first)] + [loop.submit(lambda r=r: r) for r in reqs[1:]]
    gate.set()
    with pytest.raises(NoProgress, match="waits for its documents.*host_kv_cache_tokens"):
        futures[0].result(timeout=300)
    got = [f.result(timeout=300)["token_ids"] for f in futures[1:]]
    assert got == _solo(path, prompts[1:])


def test_a_stuck_step_with_nothing_told_apart_still_fails_every_waiting_request():
    """NoProgress names the stuck requests; a scheduler that names none keeps the old answer (every
    waiting request fails), so an error that would repeat leaves nobody waiting for ever."""
    from lazyrt.runtime.scheduler.process import SchedulerLoop

    waiting = [SimpleNamespace(rid=1), SimpleNamespace(rid=2)]
    aborted: list[int] = []
    core = SimpleNamespace(scheduler=SimpleNamespace(waiting=list(waiting)),
                           abort=lambda rid, reason="abort": aborted.append(rid) or True)  # fmt: skip
    sent: list = []
    loop = SchedulerLoop.__new__(SchedulerLoop)
    loop.core, loop.to_detok = core, SimpleNamespace(send=lambda data: sent.append(decode(data)))
    loop.fail_stuck(NoProgress("scheduler made no progress (no runnable work)"))
    assert aborted == [1, 2] and [m.rid for m in sent] == [1, 2] and all(m.status == 503 for m in sent)
    aborted.clear(), sent.clear()
    loop.fail_stuck(NoProgress("x", [(2, "a request waits for its documents (y)")]))
    assert aborted == [2] and [m.rid for m in sent] == [2] and "(y)" in sent[0].message


# ---- admission evicts only what lets the request in ---------------------------------------------
@pytest.mark.parametrize("cached", ["chunk", "radix"])
def test_admission_that_still_would_not_fit_evicts_nothing(cached, tiny_model_dir):
    """12 pages. Cached from an earlier request: a 2-page document chunk (or a 2-page prompt in the
    radix). A running request takes 5 pages; the next needs 8: free 5 + the 2 cached < 8, so it
    waits. Before, the cached pages were evicted for it anyway (and it still waited); now the
    cache keeps them (a later request with the document hits it), and every answer equals its solo
    run."""
    path = tiny_model_dir("llama")
    rng = random.Random()
    eng = Engine(path, device="cpu", kv_cache_tokens=16 * 12, overlap_schedule=False)
    doc, question = ids(rng, 30), ids(rng, 5)
    warm = RagPrompt([], [doc], question) if cached == "chunk" else ids(rng, 33)
    eng.generate(warm, SamplingParams(max_tokens=1))
    s = eng.scheduler

    def kept() -> int:  # device pages of the warm request's cached document (or prompt)
        if cached == "chunk":
            c = s.chunks.lookup((), doc, record=False)
            return len(c.pages) if c is not None else 0
        node, n = s.radix.node_of(warm), 0
        while node is not s.radix.root:
            node, n = node.parent, n + 1
        return n

    assert kept() == 2
    sp1, sp2 = SamplingParams(max_tokens=40, ignore_eos=True), SamplingParams(max_tokens=60, ignore_eos=True)
    prompts = [ids(rng, 40), ids(rng, 60)]  # 5 pages with their outputs, then 8
    reqs = [eng._make_request(p, sp) for p, sp in zip(prompts, (sp1, sp2))]
    for r in reqs:
        eng.core.add(r)
    eng.core.step()
    assert reqs[0].state is not RequestState.WAITING and reqs[1].state is RequestState.WAITING
    assert s.pool.num_free + s.chunks.evictable_pages() + s.radix.evictable_pages() < 8
    assert kept() == 2  # was 0: evicted for nothing
    assert s.chunks.stats.evictions == 0
    while eng.core.has_work:
        eng.core.step()
    assert all(r.finish_reason == "length" for r in reqs)
    if cached == "chunk":  # it survived the wait (the finished prompt's radix pages went first): a hit
        assert eng.generate(warm, SamplingParams(max_tokens=1))[0]["meta"]["chunk_hits"] == 1
    roomy = Engine(path, device="cpu", kv_cache_tokens=8192)
    assert [r.output_ids for r in reqs] == [roomy.generate(p, sp)[0]["token_ids"]
                                            for p, sp in zip(prompts, (sp1, sp2))]  # fmt: skip
