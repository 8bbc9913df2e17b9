"""The router's HTTP app: one address in front of several `lazyrt.launch` replicas.

Generation requests go to the replica AffinityPolicy picks from their documents (and loads); the
body is forwarded untouched and the answer streamed back as it comes. A replica that cannot be
reached, or drops the connection before answering, is marked down and the request goes to the next
one; a 503 answer (not served there) sends it to the next one too, each replica tried once (the last
503 is the answer if all refuse). Once an answer has started it is passed through (a replica dying
mid-stream ends the stream with an error event). Health checks bring replicas back. /metrics is
every replica's, each sample labelled with its replica, plus the router's own counters; /cache_stats
lists them and sums them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from urllib.parse import quote

import aiohttp
import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from lazyrt.api_key import ApiKeyGuard
from lazyrt.cache.placement import DOC_OWNERS_HEADER
from lazyrt.router.document_routes import add_router_document_routes
from lazyrt.router.policy import AffinityPolicy, doc_key, doc_tokens

logger = logging.getLogger("lazyrt.router")
ROUTED = ("/generate", "/score", "/v1/completions", "/v1/chat/completions")
_HEALTH_S = 1.0
# A replica that times out this many health checks in a row is marked down (one that refuses the
# connection at once): a replica busy streaming hundreds of answers may be slow to answer one.
_DOWN_AFTER = 3
_HEALTH_TIMEOUT_S = 5.0
_LEARN_BYTES = 1 << 20  # answers kept to learn characters per token from (larger ones are not)


class ReplicaDown(aiohttp.ClientConnectionError):
    """The health checks found the replica down while a request waited on it."""


@dataclass
class Replica:
    url: str
    healthy: bool = False
    in_flight: int = 0
    slow_checks: int = 0  # health checks timed out in a row
    # resolved when the health checks find it down: the requests waiting on it stop waiting (a frozen
    # process or a lost host closes no connection; its answers would never end)
    _down: asyncio.Future | None = field(default=None, repr=False)

    def down_signal(self) -> asyncio.Future:
        if self._down is None or self._down.done():
            self._down = asyncio.get_running_loop().create_future()
        return self._down

    def mark_down(self) -> None:
        if self._down is not None and not self._down.done():
            self._down.set_result(None)


@dataclass
class RouterState:
    replicas: list[Replica]
    policy: AffinityPolicy = field(default_factory=AffinityPolicy)
    api_key: str | None = None
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        self.routed = Counter("lazyrt_router_requests", "requests routed", ["replica", "reason"], registry=r)
        self.retries = Counter("lazyrt_router_retries", "requests moved off a failed replica", registry=r)
        self.up = Gauge("lazyrt_router_replica_up", "1 if it answers /health", ["replica"], registry=r)

    def by_url(self) -> dict[str, Replica]:
        return {r.url: r for r in self.replicas}


def request_docs(
    body: dict, chars_per_token: float = 4.0, id_tokens: dict[str, int] | None = None
) -> tuple[list[bytes], list[int]]:
    """Routing keys and sizes (tokens, about) of a request's documents (`documents` on the OpenAI
    endpoints, `docs` on /generate)."""
    docs = body.get("documents", body.get("docs"))
    if not isinstance(docs, list):
        return [], []
    docs = [d for d in docs if isinstance(d, (str, dict))]
    return [doc_key(d) for d in docs], [doc_tokens(d, chars_per_token, id_tokens) for d in docs]


def routing_keys(raw: bytes, policy: AffinityPolicy) -> tuple[list[bytes], list[int], int]:
    """(routing keys, sizes, characters to learn from) of a request body as received; none for a body
    the replica will refuse (not JSON, nested too deeply, a lone surrogate in a document): it is
    forwarded as it is, and the replica's 400 names what is wrong."""
    try:
        body = json.loads(raw)
        if not isinstance(body, dict):
            return [], [], 0
        keys, sizes = request_docs(body, policy.chars_per_token, policy.id_tokens)
        return keys, sizes, request_chars(body) if keys else 0
    except (ValueError, RecursionError):  # (JSON, UTF-8 and UTF-8 encoding errors are ValueErrors)
        return [], [], 0


