"""Variants of the shared-chunk kernel's loop, timed beside it, with each one's registers and spills.

The kernel (lazyrt/kernels/triton_shared_chunk.py) loads a tile's page ids, then its keys at those
pages, turns the keys and runs the dots, one tile after another; on an H100 a lone question's item
takes ~2.6 us a 64-key tile with one item an SM (experiments/lone_question.py), thousands of cycles
for 48 KB. Variants, the same math (keys turned in the KV dtype, full rotary, head_dim 128):
- `base`: the kernel's loop before 6a444dc (masked tiles), copied here;
- `one dot`: the two halves' scores in one dot over the whole head (queries and keys interleaved
  by tl.join) instead of two dots of half the head each;
- `pages ahead`: the next tile's page ids loaded one tile ahead (the key loads no longer wait on a
  load issued in the same iteration), Triton's own pipelining as in the kernel;
- `tile ahead`: the next tile's keys, cos/sin and values loaded into registers while this tile's
  dots run (manual double buffering, num_stages 1).
On shared_chunk_bench.py's steps (Llama-3.1-8B heads, bf16, one layer, CUDA-graph replay): a lone
16-token question and decode steps at batch 16 / 64. Prints us per variant and each variant's
largest relative difference from the kernel's output, registers and spills. (Compiled offline for
sm_90 with the CPU box's triton 3.9, every variant and the kernel itself take 255 registers a
thread, no spills; that compile pipelined not even a plain matmul loop, so it says nothing about
pipelining.) On an H100 (2026-11-27): pages ahead and tile ahead did not help (674888c); the
kernel's loads are pipelined (async copies in its TTGIR); one dot, no gain; the unmasked loop 2-5%
faster, since the kernel's own (6a444dc, 2 stages), so `base` now copies the loop before it.

    python benchmarks/experiments/shared_kernel_variants.py
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import random
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])

from benchmarks.shared_chunk_bench import build_step  # noqa: E402
from lazyrt.kernels.rope import RopeCache  # noqa: E402
from lazyrt.models.config import ModelConfig  # noqa: E402
from lazyrt.models.dummy import PRESETS  # noqa: E402

_LOG2E = 1.4426950408889634
# (label, MODE, num_stages, ONE_DOT): MODE 0 = the kernel's loop, 1 = the next tile's page ids
# ahead, 2 = the whole next tile ahead, 4 = full tiles unmasked then a masked rest
VARIANTS = (
    ("base_s3", 0, 3, False), ("one_dot_s3", 0, 3, True), ("unmasked_s3", 4, 3, False),
    ("unmasked_s2", 4, 2, False), ("unmasked_one_dot_s3", 4, 3, True),
    ("pages_ahead_s2", 1, 2, False), ("tile_ahead_s1", 2, 1, False),
)  # fmt: skip


@triton.jit
def _tile(kv_ptr, kcos_ptr, ksin_ptr, page, j, j_ok, kvh, stride_kp, stride_kkv, stride_ks, stride_kh,
          stride_kcos, PAGE_SIZE: tl.constexpr, HALF: tl.constexpr, HEAD: tl.constexpr,
          MASKED: tl.constexpr = True):  # fmt: skip
    """A key tile's key halves, their cos/sin and its values (MASKED: keys past the segment read 0)."""
    ch = tl.arange(0, HALF)
    dh = tl.arange(0, HEAD)
    k_off = page.to(tl.int64) * stride_kp + (j % PAGE_SIZE) * stride_ks + kvh * stride_kh
    k_ptr = kv_ptr + k_off[:, None] + ch[None, :]
    c_off = j[:, None] * stride_kcos + ch[None, :]
    v_ptr = kv_ptr + (k_off + stride_kkv)[:, None] + dh[None, :]
    if MASKED:
        m = j_ok[:, None]
        k1 = tl.load(k_ptr, mask=m, other=0.0)
        k2 = tl.load(k_ptr + HALF, mask=m, other=0.0)
        cj = tl.load(kcos_ptr + c_off, mask=m, other=0.0)
        sj = tl.load(ksin_ptr + c_off, mask=m, other=0.0)
        v = tl.load(v_ptr, mask=m, other=0.0)
    else:
        k1 = tl.load(k_ptr)
        k2 = tl.load(k_ptr + HALF)
        cj = tl.load(kcos_ptr + c_off)
        sj = tl.load(ksin_ptr + c_off)
        v = tl.load(v_ptr)
    return k1, k2, cj, sj, v


