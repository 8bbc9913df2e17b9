"""CPU use of this host's lazyrt processes while a benchmark point runs (rag_serving.py --sample-cpu).

lazyrt names its processes (lazyrt/process_name.py: lazyrt-http, lazyrt-tokenize, lazyrt-schedule,
lazyrt-worker, lazyrt-router, ...), so a sampler can tell which one is busy without knowing their
pids: two replicas behind a router on one host share its cores, and which process saturates first
is what a throughput ratio below 2 asks (docs/benchmarks.md, the router). Needs psutil.
"""

from __future__ import annotations

import statistics
import threading
from collections.abc import Iterable

PREFIX = "lazyrt-"
CLIENT = "client"  # the benchmark's own process


class ProcessCpu:
    """Samples every `interval_s`, on a thread, the CPU % (100 = one core) of each process whose name
    starts with lazyrt- and of this one, from start() to stop()."""

    def __init__(self, interval_s: float = 0.5):
        import psutil  # here: the benchmark runs without it unless --sample-cpu is given

        self._psutil, self.interval_s = psutil, interval_s
        self._names: dict[int, str] = {}  # every process seen
        self._procs: dict[int, object] = {}  # those still sampled
        self._samples: dict[int, list[float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="process-cpu", daemon=True)

    def start(self) -> ProcessCpu:
        self._track()
        self._thread.start()
        return self

    def stop(self) -> dict[str, list[float]]:
        """Mean CPU % of each process over the samples, grouped by name, busiest first."""
        self._stop.set()
        self._thread.join()
        return summarize((self._names[pid], s) for pid, s in self._samples.items())

    def _track(self) -> None:
        ps = self._psutil
        me = ps.Process()
        found = [(me, CLIENT)] + [(p, p.info.get("name") or "") for p in ps.process_iter(["name"])]
        for p, name in found:
            if (p is me or name.startswith(PREFIX)) and p.pid not in self._names:
                try:
                    p.cpu_percent(None)  # the first call only starts the interval
                except ps.Error:
                    continue
                self._names[p.pid], self._procs[p.pid] = name, p

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            for pid, p in list(self._procs.items()):
                try:
                    self._samples.setdefault(pid, []).append(p.cpu_percent(None))
                except self._psutil.Error:  # it exited: its samples so far stay
                    del self._procs[pid]
            self._track()  # processes started since (a replica restarting)


def summarize(samples: Iterable[tuple[str, list[float]]]) -> dict[str, list[float]]:
    """{name: [mean CPU % of each process of that name, busiest first]}; processes with no sample
    are left out."""
    out: dict[str, list[float]] = {}
    for name, s in samples:
        if s:
            out.setdefault(name, []).append(round(statistics.fmean(s), 1))
    return {k: sorted(v, reverse=True) for k, v in sorted(out.items())}


def describe(cpu: dict[str, list[float]]) -> str:
    """One line: `lazyrt-worker 95/93 lazyrt-http 80/75 client 60` (CPU %, one entry a process)."""
    return " ".join(f"{name} {'/'.join(f'{v:.0f}' for v in vals)}" for name, vals in cpu.items())
