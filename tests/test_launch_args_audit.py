"""`python -m lazyrt.launch` with bad flags: each is a short argparse error naming the flag, before any
process starts (no model load, no children); and start-up problems only the loaded model reveals stop
the server with a non-zero exit instead of a server that never turns healthy."""

from __future__ import annotations

import sqlite3
import subprocess

import pytest
import torch
from server_util import ServerProc

import lazyrt.launch
from lazyrt.config import EngineConfig


@pytest.fixture()
def launch(monkeypatch, capsys):
    """argv -> (exit code, stderr, configs that reached serve()); serve() never runs for real."""
    served: list[EngineConfig] = []
    monkeypatch.setattr(lazyrt.launch, "serve", lambda cfg, opts: served.append(cfg) or 0)

    def run(argv: list[str]) -> tuple[int, str, list[EngineConfig]]:
        try:
            code = lazyrt.launch.main(argv)
        except SystemExit as e:
            code = e.code
        return code, capsys.readouterr().err, served

    return run


def _paths(tmp_path) -> dict[str, str]:
    (tmp_path / "notes.txt").write_text("not a model")
    (tmp_path / "junk.gguf").write_bytes(b"junk, not GGUF")
    (tmp_path / "empty_dir").mkdir()
    (tmp_path / "file").write_text("x")
    names = {"txt": "notes.txt", "junk": "junk.gguf", "dir": "empty_dir", "file": "file"}
    return {k: str(tmp_path / v) for k, v in names.items()}


BAD = [
    (["--port", "70000"], "--port", "[0, 65535]"),
    (["--port", "-1"], "--port", "[0, 65535]"),
    (["--max-model-len", "0"], "--max-model-len", "max_model_len=0"),
    (["--max-model-len", "-3"], "--max-model-len", ">= 1"),
    (["--cuda-graph-max-batch", "-1"], "--cuda-graph-max-batch", ">= 0"),
    (["--kv-cache-memory-gb", "inf"], "--kv-cache-memory-gb", "finite"),
    (["--kv-peer-timeout", "nan"], "--kv-peer-timeout", "kv_peer_timeout_s=nan"),
    (["--kv-peer-timeout", "-1"], "--kv-peer-timeout", "> 0"),
    (["--device", "cuda:x"], "--device", "cuda[:N]"),
    (["--seed", str(2**64)], "--seed", "seed="),
    (["--max-running-requests", "0"], "--max-running-requests", "max_running_requests=0"),
    (["--recompute-pages", "2", "--cache-mode", "prefix"], "--recompute-pages", "lazy or block"),
    (["--recompute-ratio", "0.5", "--cache-mode", "none"], "--recompute-ratio", "lazy or block"),
    (["--retrieval-attention"], "--host-kv-cache-tokens", "host KV tier"),
    (["--retrieval-top-k", "64"], "--retrieval-top-k", "only used with retrieval_attention"),
    (["--no-retrieval-exact-prefill"], "--retrieval-exact-prefill", "only used with retrieval_attention"),
    (["--model", "{missing}"], "--model", "no such file"),
    (["--model", "llama-3.1-8b"], "--model", "--load-format dummy"),
    (["--model", "{txt}"], "--model", "not a .gguf"),
    (["--model", "{junk}"], "--model", "not a GGUF file"),
    (["--model", "{dir}"], "--model", "no config.json"),
    (["--document-store", "{dir}"], "--document-store", "is a directory"),
    (["--document-store", "{txt}"], "--document-store", "not an SQLite file"),
    (["--document-store", "{file}/docs.sqlite"], "--document-store", "cannot be created"),
    (["--api-key", ""], "--api-key", "empty"),
    (["--host", " "], "--host", "empty"),
    (["--host", "no such host"], "--host", "cannot listen on 'no such host'"),
    (["--served-model-name", ""], "--served-model-name", "empty"),
]


@pytest.mark.parametrize("argv, flag, why", BAD, ids=[" ".join(a) for a, _, _ in BAD])
def test_bad_flags_are_a_short_error_naming_the_flag_before_any_start(launch, tmp_path, argv, flag, why):
    paths = {**_paths(tmp_path), "missing": str(tmp_path / "no" / "model")}
    code, err, served = launch(["--device", "cpu", *[a.format(**paths) for a in argv]])
    assert code == 2 and served == []  # argparse's exit: nothing was started
    lines = err.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("usage:"), err  # the usage line, not every flag
    assert flag in lines[1] and why in lines[1], lines[1]


