"""How fast Triton can gather a saved step's document pages, with no attention math (issue 14).

The shared-chunk kernel's "loads only" ablation (shared_kernel_ablation.py) moved 2.45 TB/s of
distinct KV at batch 64 on an H200 inside the kernel's own structure (64 query rows of registers a
program, 168 registers, 1 stage). This asks what the page gathers alone can reach: every (segment,
kv head) of a saved step (docs/data/steps/) read once, K and V, each tile summed into a register
accumulator, through
- `ptr`: pointer loads of BLOCK_N-key tiles (page ids gathered, a head's 256 B a token), as the
  kernel loads today;
- `tma`: one bulk tensor copy a page (a host TensorDescriptor over the pool's 5-D view, box
  [1, 1, 16, 1, head_dim]): Hopper's copy engine into shared memory, pipelined by num_stages;
swept over warps, stages, tile keys and programs an SM; against a plain device copy of the same
bytes (the ceiling). Each variant's sums are checked against torch's.

    python benchmarks/experiments/paged_gather_bw.py [--load docs/data/steps/llama8b_step_b64.npz]

GPU only (the `tma` variants need Hopper).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import os
import sys

import numpy as np
import torch
import triton
import triton.language as tl

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])


@triton.jit
def _gather_ptr(kv_ptr, indptr_ptr, indices_ptr, len_ptr, out_ptr, num_items,
                stride_kp, stride_kkv, stride_ks, stride_kh,
                KV_HEADS: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr, HEAD: tl.constexpr,
                STAGES: tl.constexpr):  # fmt: skip
    dh = tl.arange(0, HEAD)
    for item in range(tl.program_id(0), num_items, tl.num_programs(0)):
        c = item // KV_HEADS
        kvh = item % KV_HEADS
        e_lo = tl.load(indptr_ptr + c)
        n = tl.load(len_ptr + c)
        acc = tl.zeros([BLOCK_N, HEAD], tl.float32)
        for blk in tl.range(0, tl.cdiv(n, BLOCK_N), num_stages=STAGES):
            j = blk * BLOCK_N + tl.arange(0, BLOCK_N)
            ok = j < n
            page = tl.load(indices_ptr + e_lo + j // PAGE, mask=ok, other=0)
            off = page.to(tl.int64) * stride_kp + (j % PAGE) * stride_ks + kvh * stride_kh
            ptr = kv_ptr + off[:, None] + dh[None, :]
            k = tl.load(ptr, mask=ok[:, None], other=0.0)
            v = tl.load(ptr + stride_kkv, mask=ok[:, None], other=0.0)
            acc += k.to(tl.float32) + v.to(tl.float32)
        tl.store(out_ptr + item, tl.sum(acc))


@triton.jit
def _gather_tma(kv_desc, indptr_ptr, indices_ptr, len_ptr, out_ptr, num_items,
                KV_HEADS: tl.constexpr, PAGE: tl.constexpr, HEAD: tl.constexpr, STAGES: tl.constexpr):
    for item in range(tl.program_id(0), num_items, tl.num_programs(0)):
        c = item // KV_HEADS
        kvh = item % KV_HEADS
        e_lo = tl.load(indptr_ptr + c)
        n = tl.load(len_ptr + c)
        acc = tl.zeros([PAGE, HEAD], tl.float32)
        for pg in tl.range(0, tl.cdiv(n, PAGE), num_stages=STAGES):
            page = tl.load(indices_ptr + e_lo + pg)
            k = kv_desc.load([page, 0, 0, kvh, 0]).reshape(PAGE, HEAD)
            v = kv_desc.load([page, 1, 0, kvh, 0]).reshape(PAGE, HEAD)
            rows = pg * PAGE + tl.arange(0, PAGE)
            ok = (rows < n)[:, None]
            acc += tl.where(ok, k.to(tl.float32) + v.to(tl.float32), 0.0)
        tl.store(out_ptr + item, tl.sum(acc))


def reference(kv: torch.Tensor, indptr, indices, lens) -> torch.Tensor:
    """Each (segment, kv head)'s sum of its K and V (fp32)."""
    page = kv.shape[2]
    out = []
    for c in range(len(lens)):
        pages = torch.from_numpy(indices[indptr[c]:indptr[c + 1]].astype(np.int64)).to(kv.device)
        x = kv[pages].float()  # [pages, 2, page, H, D]
        x = x.permute(0, 2, 1, 3, 4).reshape(len(pages) * page, 2, kv.shape[3], kv.shape[4])[: int(lens[c])]
        out.append(x.sum(dim=(0, 1, 3)))
    return torch.stack(out).reshape(-1)


