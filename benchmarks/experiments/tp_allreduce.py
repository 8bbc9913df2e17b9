"""Issue 17: what one all-reduce of a decode step's size costs on two GPUs, NCCL vs torch's symmetric
memory kernels (one-shot: each rank reads every peer's buffer over NVLink and sums; two-shot: reduce
a slice each, then gather), eagerly and inside a CUDA graph (the engine replays its decode steps from
graphs, 2 all-reduces a layer). No NVLink multicast: NCCL_NVLS_ENABLE=0, and the multimem kernels are
not tried.

    NCCL_NVLS_ENABLE=0 python benchmarks/experiments/tp_allreduce.py            # 2 GPUs
    python benchmarks/experiments/tp_allreduce.py --sizes 4096 --iters 20         # CPU: gloo, NCCL row only

Sizes are elements of bf16 (a decode step's hidden states: batch x 4,096 for the Llama-3.1-8B shape,
8 KB at batch 1, 512 KB at batch 64). Each variant's result is checked against NCCL's on the same
inputs; a variant this torch or machine cannot run prints its error instead of a time.
"""

from __future__ import annotations

import argparse
import functools
import os
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

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
    """A callable replaying GRAPH_OPS calls of op from one CUDA graph, and the per-op divisor."""
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


def _variants(group_name: str, max_numel: int, device: torch.device):
    """name -> factory(x) returning (op, result tensor) for the symmetric-memory kernels."""
    import torch.distributed._symmetric_memory as symm_mem

    buf = symm_mem.empty(max_numel, dtype=torch.bfloat16, device=device)
    symm_mem.rendezvous(buf, group_name)

    def one_shot(x):
        n, out = x.numel(), torch.empty_like(x)

        def op():
            buf[:n].copy_(x)
            torch.ops.symm_mem.one_shot_all_reduce_out(buf[:n], "sum", group_name, out)

        return op, out

    def one_shot_copy(x):  # the engine's path (runtime/worker/peer_all_reduce.py): the copy in the kernel
        n, out = x.numel(), torch.empty_like(x)

        def op():
            torch.ops.symm_mem.one_shot_all_reduce_copy_out(buf[:n], x, "sum", group_name, out)

        return op, out

    def two_shot(x):
        n, out = x.numel(), torch.empty_like(x)

        def op():
            buf[:n].copy_(x)
            torch.ops.symm_mem.two_shot_all_reduce_(buf[:n], "sum", group_name)
            out.copy_(buf[:n])

        return op, out

    return {"one-shot": one_shot, "one-shot copy": one_shot_copy, "two-shot": two_shot}


def _rank(rank: int, world: int, store_file: str, args, results) -> None:
    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= world
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{store_file}", rank=rank,
                            world_size=world)  # fmt: skip
    group_name = dist.group.WORLD.group_name
    dtype = torch.bfloat16 if cuda else torch.float32
    rows = []
    variants, why = {}, ""
    if cuda:
        try:
            variants = _variants(group_name, max(args.sizes), device)
        except Exception as e:  # an older torch, or no peer access
            why = f"{type(e).__name__}: {e}"[:120]
    for n in args.sizes:
        gen = torch.Generator(device=device).manual_seed(1234 + rank)
        x = torch.randn(n, generator=gen, device=device, dtype=dtype)
        ref = x.clone()
        dist.all_reduce(ref)
        nccl = functools.partial(dist.all_reduce, x.clone())
        row = {"numel": n, "KB": n * x.element_size() / 1024}
        row["nccl eager"] = _time_us(nccl, args.iters, device)
        if cuda:
            replay = _graphed(nccl, device)
            row["nccl graph"] = _time_us(replay, args.iters, device) / GRAPH_OPS
        for name, make in variants.items():
            try:
                op, out = make(x)
                op()
                torch.cuda.synchronize()
                err = (out.float() - ref.float()).abs().max().item()
                row[f"{name} eager"] = _time_us(op, args.iters, device)
                row[f"{name} graph"] = _time_us(_graphed(op, device), args.iters, device) / GRAPH_OPS
                row[f"{name} max err"] = err
            except Exception:
                row[f"{name} eager"] = "failed: " + traceback.format_exc(limit=1).splitlines()[-1][:100]
        rows.append(row)
    if rank == 0:
        results.put((rows, why))
    dist.barrier()
    dist.destroy_process_group()


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
        rank_args = (args.world, os.path.join(d, "store"), args, results)
        mp.start_processes(_rank, args=rank_args, nprocs=args.world, start_method="spawn")
    rows, why = results.get()
    if why:
        print(f"symmetric memory unavailable: {why}")
    keys = list(dict.fromkeys(k for r in rows for k in r))
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for r in rows:
        cells = [f"{r[k]:.2f}" if isinstance(r.get(k), float) else str(r.get(k, "")) for k in keys]
        print("| " + " | ".join(cells) + " |")
    print("(times in us per all-reduce; graph = a CUDA graph of", GRAPH_OPS, "all-reduces, replayed)")


if __name__ == "__main__":
    main()
