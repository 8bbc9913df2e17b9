"""How fast FlashInfer's paged prefill kernels would run a shared-chunk step's grouping (issue 14).

The shared-chunk kernel reads each document once per step for all the queries that use it, but
moves only ~1.8 TB/s on an H200 (shared_kernel_ablation.py: not the rotation, the exp or the
layout; a 64-row MMA with its softmax in one warpgroup). FlashInfer's prefill kernels (FA3 on
Hopper: warp-specialized, TMA) would take the same grouping as a batch of "requests", one a
segment: its pairs' query rows over its pages, no RoPE, not causal (a decode query sees all of a
document). They cannot turn keys by their slot, so the keys would have to be stored turned by
their index inside their document (the query-rotation layout of docs/kernels.md) and each pair's
query turned by its position minus the segment's start before the call. This times that call on
the saved steps (docs/data/steps/, random q and KV; CUDA-graph replays with L2 flushed, as the
engine launches them; the profiler sees none of FlashInfer's kernels here), beside the shared-chunk
kernel on the same step (also by its profiler kernel time): an upper bound on what the storage
change would buy.

    python benchmarks/experiments/shared_via_flashinfer.py [--load STEP.npz ...]

GPU only.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import torch

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])

from benchmarks.experiments.step_replay import device_us, load_step, saved_steps, step_config  # noqa: E402
from lazyrt.kernels import triton_shared_chunk as tsc  # noqa: E402


def graph_us(fn, device: torch.device, reps: int = 10) -> float:
    """Mean device time (us) of fn's launches replayed from a CUDA graph, each after a 256 MB write
    that flushes L2 (a graph of the writes alone is timed too and taken off)."""
    flush = torch.empty(256 << 20, dtype=torch.int8, device=device)
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        fn()  # warm-up (and compile) outside the capture
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)

    def capture(with_fn: bool) -> torch.cuda.CUDAGraph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(reps):
                flush.zero_()
                if with_fn:
                    fn()
        return g

    times = []
    for g in (capture(True), capture(False)):
        g.replay()
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            g.replay()
        end.record()
        torch.cuda.synchronize(device)
        times.append(start.elapsed_time(end) * 1e3 / (5 * reps))
    return times[0] - times[1]


def one_step(path: str, model: str, workspace: torch.Tensor) -> list[str]:
    """A table row: the shared-chunk kernel and FlashInfer's prefill (fa3, fa2) on one saved step."""
    import flashinfer

    dev = workspace.device
    q, kv, pos, sh, rope, scale, kw = load_step(path, step_config(path, model), dev)
    b = int(path.rsplit("_b", 1)[1].split(".")[0])
    _, _, page, kv_heads, head_dim = kv.shape
    q_heads = q.shape[1]
    c = lambda t: t.cpu().numpy().astype(np.int64)  # noqa: E731
    kv_indptr, indices, lens = c(sh.chunk_kv_indptr), c(sh.chunk_kv_indices), c(sh.chunk_len)
    pair_indptr = c(sh.pair_indptr)
    keep = np.flatnonzero(pair_indptr[1:] > pair_indptr[:-1])  # segments some pair reads
    qo = np.concatenate([[0], np.cumsum(pair_indptr[keep + 1] - pair_indptr[keep])])
    npages = kv_indptr[keep + 1] - kv_indptr[keep]
    kvp = np.concatenate([[0], np.cumsum(npages)])
    idx = np.concatenate([indices[kv_indptr[s]:kv_indptr[s + 1]] for s in keep])
    last = lens[keep] - (npages - 1) * page
    t = lambda a: torch.as_tensor(a, dtype=torch.int32, device=dev)  # noqa: E731
    qs = torch.randn(int(qo[-1]), q_heads, head_dim, dtype=q.dtype, device=dev)
    gb = int(lens[keep].sum()) * kv_heads * head_dim * 2 * kv.element_size() / 1e9
    programs = tsc.persistent_programs(dev)  # a graph's launch, as the engine captures it
    ours_fn = lambda: tsc.shared_chunk_attention_triton(q, kv, pos, sh, rope, scale, programs=programs)  # noqa: E731
    ours, ours_q = device_us(ours_fn, dev), graph_us(ours_fn, dev)
    row = [os.path.basename(path), str(kv_heads), str(b), str(len(keep)),
           f"{ours:.1f} ({gb / ours * 1e3:.2f})", f"{ours_q:.1f}"]  # fmt: skip
    for backend in ("fa3", "fa2"):
        bufs = dict(qo_indptr_buf=t(qo), paged_kv_indptr_buf=t(kvp), paged_kv_indices_buf=t(idx),
                    paged_kv_last_page_len_buf=t(last))  # fmt: skip
        w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", use_cuda_graph=True,
                                                           backend=backend, **bufs)  # fmt: skip
        w.plan(t(qo), t(kvp), t(idx), t(last), q_heads, kv_heads, head_dim, page, causal=False,
               pos_encoding_mode="NONE", q_data_type=q.dtype, kv_data_type=kv.dtype,
               sm_scale=scale)  # fmt: skip
        us = graph_us(lambda w=w: w.run(qs, kv, return_lse=True), dev)
        row.append(f"{us:.1f} ({gb / us * 1e3:.2f})")
        print(f"{path} {backend}: {us:.1f} us vs ours {ours:.1f}", flush=True)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--load", nargs="*", default=saved_steps())
    p.add_argument("--model", default="llama-3.1-8b", help="config of steps with none beside them")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("shared_via_flashinfer.py needs CUDA")
    workspace = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    rows = [one_step(path, args.model, workspace) for path in args.load]
    print(f"\n{torch.cuda.get_device_name()}; us a layer (TB/s of the distinct K+V the segments read)")
    print("| step | kv heads | batch | segments | shared-chunk kernel, profiler | the same, CUDA graph "
          "| FlashInfer fa3, CUDA graph | FlashInfer fa2, CUDA graph |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(r) + " |")


if __name__ == "__main__":
    main()
