"""PipelineClient with the tokenizer in the HTTP process (--tokenizer-in-http), against stand-in
scheduler sockets: a request whose tokenization is slow (documents not yet tokenized) must not hold
the event loop that streams the other requests, and nothing upstream overtakes it."""

from __future__ import annotations

import asyncio
import contextlib
import random
import shutil
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

import zmq

from lazyrt.runtime.ipc.messages import (
    AbortReq,
    GenerateReq,
    TokenBatch,
    TokenizedReq,
    TokenOut,
    WorkerReady,
)
from lazyrt.runtime.ipc.sockets import IpcPaths, recv, send, socket
from lazyrt.runtime.server.pipeline_client import PipelineClient
from lazyrt.runtime.tokenizer.request_tokenizer import RequestTokenizer
from lazyrt.sampling_params import SamplingParams


@dataclass
class StandIn:
    client: PipelineClient
    sched_in: zmq.Socket  # what reaches the scheduler
    to_client: zmq.Socket  # the scheduler's outputs

    async def upstream(self, n: int = 1) -> list:
        """The next n messages at the scheduler."""

        def get() -> list:
            out = []
            for _ in range(n):
                if not self.sched_in.poll(30_000):
                    raise TimeoutError("nothing reached the stand-in scheduler")
                out.append(recv(self.sched_in))
            return out

        return await asyncio.to_thread(get)


@contextlib.asynccontextmanager
async def stand_in_scheduler(tokenizer_path: str, vocab: int) -> AsyncIterator[StandIn]:
    """A PipelineClient tokenizing in process, its worker reported ready, between two sockets."""
    ipc, ctx = IpcPaths.create(), zmq.Context()
    sched_in = socket(ctx, zmq.PULL, ipc.scheduler_in, bind=True)
    client = PipelineClient(ipc, tokenizer_in_process=True, document_store="none")
    to_client = socket(ctx, zmq.PUSH, ipc.detok_in, bind=False)
    runner = asyncio.create_task(client.run())
    try:
        send(to_client, WorkerReady("tiny", tokenizer_path, 64, 16, 2048, vocab, [2], "cpu"))
        await asyncio.wait_for(client.ready.wait(), 60)
        yield StandIn(client, sched_in, to_client)
    finally:
        runner.cancel()
        client.close()
        to_client.close()
        sched_in.close()
        ctx.term()
        shutil.rmtree(ipc.dir, ignore_errors=True)


def test_a_slow_tokenization_leaves_other_streams_flowing(tiny_model_dir, tokenizer, monkeypatch):
    events: list[str] = []
    release = threading.Event()  # request A's tokenization waits for it

    async def run() -> None:
        async with stand_in_scheduler(tiny_model_dir("llama"), len(tokenizer)) as s:
            client, sp = s.client, SamplingParams(max_tokens=8)
            c = client.new_rid()
            stream_c = client.submit(GenerateReq(c, sp, text="a request already running"))
            (got,) = await s.upstream()
            assert isinstance(got, TokenizedReq) and got.rid == c

            # request A's tokenization blocks (as a long uncached document's would) until released
            a = client.new_rid()
            real = client._tokenizer.req_tokenizer.tokenize

            def slow(req):
                if req.rid == a:
                    release.wait(20)
                    events.append("A tokenized")
                return real(req)

            monkeypatch.setattr(client._tokenizer.req_tokenizer, "tokenize", slow)
            try:
                new_doc = ["a long new document"]  # (a request whose documents are cached tokenizes inline)
                client.submit(GenerateReq(a, sp, text="Which?", docs=new_doc, text_mode="rag"))
                client.abort(a)  # must reach the scheduler after A itself, not before
                ids = tokenizer("hello there", add_special_tokens=False).input_ids
                send(s.to_client, TokenBatch([TokenOut(c, ids)]))
                out = await asyncio.wait_for(stream_c.get(), 10)
                events.append("C streamed")
                assert out.rid == c and out.text == tokenizer.decode(ids, skip_special_tokens=True)
            finally:
                release.set()
            first, second = await s.upstream(2)
            assert isinstance(first, TokenizedReq) and first.rid == a
            assert isinstance(second, AbortReq) and second.rid == a

    asyncio.run(run())
    assert events == ["C streamed", "A tokenized"]


def test_a_tokenizer_bug_fails_that_request_only(tiny_model_dir, tokenizer, monkeypatch):
    """An exception out of the tokenizer (not a bad request: a bug) answers that request with a 500
    and the next request is tokenized as usual."""
    bad = "a text the tokenizer trips over"

    async def run() -> None:
        async with stand_in_scheduler(tiny_model_dir("llama"), len(tokenizer)) as s:
            client, loop = s.client, s.client._tokenizer
            real = loop.on_http

            def broken(msg):
                if isinstance(msg, GenerateReq) and msg.text == bad:
                    raise RuntimeError(bad)
                real(msg)

            monkeypatch.setattr(loop, "on_http", broken)
            sp = SamplingParams(max_tokens=4)
            a, b = client.new_rid(), client.new_rid()
            stream_a = client.submit(GenerateReq(a, sp, text=bad))
            client.submit(GenerateReq(b, sp, text="fine"))
            err = await asyncio.wait_for(stream_a.get(), 10)
            assert err.rid == a and err.status == 500 and bad in err.message
            (got,) = await s.upstream()
            assert isinstance(got, TokenizedReq) and got.rid == b

    asyncio.run(run())


