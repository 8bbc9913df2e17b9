"""How many streamed events a second the router relays, and its CPU time per event (issue 17: on two
H200s at ~4,500 output tokens/s the router process used 78-95% of a core).

A stand-in replica (tests/stand_in_replica.py: no model, --events SSE events of ~60 bytes an answer,
one every --interval seconds, as a decoding replica sends one event a token) runs in its own process;
the router (`python -m lazyrt.router --worker URL`) in another. --streams clients stream at once, first
straight from the replica, then through the router; printed: events/s received, and the router
process's CPU seconds per 1,000 events (from /proc).

    python benchmarks/experiments/router_relay.py --streams 200 --events 200 --interval 0.01
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time

import httpx

TESTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests")
sys.path.insert(0, TESTS)
from server_util import free_port  # noqa: E402


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def wait_up(url: str, key: str | None = None) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            r = httpx.get(url + "/health", timeout=2)
            if r.status_code == 200 and (key is None or r.json().get(key)):
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise TimeoutError(url)


async def stream_all(url: str, streams: int) -> tuple[int, float]:
    async def one(client: httpx.AsyncClient) -> int:
        n = 0
        async with client.stream("POST", url + "/generate", json={"text": "hi"}) as r:
            async for line in r.aiter_lines():
                n += line.startswith("data:")
        return n

    limits = httpx.Limits(max_connections=None)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        t0 = time.perf_counter()
        counts = await asyncio.gather(*(one(client) for _ in range(streams)))
        return sum(counts), time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, default=200)
    p.add_argument("--events", type=int, default=200, help="events an answer")
    p.add_argument("--interval", type=float, default=0.01, help="seconds between a stream's events")
    args = p.parse_args()
    rport, port = free_port(), free_port()
    rep = subprocess.Popen([sys.executable, os.path.join(TESTS, "stand_in_replica.py"), str(rport),
                            str(args.events), str(args.interval)])
    router = subprocess.Popen([sys.executable, "-m", "lazyrt.router", "--port", str(port), "--log-level",
                               "warning", "--worker", f"http://127.0.0.1:{rport}"])  # fmt: skip
    try:
        wait_up(f"http://127.0.0.1:{rport}")
        wait_up(f"http://127.0.0.1:{port}", "replicas_up")
        rows = []
        for name, url, pid in (("replica", rport, rep.pid), ("router", port, router.pid)):
            c0 = cpu_seconds(pid)
            n, wall = asyncio.run(stream_all(f"http://127.0.0.1:{url}", args.streams))
            cpu = cpu_seconds(pid) - c0
            rows.append((name, n, wall, cpu))
            print(f"{name:8s} {n} events in {wall:.2f} s = {n / wall:,.0f} events/s; that process's CPU "
                  f"{cpu:.2f} s ({cpu / wall:.0%} of a core), {1000 * cpu / n:.3f} s per 1,000 events",
                  flush=True)  # fmt: skip
    finally:
        router.terminate()
        rep.terminate()
        router.wait(10)
        rep.wait(10)


if __name__ == "__main__":
    main()
