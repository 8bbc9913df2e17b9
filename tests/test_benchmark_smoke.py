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
    if mode == "lazy":  # batch 3 shares documents: its row carries the timed steps' document grouping
        assert rows[1]["shared_steps"] > 0 and rows[1]["doc_segments"] >= 1 and rows[1]["long_work_items"] > 0


def test_shared_chunk_bench_step_is_the_per_request_step():
    """benchmarks/shared_chunk_bench.py's Zipf step: its segments hold exactly the per-request keys
    (reference shared attention + merge = per-request reference attention), and popular documents
    are shared (fewer pages read than the per-request tables list)."""
    import argparse
    import random

    import shared_chunk_bench as bench

    from lazyrt.kernels.attention_ref import lazy_attention_ref
    from lazyrt.kernels.rope import RopeCache
    from lazyrt.kernels.shared_chunk import merge_parts_ref, shared_chunk_attention_ref
    from lazyrt.models.config import ModelConfig
    from lazyrt.models.dummy import PRESETS

    args = argparse.Namespace(docs=3, doc_tokens=40, pool=20, alpha=2.1, q_len=2, private=20, piece_tokens=32)
    kv, full, shared, distinct = bench.build_step(8, args, random.Random(), "cpu")
    assert distinct < 8 * 3 and shared.chunk_kv_indices.numel() < full.kv_indices.numel()
    rope = RopeCache.build(ModelConfig.from_hf(PRESETS["llama-3.1-8b"]), 512)
    kv = kv.float()
    q = torch.randn(16, bench.Q_HEADS, bench.HEAD_DIM)
    scale = bench.HEAD_DIM**-0.5
    o_s, lse_s = shared_chunk_attention_ref(q, kv, full.positions, shared, rope, scale)
    out = merge_parts_ref(o_s, lse_s, shared)
    expect = lazy_attention_ref(q, kv, full, rope, scale).float()
    torch.testing.assert_close(out, expect, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("L", [20, 23])  # 23: a step ends with a 1-token piece of the next prompt
def test_offline_profile_counts_every_prompt_token_and_step(L, no_denormals):
    """offline_vs_hf.py --profile: the steps it times by kind carry the batch's prompt tokens exactly
    (B x L, with a step budget that splits prompts), and the decode steps bring every output token."""
    import offline_vs_hf

    B, T = 3, 5
    row = offline_vs_hf.main([
        "--model", "tiny-llama", "--device", "cpu", "--batch", str(B), "--prompt-tokens", str(L),
        "--output-tokens", str(T), "--skip-hf", "--profile", "--max-step-tokens", "24",
    ])  # fmt: skip
    steps = row["profile"]["steps"]
    assert steps["prefill"]["prompt_tokens"] == B * L and row["max_step_tokens"] == 24
    assert steps["prefill"]["steps"] >= -(-B * L // 24)  # no step over the budget
    assert steps["decode"]["steps"] >= T - 1 and steps["decode"]["prompt_tokens"] == 0
    assert row["profile"]["kernel_s"]["other"] + row["profile"]["kernel_s"]["gemm"] > 0


def test_tp_greedy_agreement_reports_the_margin_where_runs_part():
    """tp_decode's greedy comparison: where two runs part, the larger top-2 margin at that token, and
    the largest logprob difference of the tokens before it (random runs; the expected figures are
    computed here from the same lists)."""
    import random

    from benchmarks.tp_decode import agreement

    rng = random.Random()
    n, prompts = 8, 5
    a = [[rng.randrange(1000) for _ in range(n)] for _ in range(prompts)]
    b = [list(t) for t in a]
    cut = [rng.randrange(n + 1) for _ in range(prompts)]
    for t, c in zip(b, cut):
        if c < n:
            t[c] = t[c] + 1  # part at token c
    rows = []
    for toks in (a, b):
        rows.append({"tokens": toks, "logprobs": [[-rng.random() for _ in t] for t in toks],
                     "margins": [[rng.random() for _ in t] for t in toks]})  # fmt: skip
    line = agreement("x", *rows)
    assert f"{sum(c == n for c in cut)} of {prompts} prompts identical" in line
    assert f"first difference at {sorted(cut)}" in line
    parted = [max(rows[0]["margins"][k][c], rows[1]["margins"][k][c]) for k, c in enumerate(cut) if c < n]
    moved = [abs(u - v) for k, c in enumerate(cut)
             for u, v in zip(rows[0]["logprobs"][k][:c], rows[1]["logprobs"][k][:c])]  # fmt: skip
    assert (f"max {max(parted):.2e}" in line) == bool(parted)
    assert (f"differ by max {max(moved):.2e} nats" in line) == bool(moved)
    assert "margin" not in agreement("x", {"tokens": a}, {"tokens": b})  # rows from before the logprobs
