"""Peer KV end to end: two `lazyrt.launch` replicas with --kv-peers on loopback answer as a replica
without peers does, while each document is cached by one of them only."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import httpx
import pytest
import torch
from server_util import DOCS, ServerProc

from lazyrt.launch import main as launch_main

MORE = [
    "The lorn was introduced in 1921, replacing the silver crown.",
    "Arvania has three official languages and one sign language.",
    "The Feller glacier shrank by a third between 1950 and 2000.",
]


def _chat(url: str, docs: list[str], q: str) -> dict:
    body = {"messages": [{"role": "user", "content": q}], "documents": docs, "max_tokens": 12}
    body["temperature"] = 0
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def ask_both_and_compare(a: ServerProc, b: ServerProc, ref: ServerProc, rounds: int) -> list[dict]:
    """Document sets sent to a and b in turn and to the reference: the same text back from each;
    returns the three replicas' /cache_stats."""
    sets = [DOCS, MORE, DOCS[:1] + MORE[1:], MORE[::-1] + DOCS[1:2], DOCS[::-1], [MORE[0], DOCS[2]]] * rounds
    for i, docs in enumerate(sets):
        where = a if i % 2 == 0 else b
        q = "What is the capital of Arvania?" if i % 3 else "How tall is Mount Feller?"
        got, want = _chat(where.url, docs, q), _chat(ref.url, docs, q)
        assert got["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"], i
    return [httpx.get(s.url + "/cache_stats", timeout=10).json() for s in (a, b, ref)]


def _wait_peers_up(a: ServerProc, b: ServerProc) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # each has the other's pool
        if all(httpx.get(s.url + "/cache_stats", timeout=10).json().get("kv_peers_up") == 1 for s in (a, b)):
            return
        time.sleep(0.2)
    raise AssertionError("the replicas did not see each other:\n" + a.read_log() + b.read_log())


def _stop_all(servers) -> None:
    """Stops them side by side: each takes about a second to wind down."""
    for s in servers:
        if s.proc.poll() is None:
            s.proc.send_signal(signal.SIGTERM)
    for s in servers:
        s.stop()


@pytest.fixture(scope="module")
def replicas(default_cpu_server):
    """(a, b, ref): two peers, and as the reference conftest's default-model server (a replica without
    peers, shared with test_frontend and test_server: a start-up fewer), its cache flushed here."""
    d = tempfile.mkdtemp(prefix="lazyrt-peers-")
    addrs = [f"ipc://{os.path.join(d, n)}" for n in ("a", "b")]
    base = ("--device", "cpu", "--kv-cache-tokens", "8192", "--log-level", "warning")
    a = ServerProc(*base, "--kv-peer-addr", addrs[0], "--kv-peers", addrs[1])
    b = ServerProc(*base, "--kv-peer-addr", addrs[1], "--kv-peers", addrs[0])
    ref = default_cpu_server
    try:
        for s in (a, b):
            s.wait_healthy()
        _wait_peers_up(a, b)
        assert httpx.post(ref.url + "/flush_cache", timeout=30).status_code == 200
        yield a, b, ref
    finally:
        _stop_all((a, b))


@pytest.mark.slow
def test_replicas_with_peers_answer_as_one_without(replicas):
    a, b, ref = replicas
    # the reference's counters from before (it is shared: they count earlier modules' requests too)
    looked_up = lambda s: s["chunk_hits"] + s["chunk_misses"]  # noqa: E731
    ref_before = looked_up(httpx.get(ref.url + "/cache_stats", timeout=10).json())
    a_before, b_before = (looked_up(httpx.get(s.url + "/cache_stats", timeout=10).json()) for s in (a, b))
    sa, sb, sr = ask_both_and_compare(a, b, ref, 1)
    assert sa["chunk_peer_fetches"] + sb["chunk_peer_fetches"] > 0
    assert sa["peer_loads"] + sb["peer_loads"] > 0
    # one copy of each document between them (each keeps its own copy of the shared prompt prefix)
    assert sa["chunks"] + sb["chunks"] == sr["chunks"] + 1
    assert sa["peer_pins_held"] == sb["peer_pins_held"] == 0  # every fetch released
    assert looked_up(sa) - a_before + looked_up(sb) - b_before == looked_up(sr) - ref_before


def test_peer_flags_go_together(capsys):
    for argv, match in [
        (["--kv-peers", "ipc:///tmp/x"], "--kv-peer-addr and --kv-peers go together"),
        (["--kv-peer-addr", "ipc:///tmp/x", "--kv-peers", "ipc:///tmp/x"], "all distinct"),
        (["--kv-peer-addr", "ipc:///tmp/x", "--kv-peers", "ipc:///tmp/y", "--cache-mode", "prefix"],
         "cache_mode lazy or block"),
    ]:  # fmt: skip
        with pytest.raises(SystemExit) as e:
            launch_main(argv)
        assert e.value.code == 2 and match in capsys.readouterr().err


