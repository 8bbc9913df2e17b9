"""python -m lazyrt.batch on a tiny random model (in process) and against a stand-in /generate server:
rejected requests, bad bytes, flags, resume of failed --endpoint lines, Ctrl-C, one prompt in both modes."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from lazyrt import Engine, SamplingParams
from lazyrt.batch import main, read_done
from lazyrt.batch_input import parse_line
from lazyrt.batch_runners import EndpointRunner, LocalRunner
from lazyrt.runtime.server.protocol import parse_generate
from lazyrt.runtime.tokenizer.request_tokenizer import RequestTokenizer

DOCS = ["Quenta is the capital of Arvania.", "Mount Feller is 5,210 metres tall."]


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    """(model path, a reference Engine on it)."""
    path = tiny_model_dir("llama")
    return path, Engine(path, device="cpu", kv_cache_tokens=4096)


def _records(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def _summary(err: str) -> dict:
    line = [x for x in err.splitlines() if x.startswith("lazyrt.batch summary: ")][-1]
    return json.loads(line.split(": ", 1)[1])


def test_local_rejected_request_and_bad_bytes_fail_their_line_only(tiny, tmp_path, capsys):
    path, ref = tiny
    words = [f"w{random.randrange(10_000)}" for _ in range(3)]
    lines = [
        json.dumps({"id": "a", "prompt": f"Once upon {words[0]}"}).encode(),
        json.dumps({"id": "b", "prompt": "Hello", "sampling_params": {"retrieval_top_k": 5}}).encode(),
        b'{"id": "c", "prompt": "caf\xff"}',
        b"   ",  # blank: skipped (README)
        json.dumps({"id": "d", "question": f"Where is {words[1]}?"}).encode(),
        json.dumps({"id": "e", "docs": DOCS, "question": f"How tall is {words[2]}?"}).encode(),
    ]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_bytes(b"\n".join(lines))  # (no newline after the last line)
    rc = main(["--input", str(inp), "--output", str(out), "--model", path, "--device", "cpu", "--no-progress",
               "--kv-cache-tokens", "4096", "--max-tokens", "4", "--concurrency", "8"])  # fmt: skip
    err = capsys.readouterr().err
    assert rc == 0 and "Traceback" not in err, err
    recs = _records(out)
    assert [r["line"] for r in recs] == [1, 2, 3, 5, 6]
    by_id = {r["id"]: r for r in recs if r["id"] is not None}
    assert "retrieval_top_k" in by_id["b"]["error"]["message"]
    (bad_utf8,) = [r for r in recs if r["line"] == 3]
    assert bad_utf8["id"] is None and "line 3: not valid UTF-8 (byte 0xff" in bad_utf8["error"]["message"]
    sp = SamplingParams(max_tokens=4)
    assert by_id["a"]["text"] == ref.generate(f"Once upon {words[0]}", sp)[0]["text"]
    assert by_id["e"]["text"] == ref.rag(DOCS, f"How tall is {words[2]}?", sampling_params=sp)["text"]
    assert by_id["d"]["meta"]["completion_tokens"] == 4
    s = _summary(err)
    assert s["requests"] == 5 and s["errors"] == 2 and s["completion_tokens"] == 12
    # the model load and the generation make up the run (each rounded to 1 ms on its own)
    assert s["load_s"] > 0 and s["generation_s"] > 0
    assert abs(s["load_s"] + s["generation_s"] - s["elapsed_s"]) <= 2e-3
    assert s["tok_per_s"] == pytest.approx(12 / s["generation_s"], rel=0.02)


def test_flag_errors_name_the_flag_and_come_before_the_model(tmp_path, capsys):
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"id": 1, "prompt": "hi"}\n')
    out = str(tmp_path / "out.jsonl")
    bad = [("--concurrency", "0"), ("--concurrency", "-2"), ("--max-tokens", "0"), ("--top-p", "0")]
    for flag, value in bad:
        with pytest.raises(SystemExit) as e:
            main(["--input", str(inp), "--output", out, flag, value])
        assert e.value.code == 2 and flag in capsys.readouterr().err, flag
    # an output that cannot be written fails before a model loads (this one does not exist at all)
    missing = tmp_path / "no_such_dir" / "out.jsonl"
    rc = main(["--input", str(inp), "--output", str(missing), "--model", str(tmp_path / "no_model")])
    err = capsys.readouterr().err
    assert rc == 2 and f"--output {missing}" in err and "cannot start" not in err, err
    assert not os.path.exists(out)


def test_read_done_keeps_a_complete_last_record_and_drops_retried_errors(tmp_path):
    p = tmp_path / "o.jsonl"
    recs = [{"id": "a", "line": 1, "text": "x"},
            {"id": "b", "line": 2, "error": {"message": "HTTP 503: busy", "type": "server_error"}},
            {"id": "c", "line": 3, "error": {"message": "ConnectError: refused", "type": "transport_error"}},
            {"id": "d", "line": 4, "error": {"message": "HTTP 400: bad", "type": "http_error"}},
            {"id": None, "line": 5, "error": {"message": "line 5: not valid JSON", "type": "invalid_line"}},
            {"id": "f", "line": 6, "text": "y"}]  # fmt: skip
    p.write_text("".join(json.dumps(r) + "\n" for r in recs[:-1]) + json.dumps(recs[-1]))  # no last newline
    assert read_done(str(p)) == {(("id", '"a"'), 1), (("id", '"d"'), 4), (("line", 5), 5), (("id", '"f"'), 6)}
    assert _records(p) == [recs[0], recs[3], recs[4], recs[5]] and p.read_text().endswith("}\n")


class _Stand_in:
    """A /generate stand-in: answers "answer: <text>" unless `behave` maps the text to 503, 400,
    "drop" (closes the connection unanswered) or "hold" (answers once `release` is set)."""

    def __init__(self):
        self.behave: dict[str, object] = {}
        self.seen: list[str] = []
        self.answered: list[str] = []
        self.release = threading.Event()
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _send(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._send(200, {})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                text = body.get("text") or body["messages"][0]["content"]
                stand_in.seen.append(text)
                how = stand_in.behave.get(text)
                if how == "drop":
                    self.close_connection = True
                    return
                if how == "hold":
                    stand_in.release.wait(60)
                if how in (503, 400):
                    self._send(how, {"error": {"message": f"status {how}"}})
                    return
                meta = {"prompt_tokens": 1, "completion_tokens": 1}
                self._send(200, {"text": f"answer: {text}", "meta": meta})
                stand_in.answered.append(text)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def stand_in():
    s = _Stand_in()
    yield s
    s.stop()


def test_endpoint_rerun_retries_transport_and_server_errors_only(stand_in, tmp_path, capsys):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps({"id": i, "prompt": f"p{i}"}) + "\n" for i in range(1, 6)))
    stand_in.behave = {"p2": 503, "p3": "drop", "p4": 400}
    args = ["--input", str(inp), "--output", str(out), "--endpoint", stand_in.url, "--no-progress"]
    assert main(args) == 0
    types = {r["id"]: r.get("error", {}).get("type") for r in _records(out)}
    assert types == {1: None, 2: "server_error", 3: "transport_error", 4: "http_error", 5: None}
    capsys.readouterr()
    stand_in.behave, stand_in.seen = {}, []
    assert main(args) == 0
    assert sorted(stand_in.seen) == ["p2", "p3"]  # the 400 is the line's answer: not asked again
    s = _summary(capsys.readouterr().err)
    assert s["skipped_already_done"] == 3 and s["requests"] == 2 and s["errors"] == 0
    recs = sorted(_records(out), key=lambda r: r["line"])
    assert [r["line"] for r in recs] == [1, 2, 3, 4, 5]  # one record per line
    assert [r.get("text") for r in recs] == ["answer: p1", "answer: p2", "answer: p3", None, "answer: p5"]
    assert main(args) == 0 and sorted(stand_in.seen) == ["p2", "p3"]  # nothing left to retry (none new)


def test_endpoint_ctrl_c_cancels_the_queue_and_keeps_answers_received(stand_in, tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps({"id": i, "prompt": f"p{i}"}) + "\n" for i in range(1, 9)))
    stand_in.behave = {"p2": "hold", "p5": "hold"}  # with 2 workers: 3 and 4 answered behind 2; 6 queued
    cmd = [sys.executable, "-m", "lazyrt.batch", "--input", str(inp), "--output", str(out),
           "--endpoint", stand_in.url, "--concurrency", "2", "--no-progress"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not ({"p3", "p4"} <= set(stand_in.answered) and "p5" in stand_in.seen and out.exists()
                   and out.read_text()):  # fmt: skip
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.05)
        time.sleep(0.5)  # (line 6 queued; the main thread waits on line 2)
        proc.send_signal(signal.SIGINT)
        deadline = time.monotonic() + 15
        while len(out.read_text().splitlines()) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)  # written before exiting, while 2 and 5 are still held
        written = sorted(r["line"] for r in _records(out))
    finally:
        stand_in.release.set()
        err = proc.communicate(timeout=60)[1]
    assert written == [1, 3, 4], err
    assert proc.returncode == 130 and _summary(err)["stopped_early"]
    assert not {"p6", "p7", "p8"} & set(stand_in.seen)  # the queued request was cancelled


def test_a_question_is_the_same_prompt_in_both_modes(tiny):
    """A docs + question line (docs empty or missing too) has the same prompt tokens through the local
    engine and through a server (its own parser and tokenizer on what --endpoint sends)."""
    _, engine = tiny
    tok = engine.tokenizer
    server = RequestTokenizer(tok, engine.max_context, engine.model_config.vocab_size)
    local = LocalRunner(engine, 4)
    q = f"Where is Quenta {random.randrange(1000)}?"
    rows = [{"question": q}, {"docs": [], "question": q}, {"docs": DOCS, "question": q},
            {"system": "Be brief.", "question": q}, {"docs": DOCS, "system": "Be brief.", "question": q},
            {"prompt": q}]  # fmt: skip
    for i, row in enumerate(rows):
        job = parse_line(json.dumps({"id": i, **row}), i + 1, {"max_tokens": 4})
        want = engine._make_request(local._prompt(job), job.sampling).prompt_ids
        t = server.tokenize(parse_generate(json.loads(json.dumps(EndpointRunner.body(job)))).req)
        got = list(t.prefix) + [x for d in t.docs for x in d] + list(t.suffix)
        assert [int(x) for x in got] == want, row
    # a question is a chat turn (the template's), not the bare text a prompt line is
    plain = engine._make_request(q, SamplingParams()).prompt_ids
    chat = engine._make_request(local._prompt(parse_line(json.dumps({"id": 0, "question": q}), 1, {})),
                                SamplingParams()).prompt_ids  # fmt: skip
    assert len(chat) > len(plain) + 4


def test_local_a_constraint_failing_while_decoding_fails_its_line_only_in_one_run(tiny, monkeypatch):
    """A line whose grammar outgrows the parser while decoding (2,001 alternatives) gets its
    ConstraintFailed entry from the chunk's one Engine.generate call; the other lines answer as they do
    run alone (the chunk is not re-run line by line), and nothing stays held."""
    _, engine = tiny
    rng = random.Random()
    alts = " | ".join(f'"opt-{rng.randrange(10**6)}-{i}"' for i in range(2001))
    rows = [{"prompt": f"Once upon {rng.randrange(10_000)}"},
            {"prompt": "Hello", "sampling_params": {"grammar": f"start: {alts}", "max_tokens": 16}},
            {"docs": DOCS, "question": f"Where is {rng.randrange(1000)}?"}]  # fmt: skip
    jobs = [parse_line(json.dumps({"id": i, **r}), i + 1, {"max_tokens": 4}) for i, r in enumerate(rows)]
    runner = LocalRunner(engine, 8)
    real, calls = engine.generate, []

    def counted(prompts, *args, **kwargs):
        calls.append(len(prompts))
        return real(prompts, *args, **kwargs)

    monkeypatch.setattr(engine, "generate", counted)
    results = runner._run_chunk(jobs)
    assert calls == [3]
    assert results[1]["error"]["type"] == "ConstraintFailed", results[1]
    for i in (0, 2):
        want = real([runner._prompt(jobs[i])], jobs[i].sampling)[0]
        assert results[i]["text"] == want["text"], i
    assert not engine.core.requests and engine.core.scheduler.held_pages() == 0
