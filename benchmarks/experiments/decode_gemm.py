"""Decode-sized matmuls of Llama-3.1-8B: cuBLAS (torch's default, and cuBLASLt preferred) vs a plain
Triton kernel over a few tiles, at TP=1 and one TP=2 rank's half-width shapes.

At batch 1 a TP=2 rank's qkv and o_proj ran at 2.4-2.7 TB/s on the H200 (decode_profile, 2 x H200)
where the large gate_up ran at ~3.8: the small GEMMs are where a TP=2 step does not halve (issue 17).
This times y = x @ W^T for each shape and M (rows = decode batch), reports us and the weight bytes'
TB/s per variant, and the best Triton tile's largest relative difference from torch's result (must stay
at bf16 rounding). GPU only; CUDA-graph replay.

    python benchmarks/experiments/decode_gemm.py [--rows 1 16 64]

Caveat: each shape's weights are read over and over, so those that fit the L2 (50 MB on the H100:
qkv and o_proj of a TP=2 rank, o_proj at TP=1) run above HBM speed here and not in a model.
H100, 2026-11-27 (commit f83cc77): the large shapes, where the L2 does not help, run at
2.6-2.9 TB/s through cuBLAS (the copy bandwidth is 2.99), and the best of these Triton tiles is within
2-4% of that (gate_up equal, down 4% faster) except lm_head (9% faster at 1 row: 341 vs 376 us);
cuBLASLt equals cuBLAS. So the decode GEMMs are at the weights' floor, and at TP=2 they halve.
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl
import triton.testing

HIDDEN, INTER, VOCAB, HEADS_DIM, KV_DIM = 4096, 14336, 128256, 4096, 1024
TILES = [(16, 256, 4, 4), (32, 128, 4, 4), (32, 256, 4, 3), (64, 128, 4, 4), (16, 512, 4, 3), (64, 64, 4, 5)]


def shapes(tp: int) -> list[tuple[str, int, int]]:
    """(name, N out features, K in features) of one rank."""
    return [("qkv", (HEADS_DIM + 2 * KV_DIM) // tp, HIDDEN), ("o_proj", HIDDEN, HEADS_DIM // tp),
            ("gate_up", 2 * INTER // tp, HIDDEN), ("down", HIDDEN, INTER // tp),
            ("lm_head", VOCAB // tp, HIDDEN)]  # fmt: skip


@triton.jit
def _gemm_kernel(x_ptr, w_ptr, y_ptr, M, N, K, M_P: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):  # fmt: skip
    # one program per BLOCK_N output features, all rows: every weight byte read once
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, M_P)
    acc = tl.zeros([M_P, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + n[:, None] * K + k[None, :], mask=(n < N)[:, None], other=0.0)
        x = tl.load(x_ptr + m[:, None] * K + k[None, :], mask=(m < M)[:, None], other=0.0)
        acc += tl.dot(x, tl.trans(w))
    tl.store(y_ptr + m[:, None] * N + n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(m < M)[:, None] & (n < N)[None, :])


def triton_gemm(x: torch.Tensor, w: torch.Tensor, tile: tuple[int, int, int, int]) -> torch.Tensor:
    block_n, block_k, warps, stages = tile
    M, K = x.shape
    N = w.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    _gemm_kernel[(triton.cdiv(N, block_n),)](x, w, y, M, N, K, M_P=max(16, triton.next_power_of_2(M)),
                                             BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps,
                                             num_stages=stages)  # fmt: skip
    return y


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("decode_gemm.py needs CUDA")
    bench = lambda fn: triton.testing.do_bench_cudagraph(fn, rep=50) * 1e3  # noqa: E731
    print(f"{torch.cuda.get_device_name()}; us (TB/s of the weights), CUDA-graph replay")
    print("| TP | shape | N x K | rows | cuBLAS | cuBLASLt | best Triton (tile) | max rel. diff |")
    print("|---|---|---|---|---|---|---|---|")
    totals: dict[tuple[int, int], list[float]] = {}
    for tp in (1, 2):
        for name, N, K in shapes(tp):
            w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02
            for M in args.rows:
                x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
                tb = lambda us, N=N, K=K: f"{us:.1f} ({N * K * 2 / us / 1e6:.2f})"  # noqa: E731
                torch.backends.cuda.preferred_blas_library("cublas")
                ref = torch.nn.functional.linear(x, w)
                t_cublas = bench(lambda x=x, w=w: torch.nn.functional.linear(x, w))
                torch.backends.cuda.preferred_blas_library("cublaslt")
                t_lt = bench(lambda x=x, w=w: torch.nn.functional.linear(x, w))
                torch.backends.cuda.preferred_blas_library("cublas")
                best = (float("inf"), None)
                diff = 0.0
                for tile in TILES:
                    try:
                        y = triton_gemm(x, w, tile)
                        t = bench(lambda x=x, w=w, tile=tile: triton_gemm(x, w, tile))
                    except Exception:  # noqa: BLE001 (a tile that does not fit this GPU's shared memory)
                        continue
                    diff = max(diff, float((y.float() - ref.float()).norm() / ref.float().norm()))
                    best = min(best, (t, tile), key=lambda b: b[0])
                totals.setdefault((tp, M), [0.0, 0.0, 0.0])
                for i, v in enumerate((t_cublas, t_lt, best[0])):
                    totals[(tp, M)][i] += v
                print(f"| {tp} | {name} | {N} x {K} | {M} | {tb(t_cublas)} | {tb(t_lt)} | "
                      f"{tb(best[0])} {best[1]} | {diff:.1e} |", flush=True)
    print("\n| TP | rows | the 5 shapes summed (a layer + lm_head), cuBLAS us | cuBLASLt "
          "| best Triton each |")
    print("|---|---|---|---|---|")
    for (tp, M), v in totals.items():
        print(f"| {tp} | {M} | " + " | ".join(f"{x:.1f}" for x in v) + " |")


if __name__ == "__main__":
    main()
