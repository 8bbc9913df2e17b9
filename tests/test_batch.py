"""python -m lazyrt.batch end to end (default model, CPU): bad lines, resume, order, summary."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import tempfile

import pytest
from server_util import selected_params

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


def _cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "lazyrt.batch", "--device", "cpu", "--max-tokens", "1", "--no-progress",
            *args]  # fmt: skip


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(_cmd(*args), capture_output=True, text=True, timeout=600)


def _run_together(*runs: tuple[str, ...]) -> list[subprocess.CompletedProcess]:
    """Independent runs at once: a run's start-up (imports, the model) is seconds of one core, and the
    box has two."""
    files = [(tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")) for _ in runs]  # (no pipe to fill)
    procs = [subprocess.Popen(_cmd(*args), stdout=out, stderr=err, text=True)
             for args, (out, err) in zip(runs, files)]  # fmt: skip
    done = []
    try:
        for args, p, (out, err) in zip(runs, procs, files):
            p.wait(timeout=600)
            out.seek(0)
            err.seek(0)
            done.append(subprocess.CompletedProcess(_cmd(*args), p.returncode, out.read(), err.read()))
    finally:
        for p, (out, err) in zip(procs, files):
            if p.poll() is None:
                p.kill()
                p.wait()
            out.close()
            err.close()
    return done


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
    h, r = _run_together(("--help",), ("--input", "/nonexistent/in.jsonl", "--output", "/tmp/never.jsonl"))
    assert h.returncode == 0 and "example:" in h.stdout and "--endpoint" in h.stdout
    assert r.returncode == 2 and "nonexistent" in r.stderr


ENGINE_OPTS = [["--cache-mode", "block"], ["--no-overlap-schedule", "--kv-cache-tokens", "64"],
               ["--device", "cpu"]]


@pytest.fixture(scope="module")
def endpoint_runs(request, tmp_path_factory):
    """ENGINE_OPTS (those of the selected tests) each run with --endpoint, all at once: a refusal costs
    the seconds of a start-up (imports), one core each. opts -> (the run, its --output path)."""
    d = tmp_path_factory.mktemp("endpoint")
    inp = d / "in.jsonl"
    inp.write_text('{"prompt": "hi"}\n')
    chosen = [tuple(o) for o in selected_params(request, "opts")] or [tuple(o) for o in ENGINE_OPTS]
    outs = [d / f"o{i}.jsonl" for i in range(len(chosen))]
    runs = _run_together(*[("--input", str(inp), "--output", str(out), "--endpoint", "http://127.0.0.1:9", *o)
                           for o, out in zip(chosen, outs)])  # fmt: skip
    return {o: (r, out) for o, r, out in zip(chosen, runs, outs)}


@pytest.mark.parametrize("opts", ENGINE_OPTS)
def test_local_engine_options_with_endpoint_are_an_error(opts, endpoint_runs):
    """With --endpoint the server's settings apply: a local engine option is refused, by name,
    before any request is sent (none would be honoured)."""
    r, out = endpoint_runs[tuple(opts)]
    assert r.returncode == 2
    for o in opts:
        if o.startswith("--"):
            assert o.replace("--no-", "--") in r.stderr
    assert not out.exists()


RECOMPUTE_ROWS = [{"id": f"r{i}", "docs": DOCS, "question": "How tall is Mount Feller?"} for i in range(3)]
N_LOGPROBS_ROW = {"id": "a", "prompt": "Once upon a time",
                  "sampling_params": {"max_tokens": 5, "n": 2, "temperature": 1.0, "seed": 7, "logprobs": 1}}


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory) -> list[dict]:
    """One run with the default options (a model load, seconds) over the rows of both tests below: the
    recompute test's three, then the n/logprobs one. Its records, in input order."""
    d = tmp_path_factory.mktemp("plain")
    inp, out = d / "in.jsonl", d / "out.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in [*RECOMPUTE_ROWS, N_LOGPROBS_ROW]))
    done = _run("--input", str(inp), "--output", str(out))
    assert done.returncode == 0, done.stderr
    return [json.loads(x) for x in out.read_text().splitlines()]


def test_recompute_options_reach_the_engine(tmp_path, plain_run):
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in RECOMPUTE_ROWS))
    tail = tmp_path / "tail.jsonl"
    bad, ok = _run_together(
        ("--input", str(inp), "--output", str(tmp_path / "bad.jsonl"), "--recompute-ratio", "1.5"),
        ("--input", str(inp), "--output", str(tail), "--recompute-policy", "tail", "--recompute-pages", "1"),
    )
    assert bad.returncode != 0 and "recompute_ratio" in bad.stderr and "Traceback" not in bad.stderr
    assert ok.returncode == 0, ok.stderr
    a = plain_run[: len(RECOMPUTE_ROWS)]
    b = [json.loads(x) for x in tail.read_text().splitlines()]
    assert [g["id"] for g in a] == [g["id"] for g in b] == ["r0", "r1", "r2"]
    # repeats hit the chunk table; with recompute the later docs' pages are computed, not cached
    for x, y in zip(a[1:], b[1:]):
        assert y["meta"]["cached_tokens"] < x["meta"]["cached_tokens"]


def test_n_and_logprobs_reach_the_output_lines(plain_run):
    (rec,) = [r for r in plain_run if r["id"] == N_LOGPROBS_ROW["id"]]
    assert len(rec["outputs"]) == 2 and rec["outputs"][0]["text"] == rec["text"]
    assert len(rec["logprobs"]) == len(rec["outputs"][0]["token_ids"]) == rec["meta"]["completion_tokens"]
    assert rec["outputs"][0]["text"] != rec["outputs"][1]["text"]  # seeds 7 and 8
