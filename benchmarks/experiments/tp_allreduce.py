"""Issue 17: what one all-reduce of a decode step's size costs on two GPUs through the engine's two
paths (lazyrt/runtime/worker/tp_group.py): NCCL (the process group) and the peer path (torch's
one-shot symmetric-memory kernel, peer_all_reduce.py), eagerly and inside a CUDA graph (the engine
replays its decode steps from graphs, 2 all-reduces a layer). No NVLink multicast.

    NCCL_NVLS_ENABLE=0 python benchmarks/experiments/tp_allreduce.py            # 2 GPUs
    python benchmarks/experiments/tp_allreduce.py --sizes 4096 --iters 20         # CPU: gloo only

Sizes are elements of bf16 (a decode step's hidden states: batch x 4,096 for the Llama-3.1-8B shape,
8 KB at batch 1, 512 KB at batch 64). The peer path's sums are checked against the process group's
on the same inputs. Each rank is a process of its own; rank 0 prints the table.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch
import torch.multiprocessing as mp

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])

from lazyrt.runtime.worker.tp_group import TPGroup  # noqa: E402
from lazyrt.runtime.worker.tp_ranks import TPRendezvous  # noqa: E402

GRAPH_OPS = 64  # all-reduces captured in one graph: one decode step's worth at 32 layers


def _time_us(fn, iters: int, device: torch.device) -> float:
    for _ in range(3):
        fn()
    if device.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) / iters * 1e6
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters * 1e3


def _graphed(op, device: torch.device):
    """A callable replaying GRAPH_OPS calls of op from one CUDA graph."""
    s = torch.cuda.Stream(device)
    s.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(s):
        for _ in range(3):
            op()
    torch.cuda.current_stream(device).wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(GRAPH_OPS):
            op()
    return g.replay


def _rank(rank: int, rdv: TPRendezvous, args, results) -> None:
    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= rdv.size
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dtype = torch.bfloat16 if cuda else torch.float32
    g = TPGroup(rdv, rank, device, peer_dtype=dtype, peer_max_bytes=max(args.sizes) * dtype.itemsize)
    rows = []
    for n in args.sizes:
        x = torch.randn(n, generator=torch.Generator().manual_seed(1234 + rank), dtype=dtype).to(device)
        ref = x.clone()
        g.pg.allreduce([ref]).wait()

        work = x.clone()  # NCCL sums in place: its own copy

        def group_op(work=work):
            g.pg.allreduce([work]).wait()

        def peer_op(x=x):
            return g.peer(x)

        row = {"numel": n, "KB": n * x.element_size() / 1024, "group": g.pg.name()}
        row["group eager"] = _time_us(group_op, args.iters, device)
        if cuda:
            row["group graph"] = _time_us(_graphed(group_op, device), args.iters, device) / GRAPH_OPS
        if g.peer is not None:
            row["peer max err"] = (peer_op().float() - ref.float()).abs().max().item()
            row["peer eager"] = _time_us(peer_op, args.iters, device)
            row["peer graph"] = _time_us(_graphed(peer_op, device), args.iters, device) / GRAPH_OPS
        rows.append(row)
    if rank == 0:
        results.put(rows)
    g.pg.allreduce([torch.zeros(1, device=device)]).wait()  # both done before either closes
    g.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[4096, 16 * 4096, 64 * 4096],
                   help="bf16 elements per all-reduce (batch x hidden)")  # fmt: skip
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--world", type=int, default=2)
    args = p.parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as d:
        rdv = TPRendezvous.create(args.world, d)
        procs = [ctx.Process(target=_rank, args=(r, rdv, args, results)) for r in range(args.world)]
        for pr in procs:
            pr.start()
        rows = results.get(timeout=300)  # before joining: a child exits only once its queue is drained
        for pr in procs:
            pr.join(60)
    keys = list(dict.fromkeys(k for r in rows for k in r))
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for r in rows:
        cells = [f"{r[k]:.2f}" if isinstance(r.get(k), float) else str(r.get(k, "")) for k in keys]
        print("| " + " | ".join(cells) + " |")
    print("(times in us per all-reduce; graph = a CUDA graph of", GRAPH_OPS, "all-reduces, replayed)")


if __name__ == "__main__":
    main()
