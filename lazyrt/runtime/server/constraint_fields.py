"""Structured-output request fields -> the SamplingParams constraint field, with 400s naming the field.

OpenAI endpoints: `response_format` ({"type": "text" | "json_object" | "json_schema", "json_schema":
{"name", "schema", "strict"}}) and vLLM's extras `guided_json`, `guided_regex`, `guided_choice`,
`guided_grammar`. /generate: the SamplingParams names inside `sampling_params` (json_schema,
json_object, regex, choice, grammar). One constraint per request; the second one given is named.
"""

from __future__ import annotations

import json
from typing import Any

from lazyrt.constraint import FIELDS, grammar_text
from lazyrt.runtime.server.errors import bad, check_json

# vLLM's extra field -> SamplingParams field
GUIDED = (("guided_json", "json_schema"), ("guided_regex", "regex"), ("guided_choice", "choice"),
          ("guided_grammar", "grammar"))  # fmt: skip


def _response_format(fmt: Any) -> tuple[str, str, object] | None:
    """(request field, SamplingParams field, value) for response_format, None for type text."""
    if not isinstance(fmt, dict):
        raise bad("response_format", "must be an object like {'type': 'json_object'}")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return "response_format", "json_object", True
    if kind != "json_schema":
        raise bad("response_format.type", f"must be 'text', 'json_object' or 'json_schema', got {kind!r}")
    js = fmt.get("json_schema")
    if not isinstance(js, dict):
        raise bad("response_format.json_schema", "must be an object with name and schema")
    if not isinstance(js.get("name"), str) or not js["name"]:
        raise bad("response_format.json_schema.name", "must be a non-empty string")
    if js.get("strict") is not None and not isinstance(js["strict"], bool):
        raise bad("response_format.json_schema.strict", "must be a boolean")
    if not isinstance(js.get("schema"), dict):
        raise bad("response_format.json_schema.schema", "must be a JSON schema object")
    return "response_format.json_schema.schema", "json_schema", js["schema"]


def _one(found: list[tuple[str, str, object]], src: dict, prefix: str) -> dict:
    if len(found) > 1:
        raise bad(found[1][0], f"cannot be combined with {found[0][0]} (one constraint per request)")
    if not found:
        return {}
    param, field, value = found[0]
    if field == "json_schema" and isinstance(value, str):  # guided_json may come as a JSON string
        try:
            value = json.loads(value)
        except (ValueError, RecursionError) as e:  # (ValueError: also a 4301-digit integer)
            raise bad(param, f"is not valid JSON: {e}") from e
        if isinstance(value, (dict, list)):
            check_json(value, param)  # parsed here: read_json saw a string
    try:
        grammar_text(field, value)
    except ValueError as e:
        raise bad(param, str(e)) from e
    # the grammar ends the output: EOS must stay allowed
    if src.get("ignore_eos"):
        raise bad(prefix + "ignore_eos", f"cannot be combined with {param}")
    if src.get("min_tokens"):
        raise bad(prefix + "min_tokens", f"cannot be combined with {param}")
    return {field: value}


def openai_constraint(body: dict) -> dict:
    """The SamplingParams constraint fields (empty, or one) from an OpenAI-style body."""
    found = []
    if body.get("response_format") is not None:
        rf = _response_format(body["response_format"])
        if rf is not None:
            found.append(rf)
    found += [(key, field, body[key]) for key, field in GUIDED if body.get(key) is not None]
    return _one(found, body, "")


def generate_constraint(sp: dict, prefix: str) -> dict:
    """The constraint fields of a /generate `sampling_params` object (SamplingParams' names)."""
    found = []
    for field in FIELDS:
        v = sp.get(field)
        if v is None or (field == "json_object" and v is False):
            continue
        if field == "json_object" and v is not True:
            raise bad(prefix + field, f"must be a boolean, got {v!r}")
        found.append((prefix + field, field, v))
    return _one(found, sp, prefix)

