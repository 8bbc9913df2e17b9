"""Split-KV count of the lazy decode kernel for a whole model's KV heads and one TP=2 rank's half.

At batch 1 a TP=2 rank has 4 KV heads: decode_tiles() gives 40 splits (MIN_SPLIT_TOKENS = 256 caps
them for a 10,368-token context), so 160 programs, under one wave of 2 per SM on 132 SMs, where the
whole model's 8 heads get 33 x 8 = 264 (issue 17: attention does not halve at TP=2). This times the
kernel (plus its merge) per forced split count beside the engine's choice, on kernels.py's RAG
pages (5 x 2,048-token chunks + a 128-token question), one layer, CUDA-graph replay:

    python benchmarks/experiments/decode_splits.py [--batches 1 2 4] [--splits 16 24 32 40 48 64]
        [--cold-layers 8] [--hnd]

Prints one row per (KV heads, batch): the engine's split count and time, then each forced count's
time, and the largest relative difference of any output from the engine's choice's (must stay at
bf16 rounding: split-KV is exact up to the order of the sums). GPU only.
"""

from __future__ import annotations

import argparse
import sys

import torch

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])

from benchmarks.kernels import HEAD_DIM, Layout, build_layout, lazy_meta, rel_err  # noqa: E402
from lazyrt.kernels.rope import RopeCache  # noqa: E402
from lazyrt.models.config import ModelConfig  # noqa: E402
from lazyrt.models.dummy import PRESETS  # noqa: E402


def head_major(kv: torch.Tensor) -> torch.Tensor:
    """kv [pages, 2, page_size, heads, dim] with each head's page contiguous (HND), viewed in that shape."""
    P, two, page, H, D = kv.shape
    out = torch.empty(P, two, H, page, D, dtype=kv.dtype, device=kv.device).permute(0, 1, 3, 2, 4)
    out.copy_(kv)
    return out


def main() -> None:
    import triton

    from lazyrt.kernels.triton_attention import decode_tiles, lazy_attention_triton

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--splits", type=int, nargs="+", default=[16, 24, 32, 40, 48, 64])
    ap.add_argument("--cold-layers", type=int, default=1,
                    help="time over this many layers' KV in turn, per launch (1: one layer, partly in L2)")
    ap.add_argument("--hnd", action="store_true",
                    help="the pool's pages head-major (FlashInfer's HND) instead of token-major (NHD, the "
                    "pool's layout): a permuted view, the kernel takes strides")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("decode_splits.py needs CUDA")
    gen = torch.Generator(device="cuda").manual_seed(0)
    rope = RopeCache.build(ModelConfig.from_hf(PRESETS["llama-3.1-8b"]), 16384, torch.device("cuda"))
    scale = HEAD_DIM**-0.5
    print(f"{torch.cuda.get_device_name()}; us per call (kernel + merge), CUDA-graph replay")
    forced = " | ".join(f"{s} splits" for s in args.splits)
    print(f"| KV heads | batch | engine's splits | engine (us) | {forced} | max rel. diff |")
    print("|---" * (5 + len(args.splits)) + "|")
    for heads in (8, 4):
        for B in args.batches:
            full = build_layout(B, "cuda", gen)
            lay = Layout(B, full.kv[:, :, :, :heads].contiguous(), full.indices, full.pages_per_req,
                         full.chunk_start, full.local_start)  # fmt: skip
            meta, ppr = lazy_meta(lay, 1), lay.pages_per_req
            q = torch.randn(B, 4 * heads, HEAD_DIM, generator=gen, device="cuda", dtype=torch.bfloat16)

            # --cold-layers: each timed call runs over that many layers' pools in turn (none in L2)
            layers = [lay.kv] + [torch.randn_like(lay.kv) for _ in range(max(1, args.cold_layers) - 1)]
            if args.hnd:
                layers = [head_major(kv) for kv in layers]

            def run(splits: int | None, q=q, layers=layers, meta=meta, ppr=ppr) -> torch.Tensor:
                for kv in layers:
                    out = lazy_attention_triton(q, kv, meta, rope, scale, max_q_len=1, max_kv_entries=ppr,
                                                num_splits=splits)  # fmt: skip
                return out

            _, auto = decode_tiles(B * heads, ppr * 16, q.device)
            want = run(None)

            def us(splits: int | None, run=run, n=len(layers)) -> float:  # noqa: B008
                return triton.testing.do_bench_cudagraph(lambda: run(splits)) * 1e3 / n

            row = [str(heads), str(B), str(auto), f"{us(None):.1f}"]
            diff = 0.0
            for s in args.splits:
                diff = max(diff, rel_err(run(s), want))
                row.append(f"{us(s):.1f}")
            print("| " + " | ".join(row) + f" | {diff:.1e} |")


if __name__ == "__main__":
    main()
