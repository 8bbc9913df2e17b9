"""EngineCore: the scheduler side of the step loop, shared by the offline Engine and the scheduler
process. It plans a step, ships it to a worker through one narrow call (`execute(StepMsg) ->
StepResult`), applies the sampled tokens and reports TokenOuts. The worker is a ModelWorker object
in-process, or a ZMQ link to the model worker process; the logic here is the same either way.

Overlapped scheduling (`overlap=True`): a step is sent deferred, so the worker launches it and
answers with the previous step's tokens; the host work of planning, encoding and building step N+1
then runs while the device computes step N. Decode items of step N+1 take their input token from
step N on the device (plan.PENDING_TOKEN); a request that step N ends (EOS, stop) has its step N+1
token dropped. Steps that need their results at once (deviation probes, scoring) run synchronously,
after the step in flight is collected.
"""

from __future__ import annotations

import time
from typing import Protocol

from lazyrt.runtime.ipc.messages import StepMsg, StepResult, TokenOut
from lazyrt.runtime.scheduler.plan import StepPlan
from lazyrt.runtime.scheduler.request import Request, RequestState
from lazyrt.runtime.scheduler.scheduler import Scheduler
from lazyrt.runtime.scheduler.step_wire import StepEncoder


class WorkerLink(Protocol):
    def execute(self, msg: StepMsg) -> StepResult: ...


class NoProgress(RuntimeError):
    """A step had nothing to run. `stuck`: (rid, why) of the waiting requests that cannot go on
    (Scheduler.stuck); the callers fail those alone, the others keep waiting. Empty: none could be
    told apart (the callers fail every waiting request, so an error that would repeat leaves none
    waiting for ever)."""

    def __init__(self, message: str, stuck: list[tuple[int, str]] | None = None):
        super().__init__(message)
        self.stuck = list(stuck or [])


