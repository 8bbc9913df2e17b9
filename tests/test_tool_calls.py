"""Tool calls (issue 16): parsing in both template formats (whole and streamed at every split), the
OpenAI shapes through the real app with canned model output (official `openai` client over ASGI), and
rendering with a real server on a tiny random model whose chat template defines tools (= HF
apply_chat_template); the default model's template has none, so tools are a 400 there."""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import pytest
from openai import AsyncOpenAI

from lazyrt.runtime.ipc.messages import GenerateReq, TextOut, WorkerReady
from lazyrt.runtime.server.app import ServerState, create_app
from lazyrt.runtime.tokenizer.tool_calls import ToolCallStream, parse_tool_calls, tool_format

# A Hermes-style template (calls in <tool_call> tags) written for these tests.
TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nYou may call these functions; answer with "
    "<tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>.\n"
    "{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}<|im_start|>tool\n{{ m.content }}<|im_end|>\n"
    "{%- elif m.tool_calls %}<|im_start|>assistant\n"
    "{% for c in m.tool_calls %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
     "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}},
]  # fmt: skip


def _rand_args(rng: random.Random) -> dict:
    city = rng.choice(["Paris", "Zürich", "東京"])
    return {"city": city, "n": rng.randint(0, 99), "ok": rng.random() < 0.5}


def test_formats_from_templates(tokenizer):
    assert tool_format(TEMPLATE) == "hermes"
    assert tool_format(tokenizer.chat_template) is None  # SmolLM2's template renders no tools
    assert tool_format("{% if tools %}{{ tools }} use parameters{% endif %}") == "json"


@pytest.mark.parametrize("trial", range(3))
def test_parse_hermes_and_json_whole_and_streamed(trial):
    rng = random.Random()
    a, b = _rand_args(rng), _rand_args(rng)
    cases = [
        ("hermes", f'Let me check.\n<tool_call>\n{{"name": "get_weather", "arguments": {json.dumps(a)}}}'
                   f'\n</tool_call>\n<tool_call>{{"name": "add", "arguments": {json.dumps(b)}}}</tool_call>',
         "Let me check.", [("get_weather", a), ("add", b)]),
        ("hermes", "No call, just <b>text</b> and <tool", "No call, just <b>text</b> and <tool", []),
        ("hermes", 'Broken <tool_call>{"name": "x", "arguments": </tool_call> end',
         'Broken <tool_call>{"name": "x", "arguments": </tool_call> end', []),
        ("json", json.dumps({"name": "add", "parameters": a}), None, [("add", a)]),
        ("json", "<|python_tag|>" + json.dumps({"name": "get_weather", "arguments": b}), None,
         [("get_weather", b)]),
        ("json", "The answer is {not json}.", "The answer is {not json}.", []),
    ]  # fmt: skip
    for fmt, text, content, calls in cases:
        got_content, got_calls = parse_tool_calls(text, fmt)
        assert got_content == content
        assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls
        # streamed in random pieces: the content sent plus the end's = the content, the same calls
        for _ in range(5):
            s, sent, i = ToolCallStream(fmt), "", 0
            while i < len(text):
                j = i + rng.randint(1, 6)
                sent += s.feed(text[i:j])
                i = j
            rest, streamed_calls = s.finish()
            assert (sent + rest).strip() == (content or "").strip()
            assert [(c.name, json.loads(c.arguments)) for c in streamed_calls] == calls
            assert "<tool_call>" not in sent or not calls


class CannedClient:
    """The PipelineClient's surface, answering every request with the same text in small pieces."""

    def __init__(self, text: str, fmt: str | None):
        self.text, self.failed, self.rid = text, None, 0
        self.ready_info = WorkerReady("m", "", 8, 16, 4096, 100, [0], "cpu", tool_format=fmt)
        self.seen: list[GenerateReq] = []

    def new_rid(self) -> int:
        self.rid += 1
        return self.rid

    def submit(self, req: GenerateReq) -> asyncio.Queue:
        self.seen.append(req)
        q: asyncio.Queue = asyncio.Queue()
        pieces = [self.text[i : i + 3] for i in range(0, len(self.text), 3)]
        for k, p in enumerate(pieces):
            last = k == len(pieces) - 1
            meta = {"prompt_tokens": 5, "completion_tokens": len(pieces), "finish_reason": "stop"}
            meta = meta if last else None
            q.put_nowait(TextOut(req.rid, p, 1, "stop" if last else None, meta, list(range(len(pieces)))))
        return q

    def abort(self, rid: int) -> None:
        pass


