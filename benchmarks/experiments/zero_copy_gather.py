"""Reading scattered rows of pinned host memory from the GPU (the retrieval fill's key and value
reads): torch index_select on a zero-copy CUDA view, beside one contiguous DMA copy of the same bytes
(the bus's ceiling) and index_select from device memory (for scale).

H100 (PCIe), 2026-11-26, 2M rows of 256 B from a 4 GiB pinned table: DMA 55.1 GB/s, index_select on
the view 11.1 GB/s, device memory 413 GB/s. A Triton gather that loads 4-128 whole rows a program
(more reads in flight) measured the same 11.1 GB/s at every size, so it was not kept: scattered
reads of this size are bounded by the bus's read requests, not by the kernel.

    python benchmarks/experiments/zero_copy_gather.py [--gib 4] [--rows 2000000] [--runs 2 4 16 64]
"""

from __future__ import annotations

import argparse

import torch

from lazyrt.retrieval.device_fill import device_view


def timed(fn, reps: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps / 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=4.0, help="pinned host table size")
    p.add_argument("--rows", type=int, default=2_000_000, help="rows gathered per call")
    p.add_argument("--cols", type=int, default=128, help="bf16 elements a row (head_dim)")
    p.add_argument("--runs", type=int, nargs="*", default=[2, 4, 16, 64],
                   help="also gather runs of this many consecutive rows")
    args = p.parse_args()
    total = int(args.gib * 2**30) // (2 * args.cols)
    host = torch.empty(total, args.cols, dtype=torch.bfloat16, pin_memory=True)
    host.view(torch.int16).random_(0, 16000)  # finite bf16 values (torch.equal below)
    view = device_view(host, torch.device("cuda"))
    rows = torch.randint(0, total, (args.rows,), device="cuda")
    nbytes = args.rows * args.cols * 2
    ref = host[rows.cpu()]
    assert torch.equal(view.index_select(0, rows).cpu(), ref)
    print(f"| method | GB/s ({args.rows} rows of {args.cols * 2} B from a {args.gib} GiB pinned table) |")
    print("|---|---|")
    dst = torch.empty(args.rows, args.cols, dtype=torch.bfloat16, device="cuda")
    src = host[: args.rows]

    def row(name: str, fn) -> None:
        print(f"| {name} | {nbytes / timed(fn) / 1e9:.1f} |", flush=True)

    row("contiguous DMA copy (ceiling)", lambda: dst.copy_(src, non_blocking=True))
    row("contiguous read by the device (a copy kernel over the view)", lambda: dst.copy_(view[: args.rows]))
    row("index_select on the view", lambda: view.index_select(0, rows))
    for run in args.runs:  # rows in runs of `run` consecutive rows (an index list's keys stored together)
        starts = torch.randint(0, total // run, (args.rows // run, 1), device="cuda") * run
        runs = (starts + torch.arange(run, device="cuda")).view(-1)
        row(f"index_select on the view, runs of {run} rows", lambda r=runs: view.index_select(0, r))
    local = view[: total // 4].clone()  # device memory, for scale
    r2 = torch.randint(0, local.shape[0], (args.rows,), device="cuda")
    row("index_select, device memory", lambda: local.index_select(0, r2))


if __name__ == "__main__":
    main()
