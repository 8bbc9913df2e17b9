"""HTTP request bodies -> GenerateReq, with OpenAI-style errors that name the offending field.

Three shapes: POST /generate (lazyrt native: text | input_ids, docs, system, sampling_params,
stream), POST /v1/completions and POST /v1/chat/completions (OpenAI, plus `documents`). Documents
(`docs` / `documents`) are texts, {"text": ...} or {"id": ...} of a registered document.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from lazyrt.documents import DocumentError, check_doc_item
from lazyrt.runtime.ipc.messages import GenerateReq
from lazyrt.runtime.server.constraint_fields import generate_constraint, openai_constraint
from lazyrt.runtime.server.errors import ApiError, bad, check_json
from lazyrt.sampling_params import (
    MAX_COUNT,
    MAX_LOGPROBS,
    MAX_N,
    SamplingParamError,
    SamplingParams,
    positive_number,
)

ROLES = ("system", "user", "assistant")
# the keys a chat message may have, by role (the template gets them all; any other is a 400, a null or
# empty value counting as absent); "developer" is OpenAI's newer name for the system role
_MESSAGE_KEYS = {
    "system": ("role", "content", "name"),
    "developer": ("role", "content", "name"),
    "user": ("role", "content", "name"),
    "assistant": ("role", "content", "name", "tool_calls"),
    "tool": ("role", "content", "tool_call_id"),
}
# OpenAI fields taken only at these values: the ones we cannot honour (best_of ... prompt_logprobs)
# at their no-op value, and storage / routing hints at the values that ask nothing of this server; any
# other value is a 400 rather than silently ignored (a null value counts as absent)
_ONLY = {
    "best_of": (1,),
    "functions": (None,),
    "function_call": ("none",),
    "suffix": (None,),
    "prompt_logprobs": (None,),
    "store": (False,),  # storing completions (with their metadata) for OpenAI's evals: not here
    "service_tier": ("auto", "default"),
    "modalities": (["text"],),
}
# OpenAI fields without an effect on the answer at any value: identifiers and hints
_NO_EFFECT = (
    "user",
    "safety_identifier",
    "prompt_cache_key",  # a cache routing hint: documents are cached by their contents anyway
    "metadata",  # kept with a stored completion only (store is false here)
)


@dataclass
class Parsed:
    req: GenerateReq  # rid filled in by the caller; with several prompts, the first
    stream: bool
    include_usage: bool = False
    more: list[GenerateReq] = dataclasses.field(default_factory=list)  # /v1/completions: prompts 2..
    echo_only: bool = False  # completions echo with max_tokens 0: the prompt back, nothing generated
    parallel_tool_calls: bool = True  # chat with tools: False keeps the first call only
    forced_tool: str | None = None  # tool_choice: '*' (required) or the named function; a grammar

    def requests(self) -> list[GenerateReq]:
        """One request per completion: each prompt's n samples in turn (choice index = position)."""
        out = []
        for req in [self.req, *self.more]:
            out += [dataclasses.replace(req, sampling=sp) for sp in req.sampling.expand_n()]
        return out


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _doc_list(body: dict, key: str) -> list[str | dict] | None:
    """A request's documents: each a text or {"id": ...} ({"text": t} becomes t); errors name the
    item (`documents[2].id`). Whether an id exists is the tokenizer process's check (404)."""
    v = body.get(key)
    if v is None:
        return None
    if not isinstance(v, list):
        raise bad(key, f"must be a list of documents (strings, {{'text': str}} or {{'id': str}}), "
                  f"got {type(v).__name__}")  # fmt: skip
    try:
        return [check_doc_item(d, f"{key}[{i}]") for i, d in enumerate(v)]
    except DocumentError as e:
        raise ApiError(400, str(e), e.param) from e


