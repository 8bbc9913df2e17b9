"""Start-up errors only the loaded model (or the memory) reveals: a clear error naming the flag, not a
child's traceback. In the server the child logs one line and exits, the server stops with exit code 1
and no process of it stays; the offline Engine raises."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess

import pytest
from server_util import ServerProc, pid_alive

from lazyrt.models.loader import default_model_path


def _model_dirs(tiny_model_dir, tmp_path) -> dict[str, str]:
    llama = tiny_model_dir("llama")
    gpt2 = tmp_path / "gpt2"
    shutil.copytree(llama, gpt2)
    cfg = json.loads((gpt2 / "config.json").read_text())
    cfg.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (gpt2 / "config.json").write_text(json.dumps(cfg))
    no_tok = tmp_path / "no_tokenizer"
    no_tok.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(os.path.join(llama, name), no_tok / name)
    return {"llama": llama, "gpt2": str(gpt2), "no_tok": str(no_tok), "gguf": _truncated_gguf(tmp_path)}


def _truncated_gguf(tmp_path) -> str:
    """The default model's GGUF cut off in its tensor data: the header (and magic) intact."""
    out = tmp_path / "truncated.gguf"
    with open(default_model_path(), "rb") as f:
        out.write_bytes(f.read(5_000_000))
    return str(out)


