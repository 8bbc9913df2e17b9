"""The scheduler and the model worker in one process (`--worker-in-scheduler`).

By default they are two processes and every step crosses ZMQ twice (the plan out, the sampled tokens
back), each crossing waking a process that may have idled: ~0.5-1 ms each at low load (docs/
benchmarks.md, the TTFT split). Here the scheduler calls the worker as the offline Engine does; the
step order, the outputs and the scheduler's loop are the same (nothing ran in parallel across the
two processes: the scheduler waited for each answer). What the worker process did around a step is
kept: a step that raises fails its requests and the process serves on; under tensor parallelism a
broken group fails them and ends the process (the server then stops, as when the worker died).
"""

from __future__ import annotations

import logging

import zmq

from lazyrt.config import EngineConfig
from lazyrt.runtime.ipc.messages import StepMsg, StepResult
from lazyrt.runtime.ipc.sockets import IpcPaths, child_setup, socket
from lazyrt.runtime.scheduler.late_planning import LatePlanner
from lazyrt.runtime.scheduler.process import SchedulerLoop, WorkerStepError, scheduler_loop, step_result
from lazyrt.runtime.worker.cpu_threads import set_worker_cpu_threads
from lazyrt.runtime.worker.process import TP_BROKEN, exit_process, run_step, startup_errors
from lazyrt.runtime.worker.tp_ranks import TPMember

logger = logging.getLogger("lazyrt.scheduler")


class InProcessWorkerLink:
    """EngineCore's worker link to a ModelWorker in this process, answering as the worker process
    does (worker.process.run_step) and telling the late planner as the ZMQ link does."""

    def __init__(self, worker, late: LatePlanner | None = None):
        self.worker, self.late = worker, late

    def execute(self, msg: StepMsg) -> StepResult:
        if self.late is not None:
            self.late.sent(msg)
        return step_result(msg, run_step(self.worker, msg), self.late)


class _Loop(SchedulerLoop):
    def fail_step(self, e: WorkerStepError) -> None:
        super().fail_step(e)
        if e.kind == TP_BROKEN:  # the ranks' collectives no longer pair up: stop, as the worker would
            self.to_detok.close(linger=2000)
            exit_process()


def run_scheduler_worker_process(
    cfg: EngineConfig, ipc: IpcPaths, log_level: str, tp: TPMember | None = None
) -> None:
    """tp: rank 0 of a tensor-parallel group (ranks 1.. are tp_follower processes, as with a worker
    process)."""
    watch = child_setup("scheduler", log_level)
    from lazyrt.runtime.worker.compile_watch import watch_late_compiles
    from lazyrt.runtime.worker.model_worker import ModelWorker  # heavy imports after setup

    ctx = zmq.Context()
    inbox = socket(ctx, zmq.PULL, ipc.scheduler_in, bind=True)
    threads = set_worker_cpu_threads(cfg)
    with startup_errors():  # bad input only the model shows: one error line and exit STARTUP_FAILED
        worker = ModelWorker(cfg, tp)
    watch_late_compiles(worker.model.device)  # start-up launched the kernels: a compile now stalls serving
    ready = worker.ready_info()
    logger.info("model %s loaded on %s in the scheduler process; %d KV pages; %d CPU threads",
                ready.model_id, ready.device, ready.num_pages, threads)  # fmt: skip

    def link(late: LatePlanner | None) -> InProcessWorkerLink:
        return InProcessWorkerLink(worker, late)

    scheduler_loop(cfg, ctx, ipc, inbox, watch, ready, link, _Loop).run()