def request_chars(body: dict) -> int:
    """Characters of text the request's prompt is made of (documents given by id excluded: the router
    does not know their text), to learn the tokenizer's characters per token from the answer."""

    def chars(x: object) -> int:
        if isinstance(x, str):
            return len(x)
        if isinstance(x, int) and not isinstance(x, bool):
            return -(10**9)  # a token id prompt: no characters to learn from
        if isinstance(x, list):
            return sum(chars(y) for y in x)
        if isinstance(x, dict):
            if "id" in x and "text" not in x and "content" not in x:
                return -(10**9)  # a registered document: its size is unknown, skip this answer
            return chars(x.get("text")) + chars(x.get("content"))
        return 0

    keys = ("documents", "docs", "prompt", "text", "input_ids", "messages", "question", "system")
    return sum(chars(body.get(k)) for k in keys)


def answer_prompt_tokens(answer: object) -> int:
    """Prompt tokens an answer reports (usage on the OpenAI endpoints, meta on /generate); 0 if none."""
    if isinstance(answer, list):
        return sum(answer_prompt_tokens(a) for a in answer)
    if not isinstance(answer, dict):
        return 0
    for k in ("usage", "meta"):
        n = answer.get(k, {}).get("prompt_tokens") if isinstance(answer.get(k), dict) else None
        if isinstance(n, int):
            return n
    return 0


def label_metrics(text: str, replica: str) -> list[str]:
    """Prometheus text with replica="..." added to every sample; HELP/TYPE lines kept."""
    out = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            out.append(line)
            continue
        name_labels, _, value = line.rpartition(" ")
        if "{" in name_labels:
            name, _, labels = name_labels.partition("{")
            out.append(f'{name}{{replica="{replica}",{labels} {value}')
        else:
            out.append(f'{name_labels}{{replica="{replica}"}} {value}')
    return out


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    """The replicas' error shape (OpenAI's): a 4xx is the request's fault, a 5xx the servers'."""
    kind = "server_error" if status >= 500 else "invalid_request_error"
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return JSONResponse(body, status_code=status)


