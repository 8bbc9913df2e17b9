"""Batch input lines (lazyrt/batch_input.py): every field a line may have is used or refused, never
dropped; each bad line's message names the problem."""

from __future__ import annotations

import json

import pytest

from lazyrt.batch_input import LINE_FIELDS, parse_line


@pytest.mark.parametrize(
    "obj, needle",
    [
        ({"id": 1, "prompt": "x", "metadata": {"k": 1}}, "unknown field 'metadata'"),
        ({"id": 1, "docs": ["d"], "question": "q", "sytem": "s"}, "unknown field 'sytem'"),
        ({"id": 1, "prompt": "x", "system": "s"}, "field 'system' goes with"),
        ({"id": 1, "prompt": "x", "sampling_params": {"seed": 2**64}}, "seed"),
        ({"id": 1, "prompt": "x", "sampling_params": {"max_tokens": 2**31}}, "max_tokens"),
        ({"id": 1, "prompt": "x", "sampling_params": {"top_k": 2**40}}, "top_k"),
    ],
)
def test_a_field_the_job_would_not_use_is_an_error(obj, needle):
    job = parse_line(json.dumps(obj), 7, {})
    assert job.error is not None and job.error.startswith("line 7: ") and needle in job.error, job.error


def test_every_listed_field_is_taken():
    rag = parse_line(json.dumps({"id": "r", "docs": ["d"], "question": "q", "system": "s",
                                 "sampling_params": {"max_tokens": 3}}), 1, {"temperature": 0.0})  # fmt: skip
    assert rag.error is None and (rag.docs, rag.question, rag.system) == (["d"], "q", "s")
    assert rag.sampling.max_tokens == 3 and rag.sampling.temperature == 0.0
    plain = parse_line(json.dumps({"id": 2, "prompt": "p"}), 2, {})
    assert plain.error is None and plain.prompt == "p"
    assert set(LINE_FIELDS) == {"id", "prompt", "docs", "question", "system", "sampling_params"}