def _bool(body: dict, key: str, default: bool = False) -> bool:
    v = body.get(key, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(key, f"must be a boolean, got {type(v).__name__}")
    return v


def _max_tokens_param(src: dict, prefix: str = "") -> str | None:
    """The request field that sets max_tokens, if the request names one (max_completion_tokens when
    both are given: see _sampling)."""
    for name in ("max_completion_tokens", "max_tokens"):
        if src.get(name) is not None:
            return prefix + name
    return None


def _sampling(
    src: dict, prefix: str, default_max_tokens: int, default_temperature: float, constraint: dict
) -> SamplingParams:
    """Validate each sampling field by name (prefix names where it sits in the body); constraint:
    the structured-output field, checked already (constraint_fields.py)."""
    p = lambda k: prefix + k  # noqa: E731
    # each is checked; with both, max_completion_tokens (OpenAI's newer name) wins, as in vLLM
    max_tokens = default_max_tokens
    for name in ("max_tokens", "max_completion_tokens"):
        v = src.get(name)
        if v is None:
            continue
        if not _is_int(v) or not 1 <= v <= MAX_COUNT:
            raise bad(p(name), f"must be an integer in [1, {MAX_COUNT}], got {v!r}")
        max_tokens = v
    temperature = src.get("temperature", default_temperature)
    temperature = default_temperature if temperature is None else temperature
    if not _is_num(temperature) or not 0 <= temperature <= 2:
        raise bad(p("temperature"), f"must be a number in [0, 2], got {temperature!r}")
    top_p = 1.0 if src.get("top_p") is None else src["top_p"]
    if not _is_num(top_p) or not 0 < top_p <= 1:
        raise bad(p("top_p"), f"must be a number in (0, 1], got {top_p!r}")
    min_p = 0.0 if src.get("min_p") is None else src["min_p"]
    if not _is_num(min_p) or not 0 <= min_p <= 1:
        raise bad(p("min_p"), f"must be a number in [0, 1] (0 = off), got {min_p!r}")
    top_k = -1 if src.get("top_k") is None else src["top_k"]
    if not _is_int(top_k) or top_k < -1:
        raise bad(p("top_k"), f"must be an integer >= 1, or -1/0 to disable, got {top_k!r}")
    stop = src.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise bad(p("stop"), "must be a non-empty string or a list of non-empty strings")
    seed = src.get("seed")
    if seed is not None and not _is_int(seed):
        raise bad(p("seed"), f"must be an integer, got {seed!r}")
    ignore_eos = _bool(src, "ignore_eos") if "ignore_eos" in src else False
    doc_attention = {}
    for name in ("doc_attention_temperature", "doc_attention_scale"):
        v = src.get(name)
        if v is not None and not positive_number(v):
            raise bad(p(name), f"must be a finite number > 0, got {v!r}")
        doc_attention[name] = None if v is None else float(v)
    doc_positions = src.get("doc_positions")
    if doc_positions not in (None, "sequential", "parallel"):
        raise bad(p("doc_positions"), f"must be 'sequential' or 'parallel', got {doc_positions!r}")
    retrieval_top_k = src.get("retrieval_top_k")
    rk = retrieval_top_k
    if rk is not None and (not _is_int(rk) or not 1 <= rk <= MAX_COUNT):
        raise bad(p("retrieval_top_k"), f"must be an integer in [1, {MAX_COUNT}], got {retrieval_top_k!r}")
    try:
        return SamplingParams(
            **constraint,
            **_parity(src, prefix),
            retrieval_top_k=retrieval_top_k,
            doc_positions=doc_positions,
            **doc_attention,
            max_tokens=max_tokens,
            temperature=float(temperature),
            top_p=float(top_p),
            min_p=float(min_p),
            top_k=top_k,
            stop=stop,
            seed=seed,
            ignore_eos=ignore_eos,
        )
    except SamplingParamError as e:  # the bounds only SamplingParams checks (sizes, seed range)
        raise bad(p(e.param), f"{e.why}, got {e.value!r}") from None


def _parity(src: dict, prefix: str) -> dict:
    """Penalties, logit_bias, min_tokens, stop_token_ids and n, checked by name (SamplingParams
    checks again; these messages name the request field). logprobs is per endpoint (_logprobs)."""
    p = lambda k: prefix + k  # noqa: E731
    out: dict = {}
    for name, lo, hi in (("presence_penalty", -2, 2), ("frequency_penalty", -2, 2)):
        v = src.get(name)
        if v is not None:
            if not _is_num(v) or not lo <= v <= hi:
                raise bad(p(name), f"must be a number in [{lo}, {hi}], got {v!r}")
            out[name] = float(v)
    v = src.get("repetition_penalty")
    if v is not None:
        if not positive_number(v):
            raise bad(p("repetition_penalty"), f"must be a finite number > 0 (1 = off), got {v!r}")
        out["repetition_penalty"] = float(v)
    bias = src.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict):
            raise bad(p("logit_bias"), "must be an object mapping token ids to biases")
        out["logit_bias"] = {}
        for k, b in bias.items():
            key = _token_id(k)
            if key is None:
                raise bad(p("logit_bias"), f"key {k!r} is not a token id")
            if not _is_num(b) or not -100 <= b <= 100:
                raise bad(p(f"logit_bias.{k}"), f"must be a number in [-100, 100], got {b!r}")
            out["logit_bias"][key] = float(b)
    v = src.get("min_tokens")
    if v is not None:
        if not _is_int(v) or v < 0:
            raise bad(p("min_tokens"), f"must be an integer >= 0, got {v!r}")
        out["min_tokens"] = v
    ids = src.get("stop_token_ids")
    if ids is not None:
        if not isinstance(ids, list) or not all(_is_int(t) and t >= 0 for t in ids):
            raise bad(p("stop_token_ids"), "must be a list of token ids")
        out["stop_token_ids"] = ids
    cite = src.get("citations")
    if cite is not None:
        if not isinstance(cite, bool):
            raise bad(p("citations"), f"must be a boolean, got {cite!r}")
        out["citations"] = cite
    n = src.get("n")
    if n is not None:
        if not _is_int(n) or not 1 <= n <= MAX_N:
            raise bad(p("n"), f"must be an integer in [1, {MAX_N}], got {n!r}")
        out["n"] = n
    return out


