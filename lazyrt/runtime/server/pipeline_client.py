"""PipelineClient: the HTTP process's end of the pipeline. Sends requests to the tokenizer process
and routes what comes back from the detokenizer to one asyncio queue per request."""

from __future__ import annotations

import asyncio
import itertools
import logging
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
    encode,
)
from lazyrt.runtime.ipc.sockets import IpcPaths, socket

logger = logging.getLogger("lazyrt.http")


class PipelineClient:
    def __init__(self, ipc: IpcPaths):
        # Sends use a plain (blocking-API) socket: with no high-water mark a PUSH never blocks, and
        # an abort can then be sent from a cancelled stream's cleanup without awaiting.
        self._sync_ctx = zmq.Context()
        self._push = socket(self._sync_ctx, zmq.PUSH, ipc.tokenizer_in, bind=False)
        self._ctx = zmq.asyncio.Context()
        self._pull = socket(self._ctx, zmq.PULL, ipc.http_in, bind=True)
        self._rids = itertools.count()
        self._queues: dict[int, asyncio.Queue] = {}
        self._controls: dict[int, asyncio.Future] = {}
        self.ready_info: WorkerReady | None = None
        self.ready = asyncio.Event()
        self.failed: str | None = None  # set when a child died: everything pending gets this error

    def new_rid(self) -> int:
        return next(self._rids)

    def submit(self, req: GenerateReq) -> asyncio.Queue:
        q: asyncio.Queue = asyncio.Queue()
        self._queues[req.rid] = q
        self._push.send(encode(req))
        return q

    def abort(self, rid: int) -> None:
        if self._queues.pop(rid, None) is not None:
            self._push.send(encode(AbortReq(rid)))

    def done(self, rid: int) -> None:
        self._queues.pop(rid, None)

    async def control(self, op: str, timeout: float = 30.0) -> dict:
        rid = self.new_rid()
        fut = asyncio.get_running_loop().create_future()
        self._controls[rid] = fut
        self._push.send(encode(ControlReq(rid, op)))
        try:
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._controls.pop(rid, None)

    async def document(self, req: DocumentReq, timeout: float = 60.0) -> DocumentResp:
        """A document store operation, answered by the tokenizer process (req.rid is set here)."""
        req.rid = self.new_rid()
        fut = asyncio.get_running_loop().create_future()
        self._controls[req.rid] = fut
        self._push.send(encode(req))
        try:
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._controls.pop(req.rid, None)

    async def run(self) -> None:
        while True:
            self.dispatch(decode(await self._pull.recv()))

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
        self._push.close()
        self._pull.close()
        self._ctx.term()
        self._sync_ctx.term()
