"""Triton KV-page kernels: store new K/V into pages, re-rotate stored keys (block mode), apply RoPE.

Same signatures and results as `attention_ref.store_kv_ref`, `attention_ref.rerotate_pages_ref`,
`attention_ref.copy_rerotate_pages_ref` and `rope.apply_rope_ref`. All math in fp32, one rounding to
the output dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lazyrt.kernels.rope import RopeCache

ROPE_BLOCK_ROWS = 32  # rows (slot x head) of one page re-rotated per program


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


@triton.jit
def _store_kv_kernel(
    kv_ptr, k_ptr, v_ptr, pages_ptr, slots_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_p, stride_kv, stride_s, stride_h,
    HEADS: tl.constexpr, HEADS_P: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_P: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.arange(0, HEADS_P)
    d = tl.arange(0, HEAD_P)
    mask = (h < HEADS)[:, None] & (d < HEAD_DIM)[None, :]
    page = tl.load(pages_ptr + t).to(tl.int64)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    dst = kv_ptr + page * stride_p + slot * stride_s + h[:, None] * stride_h + d[None, :]
    k = tl.load(k_ptr + t.to(tl.int64) * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(v_ptr + t.to(tl.int64) * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    tl.store(dst, k.to(kv_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_kv, v.to(kv_ptr.dtype.element_ty), mask=mask)


def store_kv_triton(
    kv: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pages: torch.Tensor, slots: torch.Tensor
) -> None:
    """Write k, v [T, kv_heads, head_dim] into kv [num_pages, 2, page_size, kv_heads, head_dim]."""
    T, heads, head_dim = k.shape
    if T == 0:
        return
    assert kv.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1
    _store_kv_kernel[(T,)](
        kv, k, v, pages, slots,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kv.stride(0), kv.stride(1), kv.stride(2), kv.stride(3),
        HEADS=heads, HEADS_P=_pow2(heads), HEAD_DIM=head_dim, HEAD_P=_pow2(head_dim), num_warps=4,
    )


@triton.jit
def _rope_rows(x1, x2, cos, sin):
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


@triton.jit
def _rerotate_kernel(
    kv_ptr, pages_ptr, cos_ptr, sin_ptr, sin_sign, n_rows, stride_p, stride_row,
    HALF: tl.constexpr, HALF_P: tl.constexpr, BLOCK_R: tl.constexpr,
):
    # Keys of one page are n_rows = page_size * kv_heads rows of stride stride_row (contiguous kv).
    page = tl.load(pages_ptr + tl.program_id(0)).to(tl.int64)
    r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.arange(0, HALF_P)
    mask = (r < n_rows)[:, None] & (c < HALF)[None, :]
    ptr = kv_ptr + page * stride_p + r[:, None].to(tl.int64) * stride_row + c[None, :]
    cos = tl.load(cos_ptr + c, mask=c < HALF, other=0.0)[None, :]
    sin = tl.load(sin_ptr + c, mask=c < HALF, other=0.0)[None, :] * sin_sign
    x1 = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptr + HALF, mask=mask, other=0.0).to(tl.float32)
    y1, y2 = _rope_rows(x1, x2, cos, sin)
    tl.store(ptr, y1.to(kv_ptr.dtype.element_ty), mask=mask)
    tl.store(ptr + HALF, y2.to(kv_ptr.dtype.element_ty), mask=mask)


def rerotate_pages_triton(kv: torch.Tensor, pages: torch.Tensor, delta: int, rope: RopeCache) -> None:
    """Block-mode materialization, in place: rotate the stored keys of `pages` by `delta` more positions.

    `pages` must be distinct (each is rotated in place once). A negative delta rotates backwards
    (the reference would index the cache from its end).
    """
    n = pages.numel()
    if n == 0 or delta == 0:
        return
    page_size, heads, head_dim = kv.shape[2:]
    assert kv.is_contiguous() and rope.rotary_dim % 2 == 0
    half = rope.rotary_dim // 2
    idx = abs(int(delta))
    n_rows = page_size * heads
    grid = (n, triton.cdiv(n_rows, ROPE_BLOCK_ROWS))
    _rerotate_kernel[grid](
        kv, pages, rope.cos[idx], rope.sin[idx], -1.0 if delta < 0 else 1.0,
        n_rows, kv.stride(0), kv.stride(3),
        HALF=half, HALF_P=_pow2(half), BLOCK_R=ROPE_BLOCK_ROWS, num_warps=4,
    )


@triton.jit
def _copy_rerotate_kernel(
    kv_ptr, src_ptr, dst_ptr, delta_ptr, cos_ptr, sin_ptr, n_rows,
    stride_l, stride_p, stride_kv, stride_row, stride_cos,
    HALF: tl.constexpr, HALF_P: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_P: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    # Program (page pair i, layer, row block): rows r = slot * kv_heads + head of one page.
    i = tl.program_id(0)
    layer = tl.program_id(1).to(tl.int64)
    src = tl.load(src_ptr + i).to(tl.int64)
    dst = tl.load(dst_ptr + i).to(tl.int64)
    delta = tl.load(delta_ptr + i)
    r = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < n_rows
    row = layer * stride_l + r[:, None].to(tl.int64) * stride_row
    s_ptr = kv_ptr + row + src * stride_p
    d_ptr = kv_ptr + row + dst * stride_p
    d = tl.arange(0, HEAD_P)[None, :]
    vmask = r_ok[:, None] & (d < HEAD_DIM)
    tl.store(d_ptr + stride_kv + d, tl.load(s_ptr + stride_kv + d, mask=vmask), mask=vmask)
    c = tl.arange(0, HALF_P)[None, :]
    cmask = r_ok[:, None] & (c < HALF)
    cos = tl.load(cos_ptr + tl.abs(delta) * stride_cos + c, mask=c < HALF, other=0.0)
    sin = tl.load(sin_ptr + tl.abs(delta) * stride_cos + c, mask=c < HALF, other=0.0)
    sin = tl.where(delta < 0, -sin, sin)
    x1 = tl.load(s_ptr + c, mask=cmask, other=0.0).to(tl.float32)
    x2 = tl.load(s_ptr + HALF + c, mask=cmask, other=0.0).to(tl.float32)
    y1, y2 = _rope_rows(x1, x2, cos, sin)
    tl.store(d_ptr + c, y1.to(kv_ptr.dtype.element_ty), mask=cmask)
    tl.store(d_ptr + HALF + c, y2.to(kv_ptr.dtype.element_ty), mask=cmask)
    if 2 * HALF < HEAD_DIM:  # partial rotary: the tail of each key is copied as is
        tmask = vmask & (d >= 2 * HALF)
        tl.store(d_ptr + d, tl.load(s_ptr + d, mask=tmask), mask=tmask)


def copy_rerotate_pages_triton(
    kv_all: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, delta: torch.Tensor, rope: RopeCache
) -> None:
    """Block-mode materialization in one launch for all layers of kv_all [layers, pages, 2, page_size,
    kv_heads, head_dim]: dst[i] <- src[i] (K and V), keys rotated by delta[i] (int, may be negative).
    src and dst pages must not overlap. |delta| must be < the RopeCache's positions."""
    n = src.numel()
    if n == 0:
        return
    layers, _, _, page_size, heads, head_dim = kv_all.shape
    assert kv_all.is_contiguous() and rope.rotary_dim % 2 == 0
    assert dst.numel() == n and delta.numel() == n
    half = rope.rotary_dim // 2
    n_rows = page_size * heads
    grid = (n, layers, triton.cdiv(n_rows, ROPE_BLOCK_ROWS))
    _copy_rerotate_kernel[grid](
        kv_all, src, dst, delta, rope.cos, rope.sin, n_rows,
        kv_all.stride(0), kv_all.stride(1), kv_all.stride(2), kv_all.stride(4), rope.cos.stride(0),
        HALF=half, HALF_P=_pow2(half), HEAD_DIM=head_dim, HEAD_P=_pow2(head_dim),
        BLOCK_R=ROPE_BLOCK_ROWS, num_warps=4,
    )