def _token_id(k: object) -> int | None:
    """A logit_bias key as a token id: an int, or a string of ASCII digits (int() also takes other
    scripts' digits, and isdigit() superscripts int() refuses); None if it cannot be one."""
    if isinstance(k, str) and k.isascii() and k.isdigit() and len(k) <= 10:
        k = int(k)
    return k if _is_int(k) and 0 <= k <= MAX_COUNT else None


def _logprobs(body: dict, chat: bool) -> int | None:
    """Chat: logprobs (bool) + top_logprobs (0-20); completions: logprobs (0-20, the top count)."""
    lp = body.get("logprobs")
    if chat:
        top = body.get("top_logprobs")
        if lp is not None and not isinstance(lp, bool):
            raise bad("logprobs", f"must be a boolean, got {lp!r}")
        if top is not None:
            if not _is_int(top) or not 0 <= top <= MAX_LOGPROBS:
                raise bad("top_logprobs", f"must be an integer in [0, {MAX_LOGPROBS}], got {top!r}")
            if not lp:
                raise bad("top_logprobs", "needs logprobs: true")
        return (top or 0) if lp else None
    if lp is None or lp is False:
        return None
    if not _is_int(lp) or not 0 <= lp <= MAX_LOGPROBS:
        raise bad("logprobs", f"must be an integer in [0, {MAX_LOGPROBS}] (top tokens per place), not {lp!r}")
    return lp


# The OpenAI endpoints' fields: a field outside these is a 400 naming it (as OpenAI answers an
# unrecognized argument), so a typo or a setting this server lacks (reasoning_effort, audio)
# is never accepted and then ignored. /generate has its own list (GENERATE_FIELDS).
_SAMPLING_FIELDS = (
    "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p", "stop", "seed",
    "ignore_eos", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens",
    "stop_token_ids", "citations", "n", "logprobs", "doc_attention_temperature", "doc_attention_scale",
    "doc_positions", "retrieval_top_k", "response_format", "guided_json", "guided_regex", "guided_choice",
    "guided_grammar",
)  # fmt: skip
_COMMON_FIELDS = ("model", "stream", "stream_options", "documents", *_SAMPLING_FIELDS, *_NO_EFFECT)
CHAT_FIELDS = ("messages", "tools", "tool_choice", "parallel_tool_calls", "top_logprobs", *_COMMON_FIELDS)
COMPLETION_FIELDS = ("prompt", "echo", *_COMMON_FIELDS)