# (flags, the flag(s) its error names, a phrase of the error); {name} is a model of _model_dirs
CHILD_ERRORS = [
    (["--model", "{gpt2}"], "--model", "unsupported model architecture 'GPT2LMHeadModel'"),
    (["--model", "{no_tok}", "--no-worker-in-scheduler"], "--model", "no tokenizer files"),
    (["--model", "{gguf}"], "--model", "cannot read the GGUF file (truncated or corrupt?)"),
    (["--model", "{llama}", "--tensor-parallel-size", "3"], "--tensor-parallel-size", "4 attention heads"),
    (["--model", "{llama}", "--kv-cache-tokens", "1000000000000"], "--kv-cache-tokens",
     "the host ran out of memory at start-up, allocating the KV pool"),
    (["--model", "{llama}", "--kv-cache-tokens", "100000000", "--page-size", "1048576"], "--page-size",
     "the host ran out of memory at start-up"),
    (["--model", "{llama}", "--kv-cache-memory-gb", "0.1", "--page-size", "1048576"],
     "--page-size, --kv-cache-memory-gb", "one KV page takes 512.0 MiB, more than the KV budget"),
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("argv, flag, why", CHILD_ERRORS, ids=[" ".join(a) for a, _, _ in CHILD_ERRORS])
def test_a_start_up_error_is_one_line_naming_the_flag(tiny_model_dir, tmp_path, argv, flag, why):
    """Before: each process printed its traceback (one per tensor-parallel rank) and the server said
    only that it 'exited unexpectedly (exit code 1)'."""
    models = _model_dirs(tiny_model_dir, tmp_path)
    srv = ServerProc("--device", "cpu", "--document-store", "none", "--log-level", "info",
                     *[a.format(**models) for a in argv])  # fmt: skip
    try:
        code = srv.proc.wait(120)
    except subprocess.TimeoutExpired:
        pytest.fail("the server did not exit:\n" + srv.read_log())
    finally:
        srv.stop()
    log = srv.read_log()
    assert code == 1, log
    assert "Traceback" not in log, log
    children = srv.child_pids()
    assert children and not [pid for pid in children.values() if pid_alive(pid)], log
    errors = [line for line in log.splitlines() if " ERROR " in line]
    # each process that failed says why in one line (tensor parallelism: each rank that got that far;
    # the server stops the others), and the server names the processes
    stopped = [line for line in errors if "could not start (its error is above); shutting down" in line]
    told = [line for line in errors if line not in stopped]
    assert len(stopped) == 1 and 1 <= len(told) <= int(argv[-1] if "--tensor-parallel-size" in argv else 1)
    assert all("cannot start: " in line and flag in line and why in line for line in told), errors


def test_a_port_in_use_names_port_before_any_child_starts():
    """Before: uvicorn's own '[Errno 98] ... address already in use' (no flag) and exit code 3, after
    the children had started loading the model."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        srv = ServerProc("--device", "cpu", "--document-store", "none", "--log-level", "info", "--port",
                         str(port), port=port)  # fmt: skip
        try:
            code = srv.proc.wait(60)
        finally:
            srv.stop()
    log = srv.read_log()
    assert code == 1, log
    errors = [line for line in log.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and f"--port {port}: cannot listen on 127.0.0.1:{port}" in errors[0], log
    assert "address already in use" in errors[0]
    assert "Traceback" not in log and not srv.child_pids(), log  # no child was started


def test_listen_sockets_hold_the_port_and_name_the_flag():
    """serve() binds before starting children and hands the sockets to uvicorn: the port stays taken."""
    from lazyrt.runtime.server.serve import listen_sockets

    socks = listen_sockets("127.0.0.1", 0)
    try:
        port = socks[0].getsockname()[1]
        socks[0].listen()
        with pytest.raises(ValueError, match=rf"^--port {port}: cannot listen on 127\.0\.0\.1:{port}: "):
            listen_sockets("127.0.0.1", port)
    finally:
        for s in socks:
            s.close()


def test_engine_cpu_pool_out_of_memory_names_the_flags(tiny_model_dir):
    """Before: torch's bare 'DefaultCPUAllocator: can't allocate memory' RuntimeError."""
    import torch

    from lazyrt import Engine
    from lazyrt.runtime.worker.model_worker import StartupOutOfMemory

    with pytest.raises(StartupOutOfMemory) as e:
        Engine(tiny_model_dir("llama"), device="cpu", kv_cache_tokens=10**12)
    msg = str(e.value)
    assert "the host ran out of memory at start-up, allocating the KV pool of 62500000000 pages" in msg
    assert "kv_cache_tokens=1000000000000, page_size=16" in msg
    assert msg.endswith("pass a smaller --kv-cache-tokens or --page-size")
    cause = e.value.__cause__
    assert isinstance(cause, RuntimeError) and not isinstance(cause, torch.cuda.OutOfMemoryError)


def test_engine_refuses_a_page_larger_than_the_budget(tiny_model_dir):
    """Before: the pool took one page (and a scratch one) past kv_cache_memory_gb, silently."""
    from lazyrt import Engine

    want = r"^page_size=1048576: one KV page takes 512\.0 MiB, more than the KV budget \(102\.4 MiB, "
    with pytest.raises(ValueError, match=want + r"kv_cache_memory_gb=0\.1\)"):
        Engine(tiny_model_dir("llama"), device="cpu", page_size=1048576, kv_cache_memory_gb=0.1)


def test_engine_refuses_max_model_len_past_the_models(tiny_model_dir):
    """Before: capped to the model's 2048 in silence (the server refuses it: test_launch_args_audit)."""
    from lazyrt import Engine

    path = tiny_model_dir("llama")
    with pytest.raises(ValueError, match=r"^max_model_len=4096: the model's context length is 2048"):
        Engine(path, device="cpu", kv_cache_tokens=256, max_model_len=4096)
    with Engine(path, device="cpu", kv_cache_tokens=256, max_model_len=2048) as eng:  # at most: fine
        assert eng.max_context == 2048
    with Engine(path, device="cpu", kv_cache_tokens=256, max_model_len=100) as eng:
        assert eng.max_context == 100


def test_engine_corrupt_gguf_names_the_file(tmp_path):
    """Before: numpy's 'cannot reshape array of size ...' from the GGUF reader, naming no file."""
    from lazyrt import Engine

    path = _truncated_gguf(tmp_path)
    with pytest.raises(ValueError, match=re.escape(f"model={path!r}: cannot read the GGUF file (truncated")):
        Engine(path, device="cpu", kv_cache_tokens=256)