class EngineCore:
    def __init__(self, scheduler: Scheduler, worker: WorkerLink, eos_ids: set[int], overlap: bool = False):
        self.scheduler = scheduler
        self.worker = worker
        self.eos_ids = set(eos_ids)
        self.overlap = overlap
        self.requests: dict[int, Request] = {}
        self._release: list[int] = []  # finished rids the worker may still hold state for
        self._encoder = StepEncoder()
        self._in_flight: StepPlan | None = None  # the deferred step whose tokens have not come back
        self._planned: StepPlan | None = None  # the step being planned, sent and applied now
        self.failed_rids: list[int] = []  # the requests the last failed step aborted: tell their clients
        # requests the worker could not go on with (StepResult.failed), aborted: (rid, why); the caller
        # takes them after each step and fails them with an error
        self.request_errors: list[tuple[int, str]] = []
        # steps sent (overlapped: of them, deferred), and the worker's shared-chunk step count
        self.step_counts = {"steps": 0, "overlapped_steps": 0, "shared_chunk_steps": 0, "graph_steps": 0,
                            "ragged_prefill_steps": 0, "decode_split_steps": 0}
        # the last step() had nothing to run until a peer replica answers (peer KV): the loop waits
        # for messages instead of stepping again at once
        self.waiting_on_peers = False

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or self._in_flight is not None

    def add(self, req: Request) -> None:
        """Queue a request; raises RequestTooLarge if it could never fit the KV pool."""
        self.scheduler.add(req)
        self.requests[req.rid] = req

    def abort(self, rid: int, reason: str = "abort") -> bool:
        """Finish a request now (client gone, stop string seen): frees every page it holds."""
        req = self.requests.pop(rid, None)
        if req is None:
            return False
        self.scheduler.finish(req, reason)
        self._release.append(rid)
        return True

    def step(self) -> list[TokenOut]:
        """Runs one step; returns the tokens that came back (with overlap: the previous step's).
        If the step fails (the worker raised), every running request is aborted (their rids in
        `failed_rids`, their KV not cached) before the exception propagates; waiting ones stay."""
        try:
            return self._step()
        except NoProgress:
            raise  # nothing was sent: the running requests are intact
        except BaseException:
            self._fail_running()
            raise
        finally:
            self._planned = None

    def _fail_running(self) -> None:
        # The step in flight's tokens are lost with the failed one: neither step's KV is trusted.
        plans = [p for p in (self._planned, self._in_flight) if p is not None]
        self._planned = self._in_flight = None
        self.failed_rids = []
        for req in self.scheduler.fail_running(plans):
            self.requests.pop(req.rid, None)
            self._release.append(req.rid)
            self.failed_rids.append(req.rid)

    def _step(self) -> list[TokenOut]:
        self.waiting_on_peers = False
        plan = self._planned = self.scheduler.schedule()
        if not plan.items and not plan.probes and not plan.has_copies:
            if self._in_flight is not None:  # e.g. every running request waits on its last token
                return self._collect()
            if self.scheduler.peers is not None and self.scheduler.peers.busy:
                self.waiting_on_peers = True  # their answers come to the scheduler loop
                return []
            # only the requests that cannot go on fail; a request that gave up on its documents'
            # rounds says why (Scheduler._chunk_round)
            stuck = self.scheduler.stuck()
            first = next((r for r in stuck if r.error), stuck[0] if stuck else None)
            raise NoProgress(_no_progress(first), [(r.rid, _no_progress(r)) for r in stuck])
        defer = self.overlap and not plan.probes and not any(
            it.request is not None and (it.request.score_len > 0 or it.request.params.citations)
            for it in plan.items
        )
        outs = self._collect() if not defer and self._in_flight is not None else []
        msg = self._encoder.encode(plan, self._release, defer)
        self._release = []
        plan.sent_at = plan.collect_sent_at = time.time()
        result = self.worker.execute(msg)
        self._count(result, defer)
        if not defer:
            self.scheduler.on_step_done(plan, result.probe_scores)
            return outs + self._apply(plan, result)
        plan.launched_at = time.time()
        # Chunks computed by this step are ready for the next ones: the device runs them in order.
        self.scheduler.on_step_done(plan)
        prev, self._in_flight = self._in_flight, plan
        if prev is None:
            return []
        prev.collect_sent_at = plan.sent_at  # this call brought prev's tokens back
        return self._apply(prev, result)

    def _collect(self) -> list[TokenOut]:
        """Waits for the deferred step in flight and applies its tokens."""
        plan, self._in_flight = self._in_flight, None
        msg = StepMsg([], release=self._release)
        self._release = []
        plan.collect_sent_at = time.time()
        result = self.worker.execute(msg)
        self._worker_counts(result)
        return self._apply(plan, result)

    def _count(self, result: StepResult, deferred: bool) -> None:
        self.step_counts["steps"] += 1
        self.step_counts["overlapped_steps"] += deferred
        self._worker_counts(result)

    def _worker_counts(self, result: StepResult) -> None:
        """The worker's running totals, as its last answer gives them."""
        c = self.step_counts
        c["shared_chunk_steps"] = result.shared_chunk_steps
        c["graph_steps"] = result.graph_steps
        c["ragged_prefill_steps"] = result.ragged_prefill_steps
        c["decode_split_steps"] = result.decode_split_steps

    def _apply(self, plan: StepPlan, result: StepResult) -> list[TokenOut]:
        self.scheduler.on_step_complete(plan)
        sampled = [it.request for it in plan.items if it.request is not None]
        if len(result.tokens) != len(sampled):
            raise RuntimeError(f"the worker returned {len(result.tokens)} tokens for {len(sampled)} requests")
        for rid, logprobs in (result.scores or {}).items():
            if int(rid) in self.requests:
                self.requests[int(rid)].score_logprobs = list(logprobs)
        for rid, mass in (result.citations or {}).items():
            req = self.requests.get(int(rid))
            if req is not None and req.state is not RequestState.FINISHED:
                req.add_citation_mass(mass)
        for rid, top in (result.score_top or {}).items():
            if int(rid) in self.requests:
                self.requests[int(rid)].score_top = top
        for rid, why in (result.failed or {}).items():  # before the tokens: their EOS is no answer
            if self.abort(int(rid), "error"):
                self.request_errors.append((int(rid), why))
        now = time.perf_counter()
        wall = time.time()
        outs = []
        logprobs = result.logprobs or [None] * len(sampled)
        for req, tok, lp in zip(sampled, result.tokens, logprobs):
            req.pending_tokens -= 1
            if req.state is RequestState.FINISHED:  # ended while this step ran: its token is dropped
                continue
            first = not req.output_ids
            req.output_ids.append(tok)
            req.first_token_time = req.first_token_time or now
            reason = self._finish_reason(req)
            if reason is not None:
                self.abort(req.rid, reason)
            meta = request_meta(req) if first or reason or req.params.citations else None
            if first and meta is not None and req.received_at:
                meta["timings_ms"] = request_timings(req, wall, plan, result)
            outs.append(TokenOut(req.rid, [tok], reason, meta, [lp] if lp is not None else None))
        return outs

    def cache_stats(self, cache_mode: str) -> dict:
        s = self.scheduler
        return {
            "cache_mode": cache_mode,
            "page_size": s.pool.page_size,
            "total_pages": s.pool.num_pages,
            "free_pages": s.pool.num_free,
            "chunk_pages": s.chunks.num_pages,
            "radix_pages": s.radix.num_pages,
            "held_pages": s.held_pages(),
            "chunks": len(s.chunks),
            "eviction_policy": s.chunks.eviction_policy,
            "chunk_hits": s.chunks.stats.hits,
            "chunk_misses": s.chunks.stats.misses,
            "chunk_evictions": s.chunks.stats.evictions,
            **host_tier_stats(s),
            **peer_stats(s),
            "radix_hit_tokens": s.radix.stats.hit_tokens,
            **self.step_counts,
            "running_requests": len(s.running),
            "waiting_requests": len(s.waiting),
        }

    def _finish_reason(self, req: Request) -> str | None:
        last = req.output_ids[-1]
        if not req.params.ignore_eos and last in self.eos_ids:
            return "stop"
        if last in req.params.stop_token_ids:
            return "stop"
        if len(req.output_ids) >= req.max_new_tokens:
            return "length"
        return None


