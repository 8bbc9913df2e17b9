"""ApiKeyGuard (lazyrt/api_key.py), the --api-key check of the server and the router, on a stand-in
app: 401 in the OpenAI error shape without the right bearer token, /health open, streamed answers
pass through whole."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from fastapi.testclient import TestClient

from lazyrt.api_key import ApiKeyGuard


def app_with_key(key: str) -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.post("/generate")
    async def generate():
        async def body():
            for i in range(50):
                yield f"data: {i}\n\n".encode()

        return StreamingResponse(body(), media_type="text/event-stream")

    app.add_middleware(ApiKeyGuard, api_key=key)
    return app


def test_key_checked_health_open_streams_whole():
    client = TestClient(app_with_key("s3cret"))
    assert client.get("/health").status_code == 200
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
        r = client.post("/generate", headers=headers)
        assert r.status_code == 401
        err = r.json()["error"]
        assert err["type"] == "authentication_error" and err["code"] == 401 and "API key" in err["message"]
    r = client.post("/generate", headers={"Authorization": "Bearer s3cret"})
    assert r.status_code == 200
    assert r.text == "".join(f"data: {i}\n\n" for i in range(50))
