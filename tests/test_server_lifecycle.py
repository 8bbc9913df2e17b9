"""Server lifecycle: no-argument launch, loading state, API key, SIGTERM and a child's death."""

from __future__ import annotations

import os
import re
import signal
import socket
import sys
import time

import httpx
import pytest
from openai import AuthenticationError, OpenAI
from server_util import ServerProc, pid_alive

pytestmark = pytest.mark.slow


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _comm(pid: int) -> str:
    with open(f"/proc/{pid}/comm") as f:
        return f.read().strip()


def _wait_gone(pids, timeout: float = 15) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(pid_alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if pid_alive(p)]


def test_launch_without_arguments_serves_default_model_and_sigterm_stops_children():
    if not _port_free(30000):
        pytest.skip("port 30000 (the default) is in use")
    srv = ServerProc(port=30000)  # exactly `python -m lazyrt.launch`
    try:
        srv.wait_healthy()
        assert 503 in srv.health_codes  # /health said "loading" before the warm-up generation
        oai = OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)
        out = oai.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=[{"role": "user", "content": "What is the capital of Arvania?"}],
            max_tokens=8,
            temperature=0,
            extra_body={"documents": ["Quenta is the capital of Arvania."]},
        )
        assert out.choices[0].message.content and out.usage.completion_tokens >= 1
        children = srv.child_pids()
        # the default layout: the HTTP process tokenizes, the scheduler's process runs the model worker
        assert set(children) == {"scheduler"}
        if sys.platform.startswith("linux"):  # each names itself for top / psutil (process_name.py)
            names = {k: _comm(pid) for k, pid in children.items()}
            assert names == {"scheduler": "lazyrt-schedule"}, names
            assert _comm(srv.proc.pid) == "lazyrt-http"
        ipc_dir = re.search(r"ipc sockets in (\S+)", srv.read_log()).group(1)
        assert os.path.isdir(ipc_dir)
    finally:
        code = srv.stop()
    assert code == 0, srv.read_log()
    assert _wait_gone(children.values()) == []
    assert not os.path.exists(ipc_dir)


def test_api_key_and_a_dead_child_stops_the_server_non_zero():
    srv = ServerProc("--device", "cpu", "--kv-cache-tokens", "4096", "--api-key", "sekrit",
                     "--no-worker-in-scheduler", "--no-tokenizer-in-http")  # the four-process layout
    try:
        srv.wait_healthy()  # /health needs no key
        assert httpx.get(srv.url + "/v1/models").status_code == 401
        r = httpx.post(
            srv.url + "/v1/completions", json={"prompt": "hi"}, headers={"Authorization": "Bearer no"}
        )
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        with pytest.raises(AuthenticationError):
            OpenAI(base_url=srv.url + "/v1", api_key="wrong", max_retries=0).models.list()
        oai = OpenAI(base_url=srv.url + "/v1", api_key="sekrit", max_retries=0, timeout=60)
        assert oai.completions.create(model="SmolLM2-135M-Instruct", prompt="Hi", max_tokens=2).choices
        children = srv.child_pids()
        os.kill(children["model worker"], signal.SIGKILL)
        code = srv.proc.wait(30)  # must exit by itself, not hang
    finally:
        srv.stop()
    assert code != 0
    assert "model worker process exited unexpectedly" in srv.read_log()
    assert _wait_gone(children.values()) == []
