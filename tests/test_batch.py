"""python -m lazyrt.batch end to end (default model, CPU): bad lines, resume, order, summary."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest

from lazyrt.batch import read_done

pytestmark = pytest.mark.slow

DOCS = ["Quenta is the capital of Arvania.", "Mount Feller is 5,210 metres tall.", "The lorn is money."]
BAD = [
    "{not json",
    "[1, 2]",
    json.dumps({"docs": DOCS[:1], "question": "no id?"}),
    json.dumps({"id": "b3", "docs": "not a list", "question": "q"}),
    json.dumps({"id": "b4", "docs": DOCS[:1]}),
    json.dumps({"id": "b5", "prompt": ""}),
    json.dumps({"id": "b6", "prompt": "x", "sampling_params": {"max_tokens": -1}}),
    json.dumps({"id": "b7", "prompt": "x", "question": "y"}),
    json.dumps({"id": "q0", "prompt": "duplicate of the first id"}),
    json.dumps({"id": True, "prompt": "bool id"}),
]


def _run(*args: str) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "lazyrt.batch",
        "--device",
        "cpu",
        "--max-tokens",
        "1",
        "--no-progress",
        *args,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


def _summary(stderr: str) -> dict:
    line = [x for x in stderr.splitlines() if x.startswith("lazyrt.batch summary: ")][-1]
    return json.loads(line.split(": ", 1)[1])


def test_200_lines_10_bad_interrupt_and_resume(tmp_path):
    rng = random.Random(0)
    lines, good_ids = [], []
    bad_at = set(rng.sample(range(1, 200), 10))
    bad = iter(BAD)
    for i in range(200):
        if i in bad_at:
            lines.append(next(bad))
            continue
        rid = f"q{i}"
        good_ids.append(rid)
        if i % 4 == 0:
            lines.append(json.dumps({"id": rid, "docs": rng.sample(DOCS, 2), "question": f"Q{i}?"}))
        else:
            lines.append(json.dumps({"id": rid, "prompt": f"Number {i} is"}))
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("\n".join(lines) + "\n")

    first = _run("--input", str(inp), "--output", str(out), "--stop-after", "70")
    assert first.returncode == 0, first.stderr
    recs1 = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(recs1) == 70 and _summary(first.stderr)["stopped_early"]
    with open(out, "a") as f:  # a torn line, as if killed mid-write: resume must cut it off
        f.write('{"id": "q999", "li')

    second = _run("--input", str(inp), "--output", str(out), "--concurrency", "48")
    assert second.returncode == 0, second.stderr
    s = _summary(second.stderr)
    assert s["skipped_already_done"] == 70 and s["requests"] == 130 and s["remaining"] == 0
    assert s["chunk_hit_ratio"] is not None and s["chunk_hit_ratio"] > 0.5
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert recs[:70] == recs1  # finished lines were not redone or rewritten
    assert [r["line"] for r in recs] == list(range(1, 201))  # one record per input, in input order
    errors = [r for r in recs if "error" in r]
    answers = [r for r in recs if "text" in r]
    assert len(errors) == 10 and len(answers) == 190
    assert {r["line"] - 1 for r in errors} == bad_at
    assert [r["id"] for r in answers] == good_ids
    assert all(r["meta"]["completion_tokens"] == 1 for r in answers)
    msgs = " | ".join(r["error"]["message"] for r in errors)
    for needle in (
        "not valid JSON",
        "must be a JSON object",
        "missing field 'id'",
        "'docs'",
        "missing field 'question'",
        "'prompt'",
        "max_tokens",
        "not both",
        "duplicate id",
        "'id'",
    ):
        assert needle in msgs, needle

    third = _run("--input", str(inp), "--output", str(out))  # nothing left: no model load, no changes
    assert third.returncode == 0 and _summary(third.stderr)["skipped_already_done"] == 200
    assert [json.loads(x) for x in out.read_text().splitlines()] == recs


def test_read_done_cuts_a_torn_line(tmp_path):
    p = tmp_path / "o.jsonl"
    p.write_text('{"id": "a", "line": 1, "text": "x"}\n{"id": null, "line": 2, "error": {}}\n{"id": "c", "li')
    assert read_done(str(p)) == {(("id", '"a"'), 1), (("line", 2), 2)}
    assert p.read_text().endswith("}\n")


def test_help_shows_an_example_and_missing_input_fails():
    h = subprocess.run([sys.executable, "-m", "lazyrt.batch", "--help"], capture_output=True, text=True)
    assert h.returncode == 0 and "example:" in h.stdout and "--endpoint" in h.stdout
    r = _run("--input", "/nonexistent/in.jsonl", "--output", "/tmp/never.jsonl")
    assert r.returncode == 2 and "nonexistent" in r.stderr


ENGINE_OPTS = [["--cache-mode", "block"], ["--no-overlap-schedule", "--kv-cache-tokens", "64"],
               ["--device", "cpu"]]


@pytest.mark.parametrize("opts", ENGINE_OPTS)
def test_local_engine_options_with_endpoint_are_an_error(opts, tmp_path):
    """With --endpoint the server's settings apply: a local engine option is refused, by name,
    before any request is sent (none would be honoured)."""
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"prompt": "hi"}\n')
    out = tmp_path / "o.jsonl"
    r = _run("--input", str(inp), "--output", str(out), "--endpoint", "http://127.0.0.1:9", *opts)
    assert r.returncode == 2
    for o in opts:
        if o.startswith("--"):
            assert o.replace("--no-", "--") in r.stderr
    assert not out.exists()


def test_recompute_options_reach_the_engine(tmp_path):
    inp = tmp_path / "in.jsonl"
    rows = [{"id": f"r{i}", "docs": DOCS, "question": "How tall is Mount Feller?"} for i in range(3)]
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    bad = _run("--input", str(inp), "--output", str(tmp_path / "bad.jsonl"), "--recompute-ratio", "1.5")
    assert bad.returncode != 0 and "recompute_ratio" in bad.stderr and "Traceback" not in bad.stderr
    plain, tail = tmp_path / "plain.jsonl", tmp_path / "tail.jsonl"
    assert _run("--input", str(inp), "--output", str(plain)).returncode == 0
    ok = _run("--input", str(inp), "--output", str(tail), "--recompute-policy", "tail",
              "--recompute-pages", "1")
    assert ok.returncode == 0, ok.stderr
    a = [json.loads(x) for x in plain.read_text().splitlines()]
    b = [json.loads(x) for x in tail.read_text().splitlines()]
    assert [g["id"] for g in b] == ["r0", "r1", "r2"]
    # repeats hit the chunk table; with recompute the later docs' pages are computed, not cached
    for x, y in zip(a[1:], b[1:]):
        assert y["meta"]["cached_tokens"] < x["meta"]["cached_tokens"]


def test_n_and_logprobs_reach_the_output_lines(tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    sp = {"max_tokens": 5, "n": 2, "temperature": 1.0, "seed": 7, "logprobs": 1}
    inp.write_text(json.dumps({"id": "a", "prompt": "Once upon a time", "sampling_params": sp}) + "\n")
    done = _run("--input", str(inp), "--output", str(out))
    assert done.returncode == 0, done.stderr
    (rec,) = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(rec["outputs"]) == 2 and rec["outputs"][0]["text"] == rec["text"]
    assert len(rec["logprobs"]) == len(rec["outputs"][0]["token_ids"]) == rec["meta"]["completion_tokens"]
    assert rec["outputs"][0]["text"] != rec["outputs"][1]["text"]  # seeds 7 and 8
