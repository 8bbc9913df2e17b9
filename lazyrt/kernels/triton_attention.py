"""Triton lazy paged attention: keys rotated in-register by their per-request position.

Same contract as `attention_ref.lazy_attention_ref`. One kernel serves decode and extend:

- a program owns ROWS query rows = BLOCK_M new tokens x the GQA group of one kv head, so each K/V
  page is loaded (and rotated) once per group, and a decode row block (1 token x group, padded to 16)
  feeds the tensor cores;
- it walks the page-table entries of its split in blocks of BLOCK_N tokens (several small pages per
  iteration), loads the two rotary halves of K, rotates them by `pos_base + slot` (four FMAs a
  pair; cos/sin gathered per key, or by angle addition per page: below), masks `slot < valid_len`
  and `kv_pos <= q_pos`, and runs an exp2 online softmax in fp32;
- extend/prefill first scans its split's page table: blocks of "clean" entries (full pages whose last
  slot is visible to every query row of the tile) run in a branch-free, unmasked loop that the
  compiler software-pipelines (cp.async for K, V, cos, sin and the page table); the rest run masked;
  entries after the last one any row can see are never visited (causal skip without a branch);
- split-KV (flash-decoding): with few programs for the GPU, the entries of each sequence are cut into
  `num_splits` ranges; each split writes a partial output + log2-sum-exp and `_merge_kernel` combines
  them, launched with programmatic dependent launch on sm_90+ (MERGE_PDL: 24.4 vs 25.0 us at batch 1,
  no change at 4). With one split the kernel writes the output directly (no merge launch).

(Tried on the H100 and removed; git history of docs/benchmarks.md: a merge fused into the split kernel, lazy
rescale: slower; warp specialization of the unmasked loop: no compile on triton 3.6; the page-table
scan for decode: within noise.)

cos/sin come from an fp16 copy of the RopeCache for 16-bit KV (fp32 tables added 13% at batch 64), one
row per key; on small decode grids instead by angle addition from one fp32 row per page entry and the
rows of slots 0..page_size-1 (loaded once per program), with 16-bit rotation math for 16-bit KV.
Measured on an H100 (triton 3.6, CUDA-graph replays, do_bench median), 32/8 heads, d=128, page 16,
bf16, 5 x 2,048 + 128 keys a request, distinct pages per request (benchmarks/kernels.py, session 3):
  lazy decode  b1 / 4 / 16 / 64:               21.8 / 70.5 / 244 / 934 us = 1.18 / 1.04 / 1.04 / 1.04x
  FlashInfer plain decode, same run:           18.5 / 67.5 / 234 / 901 us
  (b1 with fp32 rotation math and a cos/sin gather per key, the earlier default: 23.8-24.7 us; the same
  kernel with rotate_keys=False: 19.7-20.4 us)
  extend, one request: 128 new tokens over 10k keys 232 us; causal 2,048-token chunk 283 us
  (torch SDPA on contiguous, unrotated K/V: 124 / 86 us: extend has headroom, decode was the goal).
  prefill of the 128-token question, b1 / 4 / 16 / 64: 111 / 341 / 1197 / 4701 us = 0.78 / 1.94 /
  1.69 / 1.49x FlashInfer paged prefill without RoPE (was 146 / 492 / 1940 / 7715 us when the K/V
  loads sat under a causal-skip branch and were not pipelined). benchmarks/experiments/sweep_kernels.py.
Host cost of one eager call is ~110 us (Triton's Python launch path): capture decode in CUDA graphs.

Tunables (swept on that H100; retune per GPU):
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

try:  # grid dependency control (programmatic dependent launch), sm_90+
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - older Triton
    gdc_launch_dependents = gdc_wait = None

from lazyrt.kernels.metadata import AttentionMetadata
from lazyrt.kernels.rope import RopeCache
from lazyrt.kernels.waves import device_sms

# Decode: one token per sequence. Latency/bandwidth bound, so what matters is keeping one full wave
# of programs resident. Keys per step and resident programs per SM (from registers, d=128, 4 warps):
# 64 keys -> ~186 regs -> 2 programs/SM (fewer, longer steps: best when the grid is small);
# 32 keys -> ~126 regs -> 4 programs/SM (best once batch x kv_heads passes 2 per SM).
DECODE_BLOCK_N_WIDE, DECODE_SLOTS_WIDE = 64, 2
DECODE_BLOCK_N, DECODE_SLOTS = 32, 4
DECODE_WARPS = 4
DECODE_STAGES = 2
# Decode runs every key block masked (SCAN=0): the extend page-table scan was within noise for it.
# Key rotation angles (decode / extend). 0: gather a cos/sin row per key at pos_base + slot (fp16
# tables). 1: angle addition, cos/sin(pos_base + slot) = combination of one fp32 row per page entry
# (pos_base) and the rows of slots 0..PAGE_SIZE-1, which are loaded once per program (hoisted out of
# the key loop) when key blocks hold whole pages: ~PAGE_SIZE x less table traffic for 4 more FMAs a
# pair. 2: as 1 but the slot rows are re-read every block (the only form when a page spans several
# key blocks). Needs a power-of-two page size that divides or is a multiple of the key block; other
# shapes use the gather. ROT_LOWP: 1 = rotate 16-bit keys in packed 16-bit math, 2 = the angle
# combination too (gather: same as 1); fp32 math for fp32 KV.
# H100, RAG shape, b 1/4/16/64, decode us (2026-11-22; git history of docs/benchmarks.md):
#   gather fp32 23.9 / 71.5 / 244 / 916; gather 16-bit 23.4 / 68.6 / 236 / 899;
#   angle 16-bit (1, 2) 21.1 / 71.3 / 244 / 917; angle fp32 22.4 / 75.4 / 256 / 1272; angle 2: 2-3x
#   slower; no rotation 20.4 / 68.3 / 238 / 880; rel. err vs the fp32 reference 2.8e-3 (fp32 math),
#   3.1e-3 (gather 16-bit), 3.5e-3 (angle 16-bit). Angle addition wins only while the grid is small
#   (few, short splits: latency-bound; at b2 the 16-bit gather is faster, 41.1 vs 42.4 us), so decode
#   uses it up to DECODE_ANGLE_MAX_GRID (batch x kv heads) programs and the 16-bit gather above.
#   Extend: angle addition 5-40% slower at every batch (more live registers: spills), 16-bit math
#   1-3% slower at b >= 4: both off.
DECODE_ROT_LOWP = 2
DECODE_ROT_ANGLE = 1
DECODE_ANGLE_MAX_GRID = 8
EXTEND_ROT_ANGLE = 0
# Extend/prefill: ROWS query rows (tokens x group heads) per program against BLOCK_N keys a step.
# H100 sweep (RAG shape): 128 x 32 keys, 4 warps best for small grids (b <= 4); 256 x 64, 8 warps for
# large ones (b 16 / 64: -10%). Rotating in 16-bit math: -7% for the small tile at b >= 16 but +3% for
# the large one, rel. err 4e-3 vs 2.8e-3: off.
EXTEND_ROWS = 128
EXTEND_BLOCK_N = 32
EXTEND_WARPS = 4
EXTEND_STAGES = 2
EXTEND_SLOTS = 2
# Grids with at least this many 128-row programs per SM use the large tile (rows, keys, warps, stages).
EXTEND_LARGE = (256, 64, 8, 2)
EXTEND_LARGE_MIN_PER_SM = 2
EXTEND_ROT_LOWP = False  # rotate 16-bit keys in their own dtype (packed math) instead of fp32
EXTEND_SCAN = 128  # page-table entries scanned per step to find the unmasked / live key blocks
# Split-KV: as many splits as fill one wave of resident programs (never more: a second, partial wave
# costs more than it spreads), none once the grid alone has a program per SM, and no split shorter
# than MIN_SPLIT_TOKENS keys.
MIN_SPLIT_TOKENS = 256
MAX_SPLITS = 64
# Decode launches of the wide tiles split the keys at least this many ways (fewer only where
# MIN_SPLIT_TOKENS caps them; more where one wave holds more). Decode streams keys: a program per SM
# leaves bandwidth idle and a partial last wave of short programs costs little, so the one-wave rule
# alone (1 split past one program an SM, 2-7 from a quarter) left much of it. H200, one layer,
# kernels.py's RAG pages (10,368 keys), us with the merge, the one-wave pick -> 8 splits
# (`decode_splits.py --batches 9 12 16 17 20 24 32 40 --splits 2 4 8 16`, and 2 3 4 5 8 at 17-32,
# 36f0c55 and after, 2026-11-28): 8 kv heads at 12 sequences (2) 204 -> 142, 16 (2) 216 -> 197, 17
# (1) 391 -> 202, 20 (1) 393 -> 240, 24 (1) 398 -> 270, 32 (1) 412 -> 367; 4 kv heads (a TP=2 rank)
# at 9 (7) 71 -> 67, 12 (5) 93 -> 76, 17 (3) 140 -> 125, 24 (2) 202 -> 142, 32 (2) 214 -> 197.
# No forced count of 2 / 4 / 16 beat 8 by more than 10% at any of them.
DECODE_WIDE_SPLITS = 8
# Extend launches of one to EXTEND_SLOTS programs per SM split by whole waves (extend_num_splits).
MAX_WAVE_SPLITS = 8
WAVE_SPLIT_SLACK = 0.15
HALF_TABLES = True
# Merge of the splits launched with programmatic dependent launch (sm_90+): the split kernel lets it
# launch at once, its programs wait (griddepcontrol.wait) for the split kernel's results, so the merge's
# launch latency overlaps the split kernel instead of following it.
MERGE_PDL = True
MIN_DOT = 16  # tl.dot needs every dim >= 16: small head halves / groups are zero-padded to it

_LOG2E = 1.4426950408889634


@functools.cache
def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _rope_rows(
    rope: RopeCache, kv_dtype: torch.dtype, same_dtype: bool = False, fp32: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin views of one [max_pos, 2, rotary_dim / 2] table (a position's cos and sin share
    cache lines). For 16-bit KV it is fp16: half the table bytes per key, and its 5e-4 rounding is
    far below that of the bf16/fp16 keys it rotates (same_dtype: the KV dtype itself, for rotating
    in packed 16-bit math; fp32: always fp32, for angle addition, which reads a row per page and
    multiplies two rows). Built once per RopeCache, kept on it."""
    half_kv = kv_dtype in (torch.float16, torch.bfloat16)
    dtype = torch.float16 if HALF_TABLES and half_kv else torch.float32
    if same_dtype and half_kv:
        dtype = kv_dtype
    if fp32:
        dtype = torch.float32
    tables = rope.__dict__.setdefault("_triton_tables", {})
    hit = tables.get(dtype)
    if hit is None or hit[0] is not rope.cos or hit[1] is not rope.sin:  # rebuilt if cos/sin replaced
        h = rope.rotary_dim // 2
        table = torch.stack([rope.cos[:, :h], rope.sin[:, :h]], dim=1).to(dtype).contiguous()
        hit = (rope.cos, rope.sin, table)
        tables[dtype] = hit
    return hit[2][:, 0], hit[2][:, 1]