@triton.jit
def _apply_rope_kernel(
    x_ptr, y_ptr, pos_ptr, cos_ptr, sin_ptr, stride_xt, stride_xh, stride_yt, stride_yh, stride_cos,
    HEADS: tl.constexpr, HEADS_P: tl.constexpr, HALF: tl.constexpr, HALF_P: tl.constexpr,
    REST: tl.constexpr, REST_P: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.arange(0, HEADS_P)
    c = tl.arange(0, HALF_P)
    mask = (h < HEADS)[:, None] & (c < HALF)[None, :]
    pos = tl.load(pos_ptr + t)
    cos = tl.load(cos_ptr + pos * stride_cos + c, mask=c < HALF, other=0.0)[None, :]
    sin = tl.load(sin_ptr + pos * stride_cos + c, mask=c < HALF, other=0.0)[None, :]
    src = x_ptr + t.to(tl.int64) * stride_xt + h[:, None] * stride_xh + c[None, :]
    dst = y_ptr + t.to(tl.int64) * stride_yt + h[:, None] * stride_yh + c[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    y1, y2 = _rope_rows(x1, x2, cos, sin)
    tl.store(dst, y1.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, y2.to(y_ptr.dtype.element_ty), mask=mask)
    if REST > 0:  # partial rotary: the tail of each head is copied as is
        r = tl.arange(0, REST_P)
        rmask = (h < HEADS)[:, None] & (r < REST)[None, :]
        tail = tl.load(x_ptr + t.to(tl.int64) * stride_xt + h[:, None] * stride_xh + 2 * HALF + r[None, :],
                       mask=rmask)
        tl.store(y_ptr + t.to(tl.int64) * stride_yt + h[:, None] * stride_yh + 2 * HALF + r[None, :], tail,
                 mask=rmask)


def apply_rope_triton(x: torch.Tensor, positions: torch.Tensor, rope: RopeCache) -> torch.Tensor:
    """Rotate x [n, heads, head_dim] by positions [n]; returns a new tensor in x's dtype."""
    n, heads, head_dim = x.shape
    y = torch.empty((n, heads, head_dim), dtype=x.dtype, device=x.device)
    if n == 0:
        return y
    assert x.stride(-1) == 1 and rope.rotary_dim % 2 == 0 and rope.rotary_dim <= head_dim
    half = rope.rotary_dim // 2
    rest = head_dim - 2 * half
    _apply_rope_kernel[(n,)](
        x, y, positions, rope.cos, rope.sin,
        x.stride(0), x.stride(1), y.stride(0), y.stride(1), rope.cos.stride(0),
        HEADS=heads, HEADS_P=_pow2(heads), HALF=half, HALF_P=_pow2(half),
        REST=rest, REST_P=_pow2(rest) if rest else 0,
        num_warps=4,
    )
    return y
