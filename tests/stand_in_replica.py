"""A stand-in for a lazyrt.launch replica, for the router's tests and benchmarks/experiments/router_relay.py:
no model; /health (after app.state.health_delay seconds), /cache_stats, and POST /generate answering
`events` SSE events of ~60 bytes, `interval` seconds apart (one a token, as a decoding replica sends
them), then [DONE]. app.state.open / .most count the answers streaming now / at most at once.

    python tests/stand_in_replica.py PORT EVENTS INTERVAL      (serves it on 127.0.0.1:PORT)
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time

import uvicorn
from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from server_util import free_port

EVENT = b'data: {"index": 0, "text": " tok", "finish_reason": null, "meta": {"k": 1}}\n\n'


class Served:
    """An ASGI app (a stand-in replica, a router) on a loopback port, in a thread."""

    def __init__(self, app: FastAPI):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cfg = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(cfg)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)



def stand_in_replica(events: int, interval: float) -> FastAPI:
    app = FastAPI()
    app.state.open = 0
    app.state.most = 0
    app.state.health_delay = 0.0

    @app.get("/health")
    async def health():
        await asyncio.sleep(app.state.health_delay)
        return {"status": "ok"}

    @app.get("/cache_stats")
    async def cache_stats():
        return {"chunk_pages": 0, "free_pages": 1000, "page_size": 16, "eviction_policy": "lfu"}

    @app.post("/generate")
    async def generate():
        async def body():
            app.state.open += 1
            app.state.most = max(app.state.most, app.state.open)
            try:
                for _ in range(events):
                    yield EVENT
                    await asyncio.sleep(interval)
                yield b"data: [DONE]\n\n"
            finally:
                app.state.open -= 1

        return StreamingResponse(body(), media_type="text/event-stream")

    return app


if __name__ == "__main__":
    import uvicorn

    port, events, interval = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    uvicorn.run(stand_in_replica(events, interval), host="127.0.0.1", port=port, log_level="warning")
