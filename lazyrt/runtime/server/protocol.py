"""HTTP request bodies -> GenerateReq, with OpenAI-style errors that name the offending field.

Three shapes: POST /generate (lazyrt native: text | input_ids, docs, system, sampling_params,
stream), POST /v1/completions and POST /v1/chat/completions (OpenAI, plus `documents: [str]`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from lazyrt.runtime.ipc.messages import GenerateReq
from lazyrt.sampling_params import SamplingParams, positive_number

ROLES = ("system", "user", "assistant")
# OpenAI fields we cannot honour: reject a non-default value rather than silently ignore it.
_UNSUPPORTED = {
    "n": 1,
    "best_of": 1,
    "logprobs": None,
    "top_logprobs": None,
    "echo": False,
    "presence_penalty": 0,
    "frequency_penalty": 0,
    "logit_bias": None,
    "tools": None,
    "suffix": None,
}


class ApiError(Exception):
    def __init__(
        self, status: int, message: str, param: str | None = None, type: str = "invalid_request_error"
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.type = status, message, param, type

    def body(self) -> dict:
        return {
            "error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status}
        }


def bad(param: str, why: str) -> ApiError:
    return ApiError(400, f"{param}: {why}", param)


@dataclass
class Parsed:
    req: GenerateReq  # rid filled in by the caller
    stream: bool
    include_usage: bool = False


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _str_list(body: dict, key: str, allow_empty_items: bool = False) -> list[str] | None:
    v = body.get(key)
    if v is None:
        return None
    if not isinstance(v, list):
        raise bad(key, f"must be a list of strings, got {type(v).__name__}")
    for i, s in enumerate(v):
        if not isinstance(s, str):
            raise bad(f"{key}[{i}]", f"must be a string, got {type(s).__name__}")
        if not allow_empty_items and not s.strip():
            raise bad(f"{key}[{i}]", "must not be empty")
    return v


def _bool(body: dict, key: str, default: bool = False) -> bool:
    v = body.get(key, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(key, f"must be a boolean, got {type(v).__name__}")
    return v


def _sampling(src: dict, prefix: str, default_max_tokens: int, default_temperature: float) -> SamplingParams:
    """Validate each sampling field by name (prefix names where it sits in the body)."""
    p = lambda k: prefix + k  # noqa: E731
    max_tokens = src.get("max_tokens")
    if max_tokens is None:
        max_tokens = src.get("max_completion_tokens", default_max_tokens)
    if max_tokens is None:
        max_tokens = default_max_tokens
    if not _is_int(max_tokens) or max_tokens < 1:
        raise bad(p("max_tokens"), f"must be an integer >= 1, got {max_tokens!r}")
    temperature = src.get("temperature", default_temperature)
    temperature = default_temperature if temperature is None else temperature
    if not _is_num(temperature) or not 0 <= temperature <= 2:
        raise bad(p("temperature"), f"must be a number in [0, 2], got {temperature!r}")
    top_p = 1.0 if src.get("top_p") is None else src["top_p"]
    if not _is_num(top_p) or not 0 < top_p <= 1:
        raise bad(p("top_p"), f"must be a number in (0, 1], got {top_p!r}")
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
    if retrieval_top_k is not None and (not _is_int(retrieval_top_k) or retrieval_top_k < 1):
        raise bad(p("retrieval_top_k"), f"must be an integer >= 1, got {retrieval_top_k!r}")
    return SamplingParams(
        retrieval_top_k=retrieval_top_k,
        doc_positions=doc_positions,
        **doc_attention,
        max_tokens=max_tokens,
        temperature=float(temperature),
        top_p=float(top_p),
        top_k=top_k,
        stop=stop,
        seed=seed,
        ignore_eos=ignore_eos,
    )


def _check_unsupported(body: dict) -> None:
    for key, default in _UNSUPPORTED.items():
        v = body.get(key)
        if v is not None and v != default and not (key == "logprobs" and v is False):
            raise bad(key, f"is not supported by this server (only {default!r})")


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
    if not isinstance(opts, dict):
        raise bad("stream_options", "must be an object")
    return stream, _bool(opts, "include_usage")


def parse_completion(body: dict, served: str) -> Parsed:
    _check_model(body, served)
    _check_unsupported(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if prompt is None:
        raise bad("prompt", "is required")
    text = ids = None
    if isinstance(prompt, str):
        if not prompt:
            raise bad("prompt", "must not be empty")
        text = prompt
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        ids = prompt
    else:
        raise bad("prompt", "must be a string or a list of token ids (one prompt per request)")
    docs = _str_list(body, "documents")
    sp = _sampling(body, "", 16, 1.0)
    stream, usage = _stream(body)
    req = GenerateReq(-1, sp, text=text, input_ids=ids, docs=docs, text_mode="raw", param="prompt")
    return Parsed(req, stream, usage)


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
    _check_unsupported(body)
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages", "must be a non-empty list of {role, content} objects")
    messages = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}]", "must be an object with role and content")
        role = m.get("role")
        if role not in ROLES:
            raise bad(f"messages[{i}].role", f"must be one of {', '.join(ROLES)}, got {role!r}")
        messages.append({"role": role, "content": _content(m, i)})
    docs = _str_list(body, "documents")
    if docs and not any(m["role"] == "user" for m in messages):
        raise bad("messages", "documents need a user message to attach to")
    sp = _sampling(body, "", 128, 1.0)
    stream, usage = _stream(body)
    req = GenerateReq(-1, sp, messages=messages, docs=docs, param="messages")
    return Parsed(req, stream, usage)


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
        out.append({"role": m["role"], "content": _content(m, i)})
    return out


def _parse_program(body: dict, sp: SamplingParams) -> GenerateReq:
    """/generate with `messages` (a frontend program's state): docs go into messages[doc_turn]
    (default: the last user message); continue_final continues the last, assistant, message."""
    messages = _messages(body)
    docs = _str_list(body, "docs")
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
    sp_in = body.get("sampling_params") or {}
    if not isinstance(sp_in, dict):
        raise bad("sampling_params", "must be an object")
    unknown = sorted(set(sp_in) - set(SamplingParams.__dataclass_fields__))
    if unknown:
        raise bad(f"sampling_params.{unknown[0]}", "unknown sampling parameter")
    return _sampling(sp_in, "sampling_params.", 128, 0.0)


def parse_generate(body: dict) -> Parsed:
    text, ids = body.get("text"), body.get("input_ids")
    if body.get("messages") is not None:
        if text is not None or ids is not None:
            raise bad("messages", "give exactly one of text, input_ids or messages")
        return Parsed(_parse_program(body, _generate_sampling(body)), _bool(body, "stream"))
    if (text is None) == (ids is None):
        raise bad("text", "give exactly one of text, input_ids or messages")
    if text is not None and (not isinstance(text, str) or not text.strip()):
        raise bad("text", "must be a non-empty string")
    if ids is not None and (not isinstance(ids, list) or not ids or not all(_is_int(t) for t in ids)):
        raise bad("input_ids", "must be a non-empty list of integer token ids")
    docs = _str_list(body, "docs")
    system = body.get("system")
    if system is not None and not isinstance(system, str):
        raise bad("system", f"must be a string, got {type(system).__name__}")
    if ids is not None and system is not None:
        raise bad("system", "is only supported with text")
    sp = _generate_sampling(body)
    param = "text" if text is not None else "input_ids"
    req = GenerateReq(
        -1, sp, text=text, input_ids=ids, docs=docs, system=system, text_mode="rag", param=param
    )
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
    rest = {k: v for k, v in body.items() if k not in ("continuations", "sampling_params")}
    base = parse_generate(rest).req
    base.sampling = SamplingParams(max_tokens=1)
    return [dataclasses.replace(base, continuation=c) for c in conts]
