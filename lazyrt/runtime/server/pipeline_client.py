"""PipelineClient: the HTTP process's end of the pipeline. Sends requests to the tokenizer and routes
what comes back from the detokenizer to one asyncio queue per request.

The tokenizer runs in a process of its own, or (--tokenizer-in-http) in this process: requests are
then tokenized here, on a thread of their own in arrival order (a request whose documents are not
yet tokenized must not hold the event loop that streams every other request; what queued meanwhile
is taken at once, its new documents tokenized in one batch), and go straight to
the scheduler, whose outputs come back here and are detokenized on the event loop (one process hop
less each way).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

import zmq
import zmq.asyncio

from lazyrt.runtime.ipc.messages import (
    AbortReq,
    ControlReq,
    ControlResp,
    DocumentReq,
    DocumentResp,
    ErrorOut,
    GenerateReq,
    TextBatch,
    WorkerReady,
    decode,
)
from lazyrt.runtime.ipc.sockets import IpcPaths, send, socket
from lazyrt.runtime.tokenizer.process import TokenizerLoop, open_tokenizer_loop, tokenizing_failed

logger = logging.getLogger("lazyrt.http")


class PipelineClient:
    def __init__(self, ipc: IpcPaths, tokenizer_in_process: bool = False, document_store: str | None = None):
        """tokenizer_in_process: run the tokenizer here (EngineConfig.tokenizer_in_http), with
        document_store as its store option (EngineConfig.document_store)."""
        # Sends use a plain (blocking-API) socket: with no high-water mark a PUSH never blocks, and
        # an abort can then be sent from a cancelled stream's cleanup without awaiting.
        self._sync_ctx = zmq.Context()
        self._ctx = zmq.asyncio.Context()
        self._in_process, self._document_store = tokenizer_in_process, document_store
        self._tokenizer: TokenizerLoop | None = None  # in process: built once the worker is ready
        self._pending: list[Any] = []  # in process: what came from HTTP before that
        # in process: TokenizerLoop.on_http runs here, one message at a time in arrival order (an
        # abort never overtakes its request); the push socket is shared with the event loop's
        # detokenizer (a stop string's abort), hence the lock
        self._tokenize_thread: ThreadPoolExecutor | None = None
        # Short work (TokenizerLoop.quick: a request whose documents' ids are cached) runs on the
        # event loop instead, saving the handoff to the thread (~0.5 ms of a served TTFT), when the
        # thread has nothing queued (so nothing overtakes an earlier message) and is idle (the lock:
        # one on_http at a time). submitted / handled: written by one thread each.
        self._tokenize_lock = threading.Lock()
        self._submitted = self._handled = 0
        self._backlog: deque[Any] = deque()  # submitted, not yet taken by the tokenize thread
        self._push_lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        if tokenizer_in_process:
            self._tokenize_thread = ThreadPoolExecutor(1, thread_name_prefix="lazyrt-tokenize")
            self._push = socket(self._sync_ctx, zmq.PUSH, ipc.scheduler_in, bind=False)
            self._pull = socket(self._ctx, zmq.PULL, ipc.detok_in, bind=True)
        else:
            self._push = socket(self._sync_ctx, zmq.PUSH, ipc.tokenizer_in, bind=False)
            self._pull = socket(self._ctx, zmq.PULL, ipc.http_in, bind=True)
        self._rids = itertools.count()
        self._queues: dict[int, asyncio.Queue] = {}
        self._controls: dict[int, asyncio.Future] = {}
        self.ready_info: WorkerReady | None = None
        self.ready = asyncio.Event()
        self.failed: str | None = None  # set when a child died: everything pending gets this error
        self.fatal: str | None = None  # set when the in-process tokenizer could not start

    def _upstream(self, msg: Any) -> None:
        """Towards the scheduler, through the tokenizer (in this process: tokenized here first)."""
        if not self._in_process:
            send(self._push, msg)
        elif self._tokenizer is None:
            self._pending.append(msg)
        elif (
            self._submitted == self._handled
            and threading.get_ident() == self._loop_thread
            and self._tokenizer.quick(msg)
            and self._tokenize_lock.acquire(blocking=False)
        ):
            try:
                self._tokenize(msg)
            finally:
                self._tokenize_lock.release()
        else:
            self._submit(msg)

    def _submit(self, msg: Any) -> None:
        self._submitted += 1
        self._backlog.append(msg)
        try:
            self._tokenize_thread.submit(self._drain)
        except RuntimeError:  # shut down: the server is closing (a stream's cleanup sending an abort)
            self._backlog.pop()
            self._submitted -= 1

    def _drain(self) -> None:
        """On the tokenize thread, once per submit: takes everything queued (a later call may find
        nothing left) through TokenizerLoop.on_http_many (their new documents in one batch)."""
        msgs = []
        while self._backlog:
            msgs.append(self._backlog.popleft())
        with self._tokenize_lock:
            self._tokenizer.on_http_many(msgs, handle=self._tokenize_counted)

    def _tokenize_counted(self, msg: Any) -> None:
        try:
            self._tokenize(msg)
        finally:
            self._handled += 1

    def _tokenize(self, msg: Any) -> None:
        """TokenizerLoop.on_http, holding the tokenize lock (on the thread or the event loop)."""
        try:
            self._tokenizer.on_http(msg)
        except Exception as e:  # (on_http answers bad requests itself; this is a bug: fail the one)
            logger.exception("tokenizer: %s failed", type(msg).__name__)
            if isinstance(msg, GenerateReq):
                self._to_http(tokenizing_failed(msg.rid, e))

    def _to_sched(self, msg: Any) -> None:
        with self._push_lock:
            send(self._push, msg)

    def _to_http(self, msg: Any) -> None:
        """The tokenizer's answers: dispatched on the event loop (its queues and futures are not
        thread-safe)."""
        if threading.get_ident() == self._loop_thread:
            self.dispatch(msg)
        else:
            self._loop.call_soon_threadsafe(self.dispatch, msg)

    def new_rid(self) -> int:
        return next(self._rids)

    def submit(self, req: GenerateReq) -> asyncio.Queue:
        q: asyncio.Queue = asyncio.Queue()
        self._queues[req.rid] = q
        try:
            self._upstream(req)
        except Exception:  # not sent (msgpack cannot carry it): nothing will answer on q
            del self._queues[req.rid]
            raise
        return q

    def abort(self, rid: int) -> None:
        if self._queues.pop(rid, None) is not None:
            self._upstream(AbortReq(rid))

    def done(self, rid: int) -> None:
        self._queues.pop(rid, None)

    async def control(self, op: str, timeout: float = 30.0) -> dict:
        rid = self.new_rid()
        fut = asyncio.get_running_loop().create_future()
        self._controls[rid] = fut
        self._upstream(ControlReq(rid, op))
        try:
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._controls.pop(rid, None)

    async def document(self, req: DocumentReq, timeout: float = 60.0) -> DocumentResp:
        """A document store operation, answered by the tokenizer (req.rid is set here)."""
        req.rid = self.new_rid()
        fut = asyncio.get_running_loop().create_future()
        self._controls[req.rid] = fut
        self._upstream(req)
        try:
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._controls.pop(req.rid, None)

    async def run(self) -> None:
        self._loop, self._loop_thread = asyncio.get_running_loop(), threading.get_ident()
        while True:
            msg = decode(await self._pull.recv())
            if not self._in_process:
                self.dispatch(msg)
            elif self._tokenizer is not None:
                self._tokenizer.on_scheduler(msg)  # outputs come back through self.dispatch
            elif isinstance(msg, WorkerReady):
                await self._start_tokenizer(msg)

    async def _start_tokenizer(self, ready: WorkerReady) -> None:
        build = partial(open_tokenizer_loop, ready, self._document_store, self._to_sched, self._to_http,
                        separate_encoder=True)  # fmt: skip
        try:  # (loading the tokenizer takes a while: off the event loop)
            self._tokenizer = await self._loop.run_in_executor(self._tokenize_thread, build)
        except (Exception, SystemExit) as e:  # SystemExit: the document store cannot be opened
            self.fatal = f"the tokenizer could not start ({type(e).__name__}: {e})"
            logger.error("%s", self.fatal)
            self.fail_all(self.fatal)  # serve() sees `fatal` and shuts the server down
            return
        self.dispatch(ready)
        pending, self._pending = self._pending, []
        for msg in pending:
            self._submit(msg)

    def dispatch(self, msg: Any) -> None:
        if isinstance(msg, TextBatch):
            for out in msg.outs:
                q = self._queues.get(out.rid)
                if q is not None:
                    q.put_nowait(out)
                    if out.finish_reason is not None:
                        del self._queues[out.rid]
        elif isinstance(msg, ErrorOut):
            q = self._queues.pop(msg.rid, None)
            if q is not None:
                q.put_nowait(msg)
        elif isinstance(msg, ControlResp):
            fut = self._controls.get(msg.rid)
            if fut is not None and not fut.done():
                fut.set_result(msg.data)
        elif isinstance(msg, DocumentResp):
            fut = self._controls.get(msg.rid)
            if fut is not None and not fut.done():
                fut.set_result(msg)
        elif isinstance(msg, WorkerReady):
            self.ready_info = msg
            self.ready.set()
        else:
            logger.error("unexpected message %s", type(msg).__name__)

    def fail_all(self, why: str) -> None:
        self.failed = why
        for rid, q in list(self._queues.items()):
            q.put_nowait(ErrorOut(rid, why, None, 503, "server_error"))
        self._queues.clear()
        for fut in self._controls.values():
            if not fut.done():
                fut.set_exception(RuntimeError(why))

    def close(self) -> None:
        if self._tokenize_thread is not None:
            self._tokenize_thread.shutdown(wait=False, cancel_futures=True)
        with self._push_lock:  # not while the tokenize thread sends
            self._push.close()
        self._pull.close()
        self._ctx.term()
        self._sync_ctx.term()
