"""Late planning (issue 14, scheduler/late_planning.py): with overlapped scheduling the server's loop
plans a decode-only step shortly before the step in flight ends on the device, so a request that
arrives while that step runs joins the next step instead of the one after. Unit tests of the
LatePlanner on an injected clock (the deadline, the cases that must not wait, the cap, an arrival
ending the wait), and the scheduler loop over the real CPU worker with made-up device timing on
that clock: an arrival lands one step earlier, the device never waits for a plan, tokens are the same."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
from conftest import cpu_engine
from hf_reference import assert_no_leaked_pages

import lazyrt.launch
from lazyrt import SamplingParams
from lazyrt.config import EngineConfig
from lazyrt.runtime.ipc.messages import StepItem, StepMsg, StepResult, TokenBatch, TokenizedReq, decode
from lazyrt.runtime.scheduler.late_planning import LatePlanner, decode_only_msg, next_step_decode_only
from lazyrt.runtime.scheduler.plan import PENDING_TOKEN
from lazyrt.runtime.scheduler.process import SchedulerLoop
from lazyrt.runtime.scheduler.request import RequestState

MS = 1e-3


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def decode_msg(n: int = 2, defer: bool = True) -> StepMsg:
    return StepMsg([StepItem([PENDING_TOKEN], 10 + r, None, 0, rid=r) for r in range(n)], defer=defer)


def prefill_msg() -> StepMsg:
    return StepMsg([StepItem([5, 6, 7], 0, [[[0], 0, 3, False, False, -1]], 0, rid=9)], defer=True)


def run_step(late: LatePlanner, clock: Clock, msg: StepMsg, plan_s: float, device_ms: float | None,
             launch_ms: float | None, answer_s: float) -> None:  # fmt: skip
    """One loop step: plan for plan_s, send msg, get its answer answer_s later."""
    late.step_began()
    clock.t += plan_s
    late.sent(msg)
    clock.t += answer_s
    late.returned(msg, StepResult([1], device_ms=device_ms, launch_ms=launch_ms))


def warm(late: LatePlanner, clock: Clock, device_ms=(10.0, 10.0, 10.0), plan_ms=(0.3,), launch_ms=(0.5,)):
    n = max(len(device_ms), len(plan_ms), len(launch_ms), 3)
    for i in range(n + 1):  # the first answer carries no device time (nothing decode-only in flight)
        d = device_ms[(i - 1) % len(device_ms)] if i else None
        run_step(late, clock, decode_msg(), plan_ms[i % len(plan_ms)] * MS, d,
                 launch_ms[i % len(launch_ms)], 10 * MS)  # fmt: skip


def test_deadline_is_the_step_end_less_the_measured_margin():
    clock = Clock()
    late = LatePlanner(clock=clock, safety_s=1 * MS)
    assert late.deadline() is None  # no estimate yet
    warm(late, clock, device_ms=(10.0, 9.0, 11.0), plan_ms=(0.2, 0.6), launch_ms=(0.4, 0.7))
    at = clock.t
    # conservative sides of each window: the shortest device time, the longest plan and launch
    assert late.deadline() == pytest.approx(at + (9.0 - 0.6 - 0.7 - 1.0) * MS)
    # samples age out of the window
    late2 = LatePlanner(clock=clock, safety_s=1 * MS, window=2)
    warm(late2, clock, device_ms=(4.0, 10.0, 10.0), plan_ms=(0.3,), launch_ms=(0.5,))
    assert late2.deadline() == pytest.approx(clock.t + (10.0 - 0.3 - 0.5 - 1.0) * MS)


def test_no_deadline_without_a_decode_only_step_in_flight_or_an_estimate():
    clock = Clock()
    late = LatePlanner(clock=clock, min_samples=2)
    run_step(late, clock, decode_msg(), 0.3 * MS, None, 0.5, 10 * MS)
    run_step(late, clock, decode_msg(), 0.3 * MS, 10.0, 0.5, 10 * MS)
    assert late.deadline() is None  # one device time: not enough
    run_step(late, clock, decode_msg(), 0.3 * MS, 10.0, 0.5, 10 * MS)
    assert late.deadline() is not None
    # a prefill in flight: its device time is not what the decode history says
    run_step(late, clock, prefill_msg(), 0.3 * MS, 10.0, 0.5, 10 * MS)
    assert late.deadline() is None
    run_step(late, clock, decode_msg(), 0.3 * MS, 50.0, 0.5, 10 * MS)  # the prefill's time: not kept
    assert late.deadline() == pytest.approx(clock.t + (10.0 - 0.3 - 0.5 - 1.0) * MS)
    # a synchronous step (overlap off, scoring) or a collect: nothing in flight
    run_step(late, clock, decode_msg(defer=False), 0.3 * MS, None, None, 10 * MS)
    assert late.deadline() is None
    run_step(late, clock, decode_msg(), 0.3 * MS, None, 0.5, 10 * MS)
    assert late.deadline() is not None
    run_step(late, clock, StepMsg([]), 0.0, 10.0, None, 10 * MS)
    assert late.deadline() is None
    run_step(late, clock, decode_msg(), 0.3 * MS, None, 0.5, 10 * MS)
    late.dropped()  # the worker failed a step: nothing in flight
    assert late.deadline() is None
    # CPU worker: no device times at all, so never a wait
    cpu = LatePlanner(clock=clock)
    for _ in range(10):
        run_step(cpu, clock, decode_msg(), 0.3 * MS, None, 0.5, 10 * MS)
    assert cpu.deadline() is None


def test_decode_only_msg():
    assert decode_only_msg(decode_msg())
    assert not decode_only_msg(decode_msg(defer=False))
    assert not decode_only_msg(prefill_msg())
    assert not decode_only_msg(StepMsg([], defer=True))
    m = decode_msg()
    m.items.append(StepItem([1, 2], 0, [[[1], 0, 2, True, False, 0]], 0))  # a chunk prefill
    assert not decode_only_msg(m)
    m = decode_msg()
    m.copies = [[[1], [2], 0]]
    assert not decode_only_msg(m)


def test_next_step_decode_only_rules():
    dec = SimpleNamespace(state=RequestState.DECODE)
    s = SimpleNamespace(waiting=[], jobs=[], running=[dec, dec], max_running=4)
    assert next_step_decode_only(s)
    assert not next_step_decode_only(SimpleNamespace(**{**vars(s), "waiting": [object()]}))  # admit now
    assert not next_step_decode_only(SimpleNamespace(**{**vars(s), "jobs": [object()]}))  # a chunk
    assert not next_step_decode_only(SimpleNamespace(**{**vars(s), "max_running": 2}))  # saturated
    pre = SimpleNamespace(state=RequestState.PREFILL)
    assert not next_step_decode_only(SimpleNamespace(**{**vars(s), "running": [dec, pre]}))


class ScriptedPoll:
    """poll(timeout_s) for LatePlanner.wait: messages at given clock times; each one handled runs
    `on_msg` (a new request queued ends may_wait)."""

    def __init__(self, clock: Clock, at: list[float], on_msg=lambda: None):
        self.clock, self.at, self.on_msg, self.calls = clock, sorted(at), on_msg, []

    def __call__(self, timeout_s: float) -> bool:
        self.calls.append(timeout_s)
        if self.at and self.at[0] <= self.clock.t + timeout_s:
            self.clock.t = max(self.clock.t, self.at.pop(0))
            self.on_msg()
            return True
        self.clock.t += timeout_s
        return False


def test_wait_runs_to_the_deadline_and_serves_other_messages():
    clock = Clock()
    late = LatePlanner(clock=clock)
    warm(late, clock)
    start, deadline = clock.t, late.deadline()
    poll = ScriptedPoll(clock, [start + 2 * MS])  # e.g. an abort: may_wait stays true
    waited = late.wait(lambda: True, poll)
    assert clock.t == pytest.approx(deadline)
    assert waited == pytest.approx(clock.t - start)
    assert len(poll.calls) >= 2
    assert late.stats["late_plan_waits"] == 1 and late.stats["late_plan_arrivals"] == 0


def test_an_arrival_ends_the_wait():
    clock = Clock()
    late = LatePlanner(clock=clock)
    warm(late, clock)
    start = clock.t
    queued = []
    poll = ScriptedPoll(clock, [start + 3 * MS], on_msg=lambda: queued.append(1))
    waited = late.wait(lambda: not queued, poll)
    assert waited == pytest.approx(3 * MS)
    assert late.stats["late_plan_arrivals"] == 1


def test_no_wait_when_the_next_step_must_not_wait_or_the_deadline_is_near():
    clock = Clock()
    late = LatePlanner(clock=clock)
    warm(late, clock)
    poll = ScriptedPoll(clock, [])
    assert late.wait(lambda: False, poll) == 0.0 and not poll.calls  # e.g. a request waits to be admitted
    # the margin eats the whole step: plan at once
    late2 = LatePlanner(clock=clock)
    warm(late2, clock, device_ms=(2.0,), plan_ms=(0.5,), launch_ms=(0.6,))
    assert late2.deadline() <= clock.t
    assert late2.wait(lambda: True, poll) == 0.0 and not poll.calls
    assert late.stats["late_plan_waits"] == late2.stats["late_plan_waits"] == 0


def test_the_wait_is_capped():
    clock = Clock()
    late = LatePlanner(clock=clock, max_wait_s=30 * MS)
    warm(late, clock, device_ms=(400.0,))  # a slow model, or a bogus estimate
    start = clock.t
    assert late.deadline() == pytest.approx(start + 30 * MS)
    assert late.wait(lambda: True, ScriptedPoll(clock, [])) == pytest.approx(30 * MS)


@pytest.mark.parametrize(
    "argv, want", [([], True), (["--no-late-planning"], False), (["--late-planning"], True)]
)
def test_cli_flag(monkeypatch, argv, want):
    assert EngineConfig().late_planning is True
    assert "--no-late-planning" in lazyrt.launch.build_parser().format_help()
    seen = []
    monkeypatch.setattr(lazyrt.launch, "serve", lambda cfg, opts: seen.append(cfg) or 0)
    monkeypatch.setattr(lazyrt.launch, "check_devices", lambda cfg: None)
    assert lazyrt.launch.main(["--device", "cpu", *argv]) == 0
    assert seen[0].late_planning is want


# ---- the scheduler loop over the CPU worker, with made-up device timing ------------------------------
class FakeDevice:
    """The worker link: the in-process CPU ModelWorker computes the tokens; the device timing is made
    up on the clock. Every step takes step_s on the device, in order; the worker launches a step
    launch_s after it is sent and answers a deferred one with the previous deferred step's tokens
    once that step ends (a synchronous step or a collect: once everything queued ends)."""

    def __init__(self, worker, clock: Clock, late: LatePlanner | None, step_s=10 * MS, launch_s=0.5 * MS):
        self.worker, self.clock, self.late = worker, clock, late
        self.step_s, self.launch_s = step_s, launch_s
        self.free_at = 0.0  # when the device is done with what it has been given
        self.prev_end: float | None = None  # the deferred step in flight: when it ends
        self.steps: list[tuple[float, float, list[int]]] = []  # (start, end, rids it prefills)
        self.idle_behind: list[float] = []  # device idle between a step and the one queued after it

    def execute(self, msg: StepMsg) -> StepResult:
        if self.late is not None:
            self.late.sent(msg)
        result = self.worker.execute(msg)
        launched = self.clock.t + self.launch_s
        if msg.items:
            if self.prev_end is not None:  # a step is in flight: the next must be queued before it ends
                self.idle_behind.append(max(0.0, launched - self.prev_end))
            start = max(self.free_at, launched)
            self.free_at = start + self.step_s
            self.steps.append((start, self.free_at, [it.rid for it in msg.items if it.segments is not None]))
        answered = self.prev_end
        if msg.defer:
            self.clock.t = max(launched, answered if answered is not None else launched)
            self.prev_end = self.free_at
        else:
            self.clock.t = max(launched, self.free_at)
            self.prev_end = None
        result.device_ms = self.step_s * 1e3 if answered is not None else None
        result.launch_ms = self.launch_s * 1e3 if msg.defer else None
        if self.late is not None:
            self.late.returned(msg, result)
        return result


class ScriptedInbox:
    """SchedulerLoop's inbox: messages that arrive at given clock times."""

    def __init__(self, clock: Clock, arrivals: list[tuple[float, object]]):
        self.clock, self.arrivals = clock, sorted(arrivals, key=lambda a: a[0])

    def poll(self, timeout_s: float) -> bool:
        if self.arrivals and self.arrivals[0][0] <= self.clock.t + timeout_s:
            self.clock.t = max(self.clock.t, self.arrivals[0][0])
            return True
        self.clock.t += timeout_s
        return False

    def recv(self) -> object:
        return self.arrivals.pop(0)[1]


