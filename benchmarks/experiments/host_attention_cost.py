"""Cost of retrieval attention on the CPU for one layer: HostAttention.fill over --chunks host chunks
(default 8) of 2,048 keys (Llama-3.1-8B attention shape, bf16 host KV, random keys), 1 query row,
top-128 + 16 sink keys, 5% scan; extrapolated to 56 chunks x 32 layers (a 128K context with 1/8 on
the device). --reference also times the per-part torch reference (fill_reference: the fill before
the batched one) and checks the two agree.
Run: python benchmarks/experiments/host_attention_cost.py [--chunks 56] [--reference]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import torch

from lazyrt.kernels.rope import RopeCache
from lazyrt.retrieval.host_attention import HostAttention, HostIndexCache, HostPart, RetrievalOptions


class _Rope:
    rope_theta, rope_scaling, rotary_dim = 500000.0, None, 128


def _time(fill, chunks: int, n: int, repeat: int, label: str) -> float:
    fill()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fill()
        times.append(time.perf_counter() - t)
    per = statistics.median(times)  # the median: this box is often shared
    print(
        f"{label}, {chunks} chunks x {n} keys, 1 query: {per * 1e3:.1f} ms (median of {repeat}; min "
        f"{min(times) * 1e3:.1f}) = {per / chunks * 1e6:.0f} us a chunk-layer; 56 chunks x 32 layers: "
        f"{per / chunks * 56 * 32:.2f} s/token"
    )
    return per


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--reference", action="store_true", help="also time fill_reference (per part)")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    ap.add_argument("--build-threads", type=int, default=0,
                    help="index builders off the step (retrieval_build_threads): the first fill attends "
                    "exactly while they build; 0: the first fill builds every index itself")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rope = RopeCache.build(_Rope(), 140000)
    chunks, n, ps, kvh, d, qh = args.chunks, 2048, 16, 8, 128, 32
    pages = n // ps
    kv = torch.randn(chunks * pages, 1, 2, ps, kvh, d, dtype=torch.bfloat16)
    runs = [tuple(range(c * pages, (c + 1) * pages)) for c in range(chunks)]
    parts = [HostPart(range(0, 1), run, n, 16 + c * n, c) for c, run in enumerate(runs)]
    cache = HostIndexCache(args.build_threads)
    ha = HostAttention(parts, kv, rope, d**-0.5, RetrievalOptions(128, 16, 0.05, args.build_threads), cache)
    q = torch.randn(1, qh, d)
    o, lse = torch.zeros(chunks, qh, d), torch.zeros(chunks, qh)
    print(f"torch threads: {torch.get_num_threads()}")
    t = time.perf_counter()
    ha.fill(0, q, o, lse)
    first = time.perf_counter() - t
    print(f"first fill (built {cache.builds} indexes, {cache.pending} queued): {first:.2f} s")
    if args.build_threads:
        t = time.perf_counter()
        cache.wait()
        print(f"then {args.build_threads} builder thread(s) built {cache.builds} indexes in another "
              f"{time.perf_counter() - t:.2f} s")
    _time(lambda: ha.fill(0, q, o, lse), chunks, n, args.repeat, "fill (batched)")
    if args.reference:
        ro, rl = torch.zeros_like(o), torch.zeros_like(lse)
        _time(lambda: ha.fill_reference(0, q, ro, rl), chunks, n, max(1, args.repeat // 2), "fill_reference")
        do, dl = float((o - ro).abs().max()), float((lse - rl).abs().max())
        print(f"max |o - o_ref| {do:.2e}, |lse - lse_ref| {dl:.2e}")
    prof = cProfile.Profile()
    prof.enable()
    ha.fill(0, q, o, lse)
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(10)


if __name__ == "__main__":
    main()
