"""The router under many answers in flight: more streams than httpx's default pool (100 connections)
through one replica that takes seconds per answer. Before: requests past 100 queued inside the
router, and the health checks waiting behind them timed out and marked the busy replica down, so
later requests got 503 "no replica is healthy" (seen on two H200s at 80 req/s: 509 of 1,200
requests). The replica here is a stand-in HTTP server (no model): what is tested is the router."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest
import uvicorn
from fastapi import FastAPI
from server_util import free_port
from stand_in_replica import stand_in_replica

from lazyrt.router import app as router_app
from lazyrt.router.app import Replica, RouterState, create_router_app

STREAM_S = 6.0  # each answer's length: past the old health check's 5 s pool wait
IN_FLIGHT = 130


class Served:
    """An ASGI app on a loopback port, in a thread."""

    def __init__(self, app: FastAPI):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cfg = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(cfg)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture
def router_over_slow_replica():
    rep_app = stand_in_replica(events=1, interval=STREAM_S)
    rep = Served(rep_app)
    state = RouterState([Replica(rep.url)])
    router = Served(create_router_app(state))
    try:
        deadline = time.monotonic() + 20
        while not state.replicas[0].healthy and time.monotonic() < deadline:
            time.sleep(0.1)
        yield router.url, rep_app, state, rep
    finally:
        router.stop()
        rep.stop()


def test_many_streams_in_flight_keep_the_replica_up(router_over_slow_replica):
    url, rep_app, state, _ = router_over_slow_replica

    async def one(client: httpx.AsyncClient) -> tuple[int, float, bool]:
        t0 = time.monotonic()
        async with client.stream("POST", url + "/generate", json={"text": "hi"}) as r:
            first, done = None, False
            async for line in r.aiter_lines():
                if first is None:
                    first = time.monotonic() - t0
                done = done or line == "data: [DONE]"
            return r.status_code, first or 0.0, done

    async def main() -> tuple[list, dict]:
        limits = httpx.Limits(max_connections=None)
        async with httpx.AsyncClient(timeout=60, limits=limits) as client:
            tasks = [asyncio.create_task(one(client)) for _ in range(IN_FLIGHT)]
            await asyncio.sleep(STREAM_S - 0.5)  # every stream open; the router has checked health since
            health = (await client.get(url + "/health")).json()
            results = await asyncio.gather(*tasks)
        return results, health

    results, health = asyncio.run(main())
    assert health["replicas_up"] == 1  # still up with 130 answers streaming through it
    assert all(status == 200 and done for status, _, done in results), {r[0] for r in results}
    assert rep_app.state.most == IN_FLIGHT  # all in flight at once: none queued inside the router
    assert max(first for _, first, _ in results) < STREAM_S / 2  # every answer started at once
    assert state.replicas[0].healthy and state.replicas[0].in_flight == 0


def test_slow_health_checks_mark_a_replica_down_only_when_repeated(router_over_slow_replica, monkeypatch):
    """One or two checks timing out leave the replica up; three in a row mark it down; a fast answer
    brings it back; a refused connection marks it down at once."""
    url, rep_app, state, rep = router_over_slow_replica
    monkeypatch.setattr(router_app, "_HEALTH_S", 0.1)  # (read by every check as it runs)
    monkeypatch.setattr(router_app, "_HEALTH_TIMEOUT_S", 0.3)
    replica = state.replicas[0]

    def wait(cond, timeout=10.0) -> bool:
        deadline = time.monotonic() + timeout
        while not cond() and time.monotonic() < deadline:
            time.sleep(0.02)
        return cond()

    rep_app.state.health_delay = 1.0  # > the check's timeout (0.3 s here)
    assert wait(lambda: replica.slow_checks == 1)
    assert replica.healthy  # one slow check: still routed to
    assert wait(lambda: not replica.healthy)
    assert replica.slow_checks >= router_app._DOWN_AFTER
    rep_app.state.health_delay = 0.0
    assert wait(lambda: replica.healthy and replica.slow_checks == 0)
    assert httpx.get(url + "/health").json()["replicas_up"] == 1
    rep.stop()  # connection refused from now on
    assert wait(lambda: not replica.healthy, timeout=3.0)
    assert replica.slow_checks == 0
    assert httpx.get(url + "/health").json()["replicas_up"] == 0
