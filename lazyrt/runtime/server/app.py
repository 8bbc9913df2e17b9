"""The HTTP app: lazyrt's /generate, the OpenAI-compatible endpoints, health, metrics, cache control
(and /v1/documents, from document_routes.py).

Handlers only validate, submit to the pipeline and format what comes back; every request is one
GenerateReq and one stream of TextOuts. A client that goes away aborts its request, which frees
its pages in the scheduler.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from lazyrt.api_key import ApiKeyGuard
from lazyrt.runtime.ipc.messages import ErrorOut, GenerateReq, TextOut
from lazyrt.runtime.server.doc_owners import DOC_OWNERS_HEADER, doc_owners_header
from lazyrt.runtime.server.document_routes import add_document_routes
from lazyrt.runtime.server.errors import check_json
from lazyrt.runtime.server.metrics import ErrorCounter, ServerMetrics
from lazyrt.runtime.server.pipeline_client import PipelineClient
from lazyrt.runtime.server.protocol import (
    ApiError,
    Parsed,
    bad,
    parse_chat,
    parse_completion,
    parse_generate,
    parse_score,
)
from lazyrt.runtime.server.tool_grammar import tool_call_grammar
from lazyrt.runtime.tokenizer.tool_calls import ToolCall, ToolCallStream, parse_tool_calls

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


def out_error(out: ErrorOut, endpoint: str) -> ApiError:
    """The HTTP error for an ErrorOut. The scheduler names a SamplingParams field as /generate spells
    it (sampling_params.retrieval_top_k); the OpenAI endpoints take those fields at the top level."""
    param, message = out.param, out.message
    if endpoint != "generate" and param is not None and param.startswith("sampling_params."):
        param = param.removeprefix("sampling_params.")
        message = message.replace(out.param, param)
    return ApiError(out.status, message, param, out.type)


def error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


class _Tracker:
    """Per-request timing for the TTFT / inter-token histograms."""

    def __init__(
        self,
        metrics: ServerMetrics,
        received_at: float = 0.0,
        echo_only: bool = False,
        counts_prompt: bool = True,
    ):
        self.metrics = metrics
        self.echo_only = echo_only  # the one token generated is dropped: usage counts none
        self.counts_prompt = counts_prompt  # the first of a prompt's n completions: as usage counts it
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
        if self.echo_only:
            meta["completion_tokens"] = 0
        m = self.metrics
        m.requests.labels(endpoint, out.finish_reason).inc()
        if self.counts_prompt:
            m.prompt_tokens.inc(meta.get("prompt_tokens", 0))
            m.cached_tokens.inc(meta.get("cached_tokens", 0))
        m.generation_tokens.inc(meta.get("completion_tokens", 0))
        m.e2e.observe(time.perf_counter() - self.start)
        if isinstance(meta.get("timings_ms"), dict) and self.received_at and self.first_at:
            # "ttft" is the whole server-side time to first token; "to_http" the way back (scheduler ->
            # detokenizer -> HTTP), what the parts before it leave of ttft
            ttft = round((self.first_at - self.received_at) * 1e3, 3)
            t = meta["timings_ms"]
            parts = [t.get(k) for k in ("tokenize", "queue", "prefill")]
            back = round(ttft - sum(parts), 3) if None not in parts else None
            meta["timings_ms"] = {**t, "ttft": ttft, "to_http": back}
        return meta


def usage(meta: dict) -> dict:
    p, c = meta.get("prompt_tokens", 0), meta.get("completion_tokens", 0)
    return {
        "prompt_tokens": p,
        "completion_tokens": c,
        "total_tokens": p + c,
        "prompt_tokens_details": {"cached_tokens": meta.get("cached_tokens", 0)},
    }


@dataclass
class Choice:
    """One completion of a request (or, streaming, one chunk of it)."""

    index: int
    prompt_index: int = 0  # which prompt of a /v1/completions batch it answers
    text: str = ""
    logprobs: list[dict] | None = None  # per token (TextOut.logprobs), when asked
    finish_reason: str | None = None
    meta: dict | None = None  # when finished: the request's meta (usage, timings)

    def add(self, out: TextOut) -> None:
        self.text += out.text
        if out.logprobs is not None:
            self.logprobs = (self.logprobs or []) + out.logprobs
        self.finish_reason = out.finish_reason


def total_usage(choices: list[Choice]) -> dict:
    """usage over completions: each prompt's tokens counted once (n samples share it)."""
    seen: set[int] = set()
    total = {"prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0}
    for c in choices:
        m = c.meta or {}
        total["completion_tokens"] += m.get("completion_tokens", 0)
        if c.prompt_index not in seen:
            seen.add(c.prompt_index)
            total["prompt_tokens"] += m.get("prompt_tokens", 0)
            total["cached_tokens"] += m.get("cached_tokens", 0)
    return usage(total)


def chat_logprobs(entries: list[dict] | None) -> dict | None:
    if entries is None:
        return None
    keep = lambda e: {"token": e["token"], "logprob": e["logprob"], "bytes": e["bytes"]}  # noqa: E731
    return {"content": [{**keep(e), "top_logprobs": [keep(t) for t in e["top_logprobs"]]} for e in entries]}


def completion_logprobs(
    entries: list[dict] | None, offset: int, sampled_from: int | None = None
) -> dict | None:
    """The legacy completions shape; text_offset counts from `offset` (the choice's tokens so far).
    sampled_from: entries from this index on are sampled tokens (before it: echoed prompt tokens), whose
    top_logprobs hold the sampled token too, as OpenAI and vLLM give it (up to logprobs + 1 of them)."""
    if entries is None:
        return None
    out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for i, e in enumerate(entries):
        out["tokens"].append(e["token"])
        out["token_logprobs"].append(e["logprob"])
        # the prompt's first token (echo) has no logprob, and OpenAI gives null alternatives too
        top = None if e["logprob"] is None else {t["token"]: t["logprob"] for t in e["top_logprobs"]}
        if top is not None and sampled_from is not None and i >= sampled_from:
            top.setdefault(e["token"], e["logprob"])
        out["top_logprobs"].append(top)
        out["text_offset"].append(offset)
        offset += len(e["token"])
    return out


def cited(meta: dict | None) -> dict:
    """A finished choice's `citations` (asked with citations: true): documents by attention share."""
    if meta is None or "citations" not in meta:
        return {}
    return {"citations": meta["citations"]}


def _sse(obj: Any) -> bytes:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode()


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="lazyrt", docs_url=None, redoc_url=None)
    client = state.client

    if state.api_key:
        app.add_middleware(ApiKeyGuard, api_key=state.api_key)
    app.add_middleware(ErrorCounter, metrics=state.metrics)  # outermost: a 401 counts too

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
        except ValueError as e:  # not JSON, not UTF-8, or an integer of over 4300 digits
            raise ApiError(400, f"request body is not valid JSON: {e}", "body") from e
        except RecursionError as e:
            raise ApiError(400, "request body is nested too deeply", "body") from e
        if not isinstance(body, dict):
            raise ApiError(400, "request body must be a JSON object", "body")
        check_json(body)  # lone surrogates, integers msgpack cannot carry: a 400 here, not a 500 later
        return body

    add_document_routes(app, client, read_json)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> Response:
        """Starlette's own errors (no such route: 404, a route without this method: 405) in the
        OpenAI error shape the routes answer with."""
        kind = "server_error" if e.status_code >= 500 else "invalid_request_error"
        msg = f"{e.detail}: {request.method} {request.url.path}"
        return JSONResponse(ApiError(e.status_code, msg, None, kind).body(), e.status_code, e.headers)

    def submit_all(reqs: list[GenerateReq]) -> list[asyncio.Queue]:
        """Submit each request (rids set); if one cannot be sent, abort those sent before it."""
        queues: list[asyncio.Queue] = []
        try:
            for req in reqs:
                queues.append(client.submit(req))
        except Exception:
            for req in reqs[: len(queues)]:
                client.abort(req.rid)
            raise
        return queues

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
        finish: Callable[[list[Choice]], dict],
        chunk: Callable[[Choice, dict | None], dict | None],
    ) -> Response:
        """Submit the request's completions (n per prompt, several prompts on /v1/completions) and
        answer with all of them: one JSON body, or one SSE stream where each chunk names its choice.
        Any completion failing before its first token fails the whole request (a 4xx naming the
        field); the others are aborted."""
        received_at = time.time()
        try:
            if not state.healthy and client.ready_info is None:
                raise ApiError(503, "the model is still loading", None, "server_error")
            if client.failed:
                raise ApiError(503, client.failed, None, "server_error")
            parsed = parse(await read_json(request))
            reqs = parsed.requests()
            owners = doc_owners_header(request.headers.get(DOC_OWNERS_HEADER))
            for req in reqs if owners is not None else []:
                n = len(req.docs or [])
                if len(owners) != n:
                    raise ApiError(400, f"{DOC_OWNERS_HEADER}: {len(owners)} owners for {n} documents",
                                   DOC_OWNERS_HEADER)  # fmt: skip
                req.doc_owners = owners
        except ApiError as e:
            return error_response(e)
        for req in reqs:
            req.rid, req.received_at = client.new_rid(), received_at
        rids = [req.rid for req in reqs]
        queues = submit_all(reqs)  # all at once: they batch together (and share their documents' KV)
        per_prompt = len(reqs) // (1 + len(parsed.more))  # n
        trackers = [_Tracker(state.metrics, received_at, parsed.echo_only, i % per_prompt == 0)
                    for i in range(len(reqs))]  # fmt: skip
        pending = set(range(len(reqs)))  # choices not finished: aborted if we stop early

        def new_choice(i: int) -> Choice:
            return Choice(i, i // per_prompt)

        def give_up(status: int | None = None) -> Response:
            for i in pending:
                client.abort(rids[i])
            if status == 499:
                state.metrics.aborts.inc()
                return Response(status_code=499)
            return Response(status_code=500)

        firsts: list[TextOut] = []
        for i, q in enumerate(queues):
            first = await next_out(q, request)
            if first is None:
                return give_up(499)
            if isinstance(first, ErrorOut):
                pending.discard(i)
                give_up()
                return error_response(out_error(first, endpoint))
            trackers[i].saw(first)
            firsts.append(first)
        if not parsed.stream:
            choices = []
            for i, (q, out) in enumerate(zip(queues, firsts)):
                c = new_choice(i)
                c.add(out)
                while out.finish_reason is None:
                    out = await next_out(q, request)
                    if out is None:
                        return give_up(499)
                    if isinstance(out, ErrorOut):
                        pending.discard(i)
                        give_up()
                        return error_response(out_error(out, endpoint))
                    trackers[i].saw(out)
                    c.add(out)
                pending.discard(i)
                c.meta = {**trackers[i].finish(endpoint, out), "token_ids": out.token_ids}
                choices.append(c)
            return JSONResponse(finish(choices))

        merged: asyncio.Queue = asyncio.Queue()
        for i, out in enumerate(firsts):
            merged.put_nowait((i, out))

        async def pump(i: int, q: asyncio.Queue) -> None:
            out = firsts[i]
            while isinstance(out, TextOut) and out.finish_reason is None:
                out = await q.get()
                await merged.put((i, out))

        async def events() -> AsyncIterator[bytes]:
            pumps = [asyncio.create_task(pump(i, q)) for i, q in enumerate(queues)]
            done: list[Choice] = []
            try:
                while pending:
                    i, out = await merged.get()
                    if isinstance(out, ErrorOut):  # (after the 200: ErrorCounter did not see it)
                        state.metrics.errors.labels(endpoint, str(out.status)).inc()
                        yield _sse(out_error(out, endpoint).body())
                        break
                    if out is not firsts[i]:
                        trackers[i].saw(out)
                    c = new_choice(i)
                    c.add(out)
                    meta = None
                    if out.finish_reason is not None:
                        meta = trackers[i].finish(endpoint, out)
                        pending.discard(i)
                        c.meta = meta
                        done.append(c)
                    body = chunk(c, meta)
                    if body is not None:
                        yield _sse(body)
                if not pending and parsed.include_usage:
                    yield _sse(chunk(Choice(-1, meta={"usage": total_usage(done)}), {"usage_only": True}))
                yield b"data: [DONE]\n\n"
            finally:
                for t in pumps:
                    t.cancel()
                if pending:  # client gone (or cancelled): free the requests' pages
                    give_up(499)

        return StreamingResponse(events(), media_type="text/event-stream")

    # ---- endpoints ----------------------------------------------------------------------------
    @app.post("/generate")
    async def generate(request: Request) -> Response:
        def one(c: Choice) -> dict:
            out = {"text": c.text, "token_ids": (c.meta or {}).get("token_ids")}
            if c.logprobs is not None:
                out["logprobs"] = c.logprobs
            return out

        def finish(choices: list[Choice]) -> dict:
            first = choices[0]
            meta = {k: v for k, v in (first.meta or {}).items() if k != "token_ids"}
            body = {**one(first), "meta": meta}
            if len(choices) > 1:  # n > 1: every completion, as Engine.generate gives them
                body["outputs"] = [{**one(c), "finish_reason": c.finish_reason} for c in choices]
            return body

        def chunk(c: Choice, meta: dict | None) -> dict | None:
            if meta and meta.get("usage_only"):
                return None
            out: dict = {"index": c.index, "text": c.text, "finish_reason": c.finish_reason}
            if c.logprobs is not None:
                out["logprobs"] = c.logprobs
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
            for req in reqs:
                req.rid = client.new_rid()
            queues = submit_all(reqs)  # all at once: they batch together in the scheduler
            rids = [req.rid for req in reqs]
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
            return error_response(e)
        scores = [sum(lp) / len(lp) if lp else None for lp in per_token]
        return JSONResponse({"scores": scores, "logprobs": per_token})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        cid = f"cmpl-{time.time_ns():x}"
        created = int(time.time())  # every chunk of a stream carries the same one, as OpenAI's do
        # streaming: each choice's tokens so far (logprobs text_offset counts their texts, as unstreamed:
        # the text sent so far lags behind while a stop string may be arriving)
        offsets: dict[int, int] = {}
        asked: list[Parsed] = []

        def parse(body: dict) -> Parsed:
            asked.append(parse_completion(body, state.served_model))
            return asked[0]

        def base(obj: str) -> dict:
            return {"id": cid, "object": obj, "created": created, "model": state.served_model}

        def echoed(c: Choice) -> tuple[str, list[dict] | None, int]:
            """The choice's text and logprobs, the prompt's first when echoing, and where its sampled
            tokens' entries start."""
            m = c.meta or {}
            if "echo_text" not in m:
                return c.text, c.logprobs, 0
            if asked[0].echo_only:  # (usage: the tracker counted no completion tokens)
                lps = m.get("prompt_logprobs")
                return m["echo_text"], lps, len(lps or [])
            prompt = m.get("prompt_logprobs") or []
            lps = None if c.logprobs is None else prompt + c.logprobs
            return m["echo_text"] + c.text, lps, len(prompt)

        def finish(choices: list[Choice]) -> dict:
            body = []
            for c in choices:
                text, lps, sampled = echoed(c)
                body.append({"index": c.index, "text": text, "logprobs": completion_logprobs(lps, 0, sampled),
                             "finish_reason": c.finish_reason, **cited(c.meta)})  # fmt: skip
            return {**base("text_completion"), "choices": body, "usage": total_usage(choices)}

        def chunk(c: Choice, meta: dict | None) -> dict:
            if meta and meta.get("usage_only"):
                return {**base("text_completion"), "choices": [], "usage": c.meta["usage"]}
            p = asked[0]
            text = "" if p.echo_only else c.text
            if c.index not in offsets and p.req.echo:  # streaming echo: the prompt text comes first
                text = [p.req, *p.more][c.prompt_index].text + text
            at = offsets.get(c.index, 0)
            offsets[c.index] = at + sum(len(e["token"]) for e in c.logprobs or [])
            choice = {"index": c.index, "text": text, "logprobs": completion_logprobs(c.logprobs, at, 0),
                      "finish_reason": c.finish_reason, **cited(meta)}  # fmt: skip
            return {**base("text_completion"), "choices": [choice]}

        return await run(request, "completions", parse, finish, chunk)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        cid = f"chatcmpl-{time.time_ns():x}"
        created = int(time.time())  # every chunk of a stream carries the same one, as OpenAI's do
        sent_role: set[int] = set()
        asked: list[Parsed] = []
        streams: dict[int, ToolCallStream] = {}  # streaming with tools: per choice
        fmt = client.ready_info.tool_format if client.ready_info is not None else None

        def parse(body: dict) -> Parsed:
            p = parse_chat(body, state.served_model)
            if p.req.tools and fmt is None:
                raise ApiError(400, "tools: this model's chat template has no tool support", "tools")
            for i, m in enumerate(p.req.messages if fmt is None else []):  # the template would drop them
                if m.get("tool_calls"):
                    raise bad(f"messages[{i}].tool_calls", "this model's chat template has no tool support")
            if p.forced_tool is not None:
                grammar = tool_call_grammar(p.req.tools, p.forced_tool, fmt, p.parallel_tool_calls)
                try:
                    p.req.sampling = dataclasses.replace(p.req.sampling, grammar=grammar)
                except ValueError as e:  # a tool's parameters schema llguidance cannot take
                    raise ApiError(400, f"tool_choice: cannot force this call: {e}", "tool_choice") from e
            asked.append(p)
            return p

        def base(obj: str) -> dict:
            return {"id": cid, "object": obj, "created": created, "model": state.served_model}

        def calls_out(calls: list[ToolCall], streaming: bool = False) -> list[dict]:
            if not asked[0].parallel_tool_calls:
                calls = calls[:1]
            out = []
            for k, c in enumerate(calls):
                call = {"id": f"call_{time.time_ns():x}{k}", "type": "function",
                        "function": {"name": c.name, "arguments": c.arguments}}  # fmt: skip
                out.append({"index": k, **call} if streaming else call)
            return out

        def finish(choices: list[Choice]) -> dict:
            body = []
            for c in choices:
                message: dict = {"role": "assistant", "content": c.text}
                reason = c.finish_reason
                if asked[0].req.tools:
                    content, calls = parse_tool_calls(c.text, fmt)
                    if calls:
                        message = {"role": "assistant", "content": content, "tool_calls": calls_out(calls)}
                        reason = "tool_calls" if reason == "stop" else reason
                body.append({"index": c.index, "message": message, "logprobs": chat_logprobs(c.logprobs),
                             "finish_reason": reason, **cited(c.meta)})  # fmt: skip
            return {**base("chat.completion"), "choices": body, "usage": total_usage(choices)}

        def chunk(c: Choice, meta: dict | None) -> dict:
            if meta and meta.get("usage_only"):
                return {**base("chat.completion.chunk"), "choices": [], "usage": c.meta["usage"]}
            delta: dict = {"content": c.text}
            reason = c.finish_reason
            if asked[0].req.tools:
                stream = streams.setdefault(c.index, ToolCallStream(fmt))
                delta["content"] = stream.feed(c.text)
                if reason is not None:
                    rest, calls = stream.finish()
                    delta["content"] += rest
                    if calls:
                        delta["tool_calls"] = calls_out(calls, streaming=True)
                        reason = "tool_calls" if reason == "stop" else reason
            if c.index not in sent_role:
                delta["role"] = "assistant"
                sent_role.add(c.index)
            choice = {"index": c.index, "delta": delta, "logprobs": chat_logprobs(c.logprobs),
                      "finish_reason": reason, **cited(meta)}  # fmt: skip
            return {**base("chat.completion.chunk"), "choices": [choice]}

        return await run(request, "chat", parse, finish, chunk)

    @app.get("/health")
    async def health() -> Response:
        if client.failed:
            return JSONResponse({"status": "failed", "reason": client.failed}, status_code=503)
        if not state.healthy:
            return JSONResponse({"status": "loading"}, status_code=503)
        return JSONResponse({"status": "ok"})

    def model_card() -> dict:
        info = client.ready_info
        return {
            "id": state.served_model,
            "object": "model",
            "created": state.created,
            "owned_by": "lazyrt",
            "max_model_len": info.max_context if info else None,
        }

    @app.get("/v1/models")
    async def models() -> Response:
        return JSONResponse({"object": "list", "data": [model_card()]})

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> Response:  # OpenAI's "retrieve model" (ids may hold a "/")
        if model != state.served_model:
            msg = f"model {model!r} does not exist; this server serves {state.served_model!r}"
            return error_response(ApiError(404, msg, "model", "model_not_found"))
        return JSONResponse(model_card())

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