class Outbox:
    def __init__(self) -> None:
        self.tokens: dict[int, list[int]] = {}
        self.done: set[int] = set()

    def send(self, data: bytes) -> None:
        msg = decode(data)
        assert isinstance(msg, TokenBatch), msg
        for out in msg.outs:
            self.tokens.setdefault(out.rid, []).extend(out.token_ids)
            if out.finish_reason is not None:
                self.done.add(out.rid)


def serve(path: str, late_on: bool, prompts: list[list[int]], arrive: list[float], max_tokens: list[int]):
    eng = cpu_engine(path, "prefix", overlap_schedule=True)
    clock = Clock()
    late = LatePlanner(clock=clock) if late_on else None
    dev = FakeDevice(eng.worker, clock, late)
    eng.core.worker = dev
    reqs = [
        (t, TokenizedReq(rid, SamplingParams(max_tokens=n, ignore_eos=True), n, suffix=p))
        for rid, (t, p, n) in enumerate(zip(arrive, prompts, max_tokens))
    ]
    out = Outbox()
    watch = SimpleNamespace(check=lambda: None)
    loop = SchedulerLoop(eng.core, "prefix", ScriptedInbox(clock, reqs), out, watch, late)
    while len(out.done) < len(prompts):
        loop.run_once()
    assert not eng.core.has_work
    assert_no_leaked_pages(eng)
    return out.tokens, dev, late


