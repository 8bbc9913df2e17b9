"""Triton shared-chunk attention (contract and math: shared_chunk.py, reference
`shared_chunk_attention_ref`).

A persistent grid walks the work items (segment, block of BLOCK_P of its pairs) x kv heads
round-robin (the live count is a device scalar, so a CUDA graph replays one launch for any step of
its bucket). An item's ROWS query rows are its pairs x the GQA group of its kv head; it rotates
each row back by its pair's start (fp32, from the fp32 RoPE table:
R(-S) = cos S, -sin S), then walks the segment's keys BLOCK_N at a time: each key tile is loaded and
rotated by its local index j once for all rows, masked by `j < len` and `j <= position - start`,
under an exp2 online softmax in fp32. Writes fp32 partial outputs and natural log-sum-exp per
(pair, head); `merge_parts_triton` combines each query row's parts (torch reference:
shared_chunk.merge_parts_ref): a program per (row, head) over blocks of parts for steps of few rows,
a program per (row, block of heads) looping over parts otherwise. Tiles, grid and merges are the
fastest of the sweeps noted beside them (docs/kernels.md has the tables).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lazyrt.kernels.rope import RopeCache
from lazyrt.kernels.shared_chunk import SharedChunkMeta
from lazyrt.kernels.triton_attention import _rope_rows
from lazyrt.kernels.waves import device_sms, within_one_wave

MIN_DOT = 16  # tl.dot needs every dim >= 16: small head halves / row blocks are zero-padded to it
_LOG2E = 1.4426950408889634


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


@triton.jit
def _tile_load(ptr, rows_ok, cols_ok, WHOLE: tl.constexpr):
    """A [rows, cols] tile; WHOLE: every element is in bounds (no mask: plain vector loads)."""
    if WHOLE:
        x = tl.load(ptr)
    else:
        x = tl.load(ptr, mask=rows_ok[:, None] & cols_ok[None, :], other=0.0)
    return x


@triton.jit
def _key_tile(
    q1r, q2r, q3, kv_ptr, kcos_ptr, ksin_ptr, chunk_kv_indices_ptr, e_lo, n, blk, kvh, row_ok, delta,
    m_i, l_i, acc, stride_kp, stride_kkv, stride_ks, stride_kh, stride_kcos,
    FULL: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, HALF: tl.constexpr,
    HALF_P: tl.constexpr, REST: tl.constexpr, REST_P: tl.constexpr, HEAD: tl.constexpr, HEAD_P: tl.constexpr,
    DOT_PREC: tl.constexpr, KEY_MATH_KV: tl.constexpr,
):
    """Key tile blk (keys j of the segment; FULL: all j < n) into the rows' online softmax: its page
    ids, keys turned by j, scores, the causal mask (j <= delta), values."""
    dt = kv_ptr.dtype.element_ty
    j = blk * BLOCK_N + tl.arange(0, BLOCK_N)
    j_ok = j < n
    if FULL:
        page = tl.load(chunk_kv_indices_ptr + e_lo + j // PAGE_SIZE)
    else:
        page = tl.load(chunk_kv_indices_ptr + e_lo + j // PAGE_SIZE, mask=j_ok, other=0)
    ch = tl.arange(0, HALF_P)
    ch_ok = ch < HALF
    dh = tl.arange(0, HEAD_P)
    k_off = page.to(tl.int64) * stride_kp + (j % PAGE_SIZE) * stride_ks + kvh * stride_kh
    k_ptr = kv_ptr + k_off[:, None] + ch[None, :]
    j_off = j[:, None] * stride_kcos + ch[None, :]
    whole_k = FULL and HALF == HALF_P
    k1 = _tile_load(k_ptr, j_ok, ch_ok, whole_k)
    k2 = _tile_load(k_ptr + HALF, j_ok, ch_ok, whole_k)
    # the values' load issued with the keys', so that at 1 stage its latency overlaps the scores and
    # the softmax (H200, saved steps: -4..-6% a layer; docs/kernels.md)
    v_ptr = kv_ptr + (k_off + stride_kkv)[:, None] + dh[None, :]
    v = _tile_load(v_ptr, j_ok, dh < HEAD, FULL and HEAD == HEAD_P)
    cj = _tile_load(kcos_ptr + j_off, j_ok, ch_ok, whole_k)
    sj = _tile_load(ksin_ptr + j_off, j_ok, ch_ok, whole_k)
    if not KEY_MATH_KV:  # else the table is in the KV dtype: packed 16-bit math
        k1 = k1.to(tl.float32)
        k2 = k2.to(tl.float32)
        cj = cj.to(tl.float32)
        sj = sj.to(tl.float32)
    k1r = (k1 * cj - k2 * sj).to(dt)
    k2r = (k2 * cj + k1 * sj).to(dt)
    s = tl.dot(q1r, tl.trans(k1r), input_precision=DOT_PREC)
    s = tl.dot(q2r, tl.trans(k2r), s, input_precision=DOT_PREC)
    if REST > 0:
        cr = tl.arange(0, REST_P)
        k3_ptr = kv_ptr + k_off[:, None] + 2 * HALF + cr[None, :]
        k3 = _tile_load(k3_ptr, j_ok, cr < REST, FULL and REST == REST_P)
        s = tl.dot(q3, tl.trans(k3), s, input_precision=DOT_PREC)
    if FULL:
        visible = row_ok[:, None] & (j[None, :] <= delta[:, None])
    else:
        visible = row_ok[:, None] & j_ok[None, :] & (j[None, :] <= delta[:, None])
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = tl.dot(p.to(dt), v, acc * alpha[:, None], input_precision=DOT_PREC)
    return m_new, l_i, acc


@triton.jit
def _shared_chunk_kernel(
    q_ptr, kv_ptr, pos_ptr, cos_ptr, sin_ptr, kcos_ptr, ksin_ptr,
    chunk_kv_indptr_ptr, chunk_kv_indices_ptr, chunk_len_ptr, pair_indptr_ptr, pair_row_ptr, pair_start_ptr,
    work_chunk_ptr, work_pair_ptr, num_work_ptr,
    o_ptr, lse_ptr,
    qk_scale,
    stride_qt, stride_qh, stride_kp, stride_kkv, stride_ks, stride_kh, stride_cos, stride_kcos,
    stride_op, stride_oh, stride_lp,
    KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr, BLOCK_P: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr, HALF: tl.constexpr, HALF_P: tl.constexpr, REST: tl.constexpr,
    REST_P: tl.constexpr, HEAD: tl.constexpr, HEAD_P: tl.constexpr, DOT_PREC: tl.constexpr,
    KEY_MATH_KV: tl.constexpr,
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
        delta = tl.load(pos_ptr + qrow, mask=row_ok, other=0) - start  # keys j <= delta are visible

        # Queries rotated back by their pair's start, softmax scale and log2(e) folded in.
        ch = tl.arange(0, HALF_P)
        ch_ok = ch < HALF
        qm = row_ok[:, None] & ch_ok[None, :]
        q_base = q_ptr + qrow.to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh
        q1 = tl.load(q_base + ch[None, :], mask=qm, other=0.0).to(tl.float32)
        q2 = tl.load(q_base + HALF + ch[None, :], mask=qm, other=0.0).to(tl.float32)
        c_off = start[:, None] * stride_cos + ch[None, :]
        cs = tl.load(cos_ptr + c_off, mask=qm, other=0.0)
        sn = tl.load(sin_ptr + c_off, mask=qm, other=0.0)
        q1r = ((q1 * cs + q2 * sn) * qk_scale).to(dt)
        q2r = ((q2 * cs - q1 * sn) * qk_scale).to(dt)
        if REST > 0:
            cr = tl.arange(0, REST_P)
            q3m = row_ok[:, None] & (cr < REST)[None, :]
            q3 = tl.load(q_base + 2 * HALF + cr[None, :], mask=q3m, other=0.0)
            q3 = (q3.to(tl.float32) * qk_scale).to(dt)

        e_lo = tl.load(chunk_kv_indptr_ptr + c)
        n = tl.load(chunk_len_ptr + c)
        dh = tl.arange(0, HEAD_P)
        m_i = tl.full([ROWS], float("-inf"), tl.float32)
        l_i = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, HEAD_P], tl.float32)
        if REST == 0:
            q3 = q1r  # unused
        # Whole tiles with unmasked loads (where the head needs no padding), then the partial last one.
        for blk in range(0, n // BLOCK_N):
            m_i, l_i, acc = _key_tile(
                q1r, q2r, q3, kv_ptr, kcos_ptr, ksin_ptr, chunk_kv_indices_ptr, e_lo, n, blk, kvh, row_ok,
                delta, m_i, l_i, acc, stride_kp, stride_kkv, stride_ks, stride_kh, stride_kcos,
                True, BLOCK_N, PAGE_SIZE, HALF, HALF_P, REST, REST_P, HEAD, HEAD_P, DOT_PREC, KEY_MATH_KV,
            )  # fmt: skip
        if n % BLOCK_N:
            m_i, l_i, acc = _key_tile(
                q1r, q2r, q3, kv_ptr, kcos_ptr, ksin_ptr, chunk_kv_indices_ptr, e_lo, n, n // BLOCK_N, kvh,
                row_ok, delta, m_i, l_i, acc, stride_kp, stride_kkv, stride_ks, stride_kh, stride_kcos,
                False, BLOCK_N, PAGE_SIZE, HALF, HALF_P, REST, REST_P, HEAD, HEAD_P, DOT_PREC, KEY_MATH_KV,
            )  # fmt: skip

        seen = l_i > 0
        out = tl.where(seen[:, None], acc / tl.where(seen, l_i, 1.0)[:, None], 0.0)
        lse2 = m_i + tl.log2(tl.where(seen, l_i, 1.0))  # log2-sum-exp
        lse = tl.where(seen, lse2 * 0.6931471805599453, float("-inf"))  # natural: x ln 2
        o_ptrs = o_ptr + pair.to(tl.int64)[:, None] * stride_op + head[:, None] * stride_oh + dh[None, :]
        tl.store(o_ptrs, out, mask=row_ok[:, None] & (dh < HEAD)[None, :])
        tl.store(lse_ptr + pair.to(tl.int64) * stride_lp + head, lse, mask=row_ok)


# Tiles and grid from `shared_chunk_bench.py --sweep` (H200, Llama-3.1-8B heads, Zipf 2.1 steps at
# batch 16 and 64): 64-key blocks, 8 programs per SM, 16 pairs (64 rows) per item. Since whole tiles
# load unmasked, 2 stages beat 3 (H100, one layer, `experiments/shared_kernel_variants.py
# --kernel-stages 2`, in git at b8311eb, 2026-11-27): a lone question 30.8 vs 31.2 us, decode at
# batch 16 82.9 vs 86.5, at batch 64 153.7 vs 156.8, 4 questions 79.0 vs 80.8 (the masked loop at 3
# stages: 32.8 / 85.8 / 162.2 / 84.2).
PROGRAMS_PER_SM = 8  # persistent grid: programs per SM
# At the compiler's 255 registers a thread two programs fit an SM (waves.WAVE_PROGRAMS_PER_SM). A
# launch of more items than that wave runs at 168 registers and 1 stage (three programs an SM, a few
# spills): H100, one layer (`shared_kernel_variants.py --kernel-maxnreg 168 --kernel-stages 1`,
# 4390f1d, 2026-11-27), decode at batch 16 83.0 -> 81.0 us, batch 64 153.8 -> 146.4, 4 questions
# 79.4 -> 74.2; a lone question (168 items, one wave) 30.8 -> 33.7, so a launch within one wave keeps
# 255 registers (and kept 2 stages until the values' early load, below). 128 registers spill too
# much (b64 231.8 us); 168 at 2 stages 169.1.
# Re-checked on an H200 (2026-11-29, `shared_kernel_ablation.py --variants "as is" --settings ...`,
# saved steps): batch 64 192.4 us at 1:168 against 219.7 at 2:168, 202.5 uncapped at 2 stages, 215.7+
# at 128; batch 16 (one wave, uncapped) 61.4 against 69.9 at 1:168.
# The wave counts items in the longest one's keys (shared_chunk.wave_items: short items, own runs and
# documents' tails, hardly count): engine decode steps replayed alone (H200, one layer, us uncapped /
# capped, `experiments/step_replay.py`, 2026-11-28; wave items x kv heads an SM): 8 kv heads at batch
# 16 61.4 / 70.7 (2.0; 3.9 counted by number); a TP=2 rank's 4 at batch 8 33.9 / 37.0
# (1.6), at 16 52.9 / 61.1 (1,024-token pieces, 1.1) but 53.2 / 41.8 at 512 (2.2); 8 at batch 64
# 201.4 / 192.2 (6.4).
# Since the value tile loads beside the key tile, 1 stage is fastest for every launch (H200,
# 2026-11-29, `shared_kernel_ablation.py --variants "as is" "early V load" --settings 1:168 2:0 1:0
# 2:168`, saved steps, us a layer, as is at its settings -> the early load at 1 stage): batch 64
# 191.4 -> 179.3 (at 168 registers; 194.0 at 2 stages uncapped), batch 16 61.2 -> 58.3 (uncapped; 60.0
# at 2 stages), a lone question 32.4 -> 30.9, a TP=2 rank's batch 16 52.7 -> 50.5.
MANY_ITEMS_MAXNREG = 168
MANY_ITEMS_STAGES = 1
FEW_ITEMS_STAGES = 1


def launch_settings(items: int, device: torch.device) -> tuple[int, int]:
    """(num_stages, maxnreg; 0 = no cap) for a launch of `items` (shared_chunk.wave_items x kv heads,
    as within_one_wave; a CUDA graph captures each setting and the step's count picks the replay)."""
    if within_one_wave(items, device):
        return FEW_ITEMS_STAGES, 0
    return MANY_ITEMS_STAGES, MANY_ITEMS_MAXNREG
# The keys' cos/sin (see shared_chunk_attention_triton). H100, Llama-3.1-8B heads, Zipf 2.1 decode
# step at batch 64, one layer (`shared_chunk_bench.py --variants`, 1e3e9f1, 2026-11-23): fp32 tables
# 221.2 us, "half" 181.5, "kv" 168.0, no RoPE at all 161.2 (batch 16: 113.7 / 93.8 / 86.2 / 82.8).
# "kv" moves the output by 0.29% (relative norm) from the fp32 tables, inside bf16's own error
# against an fp32 reference (0.45%): the default.
KEY_TABLES = "kv"


def persistent_programs(device: torch.device) -> int:
    """Programs of a persistent launch: one full wave (a fixed number, so CUDA graphs capture it)."""
    return device_sms(device) * PROGRAMS_PER_SM


def shared_chunk_attention_triton(
    q: torch.Tensor,
    kv: torch.Tensor,
    positions: torch.Tensor,
    meta: SharedChunkMeta,
    rope: RopeCache,
    sm_scale: float,
    block_n: int = 64,
    programs: int | None = None,
    num_warps: int = 4,
    num_stages: int | None = None,
    key_tables: str = KEY_TABLES,
    maxnreg: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as shared_chunk.shared_chunk_attention_ref: (o [P, q_heads, D] fp32, natural
    lse [P, q_heads] fp32). programs: the persistent grid (default: min(one wave, live items); pass
    the wave, persistent_programs(), when capturing a CUDA graph). key_tables: the cos/sin the keys
    turn by: "fp32" (RopeCache's, fp32 math), "half" (one fp16 [pos, cos|sin] table for 16-bit KV,
    fp32 math: what the per-request kernel reads) or "kv" (the table in the KV dtype, the keys turned
    in packed 16-bit math). Queries always turn in fp32. num_stages, maxnreg (a cap on registers a
    thread: more programs an SM, at the cost of spills; 0: none, the compiler's 255 on an H100): None
    takes launch_settings' choice for the launch's items."""
    if key_tables not in ("fp32", "half", "kv"):
        raise ValueError(f"key_tables={key_tables!r}: must be 'fp32', 'half' or 'kv'")
    num_pages, _, page_size, kv_heads, head_dim = kv.shape
    group = q.shape[1] // kv_heads
    if q.shape[1] != group * kv_heads or q.shape[2] != head_dim:
        raise ValueError(f"q {tuple(q.shape)} does not match kv heads {kv_heads} x head_dim {head_dim}")
    P = meta.num_pairs
    o = torch.empty(P, q.shape[1], head_dim, dtype=torch.float32, device=q.device)
    lse = torch.empty(P, q.shape[1], dtype=torch.float32, device=q.device)
    if programs is None:
        programs = min(persistent_programs(q.device), meta.num_work_host * kv_heads)
    if num_stages is None or maxnreg is None:
        wave = meta.num_work_host if meta.wave_items_host is None else meta.wave_items_host
        auto_stages, auto_nreg = launch_settings(wave * kv_heads, q.device)
        num_stages = auto_stages if num_stages is None else num_stages
        maxnreg = auto_nreg if maxnreg is None else maxnreg
    if P == 0 or programs == 0:
        return o, lse
    half = rope.rotary_dim // 2
    rest = head_dim - 2 * half
    block_pairs = meta.block_pairs
    rows = max(MIN_DOT, _pow2(block_pairs * group))
    kcos, ksin = rope.cos, rope.sin
    key_math_kv = key_tables == "kv" and kv.dtype in (torch.float16, torch.bfloat16)
    if key_tables != "fp32" and half > 0:
        kcos, ksin = _rope_rows(rope, kv.dtype, same_dtype=key_math_kv)
    _shared_chunk_kernel[(programs,)](
        q, kv, positions, rope.cos, rope.sin, kcos, ksin,
        meta.chunk_kv_indptr, meta.chunk_kv_indices, meta.chunk_len, meta.pair_indptr, meta.pair_row,
        meta.pair_start, meta.work_chunk, meta.work_pair, meta.num_work, o, lse,
        sm_scale * _LOG2E,
        q.stride(0), q.stride(1), kv.stride(0), kv.stride(1), kv.stride(2), kv.stride(3), rope.cos.stride(0),
        kcos.stride(0),
        o.stride(0), o.stride(1), lse.stride(0),
        KV_HEADS=kv_heads,
        GROUP=group, BLOCK_P=block_pairs, ROWS=rows, BLOCK_N=max(MIN_DOT, block_n), PAGE_SIZE=page_size,
        HALF=half, HALF_P=max(MIN_DOT, _pow2(half)), REST=rest, REST_P=max(MIN_DOT, _pow2(max(rest, 1))),
        HEAD=head_dim, HEAD_P=max(MIN_DOT, _pow2(head_dim)),
        DOT_PREC="ieee" if kv.dtype == torch.float32 else "tf32", KEY_MATH_KV=key_math_kv,
        num_warps=num_warps, num_stages=num_stages, **({"maxnreg": maxnreg} if maxnreg else {}),
    )  # fmt: skip
    return o, lse


@triton.jit
def _merge_parts_kernel(
    o_parts_ptr, lse_parts_ptr, row_part_indptr_ptr, row_parts_ptr, out_ptr,
    stride_pp, stride_ph, stride_lp, stride_ot, stride_oh,
    HEADS: tl.constexpr, HEADS_P: tl.constexpr, HEAD: tl.constexpr, HEAD_P: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1) * HEADS_P + tl.arange(0, HEADS_P)
    d = tl.arange(0, HEAD_P)
    h_ok = h < HEADS
    hd_ok = h_ok[:, None] & (d < HEAD)[None, :]
    lo = tl.load(row_part_indptr_ptr + t)
    hi = tl.load(row_part_indptr_ptr + t + 1)
    m = tl.full([HEADS_P], float("-inf"), tl.float32)
    den = tl.zeros([HEADS_P], tl.float32)
    acc = tl.zeros([HEADS_P, HEAD_P], tl.float32)
    for i in range(lo, hi):
        p = tl.load(row_parts_ptr + i).to(tl.int64)
        lse = tl.load(lse_parts_ptr + p * stride_lp + h, mask=h_ok, other=float("-inf"))
        o = tl.load(o_parts_ptr + p * stride_pp + h[:, None] * stride_ph + d[None, :], mask=hd_ok, other=0.0)
        m_new = tl.maximum(m, lse)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing seen yet: weights stay 0
        a = tl.exp(m - m_safe)
        b = tl.exp(lse - m_safe)
        den = den * a + b
        acc = acc * a[:, None] + o * b[:, None]
        m = m_new
    out = tl.where((den > 0)[:, None], acc / tl.where(den > 0, den, 1.0)[:, None], 0.0)
    tl.store(out_ptr + t * stride_ot + h[:, None] * stride_oh + d[None, :], out, mask=hd_ok)


@triton.jit
def _merge_parts_blocked_kernel(
    o_parts_ptr, lse_parts_ptr, row_part_indptr_ptr, row_parts_ptr, out_ptr,
    stride_pp, stride_ph, stride_lp, stride_ot, stride_oh,
    HEAD: tl.constexpr, HEAD_P: tl.constexpr, PARTS_P: tl.constexpr,
):
    # one program per (query row, head); PARTS_P of the row's parts loaded at once as a
    # [PARTS_P, HEAD_P] tile: a row of many parts (a lone question over small pieces) is a few
    # loads deep instead of one load after another
    t = tl.program_id(0)
    h = tl.program_id(1)
    d = tl.arange(0, HEAD_P)
    d_ok = d < HEAD
    lo = tl.load(row_part_indptr_ptr + t)
    hi = tl.load(row_part_indptr_ptr + t + 1)
    m = tl.full([1], float("-inf"), tl.float32)
    den = tl.zeros([1], tl.float32)
    acc = tl.zeros([HEAD_P], tl.float32)
    for i0 in range(lo, hi, PARTS_P):
        i = i0 + tl.arange(0, PARTS_P)
        ok = i < hi
        p = tl.load(row_parts_ptr + i, mask=ok, other=0).to(tl.int64)
        lse = tl.load(lse_parts_ptr + p * stride_lp + h, mask=ok, other=float("-inf"))
        o = tl.load(o_parts_ptr + p[:, None] * stride_pp + h * stride_ph + d[None, :],
                    mask=ok[:, None] & d_ok[None, :], other=0.0)  # fmt: skip
        m_new = tl.maximum(m, tl.max(lse, axis=0, keep_dims=True))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing seen yet: weights stay 0
        a = tl.exp(m - m_safe)
        b = tl.exp(lse - m_safe)
        den = den * a + tl.sum(b, axis=0, keep_dims=True)
        acc = acc * a + tl.sum(o * b[:, None], axis=0)
        m = m_new
    out = tl.where(den > 0, acc / tl.where(den > 0, den, 1.0), 0.0)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + d, out, mask=d_ok)


def merge_parts_blocked_triton(
    o_parts: torch.Tensor,
    lse_parts: torch.Tensor,
    meta: SharedChunkMeta,
    out_dtype: torch.dtype,
    parts_per_block: int = 16,
) -> torch.Tensor:
    """Same as merge_parts_triton, one program per (query row, head), parts_per_block of the row's
    parts at a time."""
    _, heads, head_dim = o_parts.shape
    out = torch.empty(meta.num_rows, heads, head_dim, dtype=out_dtype, device=o_parts.device)
    if meta.num_rows == 0:
        return out
    _merge_parts_blocked_kernel[(meta.num_rows, heads)](
        o_parts, lse_parts, meta.row_part_indptr, meta.row_parts, out,
        o_parts.stride(0), o_parts.stride(1), lse_parts.stride(0), out.stride(0), out.stride(1),
        HEAD=head_dim, HEAD_P=_pow2(head_dim), PARTS_P=max(2, _pow2(parts_per_block)),
    )  # fmt: skip
    return out


# The merge for a step of at most this many query rows (a lone question, a decode step of up to 16
# requests): a program a (row, head) over 32 of its parts at a time; more rows: 4 heads a program,
# looping over the parts. H100, one layer (experiments/lone_question.py, shared_chunk_bench.py
# --variants, 674888c): a lone 16-token question over 5 x 2,048 tokens in 512-token pieces (21 parts
# a row) 3.9 us blocked vs 9.4 looping; a batch-16 decode step 5.3 (16 parts at a time) vs 9.5; 4
# questions at once (64 rows) 9.9 vs 9.7; a batch-64 decode step 8.7 vs 6.0.
BLOCKED_MERGE_MAX_ROWS = 16


def merge_parts_triton(
    o_parts: torch.Tensor,
    lse_parts: torch.Tensor,
    meta: SharedChunkMeta,
    out_dtype: torch.dtype,
    heads_per_program: int | None = None,
) -> torch.Tensor:
    """Same as shared_chunk.merge_parts_ref, in out_dtype. heads_per_program: one program per query
    row and block of that many heads, looping over the row's parts (a row alone leaves most SMs idle
    in a decode step); None: the measured best for the step's rows (BLOCKED_MERGE_MAX_ROWS). H100,
    Zipf decode steps, us a layer for 1 / 2 / 4 / 8 heads a program (shared_chunk_bench.py --variants,
    2026-11-27): batch 64 9.5 / 6.7 / 4.8 / 5.1, batch 16 7.0 / 7.4 / 7.1 / 7.7; a TP=2 rank's half
    of the heads at batch 64 5.9 / 4.8 / 4.6 / 5.0. (In this layout, loading 8 or 16 of a row's parts
    at once as [parts, heads, head_dim] tiles was 1.5-2x slower than the loop; a program per (row,
    head) over blocks of parts is merge_parts_blocked_triton, the choice for few rows.)"""
    if heads_per_program is None:
        if meta.num_rows <= BLOCKED_MERGE_MAX_ROWS:
            return merge_parts_blocked_triton(o_parts, lse_parts, meta, out_dtype, parts_per_block=32)
        heads_per_program = 4
    _, heads, head_dim = o_parts.shape
    out = torch.empty(meta.num_rows, heads, head_dim, dtype=out_dtype, device=o_parts.device)
    if meta.num_rows == 0:
        return out
    hb = min(_pow2(heads), _pow2(heads_per_program))
    _merge_parts_kernel[(meta.num_rows, triton.cdiv(heads, hb))](
        o_parts, lse_parts, meta.row_part_indptr, meta.row_parts, out,
        o_parts.stride(0), o_parts.stride(1), lse_parts.stride(0), out.stride(0), out.stride(1),
        HEADS=heads, HEADS_P=hb, HEAD=head_dim, HEAD_P=_pow2(head_dim),
    )  # fmt: skip
    return out
