"""/v1/documents through the router.

Every replica registers each document (each keeps a registry, or they share one file), so a request
naming it by id can go anywhere; `precompute` runs on one replica only: the one a request naming the
document would be sent to, whose view then holds it. Reads go to one healthy replica; deletes to all.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from urllib.parse import quote

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from lazyrt.documents import DocumentError, check_precompute
from lazyrt.router.policy import doc_key


def add_router_document_routes(
    app: FastAPI,
    state,  # RouterState (typed loosely: app.py imports this module)
    http: httpx.AsyncClient,
    headers: dict[str, str],
    error: Callable[[int, str, str | None], JSONResponse],
) -> None:
    def live() -> list[str]:
        return [r.url for r in sorted(state.replicas, key=lambda r: r.in_flight) if r.healthy]

    json_headers = {"content-type": "application/json", **headers}

    async def send(
        method: str, url: str, path: str, body: dict | None = None, params: dict | None = None
    ) -> httpx.Response | None:
        # the body as json.dumps writes it (httpx's json= raises on NaN and lone surrogates, a 500: the
        # replica reads them back, and its 400 names the field)
        content = None if body is None else json.dumps(body).encode()
        try:
            return await http.request(method, url + path, content=content, params=params, timeout=600,
                                      headers=headers if body is None else json_headers)  # fmt: skip
        except httpx.HTTPError:
            return None

    def relay(resp: httpx.Response) -> Response:
        kind = resp.headers.get("content-type")
        return Response(resp.content, status_code=resp.status_code, media_type=kind)

    @app.post("/v1/documents")
    async def add(request: Request) -> Response:
        urls = live()
        if not urls:
            return error(503, "no replica is healthy", None)
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError):  # not JSON, not UTF-8, nested too deeply
            body = None
        if not isinstance(body, dict):  # the replica names what is wrong with the body
            try:
                resp = await http.post(urls[0] + "/v1/documents", content=raw, headers=json_headers,
                                       timeout=60)  # fmt: skip
            except httpx.HTTPError:
                return error(503, "the replica did not answer", None)
            return relay(resp)
        pre = body.get("precompute")
        try:  # before registering anything (the replicas never see it otherwise)
            check_precompute(pre)
        except DocumentError as e:
            return error(400, str(e), e.param)
        plain = {k: v for k, v in body.items() if k != "precompute"}
        first = await send("POST", urls[0], "/v1/documents", plain)
        if first is None:
            return error(503, f"replica {urls[0]} did not answer", None)
        if first.status_code != 200:
            return relay(first)  # a 4xx naming the field (or a 409 on a reused id)
        doc = first.json()
        plain["id"] = doc["id"]
        rest = await asyncio.gather(*(send("POST", u, "/v1/documents", plain) for u in urls[1:]))
        failed = [u for u, r in zip(urls[1:], rest) if r is None or r.status_code != 200]
        if failed:
            why = f"{doc['id']} is registered on {urls[0]} but not on {', '.join(failed)}"
            return error(502, why, None)
        key, size = doc_key({"id": doc["id"]}), int(doc.get("tokens", 0))
        state.policy.id_tokens[doc["id"]] = size
        if pre:
            load = {r.url: r.in_flight for r in state.replicas if r.healthy}
            target = state.policy.choose([key], load, [size]).replica
            warm = await send("POST", target, "/v1/documents", {**plain, "precompute": pre})
            if warm is None:
                why = f"{doc['id']} is registered; precompute on {target} got no answer"
                return error(503, why, "precompute")
            if warm.status_code != 200:
                return relay(warm)
            state.policy.record(target, [key], [size])
            doc = warm.json()
            doc["replica"] = target
        return JSONResponse(doc)

    @app.get("/v1/documents")
    async def list_documents(request: Request) -> Response:
        return await read("/v1/documents", request)

    @app.get("/v1/documents/{doc_id}")
    async def get_document(doc_id: str, request: Request) -> Response:
        return await read(f"/v1/documents/{quote(doc_id, safe='')}", request)

    async def read(path: str, request: Request) -> Response:
        for url in live():
            resp = await send("GET", url, path, params=dict(request.query_params))
            if resp is not None:
                return relay(resp)
        return error(503, "no replica answered", None)

    @app.delete("/v1/documents/{doc_id}")
    async def delete_document(doc_id: str, request: Request) -> Response:
        """Deleted on every replica; a 200 if any held it (replicas sharing a store file: the first)."""
        urls = live()
        path = f"/v1/documents/{quote(doc_id, safe='')}"  # (an id's "#" or "?" must not cut the path)
        params = dict(request.query_params)
        done = await asyncio.gather(*(send("DELETE", u, path, params=params) for u in urls))
        answered = [r for r in done if r is not None]
        if not answered:
            return error(503, "no replica answered", None)
        ok = [r for r in answered if r.status_code == 200]
        failed = [u for u, r in zip(urls, done) if r is None or r.status_code >= 500]
        if ok and failed:  # deleted on some replicas only: requests sent to the others still find it
            deleted = [u for u, r in zip(urls, done) if r is not None and r.status_code == 200]
            why = f"{doc_id} is deleted on {', '.join(deleted)} but not on {', '.join(failed)}"
            return error(502, why, None)
        if ok:
            state.policy.id_tokens.pop(doc_id, None)
        return relay(ok[0] if ok else answered[0])
