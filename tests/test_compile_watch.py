"""The serving worker's watch on Triton compiles after start-up (runtime/worker/compile_watch.py)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from lazyrt.runtime.worker.compile_watch import late_compile_hook, watch_late_compiles


def _call(hook, name: str):
    return hook(key=("k",), repr=f"{name}[num_warps=4](x: *fp32)", fn=SimpleNamespace(name=name),
                compile={"key": ("k",)}, is_manual_warmup=False, already_compiled=False)  # fmt: skip


def test_a_late_compile_is_logged_by_kernel_name_and_the_compile_goes_ahead(caplog):
    with caplog.at_level(logging.WARNING, logger="lazyrt.worker"):
        skip = _call(late_compile_hook(), "_lazy_attn_kernel")
    assert skip is False  # a true value would make Triton skip the compile
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 1 and "_lazy_attn_kernel" in msgs[0] and "mid-serving" in msgs[0]


def test_the_hook_defers_to_one_already_installed(caplog):
    seen = []

    def previous(**kw):
        seen.append(kw)
        return "theirs"

    with caplog.at_level(logging.WARNING, logger="lazyrt.worker"):
        out = _call(late_compile_hook(previous), "_merge_kernel")
    assert out == "theirs"
    assert len(seen) == 1 and seen[0]["fn"].name == "_merge_kernel" and seen[0]["key"] == ("k",)
    assert len(caplog.records) == 1


def test_watch_installs_the_hook_in_front_of_tritons_own():
    knobs = pytest.importorskip("triton").knobs
    before = knobs.runtime.jit_cache_hook
    seen = []
    knobs.runtime.jit_cache_hook = lambda **kw: seen.append(kw["fn"].name) or False
    try:
        assert watch_late_compiles()
        assert _call(knobs.runtime.jit_cache_hook, "_store_kv_kernel") is False
        assert seen == ["_store_kv_kernel"]  # the hook installed before still runs
    finally:
        knobs.runtime.jit_cache_hook = before
