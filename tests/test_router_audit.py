"""The router's handling of bad input (python -m lazyrt.router): command-line flags it cannot use are
usage errors naming the flag; request bodies it cannot route by (not JSON, nested too deeply, a lone
surrogate) still reach a replica, whose 400 comes back unchanged; its own errors have the replicas'
OpenAI shape; document routes neither crash on what httpx cannot encode, nor register a document
with a bad `precompute`, nor cut an id at "#" or "?"; a replica that stops answering (frozen, host
lost) ends the answers waiting on it with an error. The replicas here are stand-in HTTP servers (no
model): what is tested is the router."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import signal
import threading
import time

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from server_util import free_port
from stand_in_replica import Served

from lazyrt.router import app as router_app
from lazyrt.router.app import Replica, RouterState, create_router_app
from lazyrt.router.policy import AffinityPolicy, doc_key

_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]*")




def _bad(param: str, message: str, status: int = 400) -> JSONResponse:
    kind = "not_found_error" if status == 404 else "invalid_request_error"
    body = {"error": {"message": f"{param}: {message}", "type": kind, "param": param, "code": status}}
    return JSONResponse(body, status_code=status, headers={"x-replica-error": "1"})


def stand_in() -> FastAPI:
    """A replica's routes, checking bodies as a replica does (a 400 naming the field): /generate and
    the OpenAI routes, /v1/documents. app.state: requests seen (path, headers, body), documents,
    frozen (health checks and answers wait while set), freeze ("before" / "mid": the next answer
    freezes the replica before its headers / after its first event), fail_deletes (a 500 on DELETE)."""
    app = FastAPI()
    app.state.seen, app.state.docs = [], {}
    app.state.frozen, app.state.freeze, app.state.fail_deletes = False, None, False

    async def thaw() -> None:
        while app.state.frozen:
            await asyncio.sleep(0.02)

    def parse(raw: bytes):
        try:
            body = json.loads(raw)
        except RecursionError:
            return _bad("body", "request body is nested too deeply")
        except ValueError:
            return _bad("body", "request body is not valid JSON")
        if not isinstance(body, dict):
            return _bad("body", "request body must be a JSON object")
        todo, depth = [(body, 0)], 0
        while todo:  # as a replica's check_json: no deeper than 100 levels
            v, depth = todo.pop()
            if depth > 100:
                return _bad("body", "is nested deeper than 100 levels")
            inner = v.values() if isinstance(v, dict) else v
            todo += [(x, depth + 1) for x in inner if isinstance(x, (dict, list))]
        try:
            json.dumps(body, ensure_ascii=False, allow_nan=False).encode()
        except (ValueError, RecursionError):
            return _bad("body", "not valid UTF-8, not a finite number, or nested too deeply")
        return body

    @app.get("/health")
    async def health():
        await thaw()
        return {"status": "ok"}

    @app.get("/cache_stats")
    async def cache_stats():
        return {"chunk_pages": 0, "free_pages": 1000, "page_size": 16, "eviction_policy": "lfu"}

    async def generate(request: Request):
        raw = await request.body()
        app.state.seen.append((request.url.path, dict(request.headers), raw))
        body = parse(raw)
        if isinstance(body, JSONResponse):
            return body
        if body.get("max_tokens") == 0:
            return _bad("max_tokens", "must be >= 1")
        freeze, app.state.freeze = app.state.freeze, None
        if freeze == "before":
            app.state.frozen = True
            await thaw()

        async def events():
            yield b'data: {"text": " tok"}\n\n'
            if freeze == "mid":
                app.state.frozen = True
                await thaw()
            yield b"data: [DONE]\n\n"

        if body.get("stream"):
            return StreamingResponse(events(), media_type="text/event-stream")
        return {"text": "ok", "meta": {"prompt_tokens": 3}}

    for path in ("/generate", "/v1/completions", "/v1/chat/completions"):
        app.add_api_route(path, generate, methods=["POST"])

    @app.post("/v1/documents")
    async def add(request: Request):
        body = parse(await request.body())
        if isinstance(body, JSONResponse):
            return body
        app.state.seen.append(("/v1/documents", {}, body))
        doc_id = body.get("id") or f"doc-{len(app.state.docs)}"
        app.state.docs[doc_id] = body
        out = {"id": doc_id, "object": "document", "tokens": 10}
        return {**out, "precompute": {"chunk_misses": 1}} if body.get("precompute") else out

    @app.delete("/v1/documents/{doc_id}")
    async def delete(doc_id: str):
        if app.state.fail_deletes:
            return JSONResponse({"error": {"message": "store failed", "type": "server_error"}}, 500)
        if not _ID.fullmatch(doc_id):
            return _bad("id", f"{doc_id!r} is not a document id")
        if app.state.docs.pop(doc_id, None) is None:
            return _bad("id", f"no document {doc_id}", 404)
        return {"id": doc_id, "object": "document", "deleted": True}

    return app


@contextlib.contextmanager
def router(replicas: list[str], **kw):
    """A router app over `replicas`, served once it has seen them all healthy: (its URL, its state)."""
    state = RouterState([Replica(u) for u in replicas], **kw)
    served = Served(create_router_app(state))
    try:
        deadline = time.monotonic() + 20
        while not all(r.healthy for r in state.replicas) and time.monotonic() < deadline:
            time.sleep(0.05)
        yield served.url, state
    finally:
        served.stop()


@pytest.fixture(scope="module")
def two():
    """Two stand-in replicas behind a router: (router URL, state, [replica apps], [their URLs])."""
    apps = [stand_in(), stand_in()]
    reps = [Served(a) for a in apps]
    try:
        with router([r.url for r in reps]) as (url, state):
            yield url, state, apps, [r.url for r in reps]
    finally:
        for r in reps:
            r.stop()


# ---- the command line ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--worker", "notaurl"], "--worker"),
        (["--worker", "127.0.0.1:30001"], "--worker"),
        (["--worker", "ftp://127.0.0.1:30001"], "--worker"),
        (["--worker", "http://127.0.0.1:99999"], "--worker"),
        (["--worker", "http://127.0.0.1:30001?x=1"], "--worker"),
        (["--worker", "http://127.0.0.1:30001", "--worker", "http://127.0.0.1:30001/"], "given twice"),
        (["--worker", "http://127.0.0.1:31000", "--dp", "1"], "--dp starts"),
        (["--worker", "http://127.0.0.1:1", "--log-level", "loud"], "--log-level"),
        (["--worker", "http://127.0.0.1:1", "--dp-devices", "0,1"], "--dp-devices"),
        (["--worker", "http://127.0.0.1:1", "--dp-base=32000"], "--dp-base-port"),
        (["--worker", "http://127.0.0.1:1", "--", "--model", "x"], "give --dp"),
        (["--worker", "http://127.0.0.1:1", "--dp", "-1"], "--dp -1"),
        (["--worker", "http://127.0.0.1:1", "--imbalance", "nan"], "--imbalance"),
        (["--worker", "http://127.0.0.1:1", "--port", "99999"], "--port"),
        (["--dp", "2", "--port", "31001"], "--port"),
        (["--dp", "2", "--dp-base-port", "65535"], "--dp-base-port"),
        (["--worker", "http://127.0.0.1:1", "--api-key", ""], "--api-key"),
    ],
)
def test_unusable_flags_are_usage_errors_naming_the_flag(argv, flag, capsys, monkeypatch):
    """Each was accepted before (a router answering 503 for ever, a replica routed to twice, a flag
    ignored) or crashed with a traceback; now: exit status 2 and the flag named. Nothing is served."""
    from lazyrt.router import __main__ as cli

    started = []
    monkeypatch.setattr(cli.uvicorn.Server, "run", lambda self: started.append(1))
    monkeypatch.setattr(cli, "_start_replicas", lambda *a, **k: started.append(2) or [])
    monkeypatch.setattr(signal, "signal", lambda *a: None)
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2 and not started
    assert flag in capsys.readouterr().err


# ---- requests -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "raw",
    [
        b"[" * 100_000 + b"]" * 100_000,  # past json's recursion limit
        b'{"documents": ["\\ud800"], "prompt": "q"}',  # a lone surrogate: no routing key
        b'{"documents": ["d"], "prompt": ' + b"[" * 900 + b"]" * 900 + b"}",  # deep, under json's limit
    ],
)
def test_bodies_the_router_cannot_route_by_get_the_replicas_400(two, raw):
    url, _, apps, reps = two
    direct = httpx.post(reps[0] + "/v1/completions", content=raw, timeout=30)
    got = httpx.post(url + "/v1/completions", content=raw, timeout=30)
    assert direct.status_code == 400
    assert got.status_code == 400 and got.content == direct.content  # was a 500 from the router


def test_a_replicas_4xx_passes_through_and_places_nothing(two):
    url, state, _, reps = two
    doc = f"a document {time.time_ns()}"
    body = {"prompt": "q", "documents": [doc], "max_tokens": 0}
    got = httpx.post(url + "/v1/completions", json=body, timeout=30)
    direct = httpx.post(got.headers["x-lazyrt-replica"] + "/v1/completions", json=body, timeout=30)
    assert got.status_code == direct.status_code == 400 and got.content == direct.content
    assert got.json()["error"]["param"] == "max_tokens"
    # the refused request computed nothing there: no view holds its document
    assert not any(v.holds(doc_key(doc)) for v in state.policy.views.values())
    ok = httpx.post(url + "/v1/completions", json={**body, "max_tokens": 4}, timeout=30)
    assert ok.status_code == 200
    assert state.policy.views[ok.headers["x-lazyrt-replica"]].holds(doc_key(doc))


def test_the_routers_own_errors_have_the_openai_shape(two):
    url = two[0]
    for r, status in ((httpx.get(url + "/v1/nothing-here"), 404), (httpx.get(url + "/v1/completions"), 405)):
        assert r.status_code == status
        err = r.json()["error"]
        assert err["code"] == status and err["type"] == "invalid_request_error" and "param" in err
        assert r.request.url.path in err["message"]
    bad = httpx.post(url + "/v1/documents", json={"text": "x", "precompute": "yes"})
    assert bad.json()["error"]["type"] == "invalid_request_error"  # a 4xx is not a server_error


def test_documents_the_router_cannot_reencode_reach_the_replicas(two):
    """NaN and lone surrogates parse (Python's json reads them) but httpx's json= refused to send them:
    a 500 from the router. Now the replica reads them and its 400 names the problem."""
    url, _, apps, _ = two
    for raw in (b'{"text": "\\ud800"}', b'{"text": "x", "metadata": {"a": NaN}}'):
        r = httpx.post(url + "/v1/documents", content=raw, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "body", r.text
    deep = httpx.post(url + "/v1/documents", content=b"[" * 100_000 + b"]" * 100_000, timeout=30)
    assert deep.status_code == 400 and "nested" in deep.json()["error"]["message"]


@pytest.mark.parametrize(
    "pre, param",
    [
        ("yes", "precompute"),
        ([], "precompute"),
        (0, "precompute"),
        ({"sys": "x"}, "precompute.sys"),
        ({"system": 5}, "precompute.system"),
    ],
)
def test_a_bad_precompute_is_refused_before_anything_is_registered(two, pre, param):
    """The router strips `precompute` before registering on every replica: a falsy bad value was
    ignored (registered, not precomputed, 200), a truthy one refused only after registering."""
    url, _, apps, _ = two
    before = [dict(a.state.docs) for a in apps]
    r = httpx.post(url + "/v1/documents", json={"text": "a document", "id": "pre-doc", "precompute": pre})
    assert r.status_code == 400 and r.json()["error"]["param"] == param
    assert [a.state.docs for a in apps] == before
    good = httpx.post(url + "/v1/documents", json={"text": "a document", "precompute": {"system": "s"}})
    assert good.status_code == 200 and good.json()["precompute"] == {"chunk_misses": 1}


@pytest.mark.parametrize("suffix", ["%23frag", "%3Fx%3D1"])
def test_deleting_an_id_with_a_hash_or_question_mark_deletes_no_other(two, suffix):
    """DELETE /v1/documents/a%23frag reached the replicas as DELETE /v1/documents/a: it deleted "a"."""
    url, _, apps, _ = two
    for a in apps:
        a.state.docs["a"] = {"text": "kept"}
    r = httpx.delete(f"{url}/v1/documents/a{suffix}", timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "id"
    assert all("a" in a.state.docs for a in apps)
    assert httpx.delete(f"{url}/v1/documents/a", timeout=30).status_code == 200


def test_a_delete_that_fails_on_a_replica_is_not_reported_done(two):
    url, _, apps, reps = two
    for a in apps:
        a.state.docs["half"] = {"text": "x"}
    apps[1].state.fail_deletes = True
    try:
        r = httpx.delete(f"{url}/v1/documents/half", timeout=30)
    finally:
        apps[1].state.fail_deletes = False
    assert r.status_code == 502 and reps[1] in r.json()["error"]["message"]  # was a 200
    assert "half" in apps[1].state.docs


def test_a_retry_does_not_carry_the_failed_replicas_placement():
    """Peer KV placement (x-lazyrt-doc-owners) is computed for the replica tried; a retry on a replica
    that places nothing must not send the previous one's."""
    app = stand_in()
    good = Served(app)
    dying = _Hangup()
    try:
        dead_url = f"http://127.0.0.1:{dying.port}"
        pol = AffinityPolicy()
        with router([dead_url, good.url], policy=pol) as (url, state):
            pol.peer_names[dead_url] = "ipc:///tmp/lazyrt-test-peer"  # only the dying one has a peer address
            for r in state.replicas:
                pol.view(r.url).reset(10_000)
            pol.record(dead_url, [doc_key("doc")], [5])  # its view holds the document: tried first
            r = httpx.post(url + "/generate", json={"text": "q", "docs": ["doc"]}, timeout=30)
            assert r.status_code == 200 and r.headers["x-lazyrt-replica"] == good.url
            assert dying.posts >= 1
            headers = app.state.seen[-1][1]
            assert "x-lazyrt-doc-owners" not in headers
    finally:
        good.stop()
        dying.stop()


class _Hangup:
    """A replica that answers /health and drops every other request's connection (fails before answering)."""

    def __init__(self):
        self.port, self.posts = free_port(), 0
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(ready,), daemon=True)
        self.thread.start()
        ready.wait(10)

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        srv = self.loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", self.port))
        ready.set()
        self.loop.run_forever()
        srv.close()
        self.loop.close()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = (await reader.readuntil(b"\r\n\r\n")).decode()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()
            return
        if head.startswith("GET /health"):
            writer.write(b'HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 15\r\n'
                         b'connection: close\r\n\r\n{"status":"ok"}')  # fmt: skip
            await writer.drain()
        elif head.startswith("POST"):
            self.posts += 1
        writer.close()


