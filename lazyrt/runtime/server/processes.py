"""ProcessGroup: starts the server's processes besides the HTTP one and stops them all: by default the
scheduler's, with the model worker inside it (--worker-in-scheduler) and the tokenizer inside the
HTTP process (--tokenizer-in-http); with --no-worker-in-scheduler a model worker process, with
--no-tokenizer-in-http a tokenizer process."""

from __future__ import annotations

import logging
import multiprocessing as mp
import shutil

from lazyrt.config import EngineConfig
from lazyrt.runtime.ipc.sockets import IpcPaths
from lazyrt.runtime.scheduler.process import run_scheduler_process
from lazyrt.runtime.server.scheduler_worker_process import run_scheduler_worker_process
from lazyrt.runtime.tokenizer.process import run_tokenizer_process
from lazyrt.runtime.worker.process import run_follower, run_worker_process
from lazyrt.runtime.worker.tp_ranks import TPMember, TPRendezvous, check_devices

logger = logging.getLogger("lazyrt")


class ProcessGroup:
    def __init__(self, cfg: EngineConfig, log_level: str = "info"):
        check_devices(cfg)  # before anything starts: a clear error, not a rank that cannot start
        self.ipc = IpcPaths.create()
        # Tensor parallelism: the model worker is rank 0; ranks 1..N-1 are processes of their own.
        n = cfg.tensor_parallel_size
        tp = TPRendezvous.create(n, self.ipc.dir) if n > 1 else None
        # spawn, not fork: children must not inherit the parent's threads, event loop or sockets.
        ctx = mp.get_context("spawn")
        member0 = TPMember(tp, 0) if tp else None
        self.procs: dict[str, mp.process.BaseProcess] = {}
        if not cfg.tokenizer_in_http:  # else the HTTP process tokenizes (server/pipeline_client.py)
            self.procs["tokenizer"] = ctx.Process(
                target=run_tokenizer_process, args=(self.ipc, log_level, cfg.document_store), name="tokenizer"
            )
        if cfg.worker_in_scheduler:
            self.procs["scheduler"] = ctx.Process(
                target=run_scheduler_worker_process,
                args=(cfg, self.ipc, log_level, member0),
                name="scheduler",
            )
        else:
            self.procs["scheduler"] = ctx.Process(
                target=run_scheduler_process, args=(cfg, self.ipc, log_level), name="scheduler"
            )
            self.procs["model worker"] = ctx.Process(
                target=run_worker_process, args=(cfg, self.ipc, log_level, member0), name="model worker"
            )
        for r in range(1, n):  # (tp_follower.follower_processes, their start-up errors one line each)
            name = f"model worker rank {r}"
            self.procs[name] = ctx.Process(
                target=run_follower, args=(cfg, TPMember(tp, r), log_level), name=name
            )

    def start(self) -> None:
        logger.info("ipc sockets in %s", self.ipc.dir)
        for p in self.procs.values():
            p.daemon = True  # also stopped if the parent exits through an unexpected path
            p.start()
            logger.info("started the %s process (pid %d)", p.name, p.pid)

    def dead(self) -> list[tuple[str, int | None]]:
        return [
            (name, p.exitcode) for name, p in self.procs.items() if p.pid is not None and not p.is_alive()
        ]

    def stop(self, timeout: float = 5.0) -> None:
        for p in self.procs.values():
            if p.is_alive():
                p.terminate()
        for p in self.procs.values():
            if p.pid is not None:
                p.join(timeout)
                if p.is_alive():
                    logger.warning("%s did not stop in %.0fs; killing it", p.name, timeout)
                    p.kill()
                    p.join(timeout)
        shutil.rmtree(self.ipc.dir, ignore_errors=True)
