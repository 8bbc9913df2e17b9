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
import os

import zmq

from lazyrt.config import EngineConfig
from lazyrt.runtime.ipc.messages import StepMsg, StepResult
from lazyrt.runtime.ipc.sockets import IpcPaths, child_setup, socket
from lazyrt.runtime.scheduler.late_planning import LatePlanner
from lazyrt.runtime.scheduler.process import SchedulerLoop, WorkerStepError, scheduler_loop
from lazyrt.runtime.worker.cpu_threads import set_worker_cpu_threads
from lazyrt.runtime.worker.process import describe_error
from lazyrt.runtime.worker.tp_ranks import TPMember

logger = logging.getLogger("lazyrt.scheduler")

TP_BROKEN = "tp_broken"  # WorkerStepError.kind of a step that broke the tensor-parallel group


class InProcessWorkerLink:
    """EngineCore's worker link to a ModelWorker in this process, with the ZMQ link's behaviour: the
    late planner told when a step went out and came back, a failed step raised as WorkerStepError."""

    def __init__(self, worker, late: LatePlanner | None = None):
        self.worker, self.late = worker, late

    def execute(self, msg: StepMsg) -> StepResult:
        import torch

        from lazyrt.runtime.worker.tp_group import TPGroupBroken

        if self.late is not None:
            self.late.sent(msg)
        try:
            result = self.worker.execute(msg)
        except Exception as e:
            # ModelWorker has dropped the steps in flight, as the worker process's loop relies on
            if self.late is not None:
                self.late.dropped()
            if isinstance(e, TPGroupBroken):
                logger.exception("model step failed; the tensor-parallel group cannot go on")
                raise WorkerStepError(describe_error(e), TP_BROKEN) from e
            logger.exception("model step failed; failing its requests and serving on")
            oom = isinstance(e, torch.cuda.OutOfMemoryError)
            raise WorkerStepError(describe_error(e), "oom" if oom else "error") from e
        if self.late is not None:
            self.late.returned(msg, result)
        return result


class _Loop(SchedulerLoop):
    def fail_step(self, e: WorkerStepError) -> None:
        super().fail_step(e)
        if e.kind == TP_BROKEN:  # the ranks' collectives no longer pair up: stop (see worker/process.py)
            self.to_detok.close(linger=2000)
            logging.shutdown()
            os._exit(1)  # not through the NCCL process group's destructor: it can wait for the others


def run_scheduler_worker_process(
    cfg: EngineConfig, ipc: IpcPaths, log_level: str, tp: TPMember | None = None
) -> None:
    """tp: rank 0 of a tensor-parallel group (ranks 1.. are tp_follower processes, as with a worker
    process)."""
    watch = child_setup("scheduler", log_level)
    from lazyrt.runtime.worker.model_worker import ModelWorker  # heavy imports after setup

    ctx = zmq.Context()
    inbox = socket(ctx, zmq.PULL, ipc.scheduler_in, bind=True)
    threads = set_worker_cpu_threads(cfg)
    worker = ModelWorker(cfg, tp)
    ready = worker.ready_info()
    logger.info("model %s loaded on %s in the scheduler process; %d KV pages; %d CPU threads",
                ready.model_id, ready.device, ready.num_pages, threads)  # fmt: skip
    def link(late: LatePlanner | None) -> InProcessWorkerLink:
        return InProcessWorkerLink(worker, late)

    scheduler_loop(cfg, ctx, ipc, inbox, watch, ready, link, _Loop).run()
