"""The HTTP app: lazyrt's /generate, the OpenAI-compatible endpoints, health, metrics, cache control.

Handlers only validate, submit to the pipeline and format what comes back; every request is one
GenerateReq and one stream of TextOuts. A client that goes away aborts its request, which frees
its pages in the scheduler.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from lazyrt.runtime.ipc.messages import ErrorOut, TextOut
from lazyrt.runtime.server.metrics import ServerMetrics
from lazyrt.runtime.server.pipeline_client import PipelineClient
from lazyrt.runtime.server.protocol import (
    ApiError,
    Parsed,
    parse_chat,
    parse_completion,
    parse_generate,
    parse_score,
)

logger = logging.getLogger("lazyrt.http")
MAX_BODY_BYTES = 8 << 20
_DISCONNECT_POLL_S = 0.5


@dataclass
class ServerState:
    client: PipelineClient
    served_model: str
    api_key: str | None = None
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    healthy: bool = False  # set after a real 1-token generation went through every process
    created: int = field(default_factory=lambda: int(time.time()))


def error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


class _Tracker:
    """Per-request timing for the TTFT / inter-token histograms."""

    def __init__(self, metrics: ServerMetrics, received_at: float = 0.0):
        self.metrics = metrics
        self.start = time.perf_counter()
        self.last: float | None = None
        self.received_at = received_at  # wall clock, for meta["timings_ms"]
        self.first_at = 0.0

    def saw(self, out: TextOut) -> None:
        now = time.perf_counter()
        if out.num_tokens <= 0:
            return
        if self.last is None:
            self.metrics.ttft.observe(now - self.start)
            self.first_at = time.time()
        else:
            self.metrics.itl.observe(now - self.last)
        self.last = now

    def finish(self, endpoint: str, out: TextOut) -> dict:
        meta = dict(out.meta or {})
        m = self.metrics
        m.requests.labels(endpoint, out.finish_reason).inc()
        m.prompt_tokens.inc(meta.get("prompt_tokens", 0))
        m.generation_tokens.inc(meta.get("completion_tokens", 0))
        m.cached_tokens.inc(meta.get("cached_tokens", 0))
        m.e2e.observe(time.perf_counter() - self.start)
        if isinstance(meta.get("timings_ms"), dict) and self.received_at and self.first_at:
            # + the way back: detokenizer and HTTP; "ttft" is the whole server-side time to first token
            ttft = round((self.first_at - self.received_at) * 1e3, 3)
            meta["timings_ms"] = {**meta["timings_ms"], "ttft": ttft}
        return meta


def usage(meta: dict) -> dict:
    p, c = meta.get("prompt_tokens", 0), meta.get("completion_tokens", 0)
    return {
        "prompt_tokens": p,
        "completion_tokens": c,
        "total_tokens": p + c,
        "prompt_tokens_details": {"cached_tokens": meta.get("cached_tokens", 0)},
    }


def _sse(obj: Any) -> bytes:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode()


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="lazyrt", docs_url=None, redoc_url=None)
    client = state.client

    @app.middleware("http")
    async def guard(request: Request, call_next: Callable) -> Response:
        if state.api_key and request.url.path != "/health":
            auth = request.headers.get("authorization", "")
            if auth != f"Bearer {state.api_key}":
                return error_response(
                    ApiError(
                        401,
                        "missing or wrong API key (Authorization: Bearer ...)",
                        None,
                        "authentication_error",
                    )
                )
        return await call_next(request)

    async def read_json(request: Request) -> dict:
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > MAX_BODY_BYTES:
            raise ApiError(413, f"request body is over the {MAX_BODY_BYTES} byte limit", "body")
        data = bytearray()
        async for chunk in request.stream():
            data += chunk
            if len(data) > MAX_BODY_BYTES:
                raise ApiError(413, f"request body is over the {MAX_BODY_BYTES} byte limit", "body")
        try:
            body = json.loads(data)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(400, f"request body is not valid JSON: {e}", "body") from e
        if not isinstance(body, dict):
            raise ApiError(400, "request body must be a JSON object", "body")
        return body

    async def next_out(q: asyncio.Queue, request: Request) -> TextOut | ErrorOut | None:
        """The next output, or None if the client went away (non-streaming waits)."""
        while True:
            try:
                return await asyncio.wait_for(q.get(), _DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    return None

    async def run(
        request: Request,
        endpoint: str,
        parse: Callable[[dict], Parsed],
        finish: Callable[[str, dict], dict],
        chunk: Callable[[str, str | None, dict | None], dict | None],
    ) -> Response:
        received_at = time.time()
        try:
            if not state.healthy and client.ready_info is None:
                raise ApiError(503, "the model is still loading", None, "server_error")
            if client.failed:
                raise ApiError(503, client.failed, None, "server_error")
            parsed = parse(await read_json(request))
        except ApiError as e:
            state.metrics.errors.labels(endpoint, str(e.status)).inc()
            return error_response(e)
        rid = client.new_rid()
        parsed.req.rid = rid
        parsed.req.received_at = received_at
        q = client.submit(parsed.req)
        tracker = _Tracker(state.metrics, received_at)
        first = await next_out(q, request)
        if first is None:
            client.abort(rid)
            state.metrics.aborts.inc()
            return Response(status_code=499)
        if isinstance(first, ErrorOut):
            state.metrics.errors.labels(endpoint, str(first.status)).inc()
            return error_response(ApiError(first.status, first.message, first.param, first.type))
        tracker.saw(first)
        if not parsed.stream:
            text, out = first.text, first
            while out.finish_reason is None:
                nxt = await next_out(q, request)
                if nxt is None:
                    client.abort(rid)
                    state.metrics.aborts.inc()
                    return Response(status_code=499)
                if isinstance(nxt, ErrorOut):
                    return error_response(ApiError(nxt.status, nxt.message, nxt.param, nxt.type))
                tracker.saw(nxt)
                text, out = text + nxt.text, nxt
            meta = tracker.finish(endpoint, out)
            return JSONResponse(finish(text, {**meta, "token_ids": out.token_ids}))

        async def events() -> AsyncIterator[bytes]:
            finished = False
            try:
                out: TextOut | ErrorOut = first
                while True:
                    if isinstance(out, ErrorOut):
                        yield _sse(ApiError(out.status, out.message, out.param, out.type).body())
                        break
                    meta = tracker.finish(endpoint, out) if out.finish_reason is not None else None
                    body = chunk(out.text, out.finish_reason, meta)
                    if body is not None:
                        yield _sse(body)
                    if meta is not None:
                        finished = True
                        if parsed.include_usage:
                            yield _sse(chunk("", None, {**meta, "usage_only": True}))
                        break
                    out = await q.get()
                    if isinstance(out, TextOut):
                        tracker.saw(out)
                yield b"data: [DONE]\n\n"
            finally:
                if not finished:  # client gone (or cancelled): free the request's pages
                    client.abort(rid)
                    state.metrics.aborts.inc()

        return StreamingResponse(events(), media_type="text/event-stream")

    # ---- endpoints ----------------------------------------------------------------------------
    @app.post("/generate")
    async def generate(request: Request) -> Response:
        def finish(text: str, meta: dict) -> dict:
            ids = meta.pop("token_ids", None)
            return {"text": text, "token_ids": ids, "meta": meta}

        def chunk(text: str, reason: str | None, meta: dict | None) -> dict | None:
            if meta and meta.get("usage_only"):
                return None
            out: dict = {"text": text, "finish_reason": reason}
            if meta is not None:
                out["meta"] = meta
            return out

        return await run(request, "generate", parse_generate, finish, chunk)

    @app.post("/score")
    async def score(request: Request) -> Response:
        """Log-probability of each continuation given the prompt (as /generate describes it):
        `scores` are per-token means (length-normalized), `logprobs` the per-token values."""
        rids: list[int] = []
        try:
            if client.ready_info is None:
                raise ApiError(503, "the model is still loading", None, "server_error")
            if client.failed:
                raise ApiError(503, client.failed, None, "server_error")
            reqs = parse_score(await read_json(request))
            queues = []
            for req in reqs:  # all at once: they batch together in the scheduler
                req.rid = client.new_rid()
                rids.append(req.rid)
                queues.append(client.submit(req))
            per_token: list[list[float]] = []
            for q in queues:
                while True:
                    out = await next_out(q, request)
                    if out is None:
                        for rid in rids:
                            client.abort(rid)
                        return Response(status_code=499)
                    if isinstance(out, ErrorOut):
                        raise ApiError(out.status, out.message, out.param, out.type)
                    if out.finish_reason is not None:
                        per_token.append(list((out.meta or {}).get("continuation_logprobs") or []))
                        break
        except ApiError as e:
            for rid in rids:
                client.abort(rid)
            state.metrics.errors.labels("score", str(e.status)).inc()
            return error_response(e)
        scores = [sum(lp) / len(lp) if lp else None for lp in per_token]
        return JSONResponse({"scores": scores, "logprobs": per_token})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        cid = f"cmpl-{time.time_ns():x}"

        def base(obj: str) -> dict:
            return {"id": cid, "object": obj, "created": int(time.time()), "model": state.served_model}

        def finish(text: str, meta: dict) -> dict:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": meta.get("finish_reason")}
            return {**base("text_completion"), "choices": [choice], "usage": usage(meta)}

        def chunk(text: str, reason: str | None, meta: dict | None) -> dict:
            if meta and meta.get("usage_only"):
                return {**base("text_completion"), "choices": [], "usage": usage(meta)}
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
            return {**base("text_completion"), "choices": [choice]}

        return await run(
            request, "completions", lambda b: parse_completion(b, state.served_model), finish, chunk
        )

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        cid = f"chatcmpl-{time.time_ns():x}"
        sent_role = False

        def base(obj: str) -> dict:
            return {"id": cid, "object": obj, "created": int(time.time()), "model": state.served_model}

        def finish(text: str, meta: dict) -> dict:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": meta.get("finish_reason"),
            }
            return {**base("chat.completion"), "choices": [choice], "usage": usage(meta)}

        def chunk(text: str, reason: str | None, meta: dict | None) -> dict:
            nonlocal sent_role
            if meta and meta.get("usage_only"):
                return {**base("chat.completion.chunk"), "choices": [], "usage": usage(meta)}
            delta: dict = {"content": text}
            if not sent_role:
                delta["role"] = "assistant"
                sent_role = True
            choice = {"index": 0, "delta": delta, "finish_reason": reason}
            return {**base("chat.completion.chunk"), "choices": [choice]}

        return await run(request, "chat", lambda b: parse_chat(b, state.served_model), finish, chunk)

    @app.get("/health")
    async def health() -> Response:
        if client.failed:
            return JSONResponse({"status": "failed", "reason": client.failed}, status_code=503)
        if not state.healthy:
            return JSONResponse({"status": "loading"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models() -> Response:
        info = client.ready_info
        card = {
            "id": state.served_model,
            "object": "model",
            "created": state.created,
            "owned_by": "lazyrt",
            "max_model_len": info.max_context if info else None,
        }
        return JSONResponse({"object": "list", "data": [card]})

    async def control(op: str) -> dict:
        if client.ready_info is None:
            raise ApiError(503, "the model is still loading", None, "server_error")
        try:
            return await client.control(op)
        except (asyncio.TimeoutError, RuntimeError) as e:
            raise ApiError(503, f"the scheduler did not answer: {e}", None, "server_error") from e

    @app.get("/cache_stats")
    async def cache_stats() -> Response:
        try:
            return JSONResponse(await control("stats"))
        except ApiError as e:
            return error_response(e)

    @app.post("/flush_cache")
    async def flush_cache() -> Response:
        try:
            return JSONResponse(await control("flush"))
        except ApiError as e:
            return error_response(e)

    @app.get("/metrics")
    async def metrics() -> Response:
        stats: dict = {}
        if client.ready_info is not None and not client.failed:
            try:
                stats = await client.control("stats", timeout=10)
            except (asyncio.TimeoutError, RuntimeError):
                stats = {}
        return Response(state.metrics.render(stats), media_type="text/plain; version=0.0.4")

    return app