def test_max_running_requests_error_names_only_that_flag(launch):
    _, err, _ = launch(["--max-running-requests", "0"])
    assert "--max-step-tokens" not in err and "max_step_tokens" not in err


def test_cuda_without_a_cuda_device(launch, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, err, served = launch(["--device", "cuda"])
    assert code == 2 and served == [] and "--device" in err and "no CUDA device" in err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    code, err, served = launch(["--device", "cuda:2"])
    assert code == 2 and served == [] and "--device" in err and "cuda:1" in err


def test_good_flags_still_reach_serve(launch, tmp_path):
    store = tmp_path / "kept.sqlite"
    sqlite3.connect(store).close()  # an empty SQLite file is a store
    sqlite3.connect(tmp_path / "filled.sqlite").execute("CREATE TABLE t (x)").connection.close()
    for argv in (
        ["--port", "0"],
        ["--port", "65535", "--document-store", str(store)],
        ["--document-store", str(tmp_path / "filled.sqlite")],
        ["--document-store", str(tmp_path / "new" / "dirs" / "docs.sqlite")],  # created on first use
        ["--document-store", "none", "--max-model-len", "512", "--cuda-graph-max-batch", "0"],
        ["--load-format", "dummy", "--model", "llama-3.1-8b", "--seed", str(2**64 - 1)],
        ["--recompute-pages", "1", "--cache-mode", "block"],
    ):
        code, err, served = launch(["--device", "cpu", *argv])
        assert code == 0, (argv, err)
    assert len(served) == 7 and served[4].max_model_len == 512 and served[4].cuda_graph_max_batch == 0


@pytest.mark.parametrize(
    "kw, name",
    [
        (dict(max_model_len=0), "max_model_len"),
        (dict(max_model_len=2.5), "max_model_len"),
        (dict(cuda_graph_max_batch=-1), "cuda_graph_max_batch"),
        (dict(kv_cache_memory_gb=float("inf")), "kv_cache_memory_gb"),
        (dict(kv_peer_timeout_s=float("nan")), "kv_peer_timeout_s"),
        (dict(device="cuda:"), "device"),
        (dict(seed=-(2**63) - 1), "seed"),
        (dict(max_step_tokens="8"), "max_step_tokens"),
        (dict(recompute_head_pages=1, cache_mode="prefix"), "recompute_head_pages"),
    ],
)
def test_engine_config_refuses_what_the_flags_refuse(kw, name):
    with pytest.raises(ValueError, match=name):
        EngineConfig(**kw).validate()


@pytest.mark.slow
def test_start_up_the_model_cannot_serve_exits_non_zero():
    """A --max-model-len past the model's context (the default model: 8192) and one too short for
    the 1-token warm-up: each server exits 1 saying why (before: the first served with the model's
    length, silently; the second stayed up with /health 503 for ever). Both start at once."""
    common = ("--device", "cpu", "--kv-cache-tokens", "256", "--document-store", "none")
    over = ServerProc(*common, "--max-model-len", "100000")
    short = ServerProc(*common, "--max-model-len", "1")
    try:
        codes = [s.proc.wait(120) for s in (over, short)]
    except subprocess.TimeoutExpired:
        pytest.fail("a server did not exit:\n" + over.read_log() + short.read_log())
    finally:
        over.stop(), short.stop()
    assert codes == [1, 1], (over.read_log(), short.read_log())
    assert "--max-model-len 100000: the model's context length is 8192" in over.read_log()
    assert "warm-up generation" in short.read_log() and "context length is 1" in short.read_log()
    assert "Traceback" not in over.read_log() + short.read_log()


def test_help_lists_every_flag_with_its_default():
    out = lazyrt.launch.build_parser().format_help()
    assert out.startswith("usage: python -m lazyrt.launch [options]")
    for flag in ("--port", "--max-model-len", "--document-store", "--api-key", "--cuda-graph-max-batch"):
        assert flag in out
    assert "(default: 30000)" in out