def _two_gpus() -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() >= 2


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["lazy", "block"])
def test_gpu_replicas_read_each_others_pages_over_cuda_ipc(mode):
    if not _two_gpus():
        pytest.skip("needs 2 GPUs")
    d = tempfile.mkdtemp(prefix="lazyrt-peers-gpu-")
    addrs = [f"ipc://{os.path.join(d, n)}" for n in ("a", "b")]
    # (smollm2's shape: FlashInfer's kernels, which block mode's steps use, need head_dim >= 64)
    base = ("--model", "smollm2-135m", "--load-format", "dummy", "--dtype", "bfloat16", "--cache-mode", mode,
            "--kv-cache-tokens", "16384", "--log-level", "warning")  # fmt: skip
    a = ServerProc(*base, "--device", "cuda:0", "--kv-peer-addr", addrs[0], "--kv-peers", addrs[1])
    b = ServerProc(*base, "--device", "cuda:1", "--kv-peer-addr", addrs[1], "--kv-peers", addrs[0])
    ref = ServerProc(*base, "--device", "cuda:0")
    try:
        for s in (a, b, ref):
            s.wait_healthy()
        _wait_peers_up(a, b)
        sa, sb, sr = ask_both_and_compare(a, b, ref, 2)
        assert sa["peer_loads"] + sb["peer_loads"] > 0  # over CUDA IPC
        assert sa["chunks"] + sb["chunks"] == sr["chunks"] + 1
        assert sa["peer_pins_held"] == sb["peer_pins_held"] == 0
    finally:
        for s in (a, b, ref):
            s.stop()


@pytest.mark.gpu
def test_gpu_pool_export_is_read_by_another_process_on_another_device():
    if not _two_gpus():
        pytest.skip("needs 2 GPUs")
    from lazyrt.cache.kv_share import import_shared
    from lazyrt.runtime.ipc.messages import decode

    code = textwrap.dedent("""
        import sys, torch
        from lazyrt.cache.kv_share import shared_zeros
        from lazyrt.runtime.ipc.messages import encode
        t, export = shared_zeros((4, 64, 2, 16, 8, 128), torch.bfloat16, torch.device("cuda:1"))
        g = torch.Generator(device="cuda:1").manual_seed(7)
        t.copy_(torch.randn(t.shape, generator=g, device="cuda:1").bfloat16())
        torch.cuda.synchronize()
        print(encode(export).hex(), flush=True)
        sys.stdin.readline()  # keep the pool alive until the reader is done
    """)
    pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "text": True}
    child = subprocess.Popen([sys.executable, "-c", code], **pipes)
    try:
        export = decode(bytes.fromhex(child.stdout.readline().strip()))
        kv = import_shared(export, torch.device("cuda:0"))
        assert kv.device == torch.device("cuda:0") and kv.shape == (4, 64, 2, 16, 8, 128)
        g = torch.Generator(device="cuda:1").manual_seed(7)
        want = torch.randn(kv.shape, generator=g, device="cuda:1").bfloat16().to("cuda:0")
        src = torch.tensor([5, 9, 63, 0], device="cuda:0")
        got = kv.index_select(1, src)  # a kernel on cuda:0 gathering the other process's pages
        torch.testing.assert_close(got, want.index_select(1, src), rtol=0, atol=0)
    finally:
        child.stdin.write("\n")
        child.stdin.close()
        child.wait(60)


@pytest.mark.slow
def test_router_placement_header_is_followed_and_checked(replicas):
    a, b, ref = replicas
    peers = [httpx.get(s.url + "/cache_stats", timeout=10).json()["kv_peer_addr"] for s in (a, b)]
    docs = [f"Placed fact {i}: the Arvanian pim weighs {i + 2} grams." for i in range(3)]
    before = [httpx.get(s.url + "/cache_stats", timeout=10).json() for s in (a, b)]
    body = {"messages": [{"role": "user", "content": "What does a pim weigh?"}], "documents": docs,
            "max_tokens": 8, "temperature": 0}  # fmt: skip
    owners = {"x-lazyrt-doc-owners": json.dumps([peers[1], peers[1], None])}  # two on b, one as a decides
    got = httpx.post(a.url + "/v1/chat/completions", json=body, headers=owners, timeout=120)
    want = httpx.post(ref.url + "/v1/chat/completions", json=body, timeout=120)
    assert got.status_code == 200 and got.json()["choices"] == want.json()["choices"]
    after = [httpx.get(s.url + "/cache_stats", timeout=10).json() for s in (a, b)]
    assert after[0]["chunk_peer_fetches"] - before[0]["chunk_peer_fetches"] >= 2  # read from b
    assert after[1]["chunks"] - before[1]["chunks"] >= 2  # b holds them
    for header, why in [("[1, 2", "JSON list"), ('["x"]', "1 owners for 3 documents")]:
        r = httpx.post(a.url + "/v1/chat/completions", json=body, headers={"x-lazyrt-doc-owners": header},
                       timeout=60)  # fmt: skip
        assert r.status_code == 400 and r.json()["error"]["param"] == "x-lazyrt-doc-owners", r.text
        assert why in r.json()["error"]["message"]
