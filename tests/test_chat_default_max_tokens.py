"""The endpoints' max_tokens when a request gives none (README): /v1/completions 16 (OpenAI's), chat and
/generate 128, each capped at what the context leaves after the prompt; an explicit one past the context
is a 400 naming it. A tiny random llama (ignore_eos: it runs to the count) behind a server whose context
is cut to 256 tokens, and the request tokenizer alone."""

from __future__ import annotations

import json
import random

import httpx
import pytest
from server_util import ServerProc

from lazyrt.runtime.server import protocol
from lazyrt.runtime.tokenizer.request_tokenizer import RequestTokenizer

CONTEXT = 256


def _msgs(words: int) -> list[dict]:
    rng = random.Random()
    text = " ".join(rng.choice(["river", "Sula", "stone", "bridge", "north", "old"]) for _ in range(words))
    return [{"role": "user", "content": f"Tell me about {text}."}]


def _prompt_tokens(tokenizer, msgs: list[dict]) -> int:
    """The chat prompt's length as HF's template renders it (what usage.prompt_tokens should say)."""
    text = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    return len(tokenizer(text, add_special_tokens=False).input_ids)


def test_defaults_and_the_cap_at_what_the_context_leaves(tokenizer):
    rt = RequestTokenizer(tokenizer, CONTEXT, len(tokenizer))
    short, long = _msgs(5), _msgs(180)
    n_long = _prompt_tokens(tokenizer, long)
    assert CONTEXT - n_long < 128 < CONTEXT - _prompt_tokens(tokenizer, short)
    chat = protocol.parse_chat({"messages": short}, "m").req
    assert chat.max_tokens_param is None and rt.tokenize(chat).max_new_tokens == 128
    assert rt.tokenize(protocol.parse_chat({"messages": long}, "m").req).max_new_tokens == CONTEXT - n_long
    assert rt.tokenize(protocol.parse_chat({"messages": short, "max_tokens": 5}, "m").req).max_new_tokens == 5
    assert rt.tokenize(protocol.parse_completion({"prompt": "The sky"}, "m").req).max_new_tokens == 16
    assert rt.tokenize(protocol.parse_generate({"text": "The sky"}).req).max_new_tokens == 128


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    srv = ServerProc("--model", tiny_model_dir("llama"), "--device", "cpu", "--kv-cache-tokens", "2048",
                     "--max-model-len", str(CONTEXT), "--log-level", "warning")  # fmt: skip
    try:
        srv.wait_healthy()
        yield srv
    finally:
        srv.stop()


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=300)


@pytest.mark.slow
def test_served_defaults_usage_and_finish_reason(server, tokenizer):
    short, long = _msgs(5), _msgs(180)
    n_short, n_long = _prompt_tokens(tokenizer, short), _prompt_tokens(tokenizer, long)
    for msgs, n, want in ((short, n_short, 128), (long, n_long, CONTEXT - n_long)):
        body = {"messages": msgs, "ignore_eos": True, "temperature": 0}
        out = _post(server, "/v1/chat/completions", body).json()
        assert out["usage"]["prompt_tokens"] == n and out["usage"]["completion_tokens"] == want, out["usage"]
        assert out["choices"][0]["finish_reason"] == "length"
        streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=streamed, timeout=300) as s:
            lines = [x for x in s.iter_lines() if x.startswith("data: ") and x != "data: [DONE]"]
        events = [json.loads(x[6:]) for x in lines]
        assert events[-1]["usage"]["completion_tokens"] == want
    body = {"messages": long, "ignore_eos": True}
    over = _post(server, "/v1/chat/completions", {**body, "max_tokens": CONTEXT - n_long + 1})
    assert over.status_code == 400 and over.json()["error"]["param"] == "max_tokens", over.text
    comp = _post(server, "/v1/completions", {"prompt": "The sky", "ignore_eos": True}).json()
    assert comp["usage"]["completion_tokens"] == 16 and comp["choices"][0]["finish_reason"] == "length"
    gen = _post(server, "/generate", {"text": "The sky", "sampling_params": {"ignore_eos": True}}).json()
    assert gen["meta"]["completion_tokens"] == 128 and gen["meta"]["finish_reason"] == "length"
