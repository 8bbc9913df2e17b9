"""tool_choice 'required' or a named function as a grammar: the answer is a call (or calls) in the
model's tool-call format (runtime/tokenizer/tool_calls.py), each {"name", "arguments"} with the
tool's parameters schema, enforced while decoding like any other structured-output constraint."""

from __future__ import annotations

import json

from lazyrt.constraint import JSON_OPTIONS
from lazyrt.runtime.tokenizer.tool_calls import HERMES_CLOSE, HERMES_OPEN


def _call_schema(fn: dict, args_key: str) -> dict:
    params = fn.get("parameters") or {"type": "object"}
    return {
        "type": "object",
        "properties": {"name": {"const": fn["name"]}, args_key: params},
        "required": ["name", args_key],
        "additionalProperties": False,
    }


def tool_call_grammar(tools: list[dict], forced: str, fmt: str, parallel: bool) -> str:
    """Lark text for a forced call: forced is a tool's name, or '*' for any of tools ('required');
    fmt 'hermes' (<tool_call> tags; several calls when parallel) or 'json' (one bare object)."""
    fns = [t["function"] for t in tools if forced in ("*", t["function"]["name"])]
    key = "arguments" if fmt == "hermes" else "parameters"
    calls = [_call_schema(fn, key) for fn in fns]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    schema = {**schema, "x-guidance": JSON_OPTIONS}
    call = f"call: %json {json.dumps(schema)}"
    if fmt == "json":
        return f"start: call\n{call}\n"
    block = f'{json.dumps(HERMES_OPEN + chr(10))} call {json.dumps(chr(10) + HERMES_CLOSE)}'
    start = 'start: block ("\\n" block)*' if parallel else "start: block"
    return f"{start}\nblock: {block}\n{call}\n"