@triton.jit
def _attend(q1r, q2r, qj, k1, k2, cj, sj, v, j, j_ok, row_ok, delta, m_i, l_i, acc,
            BLOCK_N: tl.constexpr, HALF: tl.constexpr, ONE_DOT: tl.constexpr):  # fmt: skip
    """One key tile into the online softmax: keys turned by their index, scores, masks, the update."""
    dt = k1.dtype
    k1r = (k1 * cj - k2 * sj).to(dt)
    k2r = (k2 * cj + k1 * sj).to(dt)
    if ONE_DOT:
        s = tl.dot(qj, tl.trans(tl.reshape(tl.join(k1r, k2r), [BLOCK_N, 2 * HALF])))
    else:
        s = tl.dot(q1r, tl.trans(k1r))
        s = tl.dot(q2r, tl.trans(k2r), s)
    visible = row_ok[:, None] & j_ok[None, :] & (j[None, :] <= delta[:, None])
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = tl.dot(p.to(dt), v, acc * alpha[:, None])
    return m_new, l_i, acc


@triton.jit
def _variant_kernel(
    q_ptr, kv_ptr, pos_ptr, cos_ptr, sin_ptr, kcos_ptr, ksin_ptr,
    chunk_kv_indptr_ptr, chunk_kv_indices_ptr, chunk_len_ptr, pair_indptr_ptr, pair_row_ptr, pair_start_ptr,
    work_chunk_ptr, work_pair_ptr, num_work_ptr,
    o_ptr, lse_ptr,
    qk_scale,
    stride_qt, stride_qh, stride_kp, stride_kkv, stride_ks, stride_kh, stride_cos, stride_kcos,
    stride_op, stride_oh, stride_lp,
    KV_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_P: tl.constexpr, ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, HALF: tl.constexpr, HEAD: tl.constexpr,
    MODE: tl.constexpr, ONE_DOT: tl.constexpr,
):
    total = tl.load(num_work_ptr) * KV_HEADS
    for item in range(tl.program_id(0), total, tl.num_programs(0)):
        w = item // KV_HEADS
        kvh = item % KV_HEADS
        c = tl.load(work_chunk_ptr + w)
        p_first = tl.load(work_pair_ptr + w)
        p_hi = tl.load(pair_indptr_ptr + c + 1)
        dt = kv_ptr.dtype.element_ty
        r = tl.arange(0, ROWS)
        pair = p_first + r // GROUP
        head = kvh * GROUP + r % GROUP
        row_ok = (r < BLOCK_P * GROUP) & (pair < p_hi)
        qrow = tl.load(pair_row_ptr + pair, mask=row_ok, other=0)
        start = tl.load(pair_start_ptr + pair, mask=row_ok, other=0)
        delta = tl.load(pos_ptr + qrow, mask=row_ok, other=0) - start
        ch = tl.arange(0, HALF)
        qm = row_ok[:, None]
        q_base = q_ptr + qrow.to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh
        q1 = tl.load(q_base + ch[None, :], mask=qm, other=0.0).to(tl.float32)
        q2 = tl.load(q_base + HALF + ch[None, :], mask=qm, other=0.0).to(tl.float32)
        c_off = start[:, None] * stride_cos + ch[None, :]
        cs = tl.load(cos_ptr + c_off, mask=qm, other=0.0)
        sn = tl.load(sin_ptr + c_off, mask=qm, other=0.0)
        q1r = ((q1 * cs + q2 * sn) * qk_scale).to(dt)
        q2r = ((q2 * cs - q1 * sn) * qk_scale).to(dt)
        if ONE_DOT:  # [q1 | q2] interleaved column by column; the keys below the same way
            qj = tl.reshape(tl.join(q1r, q2r), [ROWS, 2 * HALF])

        e_lo = tl.load(chunk_kv_indptr_ptr + c)
        n = tl.load(chunk_len_ptr + c)
        dh = tl.arange(0, HEAD)
        m_i = tl.full([ROWS], float("-inf"), tl.float32)
        l_i = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, HEAD], tl.float32)
        strides = (stride_kp, stride_kkv, stride_ks, stride_kh, stride_kcos)
        if not ONE_DOT:
            qj = q1r  # unused
        if MODE == 4:  # full tiles unmasked (the compiler may pipeline their loads), then the rest
            for blk in range(0, n // BLOCK_N):
                j = blk * BLOCK_N + tl.arange(0, BLOCK_N)
                page = tl.load(chunk_kv_indices_ptr + e_lo + j // PAGE_SIZE)
                k1, k2, cj, sj, v = _tile(kv_ptr, kcos_ptr, ksin_ptr, page, j, j < n, kvh, *strides,
                                          PAGE_SIZE, HALF, HEAD, False)  # fmt: skip
                m_i, l_i, acc = _attend(q1r, q2r, qj, k1, k2, cj, sj, v, j, j < n, row_ok, delta, m_i, l_i,
                                        acc, BLOCK_N, HALF, ONE_DOT)  # fmt: skip
            if n % BLOCK_N:
                j = (n // BLOCK_N) * BLOCK_N + tl.arange(0, BLOCK_N)
                j_ok = j < n
                page = tl.load(chunk_kv_indices_ptr + e_lo + j // PAGE_SIZE, mask=j_ok, other=0)
                k1, k2, cj, sj, v = _tile(kv_ptr, kcos_ptr, ksin_ptr, page, j, j_ok, kvh, *strides,
                                          PAGE_SIZE, HALF, HEAD)  # fmt: skip
                m_i, l_i, acc = _attend(q1r, q2r, qj, k1, k2, cj, sj, v, j, j_ok, row_ok, delta, m_i, l_i,
                                        acc, BLOCK_N, HALF, ONE_DOT)  # fmt: skip
        else:
            j = tl.arange(0, BLOCK_N)
            j_ok = j < n
            page = tl.load(chunk_kv_indices_ptr + e_lo + j // PAGE_SIZE, mask=j_ok, other=0)
            if MODE == 2:
                k1, k2, cj, sj, v = _tile(kv_ptr, kcos_ptr, ksin_ptr, page, j, j_ok, kvh, *strides,
                                          PAGE_SIZE, HALF, HEAD)  # fmt: skip
            for _ in range(0, tl.cdiv(n, BLOCK_N)):
                jn = j + BLOCK_N
                jn_ok = jn < n
                if MODE == 0:  # as the kernel: this tile's page ids, then its keys
                    page = tl.load(chunk_kv_indices_ptr + e_lo + j // PAGE_SIZE, mask=j_ok, other=0)
                    page_n = page
                else:
                    page_n = tl.load(chunk_kv_indices_ptr + e_lo + jn // PAGE_SIZE, mask=jn_ok, other=0)
                if MODE == 2:  # the next tile, in flight while this one's dots run
                    k1n, k2n, cjn, sjn, vn = _tile(kv_ptr, kcos_ptr, ksin_ptr, page_n, jn, jn_ok, kvh,
                                                   *strides, PAGE_SIZE, HALF, HEAD)  # fmt: skip
                else:
                    k1, k2, cj, sj, v = _tile(kv_ptr, kcos_ptr, ksin_ptr, page, j, j_ok, kvh, *strides,
                                              PAGE_SIZE, HALF, HEAD)  # fmt: skip
                m_i, l_i, acc = _attend(q1r, q2r, qj, k1, k2, cj, sj, v, j, j_ok, row_ok, delta, m_i, l_i,
                                        acc, BLOCK_N, HALF, ONE_DOT)  # fmt: skip
                j, j_ok, page = jn, jn_ok, page_n
                if MODE == 2:
                    k1, k2, cj, sj, v = k1n, k2n, cjn, sjn, vn

        seen = l_i > 0
        out = tl.where(seen[:, None], acc / tl.where(seen, l_i, 1.0)[:, None], 0.0)
        lse2 = m_i + tl.log2(tl.where(seen, l_i, 1.0))
        lse = tl.where(seen, lse2 * 0.6931471805599453, float("-inf"))
        o_ptrs = o_ptr + pair.to(tl.int64)[:, None] * stride_op + head[:, None] * stride_oh + dh[None, :]
        tl.store(o_ptrs, out, mask=row_ok[:, None])
        tl.store(lse_ptr + pair.to(tl.int64) * stride_lp + head, lse, mask=row_ok)


def variant(q, kv, positions, meta, rope: RopeCache, sm_scale: float, mode: int, num_stages: int,
            one_dot: bool = False, block_n: int = 64, num_warps: int = 4,
            handle: list | None = None):  # fmt: skip
    """(o, lse) as the kernel's; handle: gets the compiled kernel appended (registers, spills)."""
    from lazyrt.kernels.triton_attention import _rope_rows
    from lazyrt.kernels.triton_shared_chunk import MIN_DOT, _pow2, persistent_programs

    _, _, page_size, kv_heads, head_dim = kv.shape
    group = q.shape[1] // kv_heads
    o = torch.empty(meta.num_pairs, q.shape[1], head_dim, dtype=torch.float32, device=q.device)
    lse = torch.empty(meta.num_pairs, q.shape[1], dtype=torch.float32, device=q.device)
    kcos, ksin = _rope_rows(rope, kv.dtype, same_dtype=True)
    programs = min(persistent_programs(q.device), meta.num_work_host * kv_heads)
    h = _variant_kernel[(programs,)](
        q, kv, positions, rope.cos, rope.sin, kcos, ksin,
        meta.chunk_kv_indptr, meta.chunk_kv_indices, meta.chunk_len, meta.pair_indptr, meta.pair_row,
        meta.pair_start, meta.work_chunk, meta.work_pair, meta.num_work, o, lse,
        sm_scale * _LOG2E,
        q.stride(0), q.stride(1), kv.stride(0), kv.stride(1), kv.stride(2), kv.stride(3), rope.cos.stride(0),
        kcos.stride(0), o.stride(0), o.stride(1), lse.stride(0),
        KV_HEADS=kv_heads, GROUP=group, BLOCK_P=meta.block_pairs,
        ROWS=max(MIN_DOT, _pow2(meta.block_pairs * group)), BLOCK_N=block_n, PAGE_SIZE=page_size,
        HALF=head_dim // 2, HEAD=head_dim, MODE=mode, ONE_DOT=one_dot, num_warps=num_warps,
        num_stages=num_stages,
    )  # fmt: skip
    if handle is not None:
        handle.append(h)
    return o, lse


def main() -> None:
    import triton.testing

    from lazyrt.kernels.triton_shared_chunk import (
        PROGRAMS_PER_SM,
        persistent_programs,
        shared_chunk_attention_triton,
    )

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    ap.add_argument("--variants", nargs="*", default=None, help="labels to time (default: all)")
    ap.add_argument("--kernel-stages", type=int, nargs="*", default=[],
                    help="also time the kernel itself at these pipeline stages")  # fmt: skip
    ap.add_argument("--kernel-maxnreg", type=int, nargs="*", default=[],
                    help="also time the kernel with its registers a thread capped")  # fmt: skip
    ap.add_argument("--kernel-programs-per-sm", type=int, nargs="*", default=[],
                    help="also time the kernel with this persistent grid (programs an SM)")  # fmt: skip
    args = ap.parse_args()
    cfg = ModelConfig.from_hf(PRESETS["llama-3.1-8b"])
    rope = RopeCache.build(cfg, 5 * 2048 + 129, "cuda")
    scale = 128**-0.5

    def bench(fn) -> float:
        fn()
        return triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median") * 1000.0

    shapes = {"lone question": (1, 16), "decode 16": (16, 1), "decode 64": (64, 1), "questions 4": (4, 16)}
    rows = []
    for name, (B, q_len) in shapes.items():
        a = argparse.Namespace(docs=5, doc_tokens=2048, private=128 if q_len == 1 else q_len,
                               pool=100, alpha=2.1, q_len=q_len, piece_tokens=None, seed=0)  # fmt: skip
        kv, full, shared, _ = build_step(B, a, random.Random(0), "cuda")
        q = torch.randn(B * q_len, 32, 128, device="cuda", dtype=torch.bfloat16)
        base = functools.partial(shared_chunk_attention_triton, q, kv, full.positions, shared, rope, scale)
        o_ref, _ = base()
        # kernel_us: launch_settings' choice; kernel_s{N}: N stages, no register cap
        row = {"shape": name, "kernel_us": round(bench(base), 1)}
        for st in args.kernel_stages:
            row[f"kernel_s{st}_us"] = round(bench(functools.partial(base, num_stages=st, maxnreg=0)), 1)
        sms = persistent_programs(q.device) // PROGRAMS_PER_SM
        for per_sm in [None, *args.kernel_programs_per_sm]:
            # (shared memory also bounds the programs an SM: fewer stages leave room for more)
            for cap, st in itertools.product(args.kernel_maxnreg, [None, *args.kernel_stages]):
                kw = {"num_stages": st or 2}
                fn = functools.partial(base, maxnreg=cap, programs=sms * per_sm if per_sm else None, **kw)
                label = f"kernel_maxnreg{cap}_p{per_sm or PROGRAMS_PER_SM}" + (f"_s{st}" if st else "")
                try:
                    row[f"{label}_us"] = round(bench(fn), 1)
                except Exception as e:  # noqa: BLE001 (out of registers / shared memory)
                    print(f"{name} {label}: {type(e).__name__}: {str(e)[:160]}")
            if per_sm:
                fn = functools.partial(base, programs=sms * per_sm)
                row[f"kernel_p{per_sm}_us"] = round(bench(fn), 1)
        for label, mode, stages, one_dot in VARIANTS:
            if args.variants is not None and label not in args.variants:
                continue
            fn = functools.partial(variant, q, kv, full.positions, shared, rope, scale, mode, stages, one_dot)
            try:
                handle: list = []
                o, _ = fn(handle=handle)
                row[f"{label}_us"] = round(bench(fn), 1)
                row[f"{label}_rel_diff"] = float((o - o_ref).norm() / o_ref.norm())
                row[f"{label}_regs_spills"] = [getattr(handle[0], k, None) for k in ("n_regs", "n_spills")]
                # Pipelined loads show as async copies into shared memory in the TTGIR.
                ttgir = handle[0].asm.get("ttgir", "")
                row[f"{label}_async_copies"] = ttgir.count("async_copy_global_to_local")
            except Exception as e:  # noqa: BLE001 (out of registers / shared memory)
                print(f"{name} {label}: {type(e).__name__}: {str(e)[:160]}")
        rows.append(row)
        print(json.dumps(row), flush=True)
        del kv
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
