"""PipelineClient with the tokenizer in the HTTP process (--tokenizer-in-http), against stand-in
scheduler sockets: a request whose tokenization is slow (documents not yet tokenized) must not hold
the event loop that streams the other requests, and nothing upstream overtakes it."""

from __future__ import annotations

import asyncio
import shutil
import threading

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
from lazyrt.sampling_params import SamplingParams


def _recv(sock: zmq.Socket, timeout_s: float = 30.0):
    if not sock.poll(int(timeout_s * 1000)):
        raise TimeoutError("nothing reached the stand-in scheduler")
    return recv(sock)


def test_a_slow_tokenization_leaves_other_streams_flowing(tiny_model_dir, tokenizer, monkeypatch):
    path = tiny_model_dir("llama")
    ipc = IpcPaths.create()
    ctx = zmq.Context()
    sched_in = socket(ctx, zmq.PULL, ipc.scheduler_in, bind=True)  # the scheduler's inbox
    events: list[str] = []
    release = threading.Event()  # request A's tokenization waits for it

    async def run() -> None:
        client = PipelineClient(ipc, tokenizer_in_process=True, document_store="none")
        to_client = socket(ctx, zmq.PUSH, ipc.detok_in, bind=False)  # the scheduler's outputs
        runner = asyncio.create_task(client.run())
        try:
            send(to_client, WorkerReady("tiny", path, 64, 16, 2048, len(tokenizer), [2], "cpu"))
            await asyncio.wait_for(client.ready.wait(), 60)
            sp = SamplingParams(max_tokens=8)
            c = client.new_rid()
            stream_c = client.submit(GenerateReq(c, sp, text="a request already running"))
            got = await asyncio.to_thread(_recv, sched_in)
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
            client.submit(GenerateReq(a, sp, text="a request with a long new document"))
            client.abort(a)  # must reach the scheduler after A itself, not before
            ids = tokenizer("hello there", add_special_tokens=False).input_ids
            send(to_client, TokenBatch([TokenOut(c, ids)]))
            out = await asyncio.wait_for(stream_c.get(), 10)
            events.append("C streamed")
            assert out.rid == c and out.text == tokenizer.decode(ids, skip_special_tokens=True)
            release.set()
            first, second = await asyncio.to_thread(lambda: (_recv(sched_in), _recv(sched_in)))
            assert isinstance(first, TokenizedReq) and first.rid == a
            assert isinstance(second, AbortReq) and second.rid == a
        finally:
            release.set()
            runner.cancel()
            client.close()
            to_client.close()

    try:
        asyncio.run(run())
    finally:
        sched_in.close()
        ctx.term()
        shutil.rmtree(ipc.dir, ignore_errors=True)
    assert events == ["C streamed", "A tokenized"]


def test_a_tokenizer_bug_fails_that_request_only(tiny_model_dir, tokenizer, monkeypatch):
    """An exception out of the tokenizer (not a bad request: a bug) answers that request with a 500
    and the next request is tokenized as usual."""
    path = tiny_model_dir("llama")
    ipc = IpcPaths.create()
    ctx = zmq.Context()
    sched_in = socket(ctx, zmq.PULL, ipc.scheduler_in, bind=True)
    bad = "a text the tokenizer trips over"

    async def run() -> None:
        client = PipelineClient(ipc, tokenizer_in_process=True, document_store="none")
        to_client = socket(ctx, zmq.PUSH, ipc.detok_in, bind=False)
        runner = asyncio.create_task(client.run())
        try:
            send(to_client, WorkerReady("tiny", path, 64, 16, 2048, len(tokenizer), [2], "cpu"))
            await asyncio.wait_for(client.ready.wait(), 60)
            loop = client._tokenizer
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
            got = await asyncio.to_thread(_recv, sched_in)
            assert isinstance(got, TokenizedReq) and got.rid == b
        finally:
            runner.cancel()
            client.close()
            to_client.close()

    try:
        asyncio.run(run())
    finally:
        sched_in.close()
        ctx.term()
        shutil.rmtree(ipc.dir, ignore_errors=True)
