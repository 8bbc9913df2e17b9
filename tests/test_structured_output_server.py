"""Structured output through a real server on loopback (a tiny random-weight model) with the official
`openai` client, /generate, and the frontend's gen() on both backends. The random model's output is
only right because decoding enforces the constraint; independent validators (jsonschema, re, json)
check it."""

from __future__ import annotations

import json
import random
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest
from lazyrt_frontend import RuntimeEndpoint, function, gen, user
from server_util import ServerProc
from test_structured_output import CHOICES, REGEXES, SCHEMAS

from lazyrt import Engine

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_path(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def server(tiny_path):
    srv = ServerProc("--model", tiny_path, "--device", "cpu", "--kv-cache-tokens", "16384",
                     "--log-level", "warning")  # fmt: skip
    try:
        srv.wait_healthy()
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(oai):
    return oai.models.list().data[0].id


def words(rng: random.Random) -> str:
    vocab = ["cat", "river", "JSON", "list", "seven", "blue", "why", "a"]
    return " ".join(rng.choice(vocab) for _ in range(8))


def valid(text: str, schema: dict) -> bool:
    jsonschema.validate(json.loads(text), schema)
    return True


def test_openai_json_schema_20_prompts_valid(oai, model):
    rng = random.Random()
    jobs = [(words(rng), rng.choice(SCHEMAS), rng.random() < 0.5) for _ in range(20)]

    def ask(job):
        text, schema, sample = job
        return oai.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": text}],
            max_tokens=120,
            temperature=0.9 if sample else 0,
            seed=rng.randrange(1 << 30),
            response_format={"type": "json_schema",
                             "json_schema": {"name": "x", "schema": schema, "strict": True}},  # fmt: skip
        )

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, jobs))
    for (_, schema, _), a in zip(jobs, answers):
        assert a.choices[0].finish_reason == "stop", a.choices[0].message.content
        jsonschema.validate(json.loads(a.choices[0].message.content), schema)


def test_openai_stream_equals_whole_and_json_object(oai, model):
    rng = random.Random()
    msgs = [{"role": "user", "content": words(rng)}]
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMAS[1]}}
    whole = oai.chat.completions.create(model=model, messages=msgs, max_tokens=80, temperature=0,
                                        response_format=fmt)  # fmt: skip
    parts = oai.chat.completions.create(model=model, messages=msgs, max_tokens=80, temperature=0,
                                        response_format=fmt, stream=True)  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in parts if c.choices)
    assert text == whole.choices[0].message.content
    jsonschema.validate(json.loads(text), SCHEMAS[1])
    # json_object: any object; the random model may not close it in time, but what it wrote is a
    # prefix no grammar-free sampler would keep to: it starts an object and never leaves JSON
    obj = oai.chat.completions.create(model=model, messages=msgs, max_tokens=60, temperature=0,
                                      response_format={"type": "json_object"})  # fmt: skip
    out = obj.choices[0].message.content
    assert out.startswith("{")
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(out), dict)


def test_openai_completions_guided_extras(oai, model):
    rng = random.Random()
    prompt = words(rng)
    rx, ch = rng.choice(REGEXES), rng.choice(CHOICES)
    grammar = 'start: "(" item ("," item)? ("," item)? ("," item)? ")"\nitem: /[a-c]/ | "x" /[0-9]/'
    tuple_rx = r"\((?:[a-c]|x[0-9])(?:,(?:[a-c]|x[0-9])){0,3}\)"
    cases = [
        ({"guided_regex": rx}, lambda t: re.fullmatch(rx, t, re.ASCII)),
        ({"guided_choice": ch}, lambda t: t in ch),
        ({"guided_json": json.dumps(SCHEMAS[0])}, lambda t: valid(t, SCHEMAS[0])),
        ({"guided_grammar": grammar}, lambda t: re.fullmatch(tuple_rx, t)),
    ]
    for extra, check in cases:
        r = oai.completions.create(
            model=model, prompt=prompt, max_tokens=100, temperature=0, extra_body=extra
        )
        assert r.choices[0].finish_reason == "stop", (extra, r.choices[0].text)
        assert check(r.choices[0].text), (extra, r.choices[0].text)


@pytest.mark.parametrize(
    "kw, param",
    [
        ({"response_format": {"type": "json_schema",
                              "json_schema": {"name": "x", "schema": {"type": "objx"}}}},
         "response_format.json_schema.schema"),
        ({"extra_body": {"guided_regex": "(unclosed"}}, "guided_regex"),
        ({"response_format": {"type": "json_object"}, "extra_body": {"guided_choice": ["a"]}},
         "guided_choice"),
    ],
)  # fmt: skip
def test_openai_bad_constraint_is_400_naming_it(oai, model, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], **kw)
    assert e.value.body["param"] == param