@pytest.fixture
def fast_health(monkeypatch):
    monkeypatch.setattr(router_app, "_HEALTH_S", 0.1)  # (read by every check as it runs)
    monkeypatch.setattr(router_app, "_HEALTH_TIMEOUT_S", 0.3)


def test_a_replica_that_freezes_ends_the_answers_waiting_on_it(fast_health):
    """A frozen replica (a stopped process, a lost host) closes no connection: its answers waited for
    ever, though the health checks had marked it down. Now the stream it was sending ends with an
    error event, and a request still waiting for its headers goes to another replica."""
    apps = [stand_in(), stand_in()]
    reps = [Served(a) for a in apps]
    try:
        with router([reps[0].url]) as (url, state), httpx.Client(timeout=15) as client:
            apps[0].state.freeze = "mid"
            with client.stream("POST", url + "/generate", json={"text": "q", "stream": True}) as r:
                assert r.status_code == 200
                events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
            assert events[0] == '{"text": " tok"}' and len(events) == 2
            err = json.loads(events[1])["error"]
            assert err["type"] == "server_error" and "stopped answering" in err["message"]
            apps[0].state.frozen = False
            deadline = time.monotonic() + 20
            while not state.replicas[0].healthy and time.monotonic() < deadline:
                time.sleep(0.05)
            assert state.replicas[0].healthy and state.replicas[0].in_flight == 0
        with router([r.url for r in reps], policy=AffinityPolicy(mode="round_robin")) as (url, state):
            first = min(r.url for r in reps)  # round_robin's first choice
            app = apps[[r.url for r in reps].index(first)]
            app.state.freeze = "before"
            r = httpx.post(url + "/generate", json={"text": "q"}, timeout=15)
            app.state.frozen = False
            assert r.status_code == 200 and r.headers["x-lazyrt-replica"] != first
            assert all(x.in_flight == 0 for x in state.replicas)
    finally:
        for a in apps:
            a.state.frozen = False
        for r in reps:
            r.stop()


def test_routing_keys_survive_what_json_lets_through():
    from lazyrt.router.app import routing_keys

    pol = AffinityPolicy()
    assert routing_keys(b'{"documents": ["\\ud800"]}', pol) == ([], [], 0)
    assert routing_keys(b"[" * 100_000, pol) == ([], [], 0)
    keys, sizes, chars = routing_keys(b'{"documents": ["abcd"], "prompt": "xy"}', pol)
    assert keys == [doc_key("abcd")] and sizes == [1] and chars == 6
