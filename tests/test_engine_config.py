"""EngineConfig memory options: validation, CLI flags, and how the KV pool is sized from them."""

from __future__ import annotations

import pytest
import torch

from lazyrt.config import EngineConfig
from lazyrt.launch import build_parser, main
from lazyrt.runtime.worker.model_worker import ModelWorker


@pytest.mark.parametrize(
    "kw, name",
    [
        (dict(kv_cache_memory_fraction=0.0), "kv_cache_memory_fraction"),
        (dict(kv_cache_memory_fraction=0.99), "kv_cache_memory_fraction"),
        (dict(kv_cache_memory_fraction="0.5"), "kv_cache_memory_fraction"),
        (dict(kv_cache_memory_fraction=True), "kv_cache_memory_fraction"),
        (dict(kv_cache_memory_gb=0), "kv_cache_memory_gb"),
    ],
)
def test_bad_memory_options_rejected(kw, name):
    with pytest.raises(ValueError, match=name):
        EngineConfig(**kw).validate()


def test_memory_fraction_flag(capsys):
    assert "--kv-cache-memory-fraction" in build_parser().format_help()
    assert build_parser().parse_args(["--kv-cache-memory-fraction", "0.4"]).kv_cache_memory_fraction == 0.4
    with pytest.raises(SystemExit):
        main(["--kv-cache-memory-fraction", "1.5"])
    assert "kv_cache_memory_fraction" in capsys.readouterr().err


class _FakeCudaModel:
    device = torch.device("cuda")


def _pages(cfg: EngineConfig, model_config, free_bytes: int, monkeypatch) -> int:
    """ModelWorker._num_pages without a GPU: the free-memory query answers free_bytes."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free_bytes, 2 * free_bytes))
    worker = ModelWorker.__new__(ModelWorker)  # only the sizing: no model load
    worker.config, worker.model_config, worker.model = cfg, model_config, _FakeCudaModel()
    worker.tp = None  # one rank
    return worker._num_pages(torch.bfloat16)


def test_pool_size_follows_the_fraction(monkeypatch):
    from lazyrt.cache.page_pool import PagePool
    from lazyrt.models.config import ModelConfig
    from lazyrt.models.dummy import PRESETS

    mc = ModelConfig.from_hf(PRESETS["llama-3.1-8b"])
    per_page = PagePool.bytes_per_page(mc.num_layers, 16, mc.num_kv_heads, mc.head_dim, torch.bfloat16)
    free = 1000 * per_page + 123
    for frac in (0.8, 0.4, 0.05):
        got = _pages(EngineConfig(kv_cache_memory_fraction=frac), mc, free, monkeypatch)
        assert got == int(free * frac) // per_page
    # an explicit token budget wins over the fraction
    fixed = EngineConfig(kv_cache_tokens=160, kv_cache_memory_fraction=0.1)
    assert _pages(fixed, mc, free, monkeypatch) == 10


def test_half_precision_on_cpu_is_warned(tiny_model_dir, caplog):
    """CPU half-precision matmuls are ~100x slower than float32: the worker says so, naming the dtype;
    the default (auto -> float32 on CPU) says nothing."""
    import logging

    from lazyrt import Engine

    path = tiny_model_dir("llama3")
    with caplog.at_level(logging.WARNING, logger="lazyrt.worker"):
        Engine(path, device="cpu", kv_cache_tokens=256).close()
        assert not [r for r in caplog.records if "on CPU" in r.getMessage()]
        Engine(path, device="cpu", dtype="bfloat16", kv_cache_tokens=256).close()
    assert any("dtype=bfloat16 on CPU" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("where", ["pool", "after the pool"])
def test_out_of_memory_at_start_up_says_how_the_pool_was_sized(where, tiny_model_dir, monkeypatch):
    """A device out of memory while the worker sets up (the KV pool itself, or the runner and its CUDA
    graphs in what the pool left: 2 x H100 with a 70B model did this) ends start-up with an error that
    says how the pool was sized and which flags leave room, not a bare allocator message."""
    from lazyrt import Engine
    from lazyrt.runtime.worker import model_worker
    from lazyrt.runtime.worker.model_worker import StartupOutOfMemory

    def oom(*a, **k):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 290.00 MiB")

    monkeypatch.setattr(model_worker, "PagePool" if where == "pool" else "ModelRunner", oom)
    with pytest.raises(StartupOutOfMemory) as e:
        Engine(tiny_model_dir("llama3"), device="cpu", kv_cache_tokens=4096)
    msg = str(e.value)
    assert "ran out of memory at start-up" in msg and "kv_cache_tokens=4096" in msg
    assert "--kv-cache-memory-fraction" in msg and "--cuda-graph-max-batch 0" in msg
    if where == "pool":
        assert "allocating the KV pool" in msg
    else:  # the pool's size in pages (4096 tokens of 16)
        assert "after the KV pool took" in msg and "256 pages" in msg
    assert isinstance(e.value.__cause__, torch.cuda.OutOfMemoryError)


def test_start_up_oom_message_with_the_fraction():
    """Sized from the free memory: the message gives the fraction, what the weights left and what the
    pool left of it."""
    from types import SimpleNamespace

    from lazyrt.runtime.worker.model_worker import startup_oom_message

    cfg = EngineConfig(kv_cache_memory_fraction=0.8)
    pool = SimpleNamespace(kv_all=SimpleNamespace(nbytes=6 << 30), num_pages=1234)
    msg = startup_oom_message(cfg, pool, 7 << 30)
    assert "kv_cache_memory_fraction=0.8" in msg and "7.0 GiB free after loading the weights" in msg
    assert "took 6.0 GiB" in msg and "1234 pages" in msg and "1.0 GiB left" in msg
