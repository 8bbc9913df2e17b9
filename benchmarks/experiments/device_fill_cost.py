"""Cost of the device fill (retrieval attention's host parts on the GPU) for one layer of a decode
step: DeviceFill over --chunks host chunks of 2,048 keys (Llama-3.1-8B attention shape, bf16 pinned
host tier, random keys), --batch requests over the same chunks (1 query row each), top-32 + 16 sink
keys, 5% scan, shared lists (or --per-head). Reports, per layer:
  eager      wall time of fill() with a device sync after it (what a step pays today)
  issue      host time of fill() without the sync (Python and kernel launches)
  device     device time of the fill's kernels (CUDA events)
  graph      the fill replayed from its CUDA graph (FillGraphs: queries copied in, outputs out), synced
and x 32 layers (a decode step's share). Run on a GPU:
    python benchmarks/experiments/device_fill_cost.py [--chunks 56] [--batch 1] [--per-head]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from lazyrt.kernels.rope import RopeCache
from lazyrt.retrieval.device_fill import FillGraphs
from lazyrt.retrieval.host_attention import HostAttention, HostIndexCache, HostPart, RetrievalOptions


class _Rope:
    rope_theta, rope_scaling, rotary_dim = 500000.0, None, 128


def median_s(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunks", type=int, default=56)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--per-head", action="store_true", help="per query head lists (no share_lists)")
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    dev = torch.device("cuda")
    chunks, n, ps, kvh, d, qh = args.chunks, 2048, 16, 8, 128, 32
    pages = n // ps
    rope = RopeCache.build(_Rope(), 140000)
    kv = torch.randn(chunks * pages, 1, 2, ps, kvh, d, dtype=torch.bfloat16).pin_memory()
    runs = [tuple(range(c * pages, (c + 1) * pages)) for c in range(chunks)]
    each = [(b, c, run) for b in range(args.batch) for c, run in enumerate(runs)]
    parts = [HostPart(range(b, b + 1), run, n, 16 + c * n) for b, c, run in each]
    for i, p in enumerate(parts):  # (one pair, i.e. o / lse row, a part)
        p.pair0 = i
    opts = RetrievalOptions(32, 16, 0.05, build_device="cuda", share_lists=not args.per_head)
    cache = HostIndexCache(0, "cuda")
    q = torch.randn(args.batch, qh, d, device=dev)
    o = torch.zeros(len(parts), qh, d, device=dev)
    lse = torch.zeros(len(parts), qh, device=dev)
    ha = HostAttention(parts, kv, rope, d**-0.5, opts, cache, device_rope=rope.to(dev))
    cache.fill_graphs = None  # eager first (the fill replays CUDA graphs of repeated steps otherwise)
    t = time.perf_counter()
    ha.fill(0, q, o, lse)
    torch.cuda.synchronize()
    print(f"first fill (builds {cache.builds} indexes on the GPU): {time.perf_counter() - t:.2f} s")

    def synced() -> None:
        ha.fill(0, q, o, lse)
        torch.cuda.synchronize()

    synced()
    eager = median_s(synced, args.repeat)
    torch.cuda.synchronize()
    issue = median_s(lambda: ha.fill(0, q, o, lse), args.repeat)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(args.repeat):
        ha.fill(0, q, o, lse)
    end.record()
    torch.cuda.synchronize()
    device_s = start.elapsed_time(end) / args.repeat / 1e3  # (launch-bound: the host's pace)
    want = o.clone()
    cache.fill_graphs = FillGraphs()  # the fill's own graphs: captured on the 2nd call, replayed after
    for _ in range(2):
        ha.fill(0, q, o, lse)
    o.zero_()
    synced()
    same = torch.allclose(o, want) and cache.fill_graphs.replays == 1
    graph_s = median_s(synced, args.repeat)
    mode = "per-head" if args.per_head else "shared lists"
    print(f"| {chunks} chunks x {n} keys, batch {args.batch}, {mode} | per layer (ms) | x 32 layers (s) |")
    print("|---|---|---|")
    rows = [("eager (synced)", eager), ("issue (host)", issue), ("device, launched back to back", device_s),
            ("CUDA graph replay (synced)", graph_s)]  # fmt: skip
    for name, s in rows:
        print(f"| {name} | {s * 1e3:.2f} | {s * 32:.3f} |")
    print(f"graph output equals eager: {same}")


if __name__ == "__main__":
    main()