def test_an_arrival_joins_the_next_step_and_the_device_never_waits(tiny_model_dir):
    """Request 0 decodes alone; request 1 arrives 3 ms into one of its 10 ms decode steps. Without
    late planning the step after that one was already planned, so request 1's prefill comes a step
    later; with it, request 1 joins the very next step. The device never idles behind a late plan,
    and the greedy tokens are those of the loop without late planning."""
    path = tiny_model_dir("llama")
    rng = random.Random()
    prompts = [[rng.randrange(100, 49152) for _ in range(rng.randint(3, 30))] for _ in range(2)]
    # request 0's steps run back to back from 0.5 ms (launch) in 10 ms slots: 3 ms into its 6th step
    arrive, max_tokens = [0.0, 0.5 * MS + 5 * 10 * MS + 3 * MS], [14, 6]
    runs = {on: serve(path, on, prompts, arrive, max_tokens) for on in (True, False)}
    for on, (tokens, dev, late) in runs.items():
        assert [len(tokens[r]) for r in range(2)] == max_tokens
        running = next(i for i, (start, end, _) in enumerate(dev.steps) if start <= arrive[1] < end)
        joined = next(i for i, (_, _, rids) in enumerate(dev.steps) if 1 in rids)
        assert joined - running == (1 if on else 2), (on, dev.steps)
        assert not any(dev.idle_behind), dev.idle_behind  # the plan always reached the device in time
        if on:
            assert late.stats["late_plan_waits"] > 0 and late.stats["late_plan_arrivals"] == 1
    assert runs[True][0] == runs[False][0]