def test_quick_requests_tokenize_on_the_event_loop_in_order(tiny_model_dir, tokenizer, monkeypatch):
    """A request whose documents' ids are cached is tokenized on the event loop (no handoff to the
    thread), one with a new document on the thread; while the thread has work queued a quick request
    waits behind it (nothing overtakes), and both paths send the scheduler the same ids."""
    doc = "The Quenta river rises in the north and meets the sea at Lumen."

    async def run() -> None:
        async with stand_in_scheduler(tiny_model_dir("llama"), len(tokenizer)) as s:
            client, sp = s.client, SamplingParams(max_tokens=4)
            threads: dict[int, int] = {}
            release = threading.Event()
            real = client._tokenizer.req_tokenizer.tokenize

            def spy(req):
                threads[req.rid] = threading.get_ident()
                if req.rid == slow_rid:
                    release.wait(20)
                return real(req)

            monkeypatch.setattr(client._tokenizer.req_tokenizer, "tokenize", spy)
            slow_rid = -1

            def ask(docs: list[str], hold: bool = False) -> int:
                nonlocal slow_rid
                rid = client.new_rid()
                if hold:  # set before submit: the thread may reach it at once
                    slow_rid = rid
                client.submit(GenerateReq(rid, sp, text="Where does it rise?", docs=docs, text_mode="rag"))
                return rid

            a = ask([doc])  # a new document: the thread
            (got_a,) = await s.upstream()
            b = ask([doc])  # now cached: the event loop, before submit returns
            assert threads[b] == threading.get_ident() != threads[a]
            (got_b,) = await s.upstream()
            assert (got_a.rid, got_b.rid) == (a, b)
            assert (got_a.prefix, got_a.docs, got_a.suffix) == (got_b.prefix, got_b.docs, got_b.suffix)

            c = ask([doc + " More."], hold=True)  # the thread, held
            d = ask([doc])  # quick, but queued behind c
            client.abort(d)
            assert d not in threads  # not tokenized on the event loop
            release.set()
            got = await s.upstream(3)
            assert [(type(m).__name__, m.rid) for m in got] == [
                ("TokenizedReq", c), ("TokenizedReq", d), ("AbortReq", d)
            ]
            assert threads[d] == threads[c] != threading.get_ident()

    asyncio.run(run())


def test_requests_queued_together_have_their_new_documents_tokenized_in_one_batch(
    tiny_model_dir, tokenizer, monkeypatch
):
    """Requests that queue behind a slow one are taken at once: the new documents of them all go to
    the tokenizer in one batch (each distinct text once), they reach the scheduler in arrival order,
    and each gets the ids a request tokenized alone gets."""
    rng = random.Random()
    words = ["river", "Quenta", "1822", "lumen", "tides", "north", "sea"]
    docs = [" ".join(rng.choice(words) for _ in range(rng.randrange(5, 80))) for _ in range(6)]

    async def run() -> None:
        async with stand_in_scheduler(tiny_model_dir("llama"), len(tokenizer)) as s:
            client, sp = s.client, SamplingParams(max_tokens=4)
            rt = client._tokenizer.req_tokenizer
            release = threading.Event()
            real = rt.tokenize
            batches: list[list[str]] = []
            batch = rt.doc_cache._tokenize_batch

            entered = threading.Event()

            def spy(req):
                if req.rid == slow:
                    entered.set()
                    release.wait(20)
                return real(req)

            monkeypatch.setattr(rt, "tokenize", spy)
            spy_batch = lambda t: batches.append(list(t)) or batch(t)  # noqa: E731
            monkeypatch.setattr(rt.doc_cache, "_tokenize_batch", spy_batch)

            def ask(ds: list[str]) -> int:
                rid = client.new_rid()
                client.submit(GenerateReq(rid, sp, text="Where?", docs=ds, text_mode="rag"))
                return rid

            slow = ask(["a slow document of its own"])  # one new document: tokenized alone, held
            assert await asyncio.to_thread(entered.wait, 20)
            picks = [rng.sample(docs, 3) for _ in range(4)]
            rids = [ask(p) for p in picks]
            release.set()
            got = await s.upstream(1 + len(picks))
            assert [m.rid for m in got] == [slow, *rids]
            new = list(dict.fromkeys(d + "\n\n" for p in picks for d in p))
            assert batches == [new]  # one batch: every new document of the four, once
            alone = RequestTokenizer(tokenizer, 1 << 20, len(tokenizer))
            for m, p, rid in zip(got[1:], picks, rids):
                want = alone.tokenize(GenerateReq(rid, sp, text="Where?", docs=p, text_mode="rag"))
                assert [list(d) for d in m.docs] == [list(d) for d in want.docs]
                assert (list(m.prefix), list(m.suffix)) == (list(want.prefix), list(want.suffix))
            assert rt.doc_cache.misses == len(new) + 1 and rt.doc_cache.hits == 3 * len(picks) - len(new)

    asyncio.run(run())