def _check_fields(body: dict, fields: tuple[str, ...]) -> None:
    """Every field of an OpenAI-style body is one this endpoint reads, or one of _ONLY at a value it
    allows."""
    for key, v in body.items():
        if key in fields or v is None:
            continue
        if key not in _ONLY:
            raise bad(key, "is not a field this server supports on this endpoint (sampling fields it "
                           "takes: " + ", ".join(_SAMPLING_FIELDS) + ")")  # fmt: skip
        if v not in _ONLY[key]:
            raise bad(key, f"is not supported by this server (only {' or '.join(map(repr, _ONLY[key]))})")


def _check_model(body: dict, served: str) -> None:
    model = body.get("model")
    if model is None:
        return
    if not isinstance(model, str):
        raise bad("model", f"must be a string, got {type(model).__name__}")
    if model != served:
        raise ApiError(
            404, f"model {model!r} does not exist; this server serves {served!r}", "model", "model_not_found"
        )


def _stream(body: dict) -> tuple[bool, bool]:
    stream = _bool(body, "stream")
    opts = body.get("stream_options")
    if opts is None:
        return stream, False
    if not stream:  # as OpenAI and vLLM answer: the options would be ignored
        raise bad("stream_options", "is only allowed with stream: true")
    if not isinstance(opts, dict):
        raise bad("stream_options", "must be an object")
    for key in opts:
        if key != "include_usage":
            raise bad(f"stream_options.{key}", "unknown option (stream_options takes include_usage)")
    usage = opts.get("include_usage")
    if usage is not None and not isinstance(usage, bool):
        raise bad("stream_options.include_usage", f"must be a boolean, got {type(usage).__name__}")
    return stream, bool(usage)


def parse_completion(body: dict, served: str) -> Parsed:
    _check_model(body, served)
    _check_fields(body, COMPLETION_FIELDS)
    prompt = body.get("prompt")
    if prompt is None:
        raise bad("prompt", "is required")
    # a string, a list of token ids, or a batch: a list of strings / of token id lists
    batch = isinstance(prompt, list) and any(isinstance(x, (str, list)) for x in prompt)
    prompts = prompt if batch else [prompt]
    if len(prompts) > MAX_N:
        raise bad("prompt", f"a batch holds at most {MAX_N} prompts, got {len(prompts)}")
    docs = _doc_list(body, "documents")
    echo = _bool(body, "echo")
    mt_name = _max_tokens_param(body)
    echo_only = echo and mt_name is not None and _is_int(body[mt_name]) and body[mt_name] == 0
    if echo_only:  # a 1-token request whose token is dropped: the prompt's logprobs are the point
        body = {**body, mt_name: 1}
    sp = _sampling(body, "", 16, 1.0, openai_constraint(body))
    sp.logprobs = _logprobs(body, chat=False)
    if sp.n * len(prompts) > MAX_N:
        raise bad("n", f"n x prompts must be at most {MAX_N}, got {sp.n} x {len(prompts)}")
    stream, usage = _stream(body)
    if echo and stream and sp.logprobs is not None:
        raise bad("echo", "with logprobs is only supported without streaming")
    reqs = []
    for i, one in enumerate(prompts):
        param = f"prompt[{i}]" if batch else "prompt"
        text = ids = None
        if isinstance(one, str):
            if not one:
                raise bad(param, "must not be empty")
            text = one
        elif isinstance(one, list) and one and all(_is_int(t) for t in one):
            ids = one
        else:
            raise bad(param, "must be a string, a list of token ids, or a list of those")
        if echo and stream and text is None:
            raise bad("echo", "when streaming needs text prompts (not token ids)")
        reqs.append(
            GenerateReq(-1, sp, text=text, input_ids=ids, docs=docs, text_mode="raw", param=param, echo=echo,
                        max_tokens_param=None if echo_only else _max_tokens_param(body))  # fmt: skip
        )
    return Parsed(reqs[0], stream, usage, reqs[1:], echo_only)


