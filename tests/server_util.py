"""Start and stop a real `python -m lazyrt.launch` on loopback for the server tests."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx

# a fresh GPU machine compiles FlashInfer's and Triton's kernels in the server's start-up: give it more there
STARTUP_TIMEOUT_S = float(os.environ.get("LAZYRT_TEST_STARTUP_TIMEOUT_S", "180"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProc:
    def __init__(self, *args: str, port: int | None = None, env: dict | None = None):
        self.port = port or free_port()
        self.args = args
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="lazyrt-server-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "lazyrt.launch", *args]
        if port is None:
            cmd += ["--port", str(self.port)]
        self.proc = subprocess.Popen(
            cmd, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )
        self.health_codes: list[int] = []

    def wait_healthy(self, headers: dict | None = None) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.read_log()}")
            try:
                r = httpx.get(self.url + "/health", headers=headers, timeout=5)
                self.health_codes.append(r.status_code)
                if r.status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"server not healthy after {STARTUP_TIMEOUT_S}s:\n{self.read_log()}")

    def read_log(self) -> str:
        with open(self.log.name) as f:
            return f.read()

    def child_pids(self) -> dict[str, int]:
        found = re.findall(r"started the (.+?) process \(pid (\d+)\)", self.read_log())
        return {name: int(pid) for name, pid in found}

    def stop(self, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped) counts as gone.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


# The documents the server tests and frontend tests ask about.
DOCS = [
    "Quenta is the capital of Arvania and has two million inhabitants.",
    "Mount Feller is the tallest peak in Arvania, at 5,210 metres.",
    "The Arvanian currency is the lorn, divided into 100 pims.",
]


def serve_cpu(kv_cache_tokens: int, *args: str):
    """Generator for a module fixture: a healthy CPU server with the default model (and `args`),
    stopped after."""
    srv = ServerProc("--device", "cpu", "--kv-cache-tokens", str(kv_cache_tokens), "--log-level", "warning",
                     *args)  # fmt: skip
    try:
        srv.wait_healthy()
        yield srv
    finally:
        srv.stop()


def selected_params(request, argname: str) -> list:
    """The values `argname` is parametrized with in the tests of request's module that this session
    runs (after -k / deselection), in order, each once: the ones worth starting a server for ahead."""
    seen: list = []
    for item in request.session.items:
        callspec = getattr(item, "callspec", None)
        if getattr(item, "module", None) is request.module and callspec and argname in callspec.params:
            if callspec.params[argname] not in seen:
                seen.append(callspec.params[argname])
    return seen


def child_names(pid: int) -> set[str]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        kids = [int(k) for k in f.read().split()]
    names = set()
    for k in kids:
        with open(f"/proc/{k}/comm") as f:
            names.add(f.read().strip())
    return {n for n in names if n.startswith("lazyrt-")}  # not multiprocessing's resource tracker