def create_router_app(state: RouterState) -> FastAPI:
    # The answers stream through aiohttp, whose HTTP parser is compiled: relaying an event through
    # httpx (pure-Python h11 and anyio cancel scopes on every read) was ~55% of the router's CPU
    # (benchmarks/experiments/router_relay.py). Every answer streams over its own connection for as
    # long as it runs, so the connections have no cap (a cap queued requests past it, and the health
    # checks behind them timed out, marking busy replicas down). httpx serves the rest (health checks,
    # document routes, /metrics and /cache_stats of every replica), where a call's cost does not matter.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=32)
    http = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0), limits=limits)
    pools: dict[str, aiohttp.ClientSession] = {}

    def pool(url: str) -> aiohttp.ClientSession:
        if url not in pools:  # created on the event loop, by the first request to this replica
            pools[url] = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, limit_per_host=0),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=5.0),
            )
        return pools[url]

    probe = httpx.AsyncClient(timeout=httpx.Timeout(10.0, connect=5.0))
    headers = {"authorization": f"Bearer {state.api_key}"} if state.api_key else {}

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        task = asyncio.create_task(health_loop())
        try:
            yield
        finally:
            task.cancel()
            for c in (http, probe):
                await c.aclose()
            for session in pools.values():
                await session.close()

    app = FastAPI(title="lazyrt router", docs_url=None, redoc_url=None, lifespan=lifespan)

    if state.api_key:
        app.add_middleware(ApiKeyGuard, api_key=state.api_key)

    async def check(replica: Replica) -> None:
        was = replica.healthy
        try:
            r = await probe.get(replica.url + "/health", headers=headers, timeout=_HEALTH_TIMEOUT_S)
            replica.healthy, replica.slow_checks = r.status_code == 200, 0
        except httpx.TimeoutException:
            replica.slow_checks += 1
            replica.healthy = was and replica.slow_checks < _DOWN_AFTER
        except httpx.HTTPError:
            replica.healthy, replica.slow_checks = False, 0
        state.up.labels(replica.url).set(int(replica.healthy))
        if was and not replica.healthy:  # its answers in flight end with an error, not a wait for ever
            replica.mark_down()
        if not replica.healthy or replica.slow_checks:
            return
        view = state.policy.view(replica.url)
        try:
            s = (await probe.get(replica.url + "/cache_stats", headers=headers, timeout=10)).json()
            # what documents can hold now: the pool less the running requests' own pages (and the
            # prefix cache's), refreshed every check as the load changes
            capacity = (s["chunk_pages"] + s["free_pages"]) * s["page_size"]
            if s.get("kv_peer_addr"):  # peer KV: the name its documents' owners are hashed with
                state.policy.peer_names[replica.url] = s["kv_peer_addr"]
            else:
                state.policy.peer_names.pop(replica.url, None)
            if not was:  # (re)joined: its cache may be new; learn its size and policy
                view.reset(capacity, s.get("eviction_policy", "lfu"), s["page_size"])
            else:
                view.capacity = capacity
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            if not was:
                view.reset(None)

    async def health_loop() -> None:
        while True:
            await asyncio.gather(*(check(r) for r in state.replicas))
            await asyncio.sleep(_HEALTH_S)

    async def forward(path: str, request: Request) -> Response:
        raw = await request.body()
        pol = state.policy
        keys, sizes, chars = routing_keys(raw, pol)
        live = {r.url: r.in_flight for r in state.replicas if r.healthy}
        if not live:
            return _error(503, "no replica is healthy")
        choice, order = state.policy.ranked(keys, live, sizes)
        fwd_headers = {"content-type": request.headers.get("content-type", "application/json"), **headers}
        refused: Response | None = None  # the last replica's 503, answered if no replica serves it
        for attempt, url in enumerate(order):
            replica = state.by_url()[url]
            replica.in_flight += 1
            owners = pol.placement(keys, url) if keys else None
            if owners is not None:  # peer KV: where each document is (or will be) cached
                fwd_headers[DOC_OWNERS_HEADER] = json.dumps(owners)
            else:  # (not the placement computed for a replica tried before)
                fwd_headers.pop(DOC_OWNERS_HEADER, None)
            try:
                resp = await _unless_down(pool(url).post(url + path, data=raw, headers=fwd_headers), replica)
            except asyncio.CancelledError:
                replica.in_flight -= 1
                raise
            except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as e:
                replica.in_flight -= 1
                replica.healthy = False
                state.up.labels(url).set(0)
                state.retries.inc()
                logger.warning("replica %s failed before answering (%s); trying the next", url, e)
                continue
            if resp.status == 503:  # not served there (its scheduler died, still loading, out of memory)
                # and nothing has reached the client: the next replica gets it, as after a lost
                # connection; the health checks, not one answer, decide whether the replica is down
                replica.in_flight -= 1
                try:
                    body = await _unless_down(resp.read(), replica)
                    kind = resp.headers.get("content-type")
                    refused = Response(body, 503, {"x-lazyrt-replica": url}, media_type=kind)
                except (aiohttp.ClientError, asyncio.TimeoutError):
                    pass
                finally:
                    resp.release()
                state.retries.inc()
                logger.warning("replica %s answered 503; trying the next", url)
                continue
            reason = choice.reason if attempt == 0 else "retry"
            state.routed.labels(url, reason).inc()
            if resp.status < 400:  # a refused request computed none of its documents there
                state.policy.record(url, keys, sizes)
            learn = None
            if chars > 0 and resp.status == 200 and "json" in resp.headers.get("content-type", ""):
                learn = lambda answer: state.policy.observe(chars, answer_prompt_tokens(answer))  # noqa: E731
            return StreamingResponse(
                _relay(resp, replica, learn), status_code=resp.status,
                media_type=resp.headers.get("content-type"), headers={"x-lazyrt-replica": url},
            )  # fmt: skip
        if refused is not None:
            return refused
        return _error(503, "every replica failed to answer this request")

    def route(path: str):
        async def handler(request: Request) -> Response:
            return await forward(path, request)

        return handler

    for path in ROUTED:
        app.add_api_route(path, route(path), methods=["POST"])

    add_router_document_routes(app, state, http, headers, _error)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> Response:
        """Starlette's own errors (no such route: 404, a route without this method: 405) in the
        error shape of the replicas' (and the router's other) errors."""
        resp = _error(e.status_code, f"{e.detail}: {request.method} {request.url.path}")
        resp.headers.update(e.headers or {})
        return resp

    @app.get("/health")
    async def health() -> Response:
        up = sum(r.healthy for r in state.replicas)
        status = 200 if up else 503
        return JSONResponse({"status": "ok" if up else "no replica", "replicas_up": up}, status_code=status)

    async def each(path: str, method: str = "GET") -> list[tuple[Replica, httpx.Response | None]]:
        async def one(r: Replica) -> tuple[Replica, httpx.Response | None]:
            try:
                return r, await http.request(method, r.url + path, headers=headers, timeout=30)
            except httpx.HTTPError:
                return r, None

        return list(await asyncio.gather(*(one(r) for r in state.replicas)))

    @app.get("/v1/models")
    async def models() -> Response:
        for _, resp in await each("/v1/models"):
            if resp is not None and resp.status_code == 200:
                return JSONResponse(resp.json())
        return _error(503, "no replica answered /v1/models")

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> Response:  # every replica serves the same model: the first answer
        for _, resp in await each("/v1/models/" + quote(model, safe="/")):
            if resp is not None and resp.status_code in (200, 404):
                return JSONResponse(resp.json(), status_code=resp.status_code)
        return _error(503, f"no replica answered /v1/models/{model}")

    @app.get("/cache_stats")
    async def cache_stats() -> Response:
        stats = [(r.url, resp.json() if resp is not None and resp.status_code == 200 else None)
                 for r, resp in await each("/cache_stats")]  # fmt: skip
        total: dict = {}
        for _, s in stats:
            for k, v in (s or {}).items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    total[k] = total.get(k, 0) + v
        pol = state.policy
        views = {u: {"documents": len(v.held), "tokens": v.tokens, "capacity": v.capacity,
                     "eviction_policy": v.eviction_policy} for u, v in pol.views.items()}  # fmt: skip
        router = {"policy": pol.mode, "chars_per_token": pol.chars_per_token, "views": views}
        return JSONResponse({"replicas": [{"url": u, "stats": s} for u, s in stats], "total": total,
                             "router": router})  # fmt: skip

    @app.post("/flush_cache")
    async def flush() -> Response:
        done = await each("/flush_cache", "POST")
        for r in state.replicas:
            state.policy.view(r.url).clear()
        return JSONResponse({"replicas": [{"url": r.url, "ok": resp is not None and resp.status_code == 200}
                                          for r, resp in done]})  # fmt: skip

    @app.get("/metrics")
    async def metrics() -> Response:
        lines = generate_latest(state.registry).decode().splitlines()
        for r, resp in await each("/metrics"):
            if resp is not None and resp.status_code == 200:
                lines += label_metrics(resp.text, r.url)
        return Response("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    return app


async def _unless_down(call: Awaitable[aiohttp.ClientResponse], replica: Replica) -> aiohttp.ClientResponse:
    """call's answer (its headers), or ReplicaDown once the health checks find the replica down."""
    task = asyncio.ensure_future(call)
    down = replica.down_signal()
    try:
        await asyncio.wait((task, down), return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():  # found down, or the client left
            task.cancel()
    if not task.done():
        raise ReplicaDown(f"{replica.url} stopped answering its health checks")
    return task.result()


def _cut_on_down(resp: aiohttp.ClientResponse, replica: Replica, _down: asyncio.Future) -> None:
    resp.content.set_exception(ReplicaDown(f"{replica.url} stopped answering its health checks"))


async def _relay(
    resp: aiohttp.ClientResponse, replica: Replica, learn: Callable[[object], None] | None = None
) -> AsyncIterator[bytes]:
    """The replica's answer as it comes; a connection lost mid-answer, or the health checks finding the
    replica down, ends it with an error event. learn: called with a whole JSON answer (kept up to 1 MB;
    the bytes are relayed untouched)."""
    kept: list[bytes] | None = [] if learn is not None else None
    size = 0
    down = replica.down_signal()
    cut = partial(_cut_on_down, resp, replica)
    down.add_done_callback(cut)
    try:
        async for chunk in resp.content.iter_any():  # whatever has arrived: an event or several
            if kept is not None:
                size += len(chunk)
                if size <= _LEARN_BYTES:
                    kept.append(chunk)
                else:
                    kept = None
            yield chunk
        if kept is not None and learn is not None:
            try:
                learn(json.loads(b"".join(kept)))
            except (ValueError, UnicodeDecodeError):
                pass
    except aiohttp.ClientError as e:
        replica.healthy = False
        resp.close()
        err = {"error": {"message": f"the replica failed mid-answer: {e!r}", "type": "server_error"}}
        yield f"data: {json.dumps(err)}\n\n".encode()
    finally:
        down.remove_done_callback(cut)
        replica.in_flight -= 1
        # read to the end, the connection goes back to the pool; else (the client left) aiohttp closes
        # it, which tells the replica to stop generating
        resp.release()
