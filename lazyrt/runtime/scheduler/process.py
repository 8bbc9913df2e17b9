"""Scheduler process: owns the radix cache and chunk table, admits requests, forms batches.

Why a separate process from the model worker: the worker must be the only owner of the device and
the KV tensors, and the scheduler keeps serving control requests and aborts between steps. The
per-step round trip is one small msgpack message each way (token ids, positions, page ids ->
sampled token ids), far below a forward pass, but each crossing wakes a process that may have idled
(~0.5-1 ms at low load): --worker-in-scheduler runs the worker in this process instead
(server/scheduler_worker_process.py, through `scheduler_loop`). The scheduler's PagePool is
bookkeeping only: its tensors live on the "meta" device (no storage), so the KV memory exists once,
in the worker.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
import zmq

from lazyrt.cache.page_pool import PagePool
from lazyrt.config import EngineConfig
from lazyrt.constraint import ConstraintFailed
from lazyrt.runtime.ipc.messages import (
    AbortReq,
    ControlReq,
    ControlResp,
    ErrorOut,
    PeerEnsure,
    PeerHello,
    PeerPages,
    PeerRelease,
    PeerWelcome,
    StepFailed,
    StepMsg,
    StepResult,
    TokenBatch,
    TokenizedReq,
    WorkerReady,
)
from lazyrt.runtime.ipc.sockets import (
    PARENT_CHECK_MS,
    IpcPaths,
    ParentWatch,
    child_setup,
    poll,
    recv,
    send,
    socket,
)
from lazyrt.runtime.scheduler.engine_core import EngineCore, NoProgress, WorkerLink
from lazyrt.runtime.scheduler.late_planning import LatePlanner, next_step_decode_only
from lazyrt.runtime.scheduler.peer_kv import PeerKV
from lazyrt.runtime.scheduler.peer_link import PeerLink
from lazyrt.runtime.scheduler.request import Request
from lazyrt.runtime.scheduler.scheduler import RequestRejected, Scheduler

logger = logging.getLogger("lazyrt.scheduler")
PEER_MESSAGES = (PeerHello, PeerWelcome, PeerEnsure, PeerPages, PeerRelease)
PEER_WAIT_S = 0.05  # waiting on a peer replica's answer: how long a poll may block (timeouts checked)

# What a client whose request died with a device out-of-memory step can tell the operator.
OOM_HINT = (
    "; the device ran out of memory: a smaller --max-running-requests or --max-step-tokens, or a "
    "lower --kv-cache-memory-fraction, leaves more room for a step"
)


class WorkerStepError(RuntimeError):
    """The model worker could not run a step (it answered StepFailed) and serves on."""

    def __init__(self, error: str, kind: str):
        super().__init__(error)
        self.error, self.kind = error, kind


class ZmqWorkerLink:
    """EngineCore's worker, over ZMQ: send the step, wait for the sampled tokens. `late` (late
    planning) is told when each step went out and when its answer came back."""

    def __init__(
        self,
        to_worker: zmq.Socket,
        from_worker: zmq.Socket,
        watch: ParentWatch,
        late: LatePlanner | None = None,
    ):
        self.to_worker, self.from_worker, self.watch, self.late = to_worker, from_worker, watch, late

    def execute(self, msg: StepMsg) -> StepResult:
        send(self.to_worker, msg)
        if self.late is not None:
            self.late.sent(msg)
        while not poll([self.from_worker], PARENT_CHECK_MS):
            self.watch.check()  # a dead worker is noticed by the parent, which stops us
        return step_result(msg, recv(self.from_worker), self.late)


def step_result(msg: StepMsg, answer: StepResult | StepFailed, late: LatePlanner | None) -> StepResult:
    """The worker's answer to msg, told to the late planner; StepFailed raises WorkerStepError."""
    if isinstance(answer, StepFailed):
        if late is not None:
            late.dropped()  # the worker dropped the steps in flight
        raise WorkerStepError(answer.error, answer.kind)
    if late is not None:
        late.returned(msg, answer)
    return answer


