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
