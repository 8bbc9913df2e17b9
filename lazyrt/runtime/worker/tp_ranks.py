"""Tensor-parallel ranks: where they meet (TPRendezvous), which one a worker is (TPMember), and how
rank 0 drives the others (PlanLinks); the other ranks' process is tp_follower.py.

Rank 0 is the ordinary ModelWorker (in the Engine's process, or the server's model worker process):
the scheduler sends it one StepMsg per step, unchanged. Rank 0 forwards each message to every
follower (PlanLinks, one ZMQ PUSH per follower) before running it, and every rank executes the same
step; the model's all-reduces keep them in lockstep and only rank 0's StepResult goes back.
"""

from __future__ import annotations

import os
import tempfile
import weakref
from dataclasses import dataclass

import zmq

from lazyrt.config import EngineConfig
from lazyrt.runtime.ipc.messages import StepMsg
from lazyrt.runtime.ipc.sockets import send, socket


@dataclass(frozen=True)
class TPRendezvous:
    """Where the ranks of one tensor-parallel group meet: a torch.distributed FileStore path and, per
    follower rank (1..size-1), the ZMQ address it receives step messages on."""

    size: int
    store_path: str
    plan_addrs: tuple[str, ...]

    @classmethod
    def create(cls, size: int, directory: str | None = None) -> TPRendezvous:
        """In `directory` (default: a new private temp dir, which the caller removes)."""
        d = directory or tempfile.mkdtemp(prefix="lazyrt-tp-")
        addrs = tuple(f"ipc://{os.path.join(d, f'tp_plan_{r}')}" for r in range(1, size))
        return cls(size, os.path.join(d, "tp_store"), addrs)


@dataclass(frozen=True)
class TPMember:
    """Which rank of which group a ModelWorker is."""

    rendezvous: TPRendezvous
    rank: int


class PlanLinks:
    """Rank 0's PUSH sockets to the followers' plan inboxes."""

    def __init__(self, rendezvous: TPRendezvous):
        ctx = zmq.Context()
        self.socks = [socket(ctx, zmq.PUSH, a, bind=False) for a in rendezvous.plan_addrs]
        # Close the sockets before the context, explicitly: a context left to the garbage collector
        # with its sockets can block in term() (seen when an Engine was dropped without close()).
        self._finalizer = weakref.finalize(self, _close, self.socks, ctx)

    def send(self, msg: StepMsg) -> None:
        for s in self.socks:
            send(s, msg)

    def close(self) -> None:
        self._finalizer()


def _close(socks: list[zmq.Socket], ctx: zmq.Context) -> None:
    for s in socks:
        s.close(0)
    ctx.term()


def check_devices(cfg: EngineConfig) -> None:
    """On CUDA, one GPU per rank: ValueError naming tensor_parallel_size when there are fewer."""
    n = cfg.tensor_parallel_size
    if n == 1 or cfg.device == "cpu":
        return
    import torch  # only here: the server's top process does not load torch otherwise

    on_cuda = cfg.device.startswith("cuda") or (cfg.device == "auto" and torch.cuda.is_available())
    if n > 1 and on_cuda and torch.cuda.device_count() < n:
        raise ValueError(
            f"tensor_parallel_size={n}: needs one GPU per rank; {torch.cuda.device_count()} visible"
        )