def test_generate_endpoint_stream_with_schema(server):
    body = {"text": "a person", "sampling_params": {"max_tokens": 100, "json_schema": SCHEMAS[2]}}
    whole = httpx.post(server.url + "/generate", json=body, timeout=120).json()
    jsonschema.validate(json.loads(whole["text"]), SCHEMAS[2])
    chunks = []
    with httpx.stream("POST", server.url + "/generate", json={**body, "stream": True}, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    assert "".join(c["text"] for c in chunks) == whole["text"]  # text deltas
    assert chunks[-1]["finish_reason"] == "stop"


def test_frontend_gen_constraints_same_on_both_backends(server, tiny_path):
    @function
    def form(s, q):
        s += user(q)
        s += gen("pick", max_tokens=20, choices=CHOICES[2])
        s += user("and the code?")
        s += gen("code", max_tokens=30, regex=REGEXES[1])
        s += user("as JSON")
        s += gen("obj", max_tokens=100, json_schema=SCHEMAS[1])

    q = words(random.Random())
    got = {}
    for name, be in {"http": RuntimeEndpoint(server.url),
                     "engine": Engine(tiny_path, device="cpu", kv_cache_tokens=8192)}.items():  # fmt: skip
        st = form.run(q=q, backend=be)
        got[name] = (st["pick"], st["code"], st["obj"])
    assert got["http"] == got["engine"]
    pick, code, obj = got["http"]
    assert pick in CHOICES[2]
    assert re.fullmatch(REGEXES[1], code, re.ASCII)
    jsonschema.validate(json.loads(obj), SCHEMAS[1])


# ---- tool_choice forcing a call ----------------------------------------------------------------------
BOUNDED_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Quenta", "Oslo"]},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "convert", "parameters": {
        "type": "object", "properties": {"amount": {"type": "integer", "minimum": 0, "maximum": 999},
                                         "to": {"enum": ["lorn", "pim"]}},
        "required": ["amount", "to"], "additionalProperties": False}}},
]  # fmt: skip


@pytest.fixture(scope="module")
def tool_server(tool_template_server):
    """The client of conftest's tiny-llama server with a tools template (shared with test_tool_calls)."""
    srv, _ = tool_template_server
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_tool_choice_required_and_named_force_valid_calls(tool_server):
    """A random model forced to call: every answer is tool_calls of the allowed tool(s) whose
    arguments validate against the tool's parameters schema, whole and streamed."""
    rng = random.Random()
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in BOUNDED_TOOLS}
    model = tool_server.models.list().data[0].id
    kw = dict(model=model, tools=BOUNDED_TOOLS, max_tokens=80, parallel_tool_calls=False)
    convert = {"type": "function", "function": {"name": "convert"}}
    for choice, allowed in [("required", set(schemas)), (convert, {"convert"})]:
        for _ in range(3):
            msgs = [{"role": "user", "content": words(rng)}]
            r = tool_server.chat.completions.create(messages=msgs, tool_choice=choice, temperature=0.9,
                                                    seed=rng.randrange(1 << 30), **kw)  # fmt: skip
            ch = r.choices[0]
            assert ch.finish_reason == "tool_calls" and len(ch.message.tool_calls) == 1, ch
            call = ch.message.tool_calls[0].function
            assert call.name in allowed
            jsonschema.validate(json.loads(call.arguments), schemas[call.name])
    msgs = [{"role": "user", "content": words(rng)}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    whole = tool_server.chat.completions.create(messages=msgs, tool_choice=named, temperature=0, **kw)
    chunks = list(tool_server.chat.completions.create(messages=msgs, tool_choice=named, temperature=0,
                                                      stream=True, **kw))  # fmt: skip
    args = "".join(tc.function.arguments or "" for c in chunks if c.choices
                   for tc in (c.choices[0].delta.tool_calls or []))  # fmt: skip
    assert args == whole.choices[0].message.tool_calls[0].function.arguments
    jsonschema.validate(json.loads(args), schemas["get_weather"])
    nope = {"type": "function", "function": {"name": "nope"}}
    for bad_kw, param in [({"tool_choice": nope}, "tool_choice"),
                          ({"tool_choice": "required", "response_format": {"type": "json_object"}},
                           "tool_choice")]:  # fmt: skip
        with pytest.raises(openai.BadRequestError) as e:
            tool_server.chat.completions.create(messages=msgs, **{**kw, **bad_kw})
        assert e.value.body["param"] == param


def test_a_constraint_past_the_parsers_limits_fails_the_request_not_as_complete(oai, model, server):
    """A grammar that compiles but outgrows llguidance's parser while decoding (2,001 alternatives in
    one rule: a row holds 2,000 items) ends its request with an error, streamed or not, instead of a
    200 whose output stopped where the matcher failed; the server serves on."""
    rng = random.Random()
    alts = " | ".join(f'"opt-{rng.randrange(10**6)}-{i}"' for i in range(2001))
    body = {"text": "pick", "sampling_params": {"max_tokens": 16, "grammar": f"start: {alts}"}}
    r = httpx.post(server.url + "/generate", json=body, timeout=120)
    assert r.status_code == 500 and "structured output failed while decoding" in r.text, r.text
    with pytest.raises(openai.InternalServerError, match="structured output failed"):
        messages = [{"role": "user", "content": "pick"}]
        oai.chat.completions.create(model=model, messages=messages, max_tokens=16,
                                    extra_body={"guided_grammar": f"start: {alts}"})
    events = []
    with httpx.stream("POST", server.url + "/generate", json={**body, "stream": True}, timeout=120) as s:
        events = [json.loads(x[6:]) for x in s.iter_lines() if x.startswith("data: ") and x != "data: [DONE]"]
    assert "structured output failed" in json.dumps(events[-1]) and events[-1].get("finish_reason") != "stop"
    ok = oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert ok.choices[0].message.content is not None
