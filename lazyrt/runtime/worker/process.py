"""Model worker process: owns the device, model and KV pages; executes one StepMsg at a time."""

from __future__ import annotations

import logging

import zmq

from lazyrt.config import EngineConfig
from lazyrt.runtime.ipc.sockets import PARENT_CHECK_MS, IpcPaths, child_setup, poll, recv, send, socket

logger = logging.getLogger("lazyrt.worker")


def run_worker_process(cfg: EngineConfig, ipc: IpcPaths, log_level: str) -> None:
    watch = child_setup("worker", log_level)
    from lazyrt.runtime.worker.model_worker import ModelWorker  # heavy import after setup

    ctx = zmq.Context()
    inbox = socket(ctx, zmq.PULL, ipc.worker_in, bind=True)
    outbox = socket(ctx, zmq.PUSH, ipc.worker_out, bind=False)
    worker = ModelWorker(cfg)
    info = worker.ready_info()
    logger.info("model %s loaded on %s; %d KV pages", info.model_id, info.device, info.num_pages)
    send(outbox, info)
    while True:
        if not poll([inbox], PARENT_CHECK_MS):
            watch.check()
            continue
        send(outbox, worker.execute(recv(inbox)))
