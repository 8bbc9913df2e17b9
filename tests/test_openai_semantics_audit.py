"""OpenAI-compatible response semantics (audit): what OpenAI / vLLM clients read from /v1/completions and
/v1/chat/completions beyond input validation. Every chunk of a stream carries the completion's one
`created`; a streamed completion's logprobs `text_offset` is the unstreamed one (token texts so far, not
the text sent so far, which lags while a stop string may be arriving); a completion's `top_logprobs`
hold the sampled token too (OpenAI: "up to logprobs+1 elements")."""

from __future__ import annotations

import asyncio
import json
import types

import httpx
import pytest

from lazyrt.runtime.ipc.messages import GenerateReq, TextOut, WorkerReady
from lazyrt.runtime.server import app as app_module
from lazyrt.runtime.server.app import ServerState, create_app


# ---- the app over ASGI with a fake pipeline (no processes) ----------------------------------------------
class _PiecesClient:
    """The PipelineClient's surface: each request answered with `pieces`, one TextOut each, the last
    finished."""

    def __init__(self, pieces: list[str]):
        self.failed, self.rid, self.pieces = None, 0, pieces
        self.ready_info = WorkerReady("m", "", 8, 16, 4096, 100, [0], "cpu")

    def new_rid(self) -> int:
        self.rid += 1
        return self.rid

    def submit(self, req: GenerateReq) -> asyncio.Queue:
        q: asyncio.Queue = asyncio.Queue()
        n = len(self.pieces)
        for i, p in enumerate(self.pieces):
            last = i == n - 1
            if not last:
                q.put_nowait(TextOut(req.rid, p, 1))
                continue
            meta = {"prompt_tokens": 3, "completion_tokens": n, "finish_reason": "length"}
            q.put_nowait(TextOut(req.rid, p, 1, "length", meta, list(range(n))))
        return q

    def abort(self, rid: int) -> None:
        pass


def _sse(path: str, body: dict, client: _PiecesClient) -> list[dict]:
    transport = httpx.ASGITransport(app=create_app(ServerState(client, "m", healthy=True)))

    async def go() -> str:
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            r = await http.post(path, json={**body, "stream": True})
            assert r.status_code == 200, r.text
            return r.text

    events = [e.removeprefix("data: ") for e in asyncio.run(go()).split("\n\n") if e.strip()]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


@pytest.mark.parametrize("path, body, obj", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "chat.completion.chunk"),
    ("/v1/completions", {"prompt": "hi"}, "text_completion"),
])  # fmt: skip
def test_stream_chunks_share_one_created(monkeypatch, path, body, obj):
    """OpenAI: "created: ... Each chunk has the same timestamp." A clock that moves 1.5 s at every read
    (a stream that outlasts a second) must not move it."""
    now = [1_700_000_000.0]

    def tick() -> float:
        now[0] += 1.5
        return now[0]

    clock = types.SimpleNamespace(time=tick, time_ns=lambda: int(now[0] * 1e9), perf_counter=tick)
    monkeypatch.setattr(app_module, "time", clock)
    chunks = _sse(path, {**body, "n": 2, "stream_options": {"include_usage": True}},
                  _PiecesClient(["a", "b", "c", "d"]))  # fmt: skip
    assert len(chunks) == 2 * 4 + 1 and not chunks[-1]["choices"]  # the usage chunk too
    assert {c["object"] for c in chunks} == {obj}
    assert len({c["id"] for c in chunks}) == 1
    assert len({c["created"] for c in chunks}) == 1, [c["created"] for c in chunks]


# ---- a real server ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(default_cpu_server):
    """conftest's default-model CPU server (shared with test_server / test_frontend), cache flushed."""
    assert httpx.post(default_cpu_server.url + "/flush_cache", timeout=30).status_code == 200
    return default_cpu_server


def _post(server, path: str, body: dict) -> dict:
    r = httpx.post(server.url + path, json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def _stream(server, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", server.url + path, json={**body, "stream": True}, timeout=300) as r:
        assert r.status_code == 200
        raw = r.read().decode()
    events = [e.removeprefix("data: ") for e in raw.split("\n\n") if e.strip()]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def _joined_logprobs(chunks: list[dict], index: int) -> dict:
    out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for ch in chunks:
        for c in ch["choices"]:
            if c["index"] == index and c["logprobs"] is not None:
                for k in out:
                    out[k] += c["logprobs"][k]
    return out


@pytest.mark.slow
def test_streamed_text_offset_equals_unstreamed(server):
    """A stop string that never comes (12 characters: the last 11 of the text are held back while
    streaming) leaves the text and its logprobs unchanged; text_offset streamed is text_offset whole,
    each token's place in the choice's text."""
    body = {"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0, "logprobs": 1, "n": 2,
            "stop": ["zqzqzqzqzqzq"]}  # fmt: skip
    whole = _post(server, "/v1/completions", body)
    chunks = _stream(server, "/v1/completions", body)
    for c in whole["choices"]:
        lp = c["logprobs"]
        assert "".join(lp["tokens"]) == c["text"] and c["finish_reason"] == "length"
        assert lp["text_offset"] == [sum(map(len, lp["tokens"][:i])) for i in range(len(lp["tokens"]))]
        got = _joined_logprobs(chunks, c["index"])
        assert got["tokens"] == lp["tokens"]
        assert got["token_logprobs"] == pytest.approx(lp["token_logprobs"], abs=1e-4)
        assert got["text_offset"] == lp["text_offset"]


@pytest.mark.slow
def test_completion_top_logprobs_hold_the_sampled_token(server):
    """OpenAI's completions logprobs: "the API will always return the logprob of the sampled token, so
    there may be up to logprobs+1 elements": with logprobs 0 the sampled token alone; sampled at a high
    temperature (not always the likeliest), it is there beside the top one, at its own logprob."""
    base = {"prompt": "My favourite animal is", "max_tokens": 6}
    greedy = _post(server, "/v1/completions", {**base, "temperature": 0, "logprobs": 0})
    lp = greedy["choices"][0]["logprobs"]
    assert lp["top_logprobs"] == [{t: v} for t, v in zip(lp["tokens"], lp["token_logprobs"])]
    body = {**base, "temperature": 2.0, "top_k": 50, "seed": 11, "logprobs": 1, "n": 2}
    whole = _post(server, "/v1/completions", body)
    streamed = _stream(server, "/v1/completions", body)
    for c in whole["choices"]:
        for lps in (c["logprobs"], _joined_logprobs(streamed, c["index"])):
            assert len(lps["tokens"]) == 6
            for t, v, top in zip(lps["tokens"], lps["token_logprobs"], lps["top_logprobs"]):
                assert 1 <= len(top) <= 2 and top[t] == pytest.approx(v, abs=1e-6), (t, v, top)
                assert max(top.values()) >= v - 1e-6
