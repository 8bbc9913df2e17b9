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


def test_endpoint_mode_sends_every_sampling_field_the_line_has():
    """--endpoint: the /generate body a job becomes parses back (the server's own parser) to the
    job's SamplingParams, whatever fields the line set (n, logprobs, penalties, a constraint were
    dropped before)."""
    import random

    from lazyrt.batch_runners import EndpointRunner
    from lazyrt.runtime.server.protocol import parse_generate

    rng = random.Random()
    optional = {
        "n": lambda: rng.randint(1, 4), "logprobs": lambda: rng.randint(0, 5),
        "seed": lambda: rng.randint(0, 99), "min_tokens": lambda: rng.randint(0, 3),
        "presence_penalty": lambda: rng.uniform(-2, 2), "frequency_penalty": lambda: rng.uniform(-2, 2),
        "repetition_penalty": lambda: rng.uniform(0.5, 2), "logit_bias": lambda: {rng.randrange(50): 1.5},
        "stop_token_ids": lambda: [rng.randrange(50)], "stop": lambda: ["\\n"],
        "top_k": lambda: rng.randint(1, 40), "top_p": lambda: rng.uniform(0.1, 1),
        "regex": lambda: "[a-z]+", "citations": lambda: True, "doc_positions": lambda: "parallel",
    }  # fmt: skip
    for i in range(30):
        sp = {"max_tokens": rng.randint(4, 9), "temperature": rng.choice([0.0, 0.7])}
        sp.update({k: f() for k, f in optional.items() if rng.random() < 0.4})
        if "regex" in sp:  # (a constraint ends the output itself)
            sp.pop("min_tokens", None)
        line = {"id": i, "docs": ["d"], "question": "q", "sampling_params": sp} if i % 2 else \
            {"id": i, "prompt": "p", "sampling_params": sp}  # fmt: skip
        job = parse_line(json.dumps(line), i + 1, {})
        assert job.error is None, job.error
        body = json.loads(json.dumps(EndpointRunner.body(job)))  # as it travels
        assert parse_generate(body).req.sampling == job.sampling, sp