def _oai(client: CannedClient) -> AsyncOpenAI:
    state = ServerState(client, "m", healthy=True)
    transport = httpx.ASGITransport(app=create_app(state))
    http = httpx.AsyncClient(transport=transport, base_url="http://test")
    return AsyncOpenAI(base_url="http://test/v1", api_key="x", http_client=http, max_retries=0)


def test_openai_client_reads_tool_calls_whole_and_streamed():
    args = {"city": "Zürich"}
    text = f'Checking.\n<tool_call>{{"name": "get_weather", "arguments": {json.dumps(args)}}}</tool_call>'
    client = CannedClient(text, "hermes")
    oai = _oai(client)
    msgs = [{"role": "user", "content": "Weather in Zürich?"}]

    async def go():
        r = await oai.chat.completions.create(model="m", messages=msgs, tools=TOOLS)
        stream = await oai.chat.completions.create(model="m", messages=msgs, tools=TOOLS, stream=True)
        chunks = [c async for c in stream]
        plain = await oai.chat.completions.create(model="m", messages=msgs)  # no tools: text as is
        one = await oai.chat.completions.create(
            model="m", messages=msgs, tools=TOOLS, parallel_tool_calls=False
        )
        return r, chunks, plain, one

    r, chunks, plain, one = asyncio.run(go())
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content == "Checking."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in ch.message.tool_calls] == [
        ("get_weather", args)
    ]
    assert ch.message.tool_calls[0].id and ch.message.tool_calls[0].type == "function"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert content.strip() == "Checking." and "<tool_call>" not in content
    assert [(tc.function.name, json.loads(tc.function.arguments)) for tc in calls] == [("get_weather", args)]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert plain.choices[0].message.content == text and not plain.choices[0].message.tool_calls
    assert len(one.choices[0].message.tool_calls) == 1
    # what reached the pipeline: the tools, and assistant/tool turns with arguments as objects
    assert client.seen[0].tools == TOOLS and client.seen[2].tools is None


def test_tool_conversation_turns_and_bad_tools_are_named():
    client = CannedClient("fine", "hermes")
    oai = _oai(client)
    msgs = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]  # fmt: skip

    async def go():
        r = await oai.chat.completions.create(model="m", messages=msgs, tools=TOOLS)
        errors = []
        bad_call = [{"function": {"name": "f", "arguments": "{"}}]
        for kw in ({"tools": [{"type": "function"}]}, {"tools": "x"},
                   {"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": TOOLS},
                   {"tool_choice": "auto"}, {"tools": TOOLS, "parallel_tool_calls": "no"},
                   {"messages": [{"role": "tool", "content": 5}]},
                   {"messages": [{"role": "assistant", "tool_calls": bad_call}]}):
            body = {"model": "m", "messages": msgs, **kw}
            resp = await oai._client.post("/v1/chat/completions", json=body)
            errors.append((resp.status_code, resp.json()["error"]["param"]))
        return r, errors

    r, errors = asyncio.run(go())
    assert r.choices[0].message.content == "fine" and r.choices[0].finish_reason == "stop"
    sent = client.seen[0].messages
    assert sent[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert sent[2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}
    assert errors == [(400, "tools[0]"), (400, "tools"), (400, "tool_choice"), (400, "tool_choice"),
                      (400, "parallel_tool_calls"), (400, "messages[0].content"),
                      (400, "messages[0].tool_calls[0].function.arguments")]  # fmt: skip
    no_tools = _oai(CannedClient("x", None))

    async def refused():
        body = {"model": "m", "messages": msgs, "tools": TOOLS}
        return await no_tools._client.post("/v1/chat/completions", json=body)

    resp = asyncio.run(refused())
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "tools"


@pytest.mark.slow
def test_real_server_renders_tools_like_hf_template(tool_template_server):
    srv, tok = tool_template_server  # conftest: shared with test_structured_output_server
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    body = {"messages": msgs, "max_tokens": 4, "temperature": 0}
    post = lambda b: httpx.post(srv.url + "/v1/chat/completions", json=b, timeout=60).json()  # noqa: E731
    with_tools = post({**body, "tools": TOOLS})
    want = tok.apply_chat_template(msgs, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert with_tools["usage"]["prompt_tokens"] == len(tok(want, add_special_tokens=False).input_ids)
    none = post({**body, "tools": TOOLS, "tool_choice": "none"})
    plain = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert none["usage"]["prompt_tokens"] == len(tok(plain, add_special_tokens=False).input_ids)
    assert with_tools["usage"]["prompt_tokens"] > none["usage"]["prompt_tokens"]
