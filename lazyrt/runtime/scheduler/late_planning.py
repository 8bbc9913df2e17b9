"""Late planning (issue 14): with overlapped scheduling the server's scheduler loop would plan step
N+1 the moment step N-1's tokens come back, i.e. as step N starts on the device. A request arriving
while step N runs then misses N+1 and waits for N+2: up to one extra decode step of time to first
token at low load. When the next step would only carry running decodes, the loop instead waits
(serving its inbox) until shortly before step N is expected to end, then plans N+1.

The expected end: the in-flight step started on the device no later than its predecessor's tokens
came back (the worker launches a step before it waits for the previous one), so it ends by then plus
its device time, estimated from the device times the worker reports for recent decode-only steps.
The plan must reach the device before that: the margin is the scheduler's own plan + encode + send
time, the worker's time to launch a step (both measured on recent decode-only steps) and a safety
constant. Each estimate takes the conservative side of its recent window (the shortest device time,
the longest plan and launch times), so an error plans early and the device does not idle.

LatePlanner holds the timing state and the wait; the scheduler loop feeds it (the worker link's
send/result hooks) and decides with `next_step_decode_only` whether a wait may start.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from lazyrt.runtime.ipc.messages import StepMsg, StepResult
from lazyrt.runtime.scheduler.request import RequestState
from lazyrt.runtime.scheduler.scheduler import Scheduler


def decode_only_msg(msg: StepMsg) -> bool:
    """A deferred step of running decodes only: one token each, nothing else to do on the device."""
    return (
        msg.defer
        and bool(msg.items)
        and all(len(it.token_ids) == 1 and it.rid >= 0 for it in msg.items)
        and not (msg.probes or msg.copies or msg.offloads or msg.loads)
    )


def next_step_decode_only(s: Scheduler) -> bool:
    """The next plan would only carry the running requests' decodes, and waiting could add to it:
    nothing waits for admission, no chunk or prefill is pending, and a running slot is free (at
    max_running_requests nothing new could join, so a wait would only risk idling the device)."""
    return (
        not s.waiting
        and not s.jobs
        and len(s.running) < s.max_running
        and all(r.state is RequestState.DECODE for r in s.running)
    )


@dataclass
class LatePlanner:
    clock: Callable[[], float] = time.perf_counter
    safety_s: float = 0.001  # on top of the measured margin: IPC hops, OS wake-up, clock granularity
    max_wait_s: float = 0.03  # cap on one wait, whatever the estimate says
    window: int = 8  # recent decode-only steps each estimate looks at
    min_samples: int = 2  # device times needed before any wait (a cold start plans at once)
    # recent decode-only steps: device time, scheduler plan+encode+send, worker launch (seconds)
    device_s: deque[float] = field(default_factory=deque)
    plan_s: deque[float] = field(default_factory=deque)
    launch_s: deque[float] = field(default_factory=deque)
    # counters, and the last estimates a wait used (ms): /cache_stats shows them
    stats: dict[str, float] = field(
        default_factory=lambda: {
            "late_plan_waits": 0,
            "late_plan_wait_ms": 0.0,
            "late_plan_arrivals": 0,
            "late_plan_step_ms": 0.0,
            "late_plan_margin_ms": 0.0,
        }
    )
    _began: float | None = None  # when the loop started planning the step being sent
    _result_at: float = 0.0  # when the last result came back: the in-flight step had started by then
    _in_flight_decode: bool = False  # the step in flight is a deferred decode-only one

    # ---- hooks: the loop and the worker link call these ---------------------------------------------
    def step_began(self) -> None:
        self._began = self.clock()

    def sent(self, msg: StepMsg) -> None:
        if self._began is not None and decode_only_msg(msg):
            self._push(self.plan_s, self.clock() - self._began)
        self._began = None

    def returned(self, msg: StepMsg, result: StepResult) -> None:
        """`result` answers `msg`: with defer, msg's step is now in flight and the tokens are its
        predecessor's; otherwise (a synchronous step, a collect) nothing is in flight after it."""
        self._result_at = self.clock()
        if self._in_flight_decode and result.device_ms is not None:  # the predecessor's device time
            self._push(self.device_s, result.device_ms / 1e3)
        if decode_only_msg(msg) and result.launch_ms is not None:
            self._push(self.launch_s, result.launch_ms / 1e3)
        self._in_flight_decode = decode_only_msg(msg)

    def dropped(self) -> None:
        """The worker failed a step and dropped the steps in flight."""
        self._in_flight_decode, self._began = False, None

    # ---- the decision ---------------------------------------------------------------------------
    def deadline(self) -> float | None:
        """When to plan the next step, by the clock; None = plan at once (nothing decode-only in
        flight, or no estimate yet)."""
        if not self._in_flight_decode or len(self.device_s) < self.min_samples:
            return None
        if not self.plan_s or not self.launch_s:
            return None
        step, margin = min(self.device_s), max(self.plan_s) + max(self.launch_s) + self.safety_s
        self.stats["late_plan_step_ms"], self.stats["late_plan_margin_ms"] = step * 1e3, margin * 1e3
        return self._result_at + min(step - margin, self.max_wait_s)

    def wait(self, may_wait: Callable[[], bool], poll: Callable[[float], bool]) -> float:
        """Waits for the deadline while may_wait() holds; returns the seconds waited. poll(timeout_s)
        waits up to timeout_s (never longer) for one inbox message, handles it and says whether there
        was one.

        A new request ends the wait at once (may_wait() turns false once it is queued) rather than at
        the deadline: its prefill starts on the device when the in-flight step ends either way, but a
        prefill plans and builds slower than the decode step the margin was measured on, so starting
        now keeps the device from idling; waiting on could only batch a second arrival of the same
        few milliseconds, rare at the low load where waits happen."""
        deadline = self.deadline()
        if deadline is None or not may_wait():
            return 0.0
        start = now = self.clock()
        while now < deadline:
            if poll(deadline - now) and not may_wait():
                self.stats["late_plan_arrivals"] += 1
                now = self.clock()
                break
            now = self.clock()
        if now > start:
            self.stats["late_plan_waits"] += 1
            self.stats["late_plan_wait_ms"] += (now - start) * 1e3
        return now - start

    def _push(self, q: deque[float], v: float) -> None:
        q.append(v)
        if len(q) > self.window:
            q.popleft()
