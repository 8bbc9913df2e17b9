"""The process of a tensor-parallel rank >= 1: loads its shard, then runs every step rank 0 forwards."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import shutil
import tempfile
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

import zmq

from lazyrt.config import EngineConfig
from lazyrt.runtime.ipc.sockets import PARENT_CHECK_MS, child_setup, poll, recv, socket
from lazyrt.runtime.worker.cpu_threads import set_worker_cpu_threads
from lazyrt.runtime.worker.tp_ranks import TPMember, TPRendezvous, check_devices

if TYPE_CHECKING:
    from lazyrt.runtime.worker.model_worker import ModelWorker

logger = logging.getLogger("lazyrt.worker")


def run_follower_process(cfg: EngineConfig, member: TPMember, log_level: str) -> None:
    """Process target of rank >= 1: load this rank's shard, then run every StepMsg rank 0 forwards."""
    watch = child_setup(f"tp rank {member.rank}", log_level)
    from lazyrt.runtime.worker.compile_watch import watch_late_compiles
    from lazyrt.runtime.worker.model_worker import ModelWorker  # heavy imports after setup

    set_worker_cpu_threads(cfg)

    ctx = zmq.Context()
    inbox = socket(ctx, zmq.PULL, member.rendezvous.plan_addrs[member.rank - 1], bind=True)
    worker = ModelWorker(cfg, member)
    watch_late_compiles(worker.model.device)  # start-up launched the kernels: a compile now stalls serving
    logger.info("tensor-parallel rank %d of %d ready", member.rank, member.rendezvous.size)
    code = follow_steps(worker, inbox, watch.check, member.rank)
    logging.shutdown()
    os._exit(code)  # not through the process group's destructor: it can wait for the other ranks


def follow_steps(worker: ModelWorker, inbox: zmq.Socket, check_parent: Callable[[], None], rank: int) -> int:
    """Runs every StepMsg from rank 0 until one fails; returns the exit code (1). A failed step ends
    the rank: the others may be waiting in a collective it left, or have left one it waits in, so no
    later step would pair up; its exit tells rank 0 (which names it and fails every later step) and
    the server (which stops)."""
    while True:
        if not poll([inbox], PARENT_CHECK_MS):
            check_parent()
            continue
        try:
            worker.execute(recv(inbox))
        except Exception:
            logger.exception("model step failed on tensor-parallel rank %d; this rank stops", rank)
            return 1


def follower_processes(
    cfg: EngineConfig, rendezvous: TPRendezvous, log_level: str = "info"
) -> list[mp.process.BaseProcess]:
    """Unstarted (spawn) processes for ranks 1..size-1."""
    ctx = mp.get_context("spawn")
    return [
        ctx.Process(
            target=run_follower_process,
            args=(cfg, TPMember(rendezvous, r), log_level),
            name=f"model worker rank {r}",
            daemon=True,
        )
        for r in range(1, rendezvous.size)
    ]


class FollowerRanks:
    """Ranks 1..size-1 started by the process that runs rank 0 itself (the offline Engine); stopped
    by stop() or when this object is collected."""

    def __init__(self, cfg: EngineConfig, log_level: str = "warning"):
        check_devices(cfg)
        self.dir = tempfile.mkdtemp(prefix="lazyrt-tp-")  # private: the store and plan sockets
        self.rendezvous = TPRendezvous.create(cfg.tensor_parallel_size, self.dir)
        self.procs = follower_processes(cfg, self.rendezvous, log_level)
        for p in self.procs:
            p.start()
        self._finalizer = weakref.finalize(self, stop_processes, self.procs, self.dir)

    @property
    def member0(self) -> TPMember:
        return TPMember(self.rendezvous, 0)

    def check_alive(self) -> None:
        """RuntimeError naming the ranks whose process has exited."""
        dead = [f"{p.name} (exit code {p.exitcode})" for p in self.procs if not p.is_alive()]
        if dead:
            raise RuntimeError(
                f"tensor_parallel_size={self.rendezvous.size}: {', '.join(dead)} exited; its error is in "
                "its log (stderr)"
            )

    def stop(self) -> None:
        self._finalizer()


def stop_processes(procs: list[mp.process.BaseProcess], directory: str, timeout: float = 5.0) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout)
        if p.is_alive():
            p.kill()
            p.join(timeout)
    shutil.rmtree(directory, ignore_errors=True)