class SocketInbox:
    """The scheduler's inbox: wait up to a timeout for a message, then take it. Several sockets (the
    tokenizer's, and peer replicas' with peer KV) are served in turn."""

    def __init__(self, *socks: zmq.Socket):
        self.socks = list(socks)
        self._ready: list[zmq.Socket] = []

    def poll(self, timeout_s: float) -> bool:
        """Waits up to timeout_s, never longer (late planning's deadline), for a message."""
        if self._ready:
            return True
        ms = int(timeout_s * 1e3)  # zmq polls in whole milliseconds: round down, sleep a last fraction
        if ms == 0 and timeout_s > 0:
            time.sleep(timeout_s)
        self._ready = poll(self.socks, ms)
        return bool(self._ready)

    def recv(self) -> object:
        return recv(self._ready.pop(0) if self._ready else self.socks[0])


def run_scheduler_process(cfg: EngineConfig, ipc: IpcPaths, log_level: str) -> None:
    watch = child_setup("scheduler", log_level)
    ctx = zmq.Context()
    inbox = socket(ctx, zmq.PULL, ipc.scheduler_in, bind=True)
    from_worker = socket(ctx, zmq.PULL, ipc.worker_out, bind=True)
    to_worker = socket(ctx, zmq.PUSH, ipc.worker_in, bind=False)
    while not poll([from_worker], PARENT_CHECK_MS):
        watch.check()
    ready: WorkerReady = recv(from_worker)

    def link(late: LatePlanner | None) -> ZmqWorkerLink:
        return ZmqWorkerLink(to_worker, from_worker, watch, late)

    scheduler_loop(cfg, ctx, ipc, inbox, watch, ready, link).run()


def scheduler_loop(
    cfg: EngineConfig,
    ctx: zmq.Context,
    ipc: IpcPaths,
    inbox: zmq.Socket,
    watch: ParentWatch,
    ready: WorkerReady,
    make_link: Callable[[LatePlanner | None], WorkerLink],
    loop_cls: type[SchedulerLoop] | None = None,
) -> SchedulerLoop:
    """The scheduler's loop once its model worker is ready (`ready`, which goes on to the
    detokenizer): make_link(the late planner or None) gives the link steps run over (ZMQ to the worker
    process, or the worker itself in this process: server/scheduler_worker_process.py)."""
    to_detok = socket(ctx, zmq.PUSH, ipc.detok_in, bind=False)
    pool = PagePool(1, ready.num_pages, ready.page_size, 1, 1, torch.float32, "meta")
    sched = Scheduler.from_config(pool, cfg, ready.model_id, ready.host_pages, ready.page_bytes)
    late = LatePlanner() if cfg.overlap_schedule and cfg.late_planning else None
    core = EngineCore(sched, make_link(late), set(ready.eos_ids), overlap=cfg.overlap_schedule)
    link = None
    if cfg.kv_peers:  # peer KV: the other replicas' schedulers talk to this one
        link = PeerLink(ctx, list(cfg.kv_peers))
        sched.peers = PeerKV(sched, list(cfg.kv_peers), ready.model_id, cfg.cache_mode, ready.page_size,
                             ready.kv_export, timeout_s=cfg.kv_peer_timeout_s)  # fmt: skip
        logger.info("kv_peers: listening on %s for %s", cfg.kv_peers[0], ", ".join(cfg.kv_peers[1:]))
    send(to_detok, ready)
    box = SocketInbox(inbox, link.inbox) if link is not None else SocketInbox(inbox)
    return (loop_cls or SchedulerLoop)(core, cfg.cache_mode, box, to_detok, watch, late, link)


