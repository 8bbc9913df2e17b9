"""Batch input lines -> jobs, or a message naming what is wrong with the line (never an exception)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from lazyrt.documents import DocumentError, check_doc_item
from lazyrt.sampling_params import SamplingParams


@dataclass
class Job:
    line: int  # 1-based line number in the input file
    id: str | int | None
    sampling: SamplingParams | None = None
    prompt: str | None = None  # {"id", "prompt"}
    docs: list[str | dict] | None = None  # {"id", "docs", "question", "system"?}; {"id": ...} items too
    question: str | None = None
    system: str | None = None
    error: str | None = None  # set: the line is bad; write an error record instead of running it


LINE_FIELDS = ("id", "prompt", "docs", "question", "system", "sampling_params")


def _is_id(x: object) -> bool:
    return isinstance(x, str) and bool(x) or isinstance(x, int) and not isinstance(x, bool)


def parse_line(text: str, line: int, defaults: dict) -> Job:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return Job(line, None, error=f"line {line}: not valid JSON: {e}")
    if not isinstance(obj, dict):
        return Job(line, None, error=f"line {line}: must be a JSON object, got {type(obj).__name__}")
    job = Job(line, obj.get("id") if _is_id(obj.get("id")) else None)

    def fail(why: str) -> Job:
        job.error = f"line {line}: {why}"
        return job

    if "id" not in obj:
        return fail("missing field 'id'")
    if job.id is None:
        return fail(f"field 'id' must be a non-empty string or an integer, got {obj['id']!r}")
    unknown = [k for k in obj if k not in LINE_FIELDS]
    if unknown:  # (a field the job would not use: an error, not a silent drop)
        return fail(f"unknown field {unknown[0]!r} (a line has {', '.join(LINE_FIELDS)})")
    sp = obj.get("sampling_params")
    if sp is not None and not isinstance(sp, dict):
        return fail(f"field 'sampling_params' must be an object, got {type(sp).__name__}")
    try:
        job.sampling = SamplingParams.from_dict({**defaults, **(sp or {})})
    except (ValueError, TypeError) as e:
        return fail(f"field 'sampling_params': {e}")
    if "prompt" in obj:
        if "question" in obj or "docs" in obj:
            return fail("give either 'prompt' or 'docs' + 'question', not both")
        if "system" in obj:
            return fail("field 'system' goes with 'docs' + 'question' ('prompt' is the whole prompt)")
        if not isinstance(obj["prompt"], str) or not obj["prompt"].strip():
            return fail("field 'prompt' must be a non-empty string")
        job.prompt = obj["prompt"]
        return job
    if "question" not in obj:
        return fail("missing field 'question' (or 'prompt')")
    if not isinstance(obj["question"], str) or not obj["question"].strip():
        return fail("field 'question' must be a non-empty string")
    docs = obj.get("docs", [])
    if not isinstance(docs, list):
        return fail(f"field 'docs' must be a list of strings, got {type(docs).__name__}")
    try:  # texts, {"text": ...} or {"id": ...} of a registered document
        docs = [check_doc_item(d, f"docs[{i}]") for i, d in enumerate(docs)]
    except DocumentError as e:
        return fail(f"field {e}")
    system = obj.get("system")
    if system is not None and not isinstance(system, str):
        return fail(f"field 'system' must be a string, got {type(system).__name__}")
    job.docs, job.question, job.system = docs, obj["question"], system
    return job


def key(id_: object, line: int) -> tuple:
    """What identifies a finished input on resume: its id, or its line number when it had none."""
    return ("id", json.dumps(id_)) if id_ is not None else ("line", line)
