"""benchmarks/rag_serving.py: the workload generator, and one tiny end-to-end point on a CPU server."""

from __future__ import annotations

import json
import math
import os
import sys

import numpy as np
import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, BENCH)

import rag_workload as rw  # noqa: E402


def _wl(**kw):
    cfg = rw.WorkloadConfig(**{"num_docs": 50, "doc_tokens": 16, "num_requests": 400, "rate": 4.0, **kw})
    return rw.build_workload(cfg, rw.fallback_words())


def test_workload_deterministic():
    a, b = _wl(), _wl()
    assert a.docs == b.docs
    assert [(r.arrival_s, r.doc_ids, r.question) for r in a.requests] == [
        (r.arrival_s, r.doc_ids, r.question) for r in b.requests
    ]
    c = _wl(seed=1)
    assert c.docs != a.docs and [r.doc_ids for r in c.requests] != [r.doc_ids for r in a.requests]
    # The document pool does not depend on popularity or rate: every point shares it.
    assert _wl(popularity="uniform", rate=1.0).docs == a.docs
    for r in a.requests:
        assert len(r.doc_ids) == 5 and len(set(r.doc_ids)) == 5


def test_zipf_skew_and_uniform():
    z = np.sort(_wl().doc_counts())[::-1]
    u = np.sort(_wl(popularity="uniform").doc_counts())[::-1]
    assert z.sum() == u.sum() == 400 * 5
    # Zipf(2.1) with 5 distinct docs a request: the top documents appear in almost every request,
    # the tail rarely; uniform: every document about 400 * 5 / 50 = 40 times.
    assert z[0] >= 0.9 * 400 and z[:5].sum() > 0.6 * z.sum() and z[-10:].sum() < 0.05 * z.sum()
    assert u.max() < 70 and u.min() > 15


def test_poisson_arrivals():
    for rate in (0.5, 4.0):
        t = np.array([r.arrival_s for r in _wl(rate=rate, num_requests=2000).requests])
        gaps = np.diff(np.concatenate([[0.0], t]))
        assert np.all(gaps >= 0)
        assert abs(gaps.mean() - 1 / rate) < 0.1 / rate
        assert abs(gaps.std() / gaps.mean() - 1) < 0.1  # exponential: cv = 1
    assert all(r.arrival_s == 0 for r in _wl(rate=math.inf).requests)


def test_docs_tokenize_to_exact_length(tokenizer):
    words = rw.single_token_words(tokenizer)
    docs = rw.make_docs(words, 4, 200, seed=3)
    assert rw.check_doc_tokens(tokenizer, docs) == [200] * 4