def _content(m: dict, i: int) -> str:
    c = m.get("content")
    if isinstance(c, str):
        return c
    if isinstance(c, list):  # content parts: only text is supported
        out = []
        for j, part in enumerate(c):
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise bad(
                    f"messages[{i}].content[{j}]", "only {'type': 'text', 'text': str} parts are supported"
                )
            out.append(part["text"])
        return "".join(out)
    raise bad(f"messages[{i}].content", "must be a string or a list of text parts")


def parse_chat(body: dict, served: str) -> Parsed:
    _check_model(body, served)
    _check_fields(body, CHAT_FIELDS)
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages", "must be a non-empty list of {role, content} objects")
    messages = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}]", "must be an object with role and content")
        role = m.get("role")
        if role not in _MESSAGE_KEYS:
            raise bad(f"messages[{i}].role", f"must be one of {', '.join(_MESSAGE_KEYS)}, got {role!r}")
        _message_keys(m, i, _MESSAGE_KEYS[role])
        if role == "tool" or m.get("tool_calls"):
            out = _tool_message(m, i)
        else:
            out = {"role": "system" if role == "developer" else role, "content": _content(m, i)}
        name = m.get("name")
        if name is not None:
            if not isinstance(name, str):
                raise bad(f"messages[{i}].name", f"must be a string, got {type(name).__name__}")
            out["name"] = name  # for templates that render it (most ignore it, as with HF)
        messages.append(out)
    docs = _doc_list(body, "documents")
    if docs and not any(m["role"] == "user" for m in messages):
        raise bad("messages", "documents need a user message to attach to")
    tools, parallel, forced = _tools(body)
    constraint = openai_constraint(body)
    if forced is not None and constraint:
        raise bad("tool_choice", "forcing a call cannot be combined with response_format or guided_*")
    if forced is not None and (body.get("ignore_eos") or body.get("min_tokens")):
        name = "ignore_eos" if body.get("ignore_eos") else "min_tokens"
        raise bad(name, "cannot be combined with tool_choice forcing a call")
    sp = _sampling(body, "", 128, 1.0, constraint)
    sp.logprobs = _logprobs(body, chat=True)
    stream, usage = _stream(body)
    req = GenerateReq(-1, sp, messages=messages, docs=docs, param="messages", tools=tools,
                      max_tokens_param=_max_tokens_param(body))  # fmt: skip
    return Parsed(req, stream, usage, parallel_tool_calls=parallel, forced_tool=forced)


def _message_keys(m: dict, i: int, allowed: tuple[str, ...]) -> None:
    for key, v in m.items():
        if key not in allowed and v not in (None, [], {}, ""):  # (an echoed reply's `annotations: []`)
            raise bad(f"messages[{i}].{key}", f"is not a key of a {m['role']} message (it takes "
                                              f"{', '.join(allowed)})")  # fmt: skip


def _tool_message(m: dict, i: int) -> dict:
    """A tool result (role tool) or an assistant turn that called tools, as chat templates take them
    (each call's arguments as an object)."""
    if m["role"] == "tool":
        call_id = m.get("tool_call_id")
        if call_id is not None and not isinstance(call_id, str):
            raise bad(f"messages[{i}].tool_call_id", "must be a string")
        out = {"role": "tool", "content": _content(m, i)}
        return {**out, "tool_call_id": call_id} if call_id else out
    if m["role"] != "assistant":
        raise bad(f"messages[{i}].tool_calls", "only assistant messages carry tool calls")
    calls = m["tool_calls"]
    if not isinstance(calls, list) or not calls:
        raise bad(f"messages[{i}].tool_calls", "must be a non-empty list")
    out_calls = []
    for j, c in enumerate(calls):
        where = f"messages[{i}].tool_calls[{j}]"
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad(where, "must be {'type': 'function', 'function': {'name', 'arguments'}}")
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args or "{}")
            except (ValueError, RecursionError) as e:  # (ValueError: also a 4301-digit integer)
                raise bad(f"{where}.function.arguments", f"is not valid JSON: {e}") from e
        if not isinstance(args, dict):
            raise bad(f"{where}.function.arguments", "must be a JSON object")
        check_json(args, f"{where}.function.arguments")  # parsed here: read_json saw a string
        call = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
        out_calls.append({**call, "id": c["id"]} if isinstance(c.get("id"), str) else call)
    content = m.get("content")
    text = "" if content is None else _content(m, i)
    return {"role": "assistant", "content": text, "tool_calls": out_calls}


