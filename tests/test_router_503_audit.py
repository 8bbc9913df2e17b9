"""The router retries a replica's 503 on the next replica (python -m lazyrt.router).

A replica answers 503 when it cannot serve a request at all (its scheduler died and the health checks
have not noticed yet, the model still loading, a step out of device memory): the request was not
served there, and nothing has reached the client, so the router moves it on, as after a lost
connection, each replica tried at most once. Other statuses (a 500, a 4xx) and answers that have
started streaming pass through as before. The replicas are stand-in HTTP servers (no model)."""

from __future__ import annotations

import time

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from stand_in_replica import Served
from test_router_audit import router

BODY = {"prompt": "q", "max_tokens": 4}


def stand_in() -> FastAPI:
    """A replica whose answer app.state.mode picks: "ok" (a JSON answer, or SSE events with stream),
    "503" / "500" (an error in the replicas' shape), "stream_error" (a 200 SSE stream whose second
    event is an error). app.state.seen counts the generation requests it got."""
    app = FastAPI()
    app.state.mode, app.state.seen = "ok", 0

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/cache_stats")
    async def cache_stats():
        return {"chunk_pages": 0, "free_pages": 1000, "page_size": 16, "eviction_policy": "lfu"}

    async def generate(request: Request):
        body = await request.json()
        app.state.seen += 1
        mode = app.state.mode
        if mode in ("503", "500"):
            status = int(mode)
            why = f"replica {app.state.port} cannot serve it"
            err = {"message": why, "type": "server_error", "code": status}
            return JSONResponse({"error": err}, status_code=status)

        async def events():
            yield b'data: {"text": " tok"}\n\n'
            if mode == "stream_error":
                yield b'data: {"error": {"message": "failed mid-answer", "type": "server_error"}}\n\n'
                return
            yield b"data: [DONE]\n\n"

        if body.get("stream") or mode == "stream_error":
            return StreamingResponse(events(), media_type="text/event-stream")
        return {"text": f"served by {app.state.port}", "meta": {"prompt_tokens": 3}}

    for path in ("/generate", "/v1/completions", "/v1/chat/completions"):
        app.add_api_route(path, generate, methods=["POST"])
    return app


@pytest.fixture(scope="module")
def three():
    """Three stand-in replicas behind a router: (router URL, state, apps in the order the router tries
    them for a request without documents: least loaded, then by URL)."""
    apps = [stand_in() for _ in range(3)]
    reps = [Served(a) for a in apps]
    for a, r in zip(apps, reps):
        a.state.port = r.port
    try:
        with router([r.url for r in reps]) as (url, state):
            order = sorted(range(3), key=lambda i: reps[i].url)
            yield url, state, [apps[i] for i in order]
    finally:
        for r in reps:
            r.stop()


@pytest.fixture
def replicas(three):
    url, state, apps = three
    for a in apps:
        a.state.mode, a.state.seen = "ok", 0
    yield url, state, apps
    deadline = time.monotonic() + 10  # (nothing is left in flight for the next test)
    while any(r.in_flight for r in state.replicas) and time.monotonic() < deadline:
        time.sleep(0.02)


@pytest.mark.parametrize("path", ["/v1/completions", "/generate"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_503_goes_to_the_next_replica(replicas, path, stream):
    """The first two replicas tried answer 503: the third serves it. Before, the first 503 reached
    the client. Each replica got the request once; the router counts the moves as retries and
    marks no replica down (its health checks decide that)."""
    url, state, apps = replicas
    apps[0].state.mode = apps[1].state.mode = "503"
    retries = state.retries._value.get()
    got = httpx.post(url + path, json={**BODY, "stream": stream}, timeout=30)
    assert got.status_code == 200, got.text
    assert got.headers["x-lazyrt-replica"].endswith(f":{apps[2].state.port}")
    if stream:
        assert got.text.endswith("data: [DONE]\n\n")
    else:
        assert got.json()["text"] == f"served by {apps[2].state.port}"
    assert [a.state.seen for a in apps] == [1, 1, 1]
    assert state.retries._value.get() == retries + 2
    assert all(r.healthy for r in state.replicas)


def test_when_every_replica_answers_503_the_last_503_is_the_answer(replicas):
    url, _, apps = replicas
    for a in apps:
        a.state.mode = "503"
    got = httpx.post(url + "/v1/completions", json=BODY, timeout=30)
    assert got.status_code == 503
    assert got.json()["error"]["message"] == f"replica {apps[2].state.port} cannot serve it"
    assert got.headers["x-lazyrt-replica"].endswith(f":{apps[2].state.port}")
    assert [a.state.seen for a in apps] == [1, 1, 1]  # each tried once, none twice


def test_other_errors_and_started_answers_are_not_retried(replicas):
    """A 500 is the replica's answer (it may have run the request): relayed, nobody else asked. A
    200 stream that fails after its first event has reached the client: relayed as it is."""
    url, _, apps = replicas
    apps[0].state.mode = "500"
    got = httpx.post(url + "/v1/completions", json=BODY, timeout=30)
    assert got.status_code == 500 and "cannot serve it" in got.json()["error"]["message"]
    assert [a.state.seen for a in apps] == [1, 0, 0]
    apps[0].state.mode = "stream_error"
    got = httpx.post(url + "/v1/completions", json={**BODY, "stream": True}, timeout=30)
    assert got.status_code == 200 and "failed mid-answer" in got.text
    assert [a.state.seen for a in apps] == [2, 0, 0]
