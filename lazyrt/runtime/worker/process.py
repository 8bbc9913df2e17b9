"""Model worker process: owns the device, model and KV pages; executes one StepMsg at a time."""

from __future__ import annotations

import logging
import os
import traceback
from collections.abc import Iterator
from contextlib import contextmanager

import zmq

from lazyrt.config import EngineConfig, option_flags
from lazyrt.runtime.ipc.messages import StepFailed, StepMsg, StepResult
from lazyrt.runtime.ipc.sockets import PARENT_CHECK_MS, IpcPaths, child_setup, poll, recv, send, socket
from lazyrt.runtime.worker.cpu_threads import set_worker_cpu_threads
from lazyrt.runtime.worker.tp_ranks import TPMember

logger = logging.getLogger("lazyrt.worker")

TP_BROKEN = "tp_broken"  # StepFailed.kind of a step that broke the tensor-parallel group
# The exit code of a child whose model worker could not start on bad input (the model, a flag only the
# loaded model rules out, a KV pool the memory cannot hold): it logged one error line saying why.
STARTUP_FAILED = 3


def run_worker_process(cfg: EngineConfig, ipc: IpcPaths, log_level: str, tp: TPMember | None = None) -> None:
    """tp: rank 0 of a tensor-parallel group (ranks 1.. are tp_follower processes)."""
    watch = child_setup("worker", log_level)
    from lazyrt.runtime.worker.compile_watch import watch_late_compiles
    from lazyrt.runtime.worker.model_worker import ModelWorker  # heavy imports after setup

    ctx = zmq.Context()
    inbox = socket(ctx, zmq.PULL, ipc.worker_in, bind=True)
    outbox = socket(ctx, zmq.PUSH, ipc.worker_out, bind=False)
    threads = set_worker_cpu_threads(cfg)
    with startup_errors():
        worker = ModelWorker(cfg, tp)
    watch_late_compiles(worker.model.device)  # start-up launched the kernels: a compile now stalls serving
    info = worker.ready_info()
    logger.info("model %s loaded on %s; %d KV pages; %d CPU threads", info.model_id, info.device,
                info.num_pages, threads)  # fmt: skip
    send(outbox, info)
    while True:
        if not poll([inbox], PARENT_CHECK_MS):
            watch.check()
            continue
        answer = run_step(worker, recv(inbox))
        send(outbox, answer)
        if isinstance(answer, StepFailed) and answer.kind == TP_BROKEN:
            # the server sees the exit, answers every request left and stops
            outbox.close(linger=2000)
            exit_process()


def run_step(worker, msg: StepMsg) -> StepResult | StepFailed:
    """worker.execute(msg), or the StepFailed a raising step answers: a step that raises (e.g. CUDA
    out of memory on a large batch) fails its requests, not the server (ModelWorker has dropped the
    steps in flight; the scheduler aborts what was in them); under tensor parallelism it breaks the
    group (kind TP_BROKEN: the caller fails the step's requests, then exits with exit_process)."""
    try:
        return worker.execute(msg)
    except Exception as e:
        import torch

        from lazyrt.runtime.worker.tp_group import TPGroupBroken

        if isinstance(e, TPGroupBroken):
            logger.exception("model step failed; the tensor-parallel group cannot go on: exiting")
            return StepFailed(describe_error(e), TP_BROKEN)
        logger.exception("model step failed; answering StepFailed and serving on")
        oom = isinstance(e, torch.cuda.OutOfMemoryError)
        return StepFailed(describe_error(e), "oom" if oom else "error")


def exit_process() -> None:
    """Ends a process whose tensor-parallel group broke: not through the NCCL process group's
    destructor, which can wait for the other ranks."""
    logging.shutdown()
    os._exit(1)


def describe_error(e: BaseException, limit: int = 300) -> str:
    """`Type: first line of the message`, short enough for a client's error message."""
    lines = str(e).strip().splitlines()
    text = f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


@contextmanager
def startup_errors() -> Iterator[None]:
    """Around a child's ModelWorker start-up: an error the input caused (a ValueError, such as
    UnsupportedModelError or a model the tensor-parallel size cannot split; a FileNotFoundError, such as
    missing tokenizer files; StartupOutOfMemory) raised while the ModelWorker is set up is logged as one
    line naming the flag, and the process exits STARTUP_FAILED (the server names it and stops). Other
    exceptions, and any raised once start-up is done, propagate with their traceback: bugs."""
    try:
        yield
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        from lazyrt.runtime.worker.model_worker import StartupOutOfMemory

        if isinstance(e, RuntimeError) and not isinstance(e, StartupOutOfMemory):
            raise
        if not _raised_in(e, "lazyrt.runtime.worker.model_worker", "__init__"):
            raise
        logger.error("cannot start: %s", startup_error_line(e))
        logging.shutdown()
        os._exit(STARTUP_FAILED)  # not through a half-formed tensor-parallel group's destructor


def run_follower(cfg: EngineConfig, member: TPMember, log_level: str) -> None:
    """Process target of tensor-parallel rank >= 1 in the server: tp_follower.run_follower_process, its
    start-up errors reported as by rank 0 (startup_errors)."""
    from lazyrt.runtime.worker.tp_follower import run_follower_process

    with startup_errors():
        run_follower_process(cfg, member, log_level)


def startup_error_line(e: BaseException) -> str:
    """A start-up error as one line, prefixed with the flags of the EngineConfig options it names
    (config.option_flags), or with --model when the model's loading raised it."""
    from lazyrt.runtime.worker.model_worker import StartupOutOfMemory

    text = " ".join(str(e).split()) or type(e).__name__
    if isinstance(e, StartupOutOfMemory):  # names its flags itself
        return text
    flags = option_flags(text)
    if not flags and _raised_in(e, "lazyrt.models.loader"):
        flags = ["--model"]
    return f"{', '.join(flags)}: {text}" if flags else text


def _raised_in(e: BaseException, module: str, function: str | None = None) -> bool:
    """Whether e's traceback passes through `module` (its `function`)."""
    return any(
        frame.f_globals.get("__name__") == module and function in (None, frame.f_code.co_name)
        for frame, _ in traceback.walk_tb(e.__traceback__)
    )