def pick_num_splits(base_programs: int, max_tokens: int, device: torch.device, slots_per_sm: int) -> int:
    """Splits of each sequence's keys: fill one wave of `slots_per_sm` programs per SM (1 when the
    unsplit grid already has a program per SM)."""
    sms = device_sms(device)
    if base_programs >= sms:
        return 1
    by_len = max(1, max_tokens // MIN_SPLIT_TOKENS)
    return max(1, min(sms * slots_per_sm // base_programs, by_len, MAX_SPLITS))


def extend_num_splits(working: int, max_tokens: int, device: torch.device) -> int:
    """Splits of the keys for an extend launch of `working` programs at work. Under a program per SM:
    pick_num_splits' one wave. From one to EXTEND_SLOTS programs per SM (a step of 17-32 sequences,
    e.g. decodes beside a question) most SMs run one long program while they could run two; s splits
    give `working * s` programs of 1/s the keys each, which take ceil(working * s / slots) waves of
    the slots, so the step takes about waves / s of the unsplit time (H200: 136 programs over 10k keys
    each, s = 2 / 3 / 4 / 8 measured 0.84-0.95 / 0.68 / 0.70-0.77 / 0.65-0.69 of it; the model says 1 /
    0.67 / 0.75 / 0.63). The fewest splits within WAVE_SPLIT_SLACK of the best up to
    MAX_WAVE_SPLITS (so 1 unless a split beats it by more than the slack)."""
    sms = device_sms(device)
    if working < sms:
        return pick_num_splits(working, max_tokens, device, EXTEND_SLOTS)
    slots = sms * EXTEND_SLOTS
    if working >= slots:
        return 1
    top = max(1, min(MAX_WAVE_SPLITS, max_tokens // MIN_SPLIT_TOKENS))
    cost = [-(-working * s // slots) / s for s in range(1, top + 1)]  # cost[s - 1]; cost[0] = 1
    limit = min(cost) * (1 + WAVE_SPLIT_SLACK)
    return next(s for s, c in enumerate(cost, 1) if c <= limit)


@functools.cache
def _pdl_cap(device_index: int | None) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def _pdl_ok(device: torch.device) -> bool:
    """Programmatic dependent launch: CUDA sm_90+, a Triton with grid dependency control."""
    return device.type == "cuda" and gdc_wait is not None and _pdl_cap(device.index)


def decode_tiles(base_programs: int, max_tokens: int, device: torch.device) -> tuple[int, int]:
    """(keys per step, splits) for decode. H100, B x 8 kv heads, 10k keys: B <= 32 -> 64 keys/step;
    B = 64 -> 32 keys/step, no split (4 per SM). The wide tiles split one wave's worth of programs
    (pick_num_splits) but at least DECODE_WIDE_SPLITS ways (see it)."""
    sms = device_sms(device)
    if base_programs <= sms * DECODE_SLOTS_WIDE:
        least = max(1, min(DECODE_WIDE_SPLITS, max_tokens // MIN_SPLIT_TOKENS))
        wave = pick_num_splits(base_programs, max_tokens, device, DECODE_SLOTS_WIDE)
        return DECODE_BLOCK_N_WIDE, max(least, wave)
    return DECODE_BLOCK_N, pick_num_splits(base_programs, max_tokens, device, DECODE_SLOTS)


class LaunchConfig(NamedTuple):
    """How lazy_attention_triton launches a step (launch_config): tiles, splits, rotation scheme."""

    decode: bool
    rows: int  # query rows a program (query tokens x GQA group)
    block_m: int  # query tokens a program
    q_blocks: int
    block_n: int  # keys a step of the key loop
    warps: int
    stages: int
    angle: int  # keys rotated by angle addition (0: from the table row of each key's position)
    num_splits: int

    def variants(self) -> set[tuple]:
        """The compiled variants the launch uses (what else it passes are runtime ints): the attention
        kernel's, and the merge's by its power-of-two bucket of splits. A step whose variant was never
        launched in the process waits for Triton to compile it (seconds, the whole engine waits)."""
        split = self.num_splits > 1
        attn = ("attention", self.decode, self.rows, self.block_m, self.block_n, self.warps, self.stages,
                self.angle, split)  # fmt: skip
        return {attn, ("merge", _pow2(self.num_splits))} if split else {attn}


# Splits a warm-up case launches: every power-of-two bucket of the merge (MAX_SPLITS is one).
WARM_UP_SPLITS = tuple(1 << i for i in range(MAX_SPLITS.bit_length()))


def warm_up_cases(num_kv_heads: int, group: int, device: torch.device) -> list[tuple[int, int, int, int]]:
    """(sequences, new tokens a sequence, page-table entries a sequence, splits) of synthetic steps
    that together launch every variant launch_config picks for a model's steps (LaunchConfig.variants,
    splits by its own rule): decode at one sequence (rotation by angle addition), at a few and past the
    wide key tiles' grid; extend at a small and a large grid; each unsplit and, where the grid can
    split, split. The merge's buckets of splits are taken at one sequence."""
    sms = device_sms(device)
    few = DECODE_ANGLE_MAX_GRID // max(1, num_kv_heads) + 1  # past the angle addition
    narrow = sms * DECODE_SLOTS_WIDE // max(1, num_kv_heads) + 1  # past the wide decode tiles
    large = -(-EXTEND_LARGE_MIN_PER_SM * sms // max(1, num_kv_heads))  # sequences of 1-2 query blocks
    cases = []
    for batch, q_len in ((1, 1), (few, 1), (narrow, 1), (1, 2), (large, 2)):
        base = batch * num_kv_heads  # the unsplit grid (one query block a sequence)
        for splits in WARM_UP_SPLITS if batch == 1 else (1, 2):
            if splits == 1 or base < sms:
                cases.append((batch, q_len, max(splits, 2), splits))  # entries: none of the splits capped
    return cases


def warm_up(kv: torch.Tensor, rope: RopeCache | None, num_q_heads: int, rotate: bool,
            sm_scale: float, entry_logits: bool = False) -> int:  # fmt: skip
    """Compile every variant of the attention and merge kernels a step can launch over `kv` (one
    layer's pool: [pages, 2, page_size, kv_heads, head_dim]) by running warm_up_cases' steps over its
    first pages (outputs discarded), so that serving never waits for a compile; with entry_logits each
    step twice, the second with per-entry logit transforms (document attention's variants). Returns
    the steps run."""
    num_pages, _, page_size, num_kv_heads, head_dim = kv.shape
    if rope is not None:  # keep the positions inside the rotary tables
        num_pages = min(num_pages, rope.cos.shape[0] // page_size)
    dev, n = kv.device, 0
    t = lambda x, dt=torch.int32: torch.tensor(x, dtype=dt, device=dev)  # noqa: E731
    for batch, q_len, pages, splits in warm_up_cases(num_kv_heads, num_q_heads // num_kv_heads, dev):
        if pages > num_pages:  # a pool this small never sees a table this long
            continue
        ctx = pages * page_size
        meta = AttentionMetadata(
            qo_indptr=t([i * q_len for i in range(batch + 1)]),
            positions=t([ctx - q_len + j for _ in range(batch) for j in range(q_len)], torch.long),
            kv_indptr=t([i * pages for i in range(batch + 1)]),
            kv_indices=t(list(range(pages)) * batch),
            pos_base=t([e * page_size for e in range(pages)] * batch),
            valid_len=t([page_size] * pages * batch),
            store_pages=t([], torch.long), store_slots=t([], torch.long),
            rotate_keys=rotate, max_q_len=q_len, max_kv_entries=pages,
        )  # fmt: skip
        q = torch.zeros(batch * q_len, num_q_heads, head_dim, dtype=kv.dtype, device=dev)
        lazy_attention_triton(q, kv, meta, rope, sm_scale, num_splits=splits)
        n += 1
        if entry_logits:
            meta.entry_logit_scale = torch.ones(batch * pages, dtype=torch.float32, device=dev)
            meta.entry_log_mass = torch.zeros(batch * pages, dtype=torch.float32, device=dev)
            lazy_attention_triton(q, kv, meta, rope, sm_scale, num_splits=splits)
            n += 1
    return n


def working_q_blocks(batch: int, max_q_len: int, block_m: int, total_tokens: int | None) -> int:
    """Query blocks of a step that hold tokens. The grid gives every sequence the longest one's
    blocks, and a block past its sequence's tokens exits at once, so a mixed step (decodes beside a
    128-token question) has far fewer programs at work than the grid has. Counted from the step's
    tokens on the host: sum of ceil(n_i / block_m) <= (T + batch * (block_m - 1)) // block_m."""
    grid = batch * triton.cdiv(max_q_len, block_m)
    if total_tokens is None:
        return grid
    return max(1, min(grid, (total_tokens + batch * (block_m - 1)) // block_m))


def launch_config(
    batch: int, max_q_len: int, max_kv_entries: int, num_kv_heads: int, group: int, page_size: int,
    rotate: bool, device: torch.device, num_splits: int | None = None, total_tokens: int | None = None,
) -> LaunchConfig:  # fmt: skip
    """The launch of a step of `batch` sequences (host only): the decode path when max_q_len == 1,
    tiles by the programs at work, splits of the keys (num_splits forces them, capped at
    max_kv_entries). total_tokens (the step's query tokens, an upper bound is fine) counts the
    programs at work (working_q_blocks); without it every program of the grid counts."""
    max_tokens = max_kv_entries * page_size
    decode = max_q_len == 1
    if decode:
        rows, block_m, q_blocks, warps, stages = max(MIN_DOT, _pow2(group)), 1, 1, DECODE_WARPS, DECODE_STAGES
        block_n, auto_splits = decode_tiles(batch * num_kv_heads, max_tokens, device)
    else:
        ext_rows, block_n, warps, stages = EXTEND_ROWS, EXTEND_BLOCK_N, EXTEND_WARPS, EXTEND_STAGES
        rows = max(MIN_DOT, ext_rows, _pow2(group))
        working = working_q_blocks(batch, max_q_len, rows // group, total_tokens) * num_kv_heads
        large = working >= EXTEND_LARGE_MIN_PER_SM * device_sms(device)
        if large:
            ext_rows, block_n, warps, stages = EXTEND_LARGE
            rows = max(MIN_DOT, ext_rows, _pow2(group))
        block_m = rows // group
        q_blocks = triton.cdiv(max_q_len, block_m)
        working = working_q_blocks(batch, max_q_len, block_m, total_tokens) * num_kv_heads
        # the large tile (8 warps) is not EXTEND_SLOTS-resident and its grids are compute-bound: one wave
        auto_splits = (pick_num_splits(working, max_tokens, device, EXTEND_SLOTS) if large
                       else extend_num_splits(working, max_tokens, device))  # fmt: skip
    angle = int(DECODE_ROT_ANGLE if decode else EXTEND_ROT_ANGLE) if rotate else 0
    if decode and batch * num_kv_heads > DECODE_ANGLE_MAX_GRID:
        angle = 0
    if page_size & (page_size - 1) or (block_n % page_size and page_size % block_n):
        angle = 0  # angle addition needs key blocks of whole pages or pages of whole blocks
    splits = auto_splits if num_splits is None else num_splits
    splits = max(1, min(int(splits), max(1, max_kv_entries)))
    return LaunchConfig(decode, rows, block_m, q_blocks, block_n, warps, stages, angle, splits)


@triton.jit
def _rotated_halves_angle(
    blk, cs_slot, ss_slot, kv_ptr, kv_indices_ptr, pos_base_ptr, valid_len_ptr, cos_ptr, sin_ptr,
    e_begin, e_lo, e_hi, kvh, stride_kp, stride_ks, stride_kh, stride_cos,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, HALF: tl.constexpr, HALF_P: tl.constexpr,
    MASKED: tl.constexpr, ROT_LOWP: tl.constexpr, NP: tl.constexpr, SP: tl.constexpr, HOIST: tl.constexpr,
):
    """Both rotary halves of a key block, rotated by pos_base + slot with angle addition:
    cos(b + s) = cos b cos s - sin b sin s, sin(b + s) = sin b cos s + cos b sin s, where b's row
    (fp32 table) is gathered once per page entry and s's rows are slots of the same table
    (cs_slot / ss_slot [SP, HALF_P] when HOIST, else read here). The block is handled as NP page parts
    of SP slots each ([NP, SP, HALF_P]) and flattened to [BLOCK_N, HALF_P] for the dot."""
    dt = kv_ptr.dtype.element_ty
    ch = tl.arange(0, HALF_P)
    ch_ok = ch < HALF
    pi = tl.arange(0, NP)
    sj = tl.arange(0, SP)
    g_p = blk * BLOCK_N + pi * SP  # flat index of each part's first key
    ent_p = e_lo + g_p // PAGE_SIZE
    slot3 = (g_p % PAGE_SIZE)[:, None] + sj[None, :]  # [NP, SP]
    if MASKED:
        entp_ok = ent_p < e_hi
        page_p = tl.load(kv_indices_ptr + e_begin + ent_p, mask=entp_ok, other=0)
        base_p = tl.load(pos_base_ptr + e_begin + ent_p, mask=entp_ok, other=0)
        vlen_p = tl.load(valid_len_ptr + e_begin + ent_p, mask=entp_ok, other=0)
        tok3 = entp_ok[:, None] & (slot3 < vlen_p[:, None])
    else:
        page_p = tl.load(kv_indices_ptr + e_begin + ent_p)
        base_p = tl.load(pos_base_ptr + e_begin + ent_p)
        tok3 = slot3 < PAGE_SIZE
    k_off = page_p.to(tl.int64)[:, None] * stride_kp + slot3 * stride_ks + kvh * stride_kh
    kp = kv_ptr + k_off[:, :, None] + ch[None, None, :]
    if MASKED or HALF_P != HALF:
        kmask = tok3[:, :, None] & ch_ok[None, None, :]
        k1 = tl.load(kp, mask=kmask, other=0.0)
        k2 = tl.load(kp + HALF, mask=kmask, other=0.0)
    else:
        k1 = tl.load(kp)
        k2 = tl.load(kp + HALF)
    b_off = base_p[:, None] * stride_cos + ch[None, :]
    if HALF_P != HALF:
        cb = tl.load(cos_ptr + b_off, mask=ch_ok[None, :], other=0.0)
        sb = tl.load(sin_ptr + b_off, mask=ch_ok[None, :], other=0.0)
    else:
        cb = tl.load(cos_ptr + b_off)
        sb = tl.load(sin_ptr + b_off)
    if HOIST:
        cs = cs_slot[None, :, :]
        ss = ss_slot[None, :, :]
    else:
        s_off = slot3[:, :, None] * stride_cos + ch[None, None, :]
        cs = tl.load(cos_ptr + s_off, mask=ch_ok[None, None, :], other=0.0)
        ss = tl.load(sin_ptr + s_off, mask=ch_ok[None, None, :], other=0.0)
        if ROT_LOWP == 2:
            cs = cs.to(dt)
            ss = ss.to(dt)
    if ROT_LOWP == 2:
        cb = cb.to(dt)
        sb = sb.to(dt)
    cb = cb[:, None, :]
    sb = sb[:, None, :]
    cos = cb * cs - sb * ss
    sin = sb * cs + cb * ss
    if ROT_LOWP:
        cos = cos.to(dt)
        sin = sin.to(dt)
        k1r = k1 * cos - k2 * sin
        k2r = k2 * cos + k1 * sin
    else:
        k1f = k1.to(tl.float32)
        k2f = k2.to(tl.float32)
        k1r = (k1f * cos - k2f * sin).to(dt)
        k2r = (k2f * cos + k1f * sin).to(dt)
    return tl.reshape(k1r, (BLOCK_N, HALF_P)), tl.reshape(k2r, (BLOCK_N, HALF_P))


@triton.jit
def _attend_block(
    blk, m_i, l_i, acc, q1, q2, q3, qpos, cs_slot, ss_slot,
    kv_ptr, kv_indices_ptr, pos_base_ptr, valid_len_ptr, cos_ptr, sin_ptr,
    logit_scale_ptr, log_mass_ptr,
    e_begin, e_lo, e_hi, kvh, sm_scale_log2,
    stride_kp, stride_kk, stride_ks, stride_kh, stride_cos,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    HALF: tl.constexpr, HALF_P: tl.constexpr, REST: tl.constexpr, REST_P: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_P: tl.constexpr,
    ROTATE: tl.constexpr, MASKED: tl.constexpr, DOT_PREC: tl.constexpr,
    ROT_LOWP: tl.constexpr, ANGLE: tl.constexpr, NP: tl.constexpr, SP: tl.constexpr, HOIST: tl.constexpr,
    ENTRY_LOGITS: tl.constexpr,
):
    """One key block into the online softmax. MASKED=False: the caller guarantees every key of the
    block is a valid slot of an entry in range and visible to every query row (no load/score masks)."""
    dt = kv_ptr.dtype.element_ty
    offs_n = tl.arange(0, BLOCK_N)
    ch = tl.arange(0, HALF_P)
    ch_ok = ch < HALF
    cd = tl.arange(0, HEAD_P)
    cd_ok = cd < HEAD_DIM
    # Token n of this block: entry e_lo + g // PAGE_SIZE, slot g % PAGE_SIZE (g = flat index), so
    # a block spans several small pages or part of a large one.
    g = blk * BLOCK_N + offs_n
    ent = e_lo + g // PAGE_SIZE
    slot = g % PAGE_SIZE
    if MASKED:
        ent_ok = ent < e_hi
        page = tl.load(kv_indices_ptr + e_begin + ent, mask=ent_ok, other=0)
        vlen = tl.load(valid_len_ptr + e_begin + ent, mask=ent_ok, other=0)
        base = tl.load(pos_base_ptr + e_begin + ent, mask=ent_ok, other=0)
        tok_ok = ent_ok & (slot < vlen)
    else:
        page = tl.load(kv_indices_ptr + e_begin + ent)
        base = tl.load(pos_base_ptr + e_begin + ent)
        tok_ok = offs_n < BLOCK_N
    kpos = base + slot
    k_off = page.to(tl.int64) * stride_kp + slot * stride_ks + kvh * stride_kh
    kmask = tok_ok[:, None] & ch_ok[None, :]
    vmask = tok_ok[:, None] & cd_ok[None, :]
    if ROTATE and ANGLE:
        k1, k2 = _rotated_halves_angle(
            blk, cs_slot, ss_slot, kv_ptr, kv_indices_ptr, pos_base_ptr, valid_len_ptr, cos_ptr, sin_ptr,
            e_begin, e_lo, e_hi, kvh, stride_kp, stride_ks, stride_kh, stride_cos,
            PAGE_SIZE, BLOCK_N, HALF, HALF_P, MASKED, ROT_LOWP, NP, SP, HOIST,
        )
    elif MASKED or HALF_P != HALF:
        k1 = tl.load(kv_ptr + k_off[:, None] + ch[None, :], mask=kmask, other=0.0)
        k2 = tl.load(kv_ptr + k_off[:, None] + HALF + ch[None, :], mask=kmask, other=0.0)
    else:
        k1 = tl.load(kv_ptr + k_off[:, None] + ch[None, :])
        k2 = tl.load(kv_ptr + k_off[:, None] + HALF + ch[None, :])
    # V issued with K: both in flight at once (decode is latency/bandwidth bound)
    if MASKED or HEAD_P != HEAD_DIM:
        v = tl.load(kv_ptr + stride_kk + k_off[:, None] + cd[None, :], mask=vmask, other=0.0)
    else:
        v = tl.load(kv_ptr + stride_kk + k_off[:, None] + cd[None, :])
    if ROTATE and not ANGLE:
        # (k1, k2) -> (k1 cos - k2 sin, k2 cos + k1 sin); the cache's halves are equal.
        c_off = kpos[:, None] * stride_cos + ch[None, :]
        if ROT_LOWP:
            # 16-bit KV with tables in its dtype: packed 16-bit math (half the instructions)
            cos = tl.load(cos_ptr + c_off, mask=kmask, other=0.0)
            sin = tl.load(sin_ptr + c_off, mask=kmask, other=0.0)
            k1r = k1 * cos - k2 * sin
            k2 = k2 * cos + k1 * sin
            k1 = k1r
        else:
            cos = tl.load(cos_ptr + c_off, mask=kmask, other=0.0).to(tl.float32)
            sin = tl.load(sin_ptr + c_off, mask=kmask, other=0.0).to(tl.float32)
            k1f = k1.to(tl.float32)
            k2f = k2.to(tl.float32)
            k1 = (k1f * cos - k2f * sin).to(dt)
            k2 = (k2f * cos + k1f * sin).to(dt)
    s = tl.dot(q1, tl.trans(k1), input_precision=DOT_PREC)
    s = tl.dot(q2, tl.trans(k2), s, input_precision=DOT_PREC)
    if REST > 0:
        cr = tl.arange(0, REST_P)
        cr_ok = cr < REST
        k3 = tl.load(kv_ptr + k_off[:, None] + 2 * HALF + cr[None, :],
                     mask=tok_ok[:, None] & cr_ok[None, :], other=0.0)
        s = tl.dot(q3, tl.trans(k3), s, input_precision=DOT_PREC)
    if ENTRY_LOGITS:
        # per-entry logit * scale + log_mass, kept in s's unscaled units (the mass divided by sm_scale)
        if MASKED:
            e_scale = tl.load(logit_scale_ptr + e_begin + ent, mask=ent_ok, other=1.0)
            e_mass = tl.load(log_mass_ptr + e_begin + ent, mask=ent_ok, other=0.0)
        else:
            e_scale = tl.load(logit_scale_ptr + e_begin + ent)
            e_mass = tl.load(log_mass_ptr + e_begin + ent)
        s = s * e_scale[None, :] + (e_mass * (1.4426950408889634 / sm_scale_log2))[None, :]
    # s stays unscaled: m_i is in scaled log2 units and p = exp2(s * scale - m) is one FMA + exp2.
    if MASKED:
        visible = tok_ok[None, :] & (kpos[None, :] <= qpos[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1) * sm_scale_log2)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # fully masked rows: no inf - inf
        alpha = tl.math.exp2(m_i - m_use)
        p = tl.math.exp2(s * sm_scale_log2 - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = tl.dot(p.to(dt), v, acc * alpha[:, None], input_precision=DOT_PREC)
    else:
        m_new = tl.maximum(m_i, tl.max(s, axis=1) * sm_scale_log2)
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s * sm_scale_log2 - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = tl.dot(p.to(dt), v, acc * alpha[:, None], input_precision=DOT_PREC)
    return m_new, l_i, acc


# A step's grid sizes are runtime ints, not specializations: Triton would compile another variant
# the first time one is 1 or a multiple of 16, stalling every request in flight for ~2.5 s
# mid-serving on an H100 (benchmarks/experiments/compile_stalls.py).
@triton.jit(do_not_specialize=["q_blocks", "num_splits"])
def _lazy_attn_kernel(
    q_ptr, kv_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    qo_indptr_ptr, positions_ptr, kv_indptr_ptr, kv_indices_ptr, pos_base_ptr, valid_len_ptr,
    cos_ptr, sin_ptr, logit_scale_ptr, log_mass_ptr,
    sm_scale_log2, q_blocks, num_splits, num_q_heads,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kp, stride_kk, stride_ks, stride_kh, stride_cos,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, ROWS: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, ENTRY_ALIGN: tl.constexpr,
    HALF: tl.constexpr, HALF_P: tl.constexpr, REST: tl.constexpr, REST_P: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_P: tl.constexpr,
    ROTATE: tl.constexpr, SCAN: tl.constexpr, SPLIT: tl.constexpr, DOT_PREC: tl.constexpr,
    ROT_LOWP: tl.constexpr, PDL: tl.constexpr,
    ANGLE: tl.constexpr, NP: tl.constexpr, SP: tl.constexpr, HOIST: tl.constexpr,
    ENTRY_LOGITS: tl.constexpr,
):
    if PDL:
        gdc_launch_dependents()  # the merge may launch now; it waits for this grid's results
    pid0 = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    b = pid0 // q_blocks
    m0 = (pid0 % q_blocks) * BLOCK_M
    q_start = tl.load(qo_indptr_ptr + b)
    q_end = tl.load(qo_indptr_ptr + b + 1)
    if q_start + m0 >= q_end:
        return

    # Query rows: row r is token m0 + r // GROUP, head kvh * GROUP + r % GROUP.
    rows = tl.arange(0, ROWS)
    rm = rows // GROUP
    tok = q_start + m0 + rm
    row_ok = (rm < BLOCK_M) & (tok < q_end)
    head = kvh * GROUP + rows % GROUP
    qpos = tl.load(positions_ptr + tok, mask=row_ok, other=-1)
    q_row = tok.to(tl.int64) * stride_qt + head * stride_qh
    dt = kv_ptr.dtype.element_ty
    ch = tl.arange(0, HALF_P)
    ch_ok = ch < HALF
    qmask = row_ok[:, None] & ch_ok[None, :]
    q1 = tl.load(q_ptr + q_row[:, None] + ch[None, :], mask=qmask, other=0.0).to(dt)
    q2 = tl.load(q_ptr + q_row[:, None] + HALF + ch[None, :], mask=qmask, other=0.0).to(dt)
    if REST > 0:
        cr = tl.arange(0, REST_P)
        cr_ok = cr < REST
        q3 = tl.load(q_ptr + q_row[:, None] + 2 * HALF + cr[None, :], mask=row_ok[:, None] & cr_ok[None, :],
                     other=0.0).to(dt)
    else:
        q3 = q1  # unused
    cd = tl.arange(0, HEAD_P)
    cd_ok = cd < HEAD_DIM
    if ROTATE and ANGLE and HOIST:
        # cos/sin of slots 0..SP-1 (= PAGE_SIZE): every key block starts on a page boundary
        s_off = tl.arange(0, SP)[:, None] * stride_cos + ch[None, :]
        cs_slot = tl.load(cos_ptr + s_off, mask=ch_ok[None, :], other=0.0)
        ss_slot = tl.load(sin_ptr + s_off, mask=ch_ok[None, :], other=0.0)
        if ROT_LOWP == 2:
            cs_slot = cs_slot.to(dt)
            ss_slot = ss_slot.to(dt)
    else:
        cs_slot = q1  # unused
        ss_slot = q1

    # This split's entries [e_lo, e_hi) of the sequence (relative), aligned to whole key blocks.
    e_begin = tl.load(kv_indptr_ptr + b)
    e_count = tl.load(kv_indptr_ptr + b + 1) - e_begin
    if SPLIT:
        per = tl.cdiv(tl.cdiv(e_count, num_splits), ENTRY_ALIGN) * ENTRY_ALIGN
        e_lo = split * per
        e_hi = tl.minimum(e_lo + per, e_count)
    else:
        e_lo = 0
        e_hi = e_count
    n_blocks = tl.cdiv(tl.maximum(e_hi - e_lo, 0) * PAGE_SIZE, BLOCK_N)
    n_clean = 0
    if SCAN > 0:
        # Prefill: scan this split's page table once. Keys of "clean" entries (full page, last slot
        # <= every row's position) need no mask; entries after the last one that any row can see are
        # not visited at all (causal skip). Blocks before the first non-clean entry run unmasked (a
        # branch-free loop the compiler pipelines), the rest masked. Any entry order stays correct.
        qpos_max = tl.max(qpos, axis=0)
        qpos_min = tl.min(tl.where(row_ok, qpos, 2147483647), axis=0)
        first_dirty = e_hi
        last_live = e_lo - 1
        for e0 in range(e_lo, e_hi, SCAN):
            e = e0 + tl.arange(0, SCAN)
            e_ok = e < e_hi
            pb = tl.load(pos_base_ptr + e_begin + e, mask=e_ok, other=0)
            vl = tl.load(valid_len_ptr + e_begin + e, mask=e_ok, other=0)
            dirty = e_ok & ((vl < PAGE_SIZE) | (pb + PAGE_SIZE - 1 > qpos_min))
            first_dirty = tl.minimum(first_dirty, tl.min(tl.where(dirty, e, e_hi), axis=0))
            live = e_ok & (vl > 0) & (pb <= qpos_max)
            last_live = tl.maximum(last_live, tl.max(tl.where(live, e, e_lo - 1), axis=0))
        n_blocks = tl.cdiv((last_live + 1 - e_lo) * PAGE_SIZE, BLOCK_N)
        n_clean = tl.maximum(tl.minimum(((first_dirty - e_lo) * PAGE_SIZE) // BLOCK_N, n_blocks), 0)

    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, HEAD_P], tl.float32)
    for blk in range(0, n_clean):
        m_i, l_i, acc = _attend_block(
            blk, m_i, l_i, acc, q1, q2, q3, qpos, cs_slot, ss_slot,
            kv_ptr, kv_indices_ptr, pos_base_ptr, valid_len_ptr, cos_ptr, sin_ptr,
            logit_scale_ptr, log_mass_ptr,
            e_begin, e_lo, e_hi, kvh, sm_scale_log2,
            stride_kp, stride_kk, stride_ks, stride_kh, stride_cos,
            PAGE_SIZE, BLOCK_N, HALF, HALF_P, REST, REST_P, HEAD_DIM, HEAD_P, ROTATE, False, DOT_PREC,
            ROT_LOWP, ANGLE, NP, SP, HOIST, ENTRY_LOGITS,
        )
    for blk in range(n_clean, n_blocks):
        m_i, l_i, acc = _attend_block(
            blk, m_i, l_i, acc, q1, q2, q3, qpos, cs_slot, ss_slot,
            kv_ptr, kv_indices_ptr, pos_base_ptr, valid_len_ptr, cos_ptr, sin_ptr,
            logit_scale_ptr, log_mass_ptr,
            e_begin, e_lo, e_hi, kvh, sm_scale_log2,
            stride_kp, stride_kk, stride_ks, stride_kh, stride_cos,
            PAGE_SIZE, BLOCK_N, HALF, HALF_P, REST, REST_P, HEAD_DIM, HEAD_P, ROTATE, True, DOT_PREC,
            ROT_LOWP, ANGLE, NP, SP, HOIST, ENTRY_LOGITS,
        )

    l_safe = tl.where(l_i > 0, l_i, 1.0)
    o = acc / l_safe[:, None]
    omask = row_ok[:, None] & cd_ok[None, :]
    if SPLIT:
        idx = (tok.to(tl.int64) * num_q_heads + head) * num_splits + split
        tl.store(part_out_ptr + idx[:, None] * HEAD_P + cd[None, :], o, mask=omask)
        lse = tl.where(l_i > 0, m_i + tl.math.log2(l_safe), float("-inf"))
        tl.store(part_lse_ptr + idx, lse, mask=row_ok)
    else:
        o_row = tok.to(tl.int64) * stride_ot + head * stride_oh
        tl.store(out_ptr + o_row[:, None] + cd[None, :], o.to(out_ptr.dtype.element_ty), mask=omask)


@triton.jit(do_not_specialize=["num_splits"])  # as _lazy_attn_kernel's
def _merge_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, num_splits, num_q_heads, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, HEAD_P: tl.constexpr, SPLIT_P: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:
        gdc_wait()  # launched early (programmatic dependent launch): wait for the split kernel's partials
    t = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, SPLIT_P)
    s_ok = s < num_splits
    base = (t.to(tl.int64) * num_q_heads + h) * num_splits
    lse = tl.load(part_lse_ptr + base + s, mask=s_ok, other=float("-inf"))
    mx = tl.max(lse, axis=0)
    w = tl.math.exp2(lse - tl.where(mx == float("-inf"), 0.0, mx))
    tot = tl.sum(w, axis=0)
    cd = tl.arange(0, HEAD_P)
    cd_ok = cd < HEAD_DIM
    omask = s_ok[:, None] & cd_ok[None, :]
    o = tl.load(part_out_ptr + (base + s)[:, None] * HEAD_P + cd[None, :], mask=omask, other=0.0)
    res = tl.sum(o * w[:, None], axis=0) / tl.where(tot > 0, tot, 1.0)
    tl.store(out_ptr + t.to(tl.int64) * stride_ot + h * stride_oh + cd, res.to(out_ptr.dtype.element_ty),
             mask=cd_ok)


def lazy_attention_triton(
    q: torch.Tensor,
    kv: torch.Tensor,
    meta: AttentionMetadata,
    rope: RopeCache | None,
    sm_scale: float,
    *,
    max_q_len: int | None = None,
    max_kv_entries: int | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Triton version of `lazy_attention_ref`: q [T, q_heads, head_dim] (rotated) over paged K/V.

    max_q_len / max_kv_entries (longest new-token run / page table of a sequence) default to the
    metadata's host-side values, and are computed with a device sync when neither is set. Upper
    bounds are fine (they only size the grid and the splits; a CUDA graph can be captured per
    bucket), and max_q_len == 1 selects the decode path, so it must hold. num_splits forces the
    split-KV count (tests, tuning); by default it is picked from the grid size and context length.
    A query that sees no key gets zeros (the reference gives NaN). meta.entry_logit_scale /
    entry_log_mass (optional) scale and shift each entry's logits, as in the reference.
    """
    T, num_q_heads, head_dim = q.shape
    out = torch.empty((T, num_q_heads, head_dim), dtype=q.dtype, device=q.device)
    B = meta.batch_size
    if T == 0 or B == 0:
        return out
    assert kv.dim() == 5 and kv.shape[1] == 2 and kv.stride(-1) == 1 and q.stride(-1) == 1
    page_size, num_kv_heads = kv.shape[2], kv.shape[3]
    assert kv.shape[4] == head_dim and num_q_heads % num_kv_heads == 0
    group = num_q_heads // num_kv_heads
    max_q_len = max_q_len or meta.max_q_len or None  # host-side maxima from the step plan, if set
    max_kv_entries = max_kv_entries or meta.max_kv_entries or None
    if max_q_len is None:
        max_q_len = T if B == 1 else int((meta.qo_indptr[1:] - meta.qo_indptr[:-1]).max())
    if max_kv_entries is None:
        n_e = meta.kv_indices.numel()
        max_kv_entries = n_e if B == 1 else int((meta.kv_indptr[1:] - meta.kv_indptr[:-1]).max())

    rotate = bool(meta.rotate_keys)
    half_kv = kv.dtype in (torch.float16, torch.bfloat16)
    cfg = launch_config(B, max_q_len, max_kv_entries, num_kv_heads, group, page_size, rotate, q.device,
                        num_splits, total_tokens=T)
    decode, rows, block_m, q_blocks, block_n = cfg.decode, cfg.rows, cfg.block_m, cfg.q_blocks, cfg.block_n
    warps, stages, angle, num_splits = cfg.warps, cfg.stages, cfg.angle, cfg.num_splits
    rot_lowp = int(DECODE_ROT_LOWP if decode else EXTEND_ROT_LOWP) if half_kv else 0
    n_parts, part_slots = max(1, block_n // page_size), min(block_n, page_size)
    if rotate:
        assert rope is not None and rope.rotary_dim % 2 == 0 and rope.rotary_dim <= head_dim
        assert not angle or rope.cos.shape[0] >= page_size
        half = rope.rotary_dim // 2
        cos, sin = _rope_rows(rope, kv.dtype, bool(rot_lowp), fp32=bool(angle))
    else:
        half = head_dim // 2
        cos = sin = q  # unused
    rest = head_dim - 2 * half
    head_p = max(MIN_DOT, _pow2(head_dim))
    split = num_splits > 1
    if split:
        part_out = torch.empty((T, num_q_heads, num_splits, head_p), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((T, num_q_heads, num_splits), dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # unused
    pdl = split and MERGE_PDL and _pdl_ok(q.device)
    entry_align = block_n // page_size if block_n % page_size == 0 else 1
    entry_logits = meta.has_entry_logits
    if entry_logits:
        logit_scale = meta.entry_logit_scale.to(torch.float32).contiguous()
        log_mass = meta.entry_log_mass.to(torch.float32).contiguous()
    else:
        logit_scale = log_mass = meta.pos_base  # unused

    _lazy_attn_kernel[(B * q_blocks, num_kv_heads, num_splits)](
        q, kv, out, part_out, part_lse,
        meta.qo_indptr, meta.positions, meta.kv_indptr, meta.kv_indices, meta.pos_base, meta.valid_len,
        cos, sin, logit_scale, log_mass,
        float(sm_scale) * _LOG2E, q_blocks, num_splits, num_q_heads,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kv.stride(0), kv.stride(1), kv.stride(2), kv.stride(3), cos.stride(0),
        GROUP=group, BLOCK_M=block_m, ROWS=rows,
        PAGE_SIZE=page_size, BLOCK_N=block_n, ENTRY_ALIGN=max(1, entry_align),
        HALF=half, HALF_P=max(MIN_DOT, _pow2(half)),
        REST=rest, REST_P=max(MIN_DOT, _pow2(rest)) if rest else 0,
        HEAD_DIM=head_dim, HEAD_P=head_p,
        ROTATE=rotate, SCAN=0 if decode else EXTEND_SCAN, SPLIT=split, ROT_LOWP=rot_lowp, PDL=pdl,
        ANGLE=bool(angle), NP=n_parts, SP=part_slots, HOIST=angle == 1 and part_slots == page_size,
        DOT_PREC="ieee" if kv.dtype == torch.float32 else "tf32", ENTRY_LOGITS=entry_logits,
        num_warps=warps, num_stages=stages,
    )
    if split:
        _merge_kernel[(T, num_q_heads)](
            part_out, part_lse, out, num_splits, num_q_heads, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, HEAD_P=head_p, SPLIT_P=max(2, _pow2(num_splits)), PDL=pdl, num_warps=4,
            **({"launch_pdl": True} if pdl else {}),
        )
    return out
