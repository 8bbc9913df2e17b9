"""The router under many answers in flight: more streams than httpx's default pool (100 connections)
through one replica that takes seconds per answer. Before: requests past 100 queued inside the
router, and the health checks waiting behind them timed out and marked the busy replica down, so
later requests got 503 "no replica is healthy" (seen on two H200s at 80 req/s: 509 of 1,200
requests). Then the relay's two ends: a client that leaves mid-answer frees the replica's answer, and
a replica that dies mid-answer ends the client's stream with an error event. The replica here is a
stand-in HTTP server (no model): what is tested is the router."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from server_util import free_port
from stand_in_replica import Served, stand_in_replica

from lazyrt.router import app as router_app
from lazyrt.router.app import Replica, RouterState, create_router_app

STREAM_S = 6.0  # each answer's length: past the old health check's 5 s pool wait
IN_FLIGHT = 130




@contextlib.contextmanager
def router_over(replica_url: str, api_key: str | None = None) -> Iterator[tuple[str, RouterState]]:
    """A router app over one replica, served on loopback once it has seen the replica healthy (or
    after 20 s): (its URL, its state)."""
    state = RouterState([Replica(replica_url)], api_key=api_key)
    router = Served(create_router_app(state))
    try:
        deadline = time.monotonic() + 20
        while not state.replicas[0].healthy and time.monotonic() < deadline:
            time.sleep(0.1)
        yield router.url, state
    finally:
        router.stop()


@pytest.fixture
def router_over_slow_replica():
    rep_app = stand_in_replica(events=1, interval=STREAM_S)
    rep = Served(rep_app)
    try:
        with router_over(rep.url) as (url, state):
            yield url, rep_app, state, rep
    finally:
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


def test_a_client_leaving_mid_answer_stops_the_replicas_answer():
    """The router closes its connection to the replica when the client goes, so the replica stops
    generating (its streaming answer ends at once, not after its 200 events), and nothing stays counted
    in flight."""
    rep_app = stand_in_replica(events=200, interval=0.1)
    rep = Served(rep_app)
    try:
        with router_over(rep.url) as (url, state), httpx.Client(timeout=30) as client:
            with client.stream("POST", url + "/generate", json={"text": "hi"}) as r:
                lines = r.iter_lines()
                got = [next(lines) for _ in range(3)]
                assert got[0].startswith("data: ") and rep_app.state.open == 1
            t0 = time.monotonic()
            while (rep_app.state.open or state.replicas[0].in_flight) and time.monotonic() - t0 < 8:
                time.sleep(0.02)
            assert rep_app.state.open == 0 and state.replicas[0].in_flight == 0  # well before its 20 s
    finally:
        rep.stop()


class _DyingReplica:
    """A raw HTTP server that starts a chunked SSE answer, sends one event and drops the connection:
    a replica process killed mid-answer. /health answers 200."""

    def __init__(self):
        self.port = free_port()
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(ready,), daemon=True)
        self.thread.start()
        ready.wait(10)

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        srv = self.loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", self.port))
        ready.set()
        self.loop.run_forever()  # until stop()
        srv.close()
        self.loop.close()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = (await reader.readuntil(b"\r\n\r\n")).decode()
        sizes = [int(h.split(":")[1]) for h in head.split("\r\n") if h.lower().startswith("content-length")]
        await reader.readexactly(sizes[0] if sizes else 0)
        if head.startswith("GET /health"):
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 15\r\n"
                         b"connection: close\r\n\r\n{\"status\":\"ok\"}")  # fmt: skip
        else:
            event = b'data: {"text": " tok"}\n\n'
            start = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n"
            start += b"\r\n"
            writer.write(start + f"{len(event):x}\r\n".encode() + event + b"\r\n")
            await writer.drain()
            await asyncio.sleep(0.2)
        writer.close()  # mid-answer for the stream: no last chunk


def test_a_replica_dying_mid_answer_ends_the_stream_with_an_error_event():
    rep = _DyingReplica()
    try:
        with router_over(f"http://127.0.0.1:{rep.port}") as (url, state), httpx.Client(timeout=30) as client:
            assert state.replicas[0].healthy
            with client.stream("POST", url + "/generate", json={"text": "hi"}) as r:
                assert r.status_code == 200
                events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
            assert events[0] == '{"text": " tok"}'  # what came before the failure, untouched
            assert len(events) == 2 and "the replica failed mid-answer" in events[1]
            assert json.loads(events[1])["error"]["type"] == "server_error"
            assert state.replicas[0].in_flight == 0
    finally:
        rep.stop()


def test_router_with_an_api_key_checks_it_and_sends_it_to_the_replicas():
    """--api-key: the router answers 401 without the key, and sends the key on every call it makes to
    the replicas (health checks and the relayed answers), which check it too."""
    from lazyrt.api_key import ApiKeyGuard

    rep_app = stand_in_replica(events=3, interval=0.01)
    rep_app.add_middleware(ApiKeyGuard, api_key="k-123")
    rep = Served(rep_app)
    try:
        with router_over(rep.url, api_key="k-123") as (url, state):
            assert state.replicas[0].healthy  # its health check carried the key
            assert httpx.post(url + "/generate", json={"text": "hi"}).status_code == 401
            key = {"authorization": "Bearer k-123"}
            r = httpx.post(url + "/generate", json={"text": "hi"}, headers=key)
            assert r.status_code == 200
            assert r.text.count("data: ") == 4 and r.text.rstrip().endswith("data: [DONE]")
    finally:
        rep.stop()
