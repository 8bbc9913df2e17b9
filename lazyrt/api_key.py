"""ApiKeyGuard: the `--api-key` check of the server and the router, as plain ASGI middleware.

Every HTTP request but GET /health needs `Authorization: Bearer KEY`; others get a 401 in the
OpenAI error shape. Plain ASGI rather than Starlette's BaseHTTPMiddleware (`@app.middleware`):
that one passes every chunk of a streamed answer through an extra task and memory stream, which
was the router's largest cost per relayed event after HTTP parsing itself
(benchmarks/experiments/router_relay.py under cProfile).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[dict]], Callable[[dict], Awaitable[None]]], Awaitable[None]]

_BODY = json.dumps(
    {"error": {"message": "missing or wrong API key (Authorization: Bearer ...)",
               "type": "authentication_error", "param": None, "code": 401}}  # fmt: skip
).encode()

_HEADERS = [(b"content-type", b"application/json"), (b"content-length", str(len(_BODY)).encode())]


class ApiKeyGuard:
    def __init__(self, app: ASGIApp, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] != "/health":
            auth = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            if auth != self.expected:
                await send({"type": "http.response.start", "status": 401, "headers": _HEADERS})
                await send({"type": "http.response.body", "body": _BODY})
                return
        await self.app(scope, receive, send)
