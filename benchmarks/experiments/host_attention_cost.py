"""Cost of retrieval attention on the CPU for one layer: HostAttention.fill over 8 host chunks of
2,048 keys (Llama-3.1-8B attention shape, bf16 host KV, random keys), 1 query row, top-128 + 16 sink
keys, 5% scan; extrapolated to 56 chunks x 32 layers (a 128K context with 1/8 on the device).
Run: python benchmarks/experiments/host_attention_cost.py
"""

from __future__ import annotations

import cProfile
import pstats
import time

import torch

from lazyrt.kernels.rope import RopeCache
from lazyrt.retrieval.host_attention import HostAttention, HostIndexCache, HostPart, RetrievalOptions


class _Rope:
    rope_theta, rope_scaling, rotary_dim = 500000.0, None, 128


def main() -> None:
    rope = RopeCache.build(_Rope(), 140000)
    chunks, n, ps, kvh, d, qh = 8, 2048, 16, 8, 128, 32
    pages = n // ps
    kv = torch.randn(chunks * pages, 1, 2, ps, kvh, d, dtype=torch.bfloat16)
    runs = [tuple(range(c * pages, (c + 1) * pages)) for c in range(chunks)]
    parts = [HostPart(range(0, 1), run, n, 16 + c * n, c) for c, run in enumerate(runs)]
    cache = HostIndexCache()
    ha = HostAttention(parts, kv, rope, d**-0.5, RetrievalOptions(128, 16, 0.05), cache)
    q = torch.randn(1, qh, d)
    o, lse = torch.zeros(chunks, qh, d), torch.zeros(chunks, qh)
    t = time.perf_counter()
    ha.fill(0, q, o, lse)
    print(f"first fill (builds {cache.builds} indexes): {time.perf_counter() - t:.2f} s")
    t = time.perf_counter()
    for _ in range(5):
        ha.fill(0, q, o, lse)
    per = (time.perf_counter() - t) / 5
    print(f"fill, {chunks} chunks x {n} keys, 1 query: {per * 1e3:.1f} ms = {per / chunks * 1e3:.2f} ms a "
          f"chunk-layer; 56 chunks x 32 layers: {per / chunks * 56 * 32:.1f} s/token")
    prof = cProfile.Profile()
    prof.enable()
    ha.fill(0, q, o, lse)
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(8)


if __name__ == "__main__":
    main()
