"""Bad HTTP input is a 4xx naming the field, never a 500: the app over ASGI with a fake pipeline (no
processes), and the protocol parsers directly."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from lazyrt.documents import DocumentError, check_metadata
from lazyrt.runtime.ipc.messages import GenerateReq, TextOut, WorkerReady
from lazyrt.runtime.ipc.sockets import IpcPaths
from lazyrt.runtime.server import protocol
from lazyrt.runtime.server.app import ServerState, completion_logprobs, create_app
from lazyrt.runtime.server.errors import ApiError, check_json
from lazyrt.runtime.server.pipeline_client import PipelineClient


class FakeClient:
    """The PipelineClient's surface: each request answered by one finished TextOut (`meta` added to
    its meta); `fail_at`: the submit with that index raises, as msgpack does on what it cannot carry."""

    def __init__(self, meta: dict | None = None, fail_at: int | None = None, fmt: str | None = None):
        self.failed, self.rid, self.meta, self.fail_at = None, 0, meta or {}, fail_at
        self.ready_info = WorkerReady("m", "", 8, 16, 4096, 100, [0], "cpu", tool_format=fmt)
        self.seen: list[GenerateReq] = []
        self.aborted: list[int] = []

    def new_rid(self) -> int:
        self.rid += 1
        return self.rid

    def submit(self, req: GenerateReq) -> asyncio.Queue:
        if len(self.seen) == self.fail_at:
            raise RuntimeError("cannot send")
        self.seen.append(req)
        q: asyncio.Queue = asyncio.Queue()
        meta = {"prompt_tokens": 3, "completion_tokens": 1, "finish_reason": "length", **self.meta}
        q.put_nowait(TextOut(req.rid, "ok", 1, "length", meta, [5]))
        return q

    def abort(self, rid: int) -> None:
        self.aborted.append(rid)


def _request(client: FakeClient, path: str, body: bytes | dict | None = None, method: str = "POST",
             state: ServerState | None = None) -> httpx.Response:  # fmt: skip
    state = state or ServerState(client, "m", healthy=True)
    transport = httpx.ASGITransport(app=create_app(state), raise_app_exceptions=False)
    content = json.dumps(body).encode() if isinstance(body, dict) else body

    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            headers = {"content-type": "application/json"}
            return await http.request(method, path, content=content, headers=headers)

    return asyncio.run(go())


def _err(r: httpx.Response, status: int = 400) -> str:
    assert r.status_code == status, r.text
    err = r.json()["error"]  # (the body encoded: no surrogate left in it)
    assert err["message"] and err["type"]
    return err["param"]


S = "\\ud800"  # a lone surrogate escape, as raw JSON text
BIG = str(2**64)
MSGS = '"messages": [{"role": "user", "content": "x"}]'


@pytest.mark.parametrize("path, raw, param", [
    ("/v1/completions", f'{{"prompt": "hi{S}", "max_tokens": 2}}', "prompt"),
    ("/v1/completions", f'{{"prompt": "hi", "stop": ["a", "{S}"]}}', "stop[1]"),
    ("/v1/completions", f'{{"prompt": "hi", "documents": [{{"text": "d{S}"}}]}}', "documents[0].text"),
    ("/v1/chat/completions", f'{{"messages": [{{"role": "user", "content": "x{S}"}}]}}',
     "messages[0].content"),
    ("/generate", f'{{"text": "hi{S}"}}', "text"),
    ("/score", f'{{"text": "hi", "continuations": ["a", "b{S}"]}}', "continuations[1]"),
    ("/v1/documents", f'{{"text": "t", "metadata": {{"a": ["{S}"]}}}}', "metadata.a[0]"),
    ("/v1/completions", f'{{"{S}": 1, "prompt": "hi"}}', S),
    ("/v1/documents", f'{{"text": "t", "metadata": {{"{S}x": 1}}}}', f"metadata.{S}x"),
    ("/v1/completions", f'{{"prompt": [1, {BIG}]}}', "prompt[1]"),
    ("/generate", f'{{"input_ids": [1, -{2**63 + 1}]}}', "input_ids[1]"),
    ("/v1/completions", f'{{"prompt": "hi", "stop_token_ids": [{BIG}]}}', "stop_token_ids[0]"),
    ("/v1/documents", f'{{"text": "t", "metadata": {{"n": {BIG}}}}}', "metadata.n"),
    ("/v1/chat/completions", f'{{"messages": [{{"role": "assistant", "tool_calls": [{{"type": "function", '
     f'"function": {{"name": "f", "arguments": {{"a": {BIG}}}}}}}]}}]}}',
     "messages[0].tool_calls[0].function.arguments.a"),
    ("/v1/completions", '{"prompt": "hi", "logit_bias": {"' + BIG + '": 1}}', "logit_bias"),
    ("/v1/completions", '{"prompt": "hi", "logit_bias": {"\u00b2": 1}}', "logit_bias"),
    ("/v1/completions", '{"prompt": "hi", "seed": ' + "1" * 4301 + "}", "body"),
    ("/v1/completions", '{"prompt": ' + "[" * 100_000 + "]" * 100_000 + "}", "body"),
    ("/v1/completions", '{"prompt": "hi", "x": ' + "[" * 150 + "]" * 150 + "}", "x" + "[0]" * 99),
])  # fmt: skip
def test_unencodable_strings_big_integers_and_malformed_bodies_are_400s_naming_the_path(path, raw, param):
    # each was a 500: in the tokenizer, in msgpack (--no-tokenizer-in-http), rendering the error, or json
    client = FakeClient()
    assert _err(_request(client, path, raw.encode())) == param
    assert client.seen == []


def test_check_json_walks_every_value_and_passes_good_ones():
    good = {"a": [1, -(2**63), 2**64 - 1, "é🙂", {"b": [True, None, 1.5]}], "ü": "x"}
    check_json(good)
    for bad, where in (({"a": [{"b": [2**64]}]}, "a[0].b[0]"), ([0, "x", {"k": "\ud800"}], "[2].k"),
                       ({"a": {"b\udfff": 1}}, "a.b\\udfff"), ([[1, -(2**63) - 1]], "[0][1]")):  # fmt: skip
        with pytest.raises(ApiError) as e:
            check_json(bad)
        assert e.value.param == where
        json.dumps(e.value.body(), ensure_ascii=False).encode()  # the body can be sent


def test_tool_call_arguments_and_guided_json_given_as_strings_are_walked_too():
    msg = lambda args: {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": args}}]}  # noqa: E731
    where = "messages[0].tool_calls[0].function.arguments"
    for args, param in (('{"a": "\\ud800"}', where + ".a"), ('{"a": ' + BIG + "}", where + ".a"),
                        ('{"a": ' + "9" * 4301 + "}", where), ('{"a": ' + "[" * 10**5 + "}", where)):
        with pytest.raises(ApiError) as e:
            protocol.parse_chat({"messages": [msg(args)]}, "m")
        assert e.value.param == param
    with pytest.raises(ApiError) as e:
        protocol.parse_completion({"prompt": "x", "guided_json": '{"enum": ["\\ud800"]}'}, "m")
    assert e.value.param == "guided_json.enum[0]"


def test_a_failed_submit_aborts_the_prompts_submitted_before_it():
    client = FakeClient(fail_at=1)
    r = _request(client, "/v1/completions", {"prompt": ["a", "b", "c"], "max_tokens": 2})
    assert r.status_code == 500
    assert client.aborted == [client.seen[0].rid] and len(client.seen) == 1
    client = FakeClient(fail_at=1)
    assert _request(client, "/score", {"text": "a", "continuations": ["b", "c"]}).status_code == 500
    assert client.aborted == [client.seen[0].rid]


def test_pipeline_client_forgets_a_request_it_could_not_send():
    pc = PipelineClient(IpcPaths.create())  # --no-tokenizer-in-http: requests go out as msgpack
    try:
        with pytest.raises(UnicodeEncodeError):
            pc.submit(GenerateReq(7, protocol.SamplingParams(), text="\ud800"))
        assert pc._queues == {}
    finally:
        pc.close()


def test_unicode_digits_and_long_digit_strings_are_not_a_list_limit():
    for limit in ("%C2%B2", "%EF%BC%95", "1" * 5000):  # (superscript 2, fullwidth 5)
        assert _err(_request(FakeClient(), f"/v1/documents?limit={limit}", method="GET")) == "limit"


def test_check_metadata_refuses_a_lone_surrogate():
    with pytest.raises(DocumentError) as e:
        check_metadata({"a": "\ud800"})
    assert e.value.param == "metadata"
    deep: list = []
    for _ in range(10**4):
        deep = [deep]
    with pytest.raises(DocumentError):  # (a RecursionError in json.dumps)
        check_metadata({"a": deep})


def test_tool_calls_need_a_template_with_tools():
    msgs = [{"role": "user", "content": "q"},
            {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f"}}]},
            {"role": "tool", "content": "r"}]  # fmt: skip
    client = FakeClient()  # no tool format: the template would drop the call
    assert _err(_request(client, "/v1/chat/completions", {"messages": msgs})) == "messages[1].tool_calls"
    client = FakeClient(fmt="hermes")
    assert _request(client, "/v1/chat/completions", {"messages": msgs}).status_code == 200
    assert client.seen[0].messages[1]["tool_calls"][0]["function"]["name"] == "f"


def test_max_completion_tokens_wins_and_both_are_checked():
    body = {"messages": [{"role": "user", "content": "q"}]}
    p = protocol.parse_chat({**body, "max_tokens": 5, "max_completion_tokens": 9}, "m")
    assert p.req.sampling.max_tokens == 9 and p.req.max_tokens_param == "max_completion_tokens"
    assert protocol.parse_chat({**body, "max_tokens": 5}, "m").req.sampling.max_tokens == 5
    for bad, param in (({"max_tokens": 5, "max_completion_tokens": "x"}, "max_completion_tokens"),
                       ({"max_tokens": 0, "max_completion_tokens": 9}, "max_tokens")):  # fmt: skip
        with pytest.raises(ApiError) as e:
            protocol.parse_chat({**body, **bad}, "m")
        assert e.value.param == param
    p = protocol.parse_completion({"prompt": "x", "echo": True, "max_completion_tokens": 0}, "m")
    assert p.echo_only and p.req.sampling.max_tokens == 1


def test_generate_refuses_fields_it_would_ignore():
    for extra, param in (({"doc_turn": 0}, "doc_turn"), ({"continue_final": False}, "continue_final")):
        for prompt in ({"text": "hi"}, {"input_ids": [1]}):
            with pytest.raises(ApiError) as e:
                protocol.parse_generate({**prompt, **extra})
            assert e.value.param == param
    for sp in ([], 0, False, ""):
        with pytest.raises(ApiError) as e:
            protocol.parse_generate({"text": "hi", "sampling_params": sp})
        assert e.value.param == "sampling_params"
    assert protocol.parse_generate({"text": "hi", "sampling_params": None}).req.sampling.max_tokens == 128


def test_stream_options_only_with_stream_and_only_known_keys():
    body, on = {"prompt": "x"}, {"stream": True}
    cases = [
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"stream": False, "stream_options": {}}, "stream_options"),
        ({**on, "stream_options": {"x": 1}}, "stream_options.x"),
        ({**on, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
    ]
    for extra, param in cases:
        with pytest.raises(ApiError) as e:
            protocol.parse_completion({**body, **extra}, "m")
        assert e.value.param == param
    p = protocol.parse_completion({**body, "stream": True, "stream_options": {"include_usage": True}}, "m")
    assert p.stream and p.include_usage


def test_message_keys_are_checked_name_reaches_the_template_and_developer_is_system():
    def parse(*msgs: dict) -> list[dict]:
        return protocol.parse_chat({"messages": list(msgs)}, "m").req.messages

    for m, param in (({"role": "user", "content": "x", "foo": 1}, "messages[0].foo"),
                     ({"role": "user", "content": "x", "tool_call_id": "c"}, "messages[0].tool_call_id"),
                     ({"role": "assistant", "content": "x", "refusal": "no"}, "messages[0].refusal"),
                     ({"role": "user", "content": "x", "name": 5}, "messages[0].name")):  # fmt: skip
        with pytest.raises(ApiError) as e:
            parse(m)
        assert e.value.param == param
    echoed = {"refusal": None, "annotations": []}  # an OpenAI reply's empty keys: absent
    got = parse({"role": "developer", "content": "be brief", "name": "ops"},
                {"role": "user", "content": "q", "name": "ann", **echoed})  # fmt: skip
    assert got == [{"role": "system", "content": "be brief", "name": "ops"},
                   {"role": "user", "content": "q", "name": "ann"}]  # fmt: skip
    with pytest.raises(ApiError) as e:
        protocol.parse_generate({"messages": [{"role": "user", "content": "x", "foo": 1}]})
    assert e.value.param == "messages[0].foo"


def test_unknown_routes_and_methods_answer_in_the_openai_error_shape():
    r = _request(FakeClient(), "/v1/nope", {})
    assert _err(r, 404) is None and "/v1/nope" in r.json()["error"]["message"]
    r = _request(FakeClient(), "/generate", method="GET")
    assert _err(r, 405) is None and "POST" in r.headers["allow"]


def test_echoed_first_prompt_token_has_null_top_logprobs():
    lp = lambda tok, v, top: {"token": tok, "logprob": v, "bytes": None, "top_logprobs": top}  # noqa: E731
    sea = [{"token": " sea", "logprob": -1.0}]
    out = completion_logprobs([lp("The", None, []), lp(" sky", -2.0, sea)], 0)
    assert out["token_logprobs"] == [None, -2.0]
    assert out["top_logprobs"] == [None, {" sea": -1.0}]


def test_echo_only_counts_no_generated_tokens_in_metrics():
    client = FakeClient(meta={"echo_text": "The sky is", "prompt_logprobs": None})
    state = ServerState(client, "m", healthy=True)
    body = {"prompt": "The sky is", "max_tokens": 0, "echo": True, "n": 3}
    r = _request(client, "/v1/completions", body, state=state)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 0
    assert [c["text"] for c in r.json()["choices"]] == ["The sky is"] * 3
    assert state.metrics.registry.get_sample_value("lazyrt_generation_tokens_total") == 0
    r = _request(client, "/v1/completions", {**body, "max_tokens": 2}, state=state)  # echo and generate
    assert r.json()["usage"]["completion_tokens"] == 3
    assert state.metrics.registry.get_sample_value("lazyrt_generation_tokens_total") == 3
    # the prompt's tokens once per prompt, as usage counts them, not once per completion
    assert r.json()["usage"]["prompt_tokens"] == 3
    assert state.metrics.registry.get_sample_value("lazyrt_prompt_tokens_total") == 2 * 3
    r = _request(client, "/v1/completions", {"prompt": ["a", "b"], "max_tokens": 1, "n": 2}, state=state)
    assert r.json()["usage"]["prompt_tokens"] == 2 * 3
    assert state.metrics.registry.get_sample_value("lazyrt_prompt_tokens_total") == 4 * 3


def test_score_names_the_continuation_that_outgrows_the_context(tokenizer):
    """/score: a continuation that takes the prompt past the context is named (continuations[i]); a
    prompt too long on its own is still the prompt's error."""
    import random

    from lazyrt.runtime.tokenizer.request_tokenizer import InvalidRequest, RequestTokenizer

    rng = random.Random()
    words = " ".join(rng.choice(["river", "north", "tide", "lumen"]) for _ in range(40))
    n_prompt = len(tokenizer(words, add_special_tokens=False).input_ids)
    rt = RequestTokenizer(tokenizer, n_prompt + 8, len(tokenizer))
    reqs = protocol.parse_score({"text": words, "continuations": [" a", " sea" * 30]})
    rt.tokenize(reqs[0])  # fits
    with pytest.raises(InvalidRequest) as e:
        rt.tokenize(reqs[1])
    assert e.value.param == "continuations[1]" and "continuation" in str(e.value)
    short = RequestTokenizer(tokenizer, n_prompt - 1, len(tokenizer))
    with pytest.raises(InvalidRequest) as e:
        short.tokenize(reqs[0])
    assert e.value.param == "text"