def _tools(body: dict) -> tuple[list[dict] | None, bool, str | None]:
    """tools (function definitions, checked), parallel_tool_calls and the forced call: tool_choice
    'none' leaves the tools out of the prompt, 'auto' (the default) lets the model call them,
    'required' ('*') or {'type': 'function', 'function': {'name'}} forces a call (a grammar)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = _bool(body, "parallel_tool_calls", True)
    forced = None
    if choice == "required":
        forced = "*"
    elif isinstance(choice, dict):
        fn = choice.get("function")
        named = isinstance(fn, dict) and isinstance(fn.get("name"), str)
        if choice.get("type") != "function" or not named:
            raise bad("tool_choice", "must be {'type': 'function', 'function': {'name': str}}")
        forced = fn["name"]
    elif choice is not None and choice not in ("none", "auto"):
        raise bad("tool_choice", f"must be 'none', 'auto', 'required' or a named function, got {choice!r}")
    if tools is None:
        if choice is not None and choice != "none":
            raise bad("tool_choice", "needs tools")
        return None, parallel, None
    if not isinstance(tools, list) or not tools:
        raise bad("tools", "must be a non-empty list of {'type': 'function', 'function': {...}}")
    out = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"].strip():
            raise bad(f"tools[{i}]", "must be {'type': 'function', 'function': {'name': str, ...}}")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise bad(f"tools[{i}].function.parameters", "must be a JSON schema object")
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise bad(f"tools[{i}].function.description", "must be a string")
        out.append({"type": "function", "function": fn})
    if forced not in (None, "*") and forced not in [t["function"]["name"] for t in out]:
        raise bad("tool_choice", f"names {forced!r}, which is not in tools")
    return (None if choice == "none" else out), parallel, forced


def _messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages", "must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}]", "must be an object with role and content")
        if m.get("role") not in ROLES:
            raise bad(f"messages[{i}].role", f"must be one of {', '.join(ROLES)}, got {m.get('role')!r}")
        _message_keys(m, i, ("role", "content"))
        out.append({"role": m["role"], "content": _content(m, i)})
    return out


def _parse_program(body: dict, sp: SamplingParams) -> GenerateReq:
    """/generate with `messages` (a frontend program's state): docs go into messages[doc_turn]
    (default: the last user message); continue_final continues the last, assistant, message."""
    messages = _messages(body)
    docs = _doc_list(body, "docs")
    if body.get("system") is not None:
        raise bad("system", "with messages, give the system prompt as a system message")
    doc_turn = body.get("doc_turn")
    if doc_turn is not None:
        if not _is_int(doc_turn) or not 0 <= doc_turn < len(messages):
            raise bad("doc_turn", f"must be an index into messages, got {doc_turn!r}")
        if messages[doc_turn]["role"] != "user":
            raise bad("doc_turn", "must name a user message")
    if docs and not any(m["role"] == "user" for m in messages):
        raise bad("messages", "documents need a user message to attach to")
    cont = _bool(body, "continue_final")
    if cont and messages[-1]["role"] != "assistant":
        raise bad("continue_final", "needs the last message to be an assistant message")
    return GenerateReq(
        -1,
        sp,
        messages=messages,
        docs=docs,
        text_mode="program",
        param="messages",
        doc_turn=doc_turn,
        continue_final=cont,
    )


def _generate_sampling(body: dict) -> SamplingParams:
    sp_in = body.get("sampling_params")
    sp_in = {} if sp_in is None else sp_in
    if not isinstance(sp_in, dict):
        raise bad("sampling_params", f"must be an object, got {type(sp_in).__name__}")
    unknown = sorted(set(sp_in) - set(SamplingParams.__dataclass_fields__))
    if unknown:
        raise bad(f"sampling_params.{unknown[0]}", "unknown sampling parameter")
    prefix = "sampling_params."
    sp = _sampling(sp_in, prefix, 128, 0.0, generate_constraint(sp_in, prefix))
    lp = sp_in.get("logprobs")
    if lp is not None and (not _is_int(lp) or not 0 <= lp <= MAX_LOGPROBS):
        raise bad("sampling_params.logprobs", f"must be an integer in [0, {MAX_LOGPROBS}] or null")
    sp.logprobs = lp
    return sp


# /generate's fields (/score's too, beside continuations): any other is refused, not dropped
GENERATE_FIELDS = ("text", "input_ids", "messages", "docs", "system", "sampling_params", "stream", "doc_turn",
                   "continue_final")  # fmt: skip


def parse_generate(body: dict) -> Parsed:
    unknown = [k for k in body if k not in GENERATE_FIELDS]
    if unknown:  # e.g. SGLang's return_logprob: here sampling_params.logprobs
        raise bad(unknown[0], f"is not a field of this endpoint (it takes {', '.join(GENERATE_FIELDS)}; "
                              "sampling settings go in sampling_params)")  # fmt: skip
    text, ids = body.get("text"), body.get("input_ids")
    if body.get("messages") is not None:
        if text is not None or ids is not None:
            raise bad("messages", "give exactly one of text, input_ids or messages")
        req = _parse_program(body, _generate_sampling(body))
        req.max_tokens_param = _max_tokens_param(body.get("sampling_params") or {}, "sampling_params.")
        return Parsed(req, _bool(body, "stream"))
    if (text is None) == (ids is None):
        raise bad("text", "give exactly one of text, input_ids or messages")
    for key in ("doc_turn", "continue_final"):
        if body.get(key) is not None:
            raise bad(key, "is only for a prompt given as messages")
    if text is not None and (not isinstance(text, str) or not text.strip()):
        raise bad("text", "must be a non-empty string")
    if ids is not None and (not isinstance(ids, list) or not ids or not all(_is_int(t) for t in ids)):
        raise bad("input_ids", "must be a non-empty list of integer token ids")
    docs = _doc_list(body, "docs")
    system = body.get("system")
    if system is not None and not isinstance(system, str):
        raise bad("system", f"must be a string, got {type(system).__name__}")
    if ids is not None and system is not None:
        raise bad("system", "is only supported with text")
    sp = _generate_sampling(body)
    param = "text" if text is not None else "input_ids"
    req = GenerateReq(
        -1, sp, text=text, input_ids=ids, docs=docs, system=system, text_mode="rag", param=param,
        max_tokens_param=_max_tokens_param(body.get("sampling_params") or {}, "sampling_params."),
    )  # fmt: skip
    return Parsed(req, _bool(body, "stream"))


def parse_score(body: dict) -> list[GenerateReq]:
    """POST /score: the prompt as for /generate, plus `continuations: [str]`; one scoring request per
    continuation (a 1-token prefill whose continuation tokens report their logprobs)."""
    conts = body.get("continuations")
    if not isinstance(conts, list) or not conts:
        raise bad("continuations", "must be a non-empty list of strings")
    for i, c in enumerate(conts):
        if not isinstance(c, str) or not c:
            raise bad(f"continuations[{i}]", "must be a non-empty string")
    if body.get("stream"):
        raise bad("stream", "is not supported by /score")
    if body.get("sampling_params") is not None:  # a 1-token prefill: nothing is sampled
        raise bad("sampling_params", "is not supported by /score (it samples nothing)")
    rest = {k: v for k, v in body.items() if k not in ("continuations", "sampling_params")}  # (None)
    base = parse_generate(rest).req
    base.sampling = SamplingParams(max_tokens=1)
    return [dataclasses.replace(base, continuation=c, continuation_param=f"continuations[{i}]")
            for i, c in enumerate(conts)]  # fmt: skip
