"""Tool calls in a model's output, in the format its chat template teaches it.

Two formats, picked from the template's text:
- "hermes": calls wrapped in <tool_call> ... </tool_call>, each a JSON object {"name", "arguments"}
  (Hermes, Qwen 2.5 / 3 and templates like them); text outside the tags is content.
- "json": the whole answer is one JSON object {"name", "parameters" | "arguments"} (Llama 3.1+ style),
  optionally after <|python_tag|>.
A template that never mentions tools has no format: a request with tools is refused.

`ToolCallStream` splits streamed text: content goes out as it comes, except what may be the start of
a call, which is held until it is one (then kept for the end) or is not (then sent).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"


def tool_format(chat_template: str | None) -> str | None:
    """The tool-call format a chat template uses, or None when it renders no tools."""
    if not chat_template or "tools" not in chat_template:
        return None
    if HERMES_OPEN in chat_template:
        return "hermes"
    if "parameters" in chat_template or "arguments" in chat_template:
        return "json"
    return None


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object's text, as OpenAI sends it


def _call(obj: object) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # already JSON text
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def parse_tool_calls(text: str, fmt: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a finished answer. Text that is not a well-formed call stays content."""
    if fmt == "hermes":
        calls, content, rest = [], [], text
        while True:
            head, sep, tail = rest.partition(HERMES_OPEN)
            content.append(head)
            if not sep:
                break
            body, closed, after = tail.partition(HERMES_CLOSE)
            try:
                call = _call(json.loads(body))
            except json.JSONDecodeError:
                call = None
            if call is None:  # not a call after all: keep the text as it was
                content.append(sep + body + closed)
            else:
                calls.append(call)
            rest = after
        out = "".join(content)
        return (out.strip() or None) if calls else out, calls
    if fmt == "json":
        body = text.strip()
        body = body[len(PYTHON_TAG) :].strip() if body.startswith(PYTHON_TAG) else body
        if body.startswith("{"):
            try:
                objs = [json.loads(body)]
            except json.JSONDecodeError:  # several calls separated by ';' (Llama 3.2 style)
                try:
                    objs = [json.loads(p) for p in body.split(";") if p.strip()]
                except json.JSONDecodeError:
                    objs = []
            calls = [c for c in map(_call, objs) if c is not None]
            if calls and len(calls) == len(objs):
                return None, calls
        return text, []
    raise ValueError(f"unknown tool-call format {fmt!r}")


@dataclass
class ToolCallStream:
    """Streaming: feed() each text delta, send back what it returns as content; finish() at the end
    gives the calls (and any held content) once the whole answer is known."""

    fmt: str
    text: str = ""  # everything seen
    sent: int = 0  # characters of text sent as content
    holding: bool = field(default=False)  # a call (or what may be one) started at `sent`

    def feed(self, delta: str) -> str:
        self.text += delta
        if self.holding:
            return ""
        pending = self.text[self.sent :]
        if self.fmt == "json":
            lead = pending.lstrip()
            if not lead:
                return ""
            if lead[0] == "{" or lead.startswith(PYTHON_TAG) or PYTHON_TAG.startswith(lead):
                if self.sent == 0:  # a JSON answer: held to the end
                    self.holding = True
                    return ""
            out, self.sent = pending, len(self.text)
            return out
        at = pending.find(HERMES_OPEN)
        if at >= 0:
            self.holding = True
            out, self.sent = pending[:at], self.sent + at
            return out
        keep = next((k for k in range(min(len(HERMES_OPEN) - 1, len(pending)), 0, -1)
                     if HERMES_OPEN.startswith(pending[-k:])), 0)  # fmt: skip
        out = pending[: len(pending) - keep]
        self.sent += len(out)
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(content not yet sent, calls)."""
        rest = self.text[self.sent :]
        self.sent = len(self.text)
        if not rest:
            return "", []
        content, calls = parse_tool_calls(rest, self.fmt)
        return content or "", calls
