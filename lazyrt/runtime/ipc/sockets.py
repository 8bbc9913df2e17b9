"""ZMQ plumbing shared by the processes: socket addresses in a private temp dir, typed send/recv,
and the child-process setup (logging, signals, noticing that the parent is gone)."""

from __future__ import annotations

import logging
import os
import signal
import tempfile
from dataclasses import dataclass
from typing import Any

import zmq

from lazyrt.process_name import set_process_name
from lazyrt.runtime.ipc.messages import decode, encode

# Poll timeout for children: how quickly a child notices its parent died.
PARENT_CHECK_MS = 1000


@dataclass(frozen=True)
class IpcPaths:
    """ipc:// addresses; data flows HTTP -> tokenizer -> scheduler <-> worker, scheduler -> detok -> HTTP."""

    dir: str
    tokenizer_in: str  # HTTP -> tokenizer (requests, aborts, control)
    scheduler_in: str  # tokenizer -> scheduler
    worker_in: str  # scheduler -> worker (StepMsg)
    worker_out: str  # worker -> scheduler (StepResult, WorkerReady)
    detok_in: str  # scheduler -> detokenizer (TokenBatch, errors, control answers)
    http_in: str  # detokenizer -> HTTP

    @classmethod
    def create(cls) -> IpcPaths:
        d = tempfile.mkdtemp(prefix="lazyrt-ipc-")  # private (mode 0700); removed on shutdown
        names = ("tokenizer_in", "scheduler_in", "worker_in", "worker_out", "detok_in", "http_in")
        return cls(d, **{n: f"ipc://{os.path.join(d, n)}" for n in names})


def socket(ctx: zmq.Context, kind: int, addr: str, bind: bool) -> zmq.Socket:
    s = ctx.socket(kind)
    s.setsockopt(zmq.LINGER, 0)
    if kind == zmq.PUSH:
        s.setsockopt(zmq.SNDHWM, 0)  # never block a sender: queues are bounded by request admission
    if kind == zmq.PULL:
        s.setsockopt(zmq.RCVHWM, 0)
    (s.bind if bind else s.connect)(addr)
    return s


def send(sock: zmq.Socket, msg: Any) -> None:
    sock.send(encode(msg))


def recv(sock: zmq.Socket) -> Any:
    return decode(sock.recv())


class ParentWatch:
    """A child exits when its parent is gone (killed with SIGKILL, so it could not stop us)."""

    def __init__(self) -> None:
        self.parent = os.getppid()

    def check(self) -> None:
        if os.getppid() != self.parent:
            logging.getLogger("lazyrt").error("parent process exited; stopping")
            os._exit(1)


def child_setup(name: str, log_level: str) -> ParentWatch:
    set_process_name("lazyrt-" + name.replace(" ", ""))  # lazyrt-schedule, lazyrt-tprank1 (15 bytes kept)
    # The parent handles Ctrl-C and stops us with SIGTERM; ignoring SIGINT avoids a traceback per child.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    logging.basicConfig(
        level=log_level.upper(), format=f"%(asctime)s {name} %(levelname)s %(message)s", force=True
    )
    return ParentWatch()


def poll(sockets: list[zmq.Socket], timeout_ms: int) -> list[zmq.Socket]:
    poller = zmq.Poller()
    for s in sockets:
        poller.register(s, zmq.POLLIN)
    return [s for s, _ in poller.poll(timeout_ms)]
