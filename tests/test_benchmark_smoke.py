"""The decode benchmarks run end to end on the CPU (tiny dummy model): rows are complete and sane."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


@pytest.fixture
def no_denormals():
    # random dummy weights drift into denormal floats, which make CPU matmuls ~100x slower
    torch.set_flush_denormal(True)
    yield
    torch.set_flush_denormal(False)


@pytest.mark.parametrize("mode", ["none", "lazy"])
def test_decode_roofline_rows(mode, no_denormals, tmp_path):
    import decode_roofline

    out = tmp_path / "rows.jsonl"
    rows = decode_roofline.main([
        "--model", "tiny-llama", "--device", "cpu", "--batches", "1", "3", "--context", "48",
        "--steps", "3", "--cache-mode", mode, "--pool-docs", "4", "--docs-per-request", "2",
        "--copy-mb", "8", "--out", str(out),
    ])  # fmt: skip
    assert [r["batch"] for r in rows] == [1, 3] and len(out.read_text().splitlines()) == 2
    for r in rows:
        assert r["step_ms"] > 0 and r["roofline_ms"] > 0 and r["weight_gb"] > 0
        assert r["cache_mode"] == mode and r["tokens_per_s"] == pytest.approx(r["batch"] / r["step_ms"] * 1e3)