def timed_us(fn, reps: int = 30) -> float:
    """Median of event-timed launches, each after a 256 MB write that flushes L2."""
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        flush.zero_()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return float(np.median(times))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    here = os.path.join(__file__.rsplit("/benchmarks/", 1)[0], "docs", "data", "steps")
    steps = [os.path.join(here, f"llama8b_step_b{b}.npz") for b in (64, 16)]
    p.add_argument("--load", nargs="+", default=steps)
    p.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    p.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3, 4])
    p.add_argument("--block-n", type=int, nargs="+", default=[64, 128])
    p.add_argument("--programs-per-sm", type=int, nargs="+", default=[2, 4, 8])
    a = p.parse_args(argv)
    from triton.tools.tensor_descriptor import TensorDescriptor

    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=dev))
    rows = []
    for path in a.load:
        z = np.load(path)
        shape = z["kv_shape"].tolist()  # [pages, 2, page, kv heads, head dim]
        kv = torch.randn(*shape, dtype=torch.bfloat16, device=dev)
        indptr, indices, lens = z["chunk_kv_indptr"], z["chunk_kv_indices"], z["chunk_len"]
        H, D, page = shape[3], shape[4], shape[2]
        nbytes = int(lens.sum()) * H * D * 2 * kv.element_size()
        ref = reference(kv, indptr, indices, lens)
        t = lambda x: torch.from_numpy(np.ascontiguousarray(x).astype(np.int32)).to(dev)  # noqa: E731
        d_indptr, d_indices, d_lens = t(indptr), t(indices), t(lens)
        items = len(lens) * H
        out = torch.empty(items, dtype=torch.float32, device=dev)
        src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=dev)
        dst = torch.empty_like(src)
        copy_us = timed_us(functools.partial(dst.copy_, src))
        name = os.path.basename(path)
        print(f"{name}: {len(lens)} segments, {nbytes / 1e6:.1f} MB of distinct K+V; a copy of that many "
              f"bytes {copy_us:.1f} us ({2 * nbytes / copy_us / 1e6:.2f} TB/s read + write)", flush=True)
        rows.append((name, "copy (read + write)", copy_us, 2 * nbytes / copy_us / 1e6, ""))
        desc = TensorDescriptor.from_tensor(kv, [1, 1, page, 1, D])
        sweep = itertools.product(("ptr", "tma"), a.warps, a.stages, a.block_n, a.programs_per_sm)
        for kind, w, s, bn, ps in sweep:
            if kind == "tma" and bn != a.block_n[0]:
                continue  # a page a load: the tile is the page
            grid = (min(items, ps * sms),)
            if kind == "ptr":
                fn = functools.partial(_gather_ptr[grid], kv, d_indptr, d_indices, d_lens, out, items,
                                       *kv.stride()[:4], KV_HEADS=H, BLOCK_N=bn, PAGE=page, HEAD=D,
                                       STAGES=s, num_warps=w, num_stages=s)  # fmt: skip
            else:
                fn = functools.partial(_gather_tma[grid], desc, d_indptr, d_indices, d_lens, out, items,
                                       KV_HEADS=H, PAGE=page, HEAD=D, STAGES=s, num_warps=w,
                                       num_stages=s)  # fmt: skip
            label = f"{kind} warps {w} stages {s}" + (f" tile {bn}" if kind == "ptr" else "") + f" {ps}/SM"
            try:
                out.fill_(float("nan"))
                fn()
                torch.cuda.synchronize()
                err = ((out - ref).abs().max() / ref.abs().max()).item()
                us = timed_us(fn)
            except Exception as e:  # a setting that does not compile: noted, the sweep goes on
                print(f"  {label}: failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}", flush=True)
                continue
            ok = "" if err < 1e-4 else f"WRONG (rel err {err:.2e})"
            print(f"  {label}: {us:.1f} us, {nbytes / us / 1e6:.2f} TB/s {ok}", flush=True)
            rows.append((name, label, us, nbytes / us / 1e6, ok))
    print("\n| step | variant | us | TB/s |\n|---|---|---:|---:|")
    for name in dict.fromkeys(r[0] for r in rows):
        mine = [r for r in rows if r[0] == name]
        best = sorted((r for r in mine if r[1] != "copy (read + write)" and not r[4]), key=lambda r: r[2])
        shown = [mine[0]] + [next(r for r in best if r[1].startswith(k)) for k in ("ptr", "tma")
                             if any(r[1].startswith(k) for r in best)] + best[:3]
        for r in dict.fromkeys(shown):
            print(f"| {r[0]} | {r[1]} | {r[2]:.1f} | {r[3]:.2f} |")


if __name__ == "__main__":
    main()
