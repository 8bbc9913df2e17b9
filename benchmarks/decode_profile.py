"""Where a pure decode step's time goes: device kernel time by kernel vs wall time (issue 6).

B prompts of --context tokens (decode_roofline.py's workload: by default lazy RAG prompts of 5
documents by Zipf popularity; --cache-mode none: plain prompts) are prefilled first; then --steps
decode steps (every request decoding, no prefill piece in the step:
benchmarks/decode_roofline.decode_step_seconds) run once untimed-by-profiler for the wall time and
once under torch.profiler for the per-kernel device time. If the device is busy for much less than
the wall time, the step is host-bound.

GPU:  python benchmarks/decode_profile.py --batches 1 64
      python benchmarks/decode_profile.py --batches 1 64 --cache-mode none --context 4096
CPU smoke:  python benchmarks/decode_profile.py --model tiny-llama --device cpu --batches 2 --context 48 \
              --steps 2 --pool-docs 4 --docs-per-request 2
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import pstats
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile


def kernel_times(prof, device_type: str, counts: dict[str, int] | None = None) -> dict[str, float]:
    """Total self time (us) of each device kernel (or CPU op on a CPU run), by name; counts, when
    given, gets each name's number of launches."""
    out: dict[str, float] = defaultdict(float)
    for ev in prof.events():
        if device_type == "cuda" and ev.device_type == torch.autograd.DeviceType.CUDA:
            out[ev.name] += ev.self_device_time_total
        elif device_type != "cuda" and ev.cpu_parent is None:
            out[ev.name] += ev.self_cpu_time_total
        else:
            continue
        if counts is not None:
            counts[ev.name] = counts.get(ev.name, 0) + 1
    return out


GAP_US = 20.0  # idle device time between kernels: launch gaps inside a graph replay are shorter


def device_gaps(prof) -> tuple[float, float, float]:
    """(span, short gaps, long gaps) in us over the profiled window: from the first kernel's start to
    the last one's end, and the idle time between kernels, split at GAP_US (long gaps: the device
    waited for the host)."""
    spans = sorted((ev.time_range.start, ev.time_range.end) for ev in prof.events()
                   if ev.device_type == torch.autograd.DeviceType.CUDA)  # fmt: skip
    if not spans:
        return 0.0, 0.0, 0.0
    short = long = 0.0
    end = spans[0][1]
    for start, stop in spans[1:]:
        gap = start - end
        if gap >= GAP_US:
            long += gap
        elif gap > 0:
            short += gap
        end = max(end, stop)
    return end - spans[0][0], short, long


class _CProfile:
    def __init__(self, prof: cProfile.Profile):
        self.prof = prof

    def __enter__(self):
        self.prof.enable()

    def __exit__(self, *exc):
        self.prof.disable()


def host_profile(eng, prompts: list[list[int]], steps: int, top: int) -> None:
    """Host functions by own time over `steps` pure decode steps (the device time shows as waits)."""
    from benchmarks.decode_roofline import decode_step_seconds

    prof = cProfile.Profile()
    decode_step_seconds(eng, prompts, steps, around_steps=lambda: _CProfile(prof))
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    print(f"-- host profile, {steps} steps (tottime in s over all steps)")
    print("\n".join(line for line in out.getvalue().splitlines() if line.strip())[-6000:])


def main() -> None:
    from benchmarks.decode_roofline import add_workload_args, decode_step_seconds, make_workload

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(p, [1, 64])
    p.add_argument("--top", type=int, default=14)
    p.add_argument("--host-profile", action="store_true",
                   help="also run the steps under cProfile and print the top host functions")
    p.add_argument("--compare-overlap", action="store_true",
                   help="each batch with overlapped scheduling on and off, in the same engine")
    p.add_argument("--out", default=None, help="JSON lines, appended")
    args = p.parse_args()

    eng, make_prompts, _ = make_workload(args)
    dev = args.device
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev == "cuda" else [])

    def prompts(b: int) -> list:
        return make_prompts(b)[0]

    decode_step_seconds(eng, prompts(1), 4)  # compile, capture
    overlaps = (True, False) if args.compare_overlap else (args.overlap_schedule,)
    for b, overlap in ((b, o) for b in args.batches for o in overlaps):
        eng.core.overlap = overlap
        graphs = {}

        @contextlib.contextmanager
        def count_graphs(graphs=graphs):  # steps of the timed window replayed from a CUDA graph,
            r = eng.runner  # through shared-chunk attention, and their work items
            before = r.graph_steps, r.shared_steps, r.shared_work_items
            yield
            graphs["n"], graphs["shared"], graphs["items"] = (
                now - was for now, was in zip((r.graph_steps, r.shared_steps, r.shared_work_items), before))

        wall_us = decode_step_seconds(eng, prompts(b), args.steps, around_steps=count_graphs) * 1e6
        shared_steps, items = graphs["shared"], graphs["items"] / max(1, graphs["shared"])
        prof = profile(activities=activities)
        decode_step_seconds(eng, prompts(b), args.steps, around_steps=lambda p=prof: p)
        counts: dict[str, int] = {}
        per_step = {k: v / args.steps for k, v in kernel_times(prof, dev, counts).items()}
        busy_us = sum(per_step.values())
        span, short, long = (x / args.steps for x in device_gaps(prof)) if dev == "cuda" else (0.0,) * 3
        print(f"\n== batch {b}, context {args.context}, overlap {overlap}: pure decode step wall "
              f"{wall_us / 1e3:.2f} ms, device busy {busy_us / 1e3:.2f} ms ({busy_us / wall_us:.0%}), "
              f"{graphs['n']}/{args.steps} steps from CUDA graphs")
        if dev == "cuda":  # profiled window, per step: where the wall time the kernels do not fill goes
            print(f"   device span {span / 1e3:.2f} ms a step: kernels {busy_us / 1e3:.2f}, gaps under "
                  f"{GAP_US:.0f} us {short / 1e3:.2f}, longer gaps (waiting on the host) {long / 1e3:.2f}")
        if shared_steps:  # rank 0's view (every rank of a tensor-parallel model groups the same)
            heads = eng.runner.pool.num_kv_heads
            print(f"   shared-chunk attention in {shared_steps}/{args.steps} steps: "
                  f"{eng.runner.shared_piece_tokens}-token pieces, {items:.0f} work items a step "
                  f"(x {heads} kv heads = {items * heads:.0f} programs' work)")
        top = sorted(per_step.items(), key=lambda kv: -kv[1])[: args.top]
        for name, us in top:
            print(f"  {us / 1e3:8.3f} ms  {us / busy_us:5.1%}  {counts[name] / args.steps:5.1f}x  "
                  f"{name[:100]}")
        if args.host_profile:
            host_profile(eng, prompts(b), args.steps, args.top)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps({"batch": b, "context": args.context, "cache_mode": args.cache_mode,
                                    "alpha": args.alpha, "shared": args.shared_chunk_attention,
                                    "overlap": overlap,
                                    "wall_ms": wall_us / 1e3, "busy_ms": busy_us / 1e3,
                                    "graph_steps": graphs["n"], "span_ms": span / 1e3,
                                    "short_gaps_ms": short / 1e3, "long_gaps_ms": long / 1e3,
                                    "top": [(n, us / 1e3) for n, us in top]}) + "\n")


if __name__ == "__main__":
    main()
