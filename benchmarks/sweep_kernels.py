"""On-device sweep of the lazy attention kernel's tiles at the RAG shape, against FlashInfer.

    python benchmarks/sweep_kernels.py --batches 1 4 16 64 [--decode-batches 1 4] [--skip-flashinfer]

Extend (the 128-token question over 5 x 2,048 chunk keys): every (rows, keys/step, warps,
stages, 16-bit rotation, lazy rescale) variant below, timed like benchmarks/kernels.py (median
CUDA-graph replay) on the same pages as FlashInfer's paged prefill without RoPE; each variant is
checked against the default variant's output. Decode: split counts and keys/step vs FlashInfer.
--then-bench B...: then benchmarks/kernels.py's rows with the best extend choice.
Prints every result as it goes, then a short table of the best variant per batch.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys

import torch

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])

from benchmarks.kernels import (  # noqa: E402
    HEAD_DIM,
    KV_HEADS,
    PAGE,
    Q_HEADS,
    QUESTION,
    build_layout,
    lazy_meta,
    rel_err,
)
from lazyrt.kernels import triton_attention as ta  # noqa: E402
from lazyrt.kernels.rope import RopeCache  # noqa: E402
from lazyrt.models.config import ModelConfig  # noqa: E402
from lazyrt.models.dummy import PRESETS  # noqa: E402

# extend tiles (rows, block_n, warps, stages) x flags (rotate in 16-bit math, lazy-rescale threshold)
EXTEND_TILES = [(128, 32, 4, 2), (256, 64, 8, 2), (128, 128, 8, 2)]
EXTEND_FLAGS = [(False, 0.0), (True, 0.0), (False, 8.0), (True, 8.0)]
EXTEND_VARIANTS = [t + f for f in EXTEND_FLAGS for t in EXTEND_TILES]
DECODE_SPLITS = [8, 16, 24, 33, 48, 66, 99, 132]
DECODE_BLOCK_NS = [32, 64, 128]
DEV = "cuda"


def set_extend(rows, block_n, warps, stages, lowp, lazy, large_min=10**9):
    """One explicit tile for every grid size (large_min=10**9 turns the large-grid tile off)."""
    ta.EXTEND_ROWS, ta.EXTEND_BLOCK_N, ta.EXTEND_WARPS, ta.EXTEND_STAGES = rows, block_n, warps, stages
    ta.EXTEND_ROT_LOWP, ta.EXTEND_LAZY_RESCALE, ta.EXTEND_LARGE_MIN_PER_SM = lowp, lazy, large_min


def choose(results) -> tuple:
    """Flags and (small-grid, large-grid) tiles with the lowest mean time / FlashInfer over batches
    (small grid: batch <= 4 at the RAG shape)."""
    ext = [r for r in results if r["kind"] == "extend" and r["fi_us"]]
    best = None
    for f in EXTEND_FLAGS:
        for small in EXTEND_TILES:
            for large in EXTEND_TILES:
                rs = [r["us"] / r["fi_us"] for r in ext
                      if tuple(r["var"]) == (small if r["batch"] <= 4 else large) + f]
                if len(rs) != len({r["batch"] for r in ext}):
                    continue
                score = sum(rs) / len(rs)
                if best is None or score < best[0]:
                    best = (score, f, small, large)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 4, 16, 64])
    ap.add_argument("--decode-batches", type=int, nargs="*", default=[])
    ap.add_argument("--skip-flashinfer", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--then-bench", type=int, nargs="*", default=[],
                    help="then benchmarks/kernels.py's rows for these batches with the best extend choice")
    args = ap.parse_args()
    import triton.testing

    dev = DEV
    cfg = ModelConfig.from_hf(PRESETS["llama-3.1-8b"])
    rope = RopeCache.build(cfg, 5 * 2048 + QUESTION + 1, dev)
    scale = HEAD_DIM**-0.5
    gen = torch.Generator(device=dev)
    gen.manual_seed(1234)
    fi = workspace = None
    if not args.skip_flashinfer:
        import flashinfer

        fi = flashinfer
        workspace = torch.empty(256 << 20, dtype=torch.uint8, device=dev)

    def bench(fn) -> float:
        fn()
        return triton.testing.do_bench_cudagraph(fn, rep=60, return_mode="median") * 1000.0

    default = (ta.EXTEND_ROWS, ta.EXTEND_BLOCK_N, ta.EXTEND_WARPS, ta.EXTEND_STAGES, False, 0.0)
    saved = (ta.EXTEND_ROWS, ta.EXTEND_BLOCK_N, ta.EXTEND_WARPS, ta.EXTEND_STAGES, ta.EXTEND_ROT_LOWP,
             ta.EXTEND_LAZY_RESCALE, ta.EXTEND_LARGE_MIN_PER_SM)
    results: list[dict] = []
    for B in args.batches:
        sweep_extend_batch(B, default, gen, rope, scale, fi, workspace, bench, results)
        torch.cuda.empty_cache()
    for B in args.decode_batches:
        sweep_decode_batch(B, gen, rope, scale, fi, workspace, bench, results)
        torch.cuda.empty_cache()

    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"device": torch.cuda.get_device_name(), "results": results}, fh, indent=1)
    set_extend(*saved)
    if args.then_bench and fi is not None:
        # The full kernels.py benchmark with the chosen extend settings (decode unchanged).
        from benchmarks.kernels import bench_batch, print_table

        best = choose(results)
        if best is not None:
            _, (lowp, lazy), small, large = best
            ta.EXTEND_ROWS, ta.EXTEND_BLOCK_N, ta.EXTEND_WARPS, ta.EXTEND_STAGES = small
            ta.EXTEND_LARGE = large
            ta.EXTEND_ROT_LOWP, ta.EXTEND_LAZY_RESCALE = lowp, lazy
            print(f"CHOSEN mean ratio {best[0]:.3f}: small {small} large {large} lowp={lowp} lazy={lazy}")
        rows = []
        for B in args.then_bench:
            rows.append(bench_batch(B, gen, rope, scale, fi, workspace, bench))
            print(json.dumps(rows[-1]), flush=True)
            torch.cuda.empty_cache()
        if args.out:
            with open(args.out.replace(".json", "_bench.json"), "w") as fh:
                json.dump({"device": torch.cuda.get_device_name(), "chosen": best, "results": rows}, fh,
                          indent=1)
        print_table(rows)
    print("== best per batch (variant: rows, block_n, warps, stages, lowp, lazy | block_n, splits)")
    for kind in ("extend", "decode"):
        for B in sorted({r["batch"] for r in results if r["kind"] == kind}):
            rs = sorted((r for r in results if r["kind"] == kind and r["batch"] == B), key=lambda r: r["us"])
            fi_us = rs[0]["fi_us"]
            top = "; ".join(
                f"{r['var']} {r['us']:.1f}" + (f" x{r['us'] / fi_us:.2f}" if fi_us else "") for r in rs[:3])
            print(f"{kind} B={B} FI={fi_us and round(fi_us, 1)} | {top}")


def sweep_extend_batch(B, default, gen, rope, scale, fi, workspace, bench, results) -> None:
    dev = DEV
    lay = build_layout(B, dev, gen)
    ppr = lay.pages_per_req
    meta = lazy_meta(lay, QUESTION)
    qp = torch.randn(B * QUESTION, Q_HEADS, HEAD_DIM, generator=gen, device=dev, dtype=torch.bfloat16)
    f = functools.partial(ta.lazy_attention_triton, qp, lay.kv, meta, rope, scale, max_q_len=QUESTION,
                          max_kv_entries=ppr)
    set_extend(*default)
    ref = f()
    fi_us = None
    if fi is not None:
        last = torch.full((B,), PAGE, dtype=torch.int32, device=dev)
        pre = fi.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
        pre.plan(meta.qo_indptr, meta.kv_indptr, lay.indices, last, Q_HEADS, KV_HEADS, HEAD_DIM, PAGE,
                 causal=True, pos_encoding_mode="NONE", q_data_type=torch.bfloat16,
                 kv_data_type=torch.bfloat16)
        fi_us = bench(functools.partial(pre.run, qp, lay.kv))
        print(f"FI prefill B={B}: {fi_us:.1f}us", flush=True)
    for var in EXTEND_VARIANTS:
        set_extend(*var)
        try:
            err = rel_err(f(), ref)
            us = bench(f)
        except Exception as e:  # noqa: BLE001
            print(f"EXT B={B} {var}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            continue
        results.append({"kind": "extend", "batch": B, "var": var, "us": us, "err": err, "fi_us": fi_us})
        ratio = f" x{us / fi_us:.2f}" if fi_us else ""
        print(f"EXT B={B} {var}: {us:.1f}us{ratio} err={err:.1e}", flush=True)
    set_extend(*default)


def sweep_decode_batch(B, gen, rope, scale, fi, workspace, bench, results) -> None:
    dev = DEV
    lay = build_layout(B, dev, gen)
    ppr = lay.pages_per_req
    meta = lazy_meta(lay, 1)
    q = torch.randn(B, Q_HEADS, HEAD_DIM, generator=gen, device=dev, dtype=torch.bfloat16)
    f0 = functools.partial(ta.lazy_attention_triton, q, lay.kv, meta, rope, scale, max_q_len=1,
                           max_kv_entries=ppr)
    ref = f0()
    fi_us = None
    if fi is not None:
        last = torch.full((B,), PAGE, dtype=torch.int32, device=dev)
        dec = fi.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=True)
        dec.plan(meta.kv_indptr, lay.indices, last, Q_HEADS, KV_HEADS, HEAD_DIM, PAGE,
                 pos_encoding_mode="NONE", q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
        fi_us = bench(functools.partial(dec.run, q, lay.kv))
        print(f"FI decode B={B}: {fi_us:.1f}us", flush=True)
    us0 = bench(f0)
    print(f"DEC B={B} default: {us0:.1f}us", flush=True)
    saved = ta.DECODE_BLOCK_N_WIDE, ta.DECODE_BLOCK_N
    for bn in DECODE_BLOCK_NS:
        ta.DECODE_BLOCK_N_WIDE = ta.DECODE_BLOCK_N = bn
        for sp in DECODE_SPLITS:
            f = functools.partial(f0, num_splits=sp)
            try:
                err = rel_err(f(), ref)
                us = bench(f)
            except Exception as e:  # noqa: BLE001
                print(f"DEC B={B} n={bn} splits={sp}: {type(e).__name__}", flush=True)
                continue
            results.append({"kind": "decode", "batch": B, "var": (bn, sp), "us": us, "err": err,
                            "fi_us": fi_us, "default_us": us0})
            print(f"DEC B={B} n={bn} splits={sp}: {us:.1f}us err={err:.1e}", flush=True)
    ta.DECODE_BLOCK_N_WIDE, ta.DECODE_BLOCK_N = saved


if __name__ == "__main__":
    main()