class SchedulerLoop:
    """inbox: SocketInbox (or any object with its poll/recv); to_detok: a socket; late: the late
    planner its worker link reports to (None: each step is planned as soon as the last returns)."""

    def __init__(
        self,
        core: EngineCore,
        cache_mode: str,
        inbox: SocketInbox,
        to_detok: zmq.Socket,
        watch: ParentWatch,
        late: LatePlanner | None = None,
        peer_link: PeerLink | None = None,
    ):
        self.core, self.cache_mode, self.inbox, self.to_detok = core, cache_mode, inbox, to_detok
        self.watch, self.late, self.peer_link = watch, late, peer_link

    def run(self) -> None:
        while True:
            self.run_once()

    def run_once(self) -> None:
        """Serves the inbox, then runs one step if there is work."""
        # Block for input only when idle (or waiting on a peer replica's answer); between steps just
        # drain what has arrived.
        busy = self.core.has_work and not self.core.waiting_on_peers
        timeout = 0 if busy else (PEER_WAIT_S if self.core.waiting_on_peers else PARENT_CHECK_MS / 1e3)
        while self.inbox.poll(timeout):
            self.handle(self.inbox.recv())
            timeout = 0
        self.watch.check()
        peers = self.core.scheduler.peers
        if peers is not None:
            peers.tick()
            self._send_peers()
        if not self.core.has_work:
            return
        if self.late is not None:
            # a decode-only step in flight and only decodes to plan: plan shortly before it ends, so
            # that a request arriving meanwhile joins the next step, not the one after
            self.late.wait(lambda: next_step_decode_only(self.core.scheduler), self._serve_one)
            self.late.step_began()
        try:
            outs = self.core.step()
        except NoProgress as e:
            self.fail_stuck(e)  # the requests behind them are served by the next steps
            return
        except WorkerStepError as e:
            self.fail_step(e)  # EngineCore has aborted the requests; new ones are served
            return
        finally:
            self._send_peers()
        if outs:
            send(self.to_detok, TokenBatch(outs))
        self.fail_requests()

    def fail_requests(self) -> None:
        """Answers the requests the worker could not go on with (EngineCore.request_errors)."""
        errors, self.core.request_errors = self.core.request_errors, []
        for rid, why in errors:
            send(self.to_detok, ErrorOut(rid, str(ConstraintFailed(why)), None, 500, "server_error"))

    def _send_peers(self) -> None:
        if self.peer_link is not None:
            self.peer_link.send_all(self.core.scheduler.peers.take_outbox())

    def _serve_one(self, timeout_s: float) -> bool:
        """Handles one inbox message if one comes within timeout_s (late planning's wait)."""
        if not self.inbox.poll(timeout_s):
            return False
        self.handle(self.inbox.recv())
        return True

    def handle(self, msg: object) -> None:
        if isinstance(msg, TokenizedReq):
            req = Request(msg.rid, msg.sampling, prefix=msg.prefix, docs=msg.docs, suffix=msg.suffix)
            req.received_at, req.tokenizing_at = msg.received_at, msg.tokenizing_at
            req.tokenized_at, req.queued_at = msg.tokenized_at, time.time()
            req.score_len = msg.score_len
            req.max_new_tokens = msg.max_new_tokens
            req.doc_keys, req.doc_owners = list(msg.doc_keys), list(msg.doc_owners)
            try:
                self.core.add(req)
            except RequestRejected as e:
                send(self.to_detok, ErrorOut(msg.rid, str(e), e.param))
        elif isinstance(msg, PEER_MESSAGES) and self.core.scheduler.peers is not None:
            self.core.scheduler.peers.handle(msg)
            self._send_peers()
        elif isinstance(msg, AbortReq):
            self.core.abort(msg.rid, msg.reason)
        elif isinstance(msg, ControlReq):
            if msg.op == "flush":
                data = {"freed_pages": self.core.scheduler.flush()}
            else:
                data = self.core.cache_stats(self.cache_mode)
                data.update(self.late.stats if self.late is not None else {})
            send(self.to_detok, ControlResp(msg.rid, data))
        else:
            logger.error("unexpected message %s", type(msg).__name__)

    def fail_step(self, e: WorkerStepError) -> None:
        """Answers every request the failed step aborted (core.failed_rids) with a 5xx error."""
        rids = self.core.failed_rids
        logger.error("model step failed (%s): failing %d running request(s)", e.error, len(rids))
        oom = e.kind == "oom"
        why = f"the model step failed: {e.error}" + (OOM_HINT if oom else "")
        for rid in rids:
            send(self.to_detok, ErrorOut(rid, why, None, 503 if oom else 500, "server_error"))

    def fail_stuck(self, e: NoProgress) -> None:
        """A step had nothing to run: answers the requests that cannot go on (e.stuck) with a 503,
        each with its reason; the other waiting ones stay queued. With none told apart, every waiting
        one fails (fail_waiting), so none waits for ever."""
        if not e.stuck:
            self.fail_waiting(f"the scheduler could not make progress on this request: {e}")
            return
        logger.error("%s: failing %d request(s) that cannot go on", e, len(e.stuck))
        for rid, why in e.stuck:
            if self.core.abort(rid):
                msg = f"the scheduler could not make progress on this request: {why}"
                send(self.to_detok, ErrorOut(rid, msg, None, 503, "server_error"))

    def fail_waiting(self, why: str) -> None:
        for req in list(self.core.scheduler.waiting):
            self.core.abort(req.rid)
            send(self.to_detok, ErrorOut(req.rid, why, None, 503, "server_error"))