def test_tokenizer_dir_env_for_dummy_preset(tokenizer, tmp_path, monkeypatch):
    """LAZYRT_TOKENIZER_DIR gives a dummy preset a tokenizer without the default GGUF."""
    from lazyrt.models import loader

    tokenizer.save_pretrained(tmp_path)
    monkeypatch.setenv(loader.TOKENIZER_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(loader, "default_model_path", lambda: (_ for _ in ()).throw(FileNotFoundError("x")))
    m = loader.load_model("tiny-llama", load_format="dummy")
    assert m.tokenizer.get_vocab() == tokenizer.get_vocab()
    monkeypatch.delenv(loader.TOKENIZER_DIR_ENV)
    with pytest.raises(FileNotFoundError):
        loader.load_model("tiny-llama", load_format="dummy")


def test_middle_half_throughput_leaves_out_the_ramps():
    """A run streaming at a steady rate between a slow start and a slow drain, each under a quarter of
    its tokens: the middle-half rate is the steady one, whatever the requests' shapes."""
    import random

    import rag_serving as rs

    rng = random.Random()
    rate = rng.uniform(100, 400)
    times = [10 * i / 100 for i in range(100)]  # start: 100 tokens in 10 s
    steady = rng.randrange(800, 1200)
    times += [10 + i / rate for i in range(steady)]
    end = times[-1]
    times += [end + 10 * (i + 1) / 100 for i in range(100)]  # drain: 100 tokens in 10 s
    results, i = [], 0
    while i < len(times):  # requests of 1-8 streamed events, one token each, consecutive times
        k = min(rng.randint(1, 8), len(times) - i)
        t = times[i : i + k]
        gaps = [b - a for a, b in zip(t, t[1:])]
        send = t[0] - rng.uniform(0, 1)
        r = rs.Result(len(results), True, send_s=send, ttft_s=t[0] - send, itl_s=gaps, completion_tokens=k)
        results.append(r)
        i += k
    rng.shuffle(results)
    got = rs.middle_half_throughput(results)
    assert got == pytest.approx(rate, rel=0.01)
    whole = len(times) / (max(times) - min(times))
    assert whole < 0.7 * got
    # events carrying several tokens count them all: doubling every request's tokens doubles the rate
    for r in results:
        r.completion_tokens *= 2
    assert rs.middle_half_throughput(results) == pytest.approx(2 * rate, rel=0.01)
    assert rs.middle_half_throughput([rs.Result(0, False)]) is None


@pytest.mark.slow
def test_end_to_end_point_on_cpu_server(tmp_path):
    """One tiny point through the real harness: launches a CPU server, streams, reports, plots."""
    import rag_serving

    out, md, png = tmp_path / "r.jsonl", tmp_path / "r.md", tmp_path / "r.png"
    rows = rag_serving.main(
        [
            "--model", "default", "--load-format", "auto", "--device", "cpu",
            "--docs", "4", "--doc-tokens", "24", "--docs-per-request", "2", "--num-requests", "3",
            "--rates", "inf", "--popularity", "zipf", "--modes", "lazy", "--output-tokens", "3",
            "--warmup", "0", "--out", str(out), "--md", str(md), "--plot", str(png),
            "--startup-timeout", "240", "--request-timeout", "240",
        ]
    )  # fmt: skip
    assert len(rows) == 1
    row = json.loads(out.read_text().splitlines()[0])
    assert row["mode"] == "lazy" and row["completed"] == 3 and row["failed"] == 0
    assert row["total_output_tokens"] == 9 and row["output_tokens"] == 3
    assert row["ttft_ms"]["p50"] > 0 and row["e2e_ms"]["p99"] >= row["ttft_ms"]["p99"]
    assert row["chunk_hits"] + row["chunk_misses"] == 6  # 3 requests x 2 docs
    assert row["chunk_misses"] >= 1 and row["kv_pages_total"] > 0
    assert "| lazy | zipf |" in md.read_text()
    try:
        import matplotlib  # noqa: F401

        assert png.stat().st_size > 1000
    except ImportError:
        pass
    # --report-only rebuilds the table from the JSON lines.
    again = rag_serving.main(["--report-only", "--out", str(out), "--plot", ""])
    assert again[0]["ttft_ms"] == row["ttft_ms"]


@pytest.mark.slow
def test_a_sigterm_to_the_benchmark_stops_the_server_it_launched(tmp_path):
    """The servers run in their own sessions, so `timeout` or a job runner signalling the benchmark alone
    left them holding the GPU (the next point's server then ran out of memory): SIGTERM mid-point must
    stop the server too."""
    import re
    import signal
    import subprocess
    import time

    import httpx

    cmd = [sys.executable, os.path.join(BENCH, "rag_serving.py"), "--model", "default",
           "--load-format", "auto", "--device", "cpu", "--docs", "4", "--doc-tokens", "24",
           "--docs-per-request", "2", "--num-requests", "200", "--rates", "0.2", "--modes", "lazy",
           "--output-tokens", "3", "--warmup", "0", "--out", str(tmp_path / "r.jsonl"), "--md", "",
           "--plot", "", "--startup-timeout", "240"]  # fmt: skip
    bench = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        port = None
        for line in bench.stdout:
            if m := re.search(r"launching: .* --port (\d+)", line):
                port = int(m.group(1))
                break
        assert port, "the benchmark printed no launch line"
        url = f"http://127.0.0.1:{port}/health"
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            try:
                if httpx.get(url, timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.5)
        else:
            pytest.fail("the server never came up")
        time.sleep(2)  # the point is under way
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(90) == 143
        with pytest.raises(httpx.TransportError):
            httpx.get(url, timeout=5)  # nobody listens on the port any more
    finally:
        if bench.poll() is None:
            bench.kill()
        if port:  # a server left behind by a failure here must not outlive the test
            subprocess.run(["pkill", "-f", f"lazyrt.launch --port {port} "], check=False)


def test_others_in_flight_at_each_send():
    """How many other completed requests were streaming when each was sent, against a brute-force count
    over random intervals (with requests sent at the same instant, back to back and failed ones)."""
    import random

    import rag_serving as rs

    rng = random.Random()
    results = []
    for i in range(200):
        send = rng.choice([round(rng.uniform(0, 20), 1), rng.uniform(0, 20)])  # some equal instants
        ok = rng.random() > 0.1
        results.append(rs.Result(i, ok, send_s=send, e2e_s=rng.uniform(0.05, 2) if ok else float("nan")))
    a, b = results[0], results[1]  # back to back: the second sent the instant the first finished
    a.ok, b.ok, a.e2e_s, b.e2e_s, b.send_s = True, True, 1.0, 1.0, a.send_s + 1.0
    results.append(rs.Result(200, True, send_s=50.0, e2e_s=1.0))  # alone, long after the others
    results += [rs.Result(201 + k, True, send_s=60.0, e2e_s=1.0) for k in range(4)]  # 4 sent at once

    def brute(r: rs.Result) -> int:
        return sum(o is not r and o.ok and o.send_s <= r.send_s < o.send_s + o.e2e_s for o in results)

    got = rs.others_in_flight(results)
    assert got == [brute(r) for r in results]
    assert got[200:] == [0, 3, 3, 3, 3]