def _no_progress(req: Request | None) -> str:
    why = f": a request waits for its documents ({req.error})" if req is not None and req.error else ""
    return "scheduler made no progress" + (why or " (no runnable work)")


def host_tier_stats(s: Scheduler) -> dict:
    """Chunk hits per tier and the host KV tier's size and traffic (zeros when it is off)."""
    st, host = s.chunks.stats, s.chunks.host_pool
    return {
        "chunk_device_hits": st.device_hits,
        "chunk_host_hits": st.host_hits,
        "chunk_host_attended": s.host_attended,  # retrieval attention: uses attended in the host tier
        "host_total_pages": host.num_pages if host is not None else 0,
        "host_free_pages": host.num_free if host is not None else 0,
        "host_chunk_pages": s.chunks.num_host_pages,
        "chunk_offloads": st.offloads,
        "chunk_loads": st.loads,
        "chunk_host_evictions": st.host_evictions,
        "host_offload_bytes": st.offload_pages * s.page_bytes,
        "host_load_bytes": st.load_pages * s.page_bytes,
    }


def peer_stats(s: Scheduler) -> dict:
    """Peer KV (kv_peers): chunk uses read from peers, copies, and the protocol's counters."""
    if s.peers is None:
        return {}
    st = s.chunks.stats
    return {"chunk_peer_fetches": st.peer_fetches, "peer_loads": st.peer_loads,
            "peer_load_bytes": st.peer_load_pages * s.page_bytes, **s.peers.stats_dict()}  # fmt: skip


def request_timings(
    req: Request, first_token_at: float, plan: StepPlan | None = None, result: StepResult | None = None
) -> dict:
    """Where a served request's time to first token went (ms, wall clock across processes): HTTP
    receipt -> tokenized, -> admitted by the scheduler (queueing for pages / a running slot), ->
    first token sampled (its prefill steps, and any step in flight when it arrived). The first two
    split further: HTTP -> the tokenizer process (to_tokenizer) + its work (tokenizing); -> read by
    the scheduler process (to_scheduler: it reads its inbox between steps, so a step it waits on
    counts here) + from there to admitted (admission: pages, a running slot).

    With the step that sampled the token (plan, result), prefill splits too: admitted -> that step
    sent to the worker (to_step: planning it, and any earlier steps of its prefill), -> its launch
    answered (launch: the worker built and queued it; deferred steps), -> the call that brings its
    tokens back sent (next_plan: the scheduler planned the next step meanwhile), -> the tokens on the
    worker's host (tokens_ready: the next step's launch, then the rest of this one's device work), ->
    back in the scheduler (to_core). device: the step's device time (CUDA, deferred steps)."""
    ms = lambda a, b: round((b - a) * 1e3, 3) if a and b else None  # noqa: E731
    out = {
        "tokenize": ms(req.received_at, req.tokenized_at),
        "queue": ms(req.tokenized_at, req.admitted_at),
        "prefill": ms(req.admitted_at, first_token_at),
        "to_tokenizer": ms(req.received_at, req.tokenizing_at),
        "tokenizing": ms(req.tokenizing_at, req.tokenized_at),
        "to_scheduler": ms(req.tokenized_at, req.queued_at),
        "admission": ms(req.queued_at, req.admitted_at),
    }
    if plan is not None and result is not None and plan.sent_at and result.ready_at:
        launched = plan.launched_at or None  # a synchronous step: sent -> its tokens, one call
        out["to_step"] = ms(req.admitted_at, plan.sent_at)
        if launched:
            out["launch"] = ms(plan.sent_at, launched)
            out["next_plan"] = ms(launched, plan.collect_sent_at)
        out["tokens_ready"] = ms(plan.collect_sent_at, result.ready_at)
        out["to_core"] = ms(result.ready_at, first_token_at)
        if result.device_ms is not None:
            out["device"] = round(result.device_ms, 3)
    return out


def request_meta(req: Request) -> dict:
    meta = {
        "prompt_tokens": req.prompt_len,
        "cached_tokens": req.cached_tokens,
        "chunk_hits": req.chunk_hits,
        "chunk_misses": req.chunk_misses,
        "recomputed_tokens": req.recomputed_tokens,
    }
    if req.host_chunks:
        meta["host_attended_chunks"] = req.host_chunks
    if req.peer_chunks:
        meta["peer_chunks"] = req.peer_chunks
    if req.chunk_rounds:  # its documents were computed in rounds while it waited
        meta["chunk_rounds"] = req.chunk_rounds
    if req.score_logprobs is not None:
        meta["continuation_logprobs"] = req.score_logprobs
    if req.params.citations:  # every token's meta: a stop string may end it at any one
        meta["citations"] = req.citations()
    if req.score_top is not None:  # [top ids, top logprobs] per scored token
        meta["continuation_top_logprobs"] = req.score_top
    return meta
