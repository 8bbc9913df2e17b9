"""/v1/documents: register, read, list and delete documents that requests then name by id.

Bodies and query strings are checked here (4xx naming the field); the store itself lives with the
tokenizer (it tokenizes what is registered, and looks ids up when a request uses them): on this
process's tokenizing thread, or in the tokenizer process (--no-tokenizer-in-http). Each operation
is one DocumentReq there and back, and sqlite never runs on this event loop.

precompute: after registering, one request through the normal pipeline: /generate's RAG prompt with
the document alone, an empty question and max_tokens 1 (optionally under a system prompt). Its
prefill puts the document's chunk KV in the chunk table, so the first real request with the same
system prompt (none: the chat template's default) hits it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from lazyrt.documents import (
    DEFAULT_LIST_LIMIT,
    MAX_LIST_LIMIT,
    DocumentError,
    check_id,
    check_metadata,
    check_precompute,
    check_text,
)
from lazyrt.runtime.ipc.messages import DocumentReq, DocumentResp, ErrorOut, GenerateReq
from lazyrt.runtime.server.errors import ApiError
from lazyrt.runtime.server.pipeline_client import PipelineClient
from lazyrt.runtime.server.protocol import bad
from lazyrt.sampling_params import SamplingParams

T = TypeVar("T")
_ADD_KEYS = ("text", "id", "metadata", "precompute")
_ERROR_TYPES = {404: "not_found_error", 409: "conflict_error"}


def _error(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


def _api_error(resp: DocumentResp) -> ApiError:
    kind = "server_error" if resp.status >= 500 else _ERROR_TYPES.get(resp.status, "invalid_request_error")
    return ApiError(resp.status, resp.message, resp.param, kind)


def _checked(fn: Callable[..., T], *args: object) -> T:
    try:
        return fn(*args)
    except DocumentError as e:
        raise ApiError(400, str(e), e.param) from e


def _query(request: Request, allowed: tuple[str, ...]) -> dict[str, str]:
    q = dict(request.query_params)
    unknown = sorted(set(q) - set(allowed))
    if unknown:
        raise bad(unknown[0], f"unknown query parameter (this route takes {', '.join(allowed) or 'none'})")
    for key in q:  # (a dict keeps the last value: the others would be dropped without a word)
        if len(request.query_params.getlist(key)) > 1:
            raise bad(key, "given more than once")
    return q


def _flag(q: dict[str, str], key: str) -> bool:
    v = q.get(key, "false").lower()
    if v not in ("true", "false", "1", "0"):
        raise bad(key, f"must be true or false, got {q[key]!r}")
    return v in ("true", "1")


def parse_add(body: dict) -> tuple[DocumentReq, str | None, bool]:
    """POST /v1/documents body -> (the add request, precompute's system prompt, precompute?)."""
    unknown = sorted(k for k in body if k not in _ADD_KEYS)
    if unknown:
        raise bad(unknown[0], f"unknown field (a document takes {', '.join(_ADD_KEYS)})")
    if "text" not in body:
        raise bad("text", "is required")
    text = _checked(check_text, body["text"])
    doc_id = None if body.get("id") is None else _checked(check_id, body["id"])
    metadata = None if body.get("metadata") is None else _checked(check_metadata, body["metadata"])
    pre, system = _checked(check_precompute, body.get("precompute"))
    req = DocumentReq(-1, "add", id=doc_id, text=text, metadata=metadata)
    return req, system, pre


def add_document_routes(
    app: FastAPI, client: PipelineClient, read_json: Callable[[Request], Awaitable[dict]]
) -> None:
    async def call(req: DocumentReq) -> dict:
        if client.ready_info is None:
            raise ApiError(503, "the model is still loading", None, "server_error")
        if client.failed:
            raise ApiError(503, client.failed, None, "server_error")
        try:
            resp = await client.document(req)
        except (asyncio.TimeoutError, RuntimeError) as e:
            raise ApiError(503, f"the tokenizer did not answer: {e}", None, "server_error") from e
        if resp.status != 200:
            raise _api_error(resp)
        return resp.data or {}

    async def precompute(doc_id: str, system: str | None) -> dict:
        """A 1-token RAG request with the document alone: its prefill fills the chunk table."""
        req = GenerateReq(client.new_rid(), SamplingParams(max_tokens=1), text="", docs=[{"id": doc_id}],
                          system=system, text_mode="rag", param="precompute")  # fmt: skip
        q = client.submit(req)
        try:
            while True:
                out = await q.get()
                if isinstance(out, ErrorOut):
                    why = f"{doc_id} is registered, but precompute failed: {out.message}"
                    raise ApiError(out.status, why, "precompute", out.type)
                if out.finish_reason is not None:
                    break
        except asyncio.CancelledError:
            client.abort(req.rid)
            raise
        meta = out.meta or {}
        return {k: meta.get(k, 0) for k in ("prompt_tokens", "cached_tokens", "chunk_hits", "chunk_misses")}

    @app.post("/v1/documents")
    async def add(request: Request) -> Response:
        """Register a document: {"text", "id"?, "metadata"?, "precompute"?} -> the document object
        (without its text); the same text under the same id again returns it (metadata replaced
        when given). With precompute, "precompute" reports the warm-up request's chunk hits/misses."""
        try:
            req, system, pre = parse_add(await read_json(request))
            doc = await call(req)
            if pre:
                doc["precompute"] = await precompute(doc["id"], system)
        except ApiError as e:
            return _error(e)
        return JSONResponse(doc)

    @app.get("/v1/documents")
    async def list_documents(request: Request) -> Response:
        """A page in registration order: ?limit (1-100, default 20), ?after=<last id of the previous
        page>, ?include_text; {"object": "list", "data", "first_id", "last_id", "has_more"}."""
        try:
            q = _query(request, ("limit", "after", "include_text"))
            limit = q.get("limit", str(DEFAULT_LIST_LIMIT))
            if not (limit.isascii() and limit.isdigit()) or len(limit) > 9:  # int() takes other digits
                raise bad("limit", f"must be an integer in [1, {MAX_LIST_LIMIT}], got {limit!r}")
            after = q.get("after")
            if after is not None:
                _checked(check_id, after, "after")
            req = DocumentReq(-1, "list", include_text=_flag(q, "include_text"), limit=int(limit))
            req.after = after
            return JSONResponse(await call(req))
        except ApiError as e:
            return _error(e)

    @app.get("/v1/documents/{doc_id}")
    async def get_document(doc_id: str, request: Request) -> Response:
        """The document object: id, object, created, tokens, metadata; text with ?include_text=true."""
        try:
            q = _query(request, ("include_text",))
            _checked(check_id, doc_id)
            text = _flag(q, "include_text")
            return JSONResponse(await call(DocumentReq(-1, "get", id=doc_id, include_text=text)))
        except ApiError as e:
            return _error(e)

    @app.delete("/v1/documents/{doc_id}")
    async def delete_document(doc_id: str, request: Request) -> Response:
        """Forget the document (requests naming it get a 404 after); its cached KV ages out as usual."""
        try:
            _query(request, ())
            _checked(check_id, doc_id)
            return JSONResponse(await call(DocumentReq(-1, "delete", id=doc_id)))
        except ApiError as e:
            return _error(e)
