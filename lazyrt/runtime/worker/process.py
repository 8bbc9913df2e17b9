"""Model worker process: owns the device, model and KV pages; executes one StepMsg at a time."""

from __future__ import annotations

import logging
import os

import zmq

from lazyrt.config import EngineConfig
from lazyrt.runtime.ipc.messages import StepFailed
from lazyrt.runtime.ipc.sockets import PARENT_CHECK_MS, IpcPaths, child_setup, poll, recv, send, socket
from lazyrt.runtime.worker.cpu_threads import set_worker_cpu_threads
from lazyrt.runtime.worker.tp_ranks import TPMember

logger = logging.getLogger("lazyrt.worker")


def run_worker_process(cfg: EngineConfig, ipc: IpcPaths, log_level: str, tp: TPMember | None = None) -> None:
    """tp: rank 0 of a tensor-parallel group (ranks 1.. are tp_follower processes)."""
    watch = child_setup("worker", log_level)
    import torch  # heavy imports after setup

    from lazyrt.runtime.worker.model_worker import ModelWorker
    from lazyrt.runtime.worker.tp_group import TPGroupBroken

    ctx = zmq.Context()
    inbox = socket(ctx, zmq.PULL, ipc.worker_in, bind=True)
    outbox = socket(ctx, zmq.PUSH, ipc.worker_out, bind=False)
    threads = set_worker_cpu_threads(cfg)
    worker = ModelWorker(cfg, tp)
    info = worker.ready_info()
    logger.info("model %s loaded on %s; %d KV pages; %d CPU threads", info.model_id, info.device,
                info.num_pages, threads)  # fmt: skip
    send(outbox, info)
    while True:
        if not poll([inbox], PARENT_CHECK_MS):
            watch.check()
            continue
        msg = recv(inbox)
        try:
            answer = worker.execute(msg)
        except TPGroupBroken as e:
            # under tensor parallelism a failed step ends the group: fail the step's requests, then
            # exit; the server sees the exit, answers every request left and stops
            logger.exception("model step failed; the tensor-parallel group cannot go on: exiting")
            send(outbox, StepFailed(describe_error(e)))
            outbox.close(linger=2000)
            logging.shutdown()
            os._exit(1)  # not through the NCCL process group's destructor: it can wait for the others
        except Exception as e:
            # A step that raises (e.g. CUDA out of memory on a large batch) fails its requests, not
            # the server: ModelWorker has dropped the step; the scheduler aborts what was in it.
            logger.exception("model step failed; answering StepFailed and serving on")
            oom = isinstance(e, torch.cuda.OutOfMemoryError)
            answer = StepFailed(describe_error(e), "oom" if oom else "error")
        send(outbox, answer)


def describe_error(e: BaseException, limit: int = 300) -> str:
    """`Type: first line of the message`, short enough for a client's error message."""
    lines = str(e).strip().splitlines()
    text = f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."