def test_a_scheduler_rejection_names_the_field_as_each_endpoint_spells_it():
    """The scheduler names a SamplingParams field as /generate spells it; the OpenAI endpoints take
    that field at the top level, and their 400 names it there."""
    from lazyrt.runtime.ipc.messages import ErrorOut

    class Rejecting(FakeClient):
        def submit(self, req: GenerateReq) -> asyncio.Queue:
            q: asyncio.Queue = asyncio.Queue()
            why = "sampling_params.retrieval_top_k=5: needs a server started with retrieval attention"
            q.put_nowait(ErrorOut(req.rid, why, "sampling_params.retrieval_top_k"))
            return q

    for path, body, param in (
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "retrieval_top_k": 5},
         "retrieval_top_k"),
        ("/v1/completions", {"prompt": "x", "retrieval_top_k": 5}, "retrieval_top_k"),
        ("/generate", {"text": "x", "sampling_params": {"retrieval_top_k": 5}},
         "sampling_params.retrieval_top_k"),
    ):  # fmt: skip
        r = _request(Rejecting(), path, body)
        assert _err(r) == param and r.json()["error"]["message"].startswith(param + "=")


def test_every_error_answer_is_counted_by_endpoint():
    """lazyrt_request_errors counts every 4xx / 5xx by endpoint, whoever answered: a route's 400, the
    documents routes, an exception no route caught (a 500), an unknown path; 2xx are not counted."""
    client = FakeClient()
    state = ServerState(client, "m", healthy=True)

    def count(endpoint: str, status: str) -> float:
        v = state.metrics.registry.get_sample_value(
            "lazyrt_request_errors_total", {"endpoint": endpoint, "status": status})
        return v or 0.0

    def status(path: str, body: bytes | dict) -> int:
        return _request(client, path, body, state=state).status_code

    assert status("/v1/completions", {"prompt": "x", "max_tokens": 2}) == 200
    assert status("/v1/completions", {"prompt": "x", "max_tokens": 0}) == 400
    assert status("/v1/chat/completions", b"not json") == 400
    assert status("/v1/documents", {"text": 5}) == 400
    # the stand-in client has no document(): the route raises, the server answers 500
    assert status("/v1/documents", {"text": "a doc"}) == 500
    assert status("/nope", {}) == 404
    got = [count("completions", "400"), count("chat", "400"), count("documents", "400"),
           count("documents", "500"), count("other", "404"), count("completions", "200")]  # fmt: skip
    assert got == [1, 1, 1, 1, 1, 0]
