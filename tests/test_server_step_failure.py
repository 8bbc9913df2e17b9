"""A model step that raises inside the server's model worker (e.g. CUDA out of memory): the requests
in it get a 5xx JSON error (mid-stream: an SSE error event), nothing leaks, and the server serves the
next requests as a fresh one does; with the worker in its own process and inside the scheduler's
(--worker-in-scheduler), and with the tokenizer inside the HTTP process as well (--tokenizer-in-http)."""

from __future__ import annotations

import json
import os
import sys

import httpx
import pytest
from conftest import cpu_engine
from server_util import DOCS, ServerProc, child_names

from lazyrt import SamplingParams

pytestmark = pytest.mark.slow

# Loaded at start-up by every process of the server under test (it is first on their PYTHONPATH; the
# venv has no sitecustomize of its own): the model worker's next forward raises once the test has
# written the fault file ("oom" or "error"), which it consumes. No server option exists for this.
SITECUSTOMIZE = """
import os

_FAULT = os.environ.get("LAZYRT_TEST_FAULT_FILE")
if _FAULT:
    import torch

    from lazyrt.runtime.worker.model_runner import ModelRunner

    _execute = ModelRunner.execute

    def _faulty_execute(self, plan):
        try:
            with open(_FAULT) as f:
                kind = f.read()
            os.remove(_FAULT)
        except FileNotFoundError:
            return _execute(self, plan)
        if kind == "oom":
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (injected)")
        raise RuntimeError("injected step failure")

    ModelRunner.execute = _faulty_execute
"""

QUESTION = "What is the capital of Arvania?"


LAYOUTS = {
    "four processes": ("--no-worker-in-scheduler", "--no-tokenizer-in-http"),
    "worker in scheduler": ("--no-tokenizer-in-http",),
    "two processes": (),  # the default
}


@pytest.fixture(scope="module", params=list(LAYOUTS.values()), ids=list(LAYOUTS))
def faulty(request, tmp_path_factory, tiny_model_dir):
    """(server, arm, fault file): arm(kind) makes the worker's next forward fail."""
    d = tmp_path_factory.mktemp("fault")
    (d / "sitecustomize.py").write_text(SITECUSTOMIZE)
    fault = d / "fault"
    path = os.pathsep.join(p for p in (str(d), os.environ.get("PYTHONPATH")) if p)
    srv = ServerProc(
        "--model", tiny_model_dir("llama"), "--device", "cpu", "--kv-cache-tokens", "8192",
        "--log-level", "warning", *request.param,
        env={"PYTHONPATH": path, "LAZYRT_TEST_FAULT_FILE": str(fault)},
    )  # fmt: skip

    def arm(kind: str) -> None:
        tmp = d / "fault.tmp"
        tmp.write_text(kind)
        tmp.rename(fault)  # whole, never half written

    try:
        srv.wait_healthy()
        yield srv, arm, fault
    finally:
        srv.stop()


def _generate(srv, max_tokens: int = 8, **extra) -> httpx.Response:
    sp = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    body = {"text": QUESTION, "docs": DOCS, "sampling_params": sp, **extra}
    return httpx.post(srv.url + "/generate", json=body, timeout=120)


def test_a_failed_step_answers_5xx_and_the_server_serves_on(faulty, tiny_model_dir):
    srv, arm, fault = faulty
    if sys.platform.startswith("linux"):  # the processes by name (lazyrt/process_name.py)
        want = {"lazyrt-schedule"}
        want |= {"lazyrt-worker"} if "--no-worker-in-scheduler" in srv.args else set()
        want |= {"lazyrt-tokenize"} if "--no-tokenizer-in-http" in srv.args else set()
        assert child_names(srv.proc.pid) == want
    stats = httpx.get(srv.url + "/cache_stats", timeout=30).json()
    arm("error")
    r = _generate(srv)
    assert r.status_code == 500, r.text
    err = r.json()["error"]
    assert err["type"] == "server_error"
    assert err["message"] == "the model step failed: RuntimeError: injected step failure"
    # The next request succeeds, with a fresh engine's tokens (its documents computed anew).
    fresh = cpu_engine(tiny_model_dir("llama"), "lazy")
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    want = fresh.rag(DOCS, QUESTION, sampling_params=sp)["token_ids"]
    r = _generate(srv)
    assert r.status_code == 200, r.text
    assert r.json()["token_ids"] == want
    # Out of memory: 503, with the options that leave a step more room.
    arm("oom")
    r = _generate(srv)
    assert r.status_code == 503, r.text
    msg = r.json()["error"]["message"]
    assert msg.startswith("the model step failed: OutOfMemoryError: CUDA out of memory (injected)")
    assert "--max-step-tokens" in msg and "--kv-cache-memory-fraction" in msg
    # Mid-stream: the tokens so far, then an SSE error event instead of the rest.
    events = []
    with httpx.stream(
        "POST", srv.url + "/generate", timeout=120,
        json={"text": QUESTION, "docs": DOCS, "stream": True,
              "sampling_params": {"max_tokens": 1000, "temperature": 0, "ignore_eos": True}},
    ) as resp:  # fmt: skip
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
                if len(events) == 1:
                    arm("error")
    assert not fault.exists()  # the failure hit this request's steps, not a later request's
    assert "text" in events[0] and len(events) < 1000
    assert events[-1]["error"]["message"] == "the model step failed: RuntimeError: injected step failure"
    r = _generate(srv)
    assert r.status_code == 200 and r.json()["token_ids"] == want
    # Nothing leaked: with the caches flushed every page is free.
    httpx.post(srv.url + "/flush_cache", timeout=30)
    after = httpx.get(srv.url + "/cache_stats", timeout=30).json()
    assert after["running_requests"] == after["waiting_requests"] == after["held_pages"] == 0
    assert after["free_pages"] == after["total_pages"] == stats["total_pages"]
    assert srv.proc.poll() is None
