"""Triton row gather: out[i] = src[rows[i]] for a 2-D src, `torch.index_select(src, 0, rows)`'s result.

Why not index_select: the retrieval fill gathers key and value rows (head_dim elements, 256 bytes in
bf16) straight from pinned host memory over PCIe, where the bus latency (~1-2 us a read) rather
than its bandwidth bounds a kernel that has too few reads in flight. Each program here loads a block
of ROWS_PER_PROGRAM whole rows at once (many independent 16-byte loads per thread), which keeps more
reads outstanding per SM. `benchmarks/experiments/zero_copy_gather.py` compares the two.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ROWS_PER_PROGRAM = 32


@triton.jit
def _gather_rows_kernel(
    src_ptr, rows_ptr, out_ptr, n, stride_src, stride_out,
    COLS: tl.constexpr, COLS_P: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    c = tl.arange(0, COLS_P)
    live = i < n
    r = tl.load(rows_ptr + i, mask=live, other=0).to(tl.int64)
    mask = live[:, None] & (c < COLS)[None, :]
    x = tl.load(src_ptr + r[:, None] * stride_src + c[None, :], mask=mask)
    tl.store(out_ptr + i.to(tl.int64)[:, None] * stride_out + c[None, :], x, mask=mask)


def gather_rows_triton(
    src: torch.Tensor, rows: torch.Tensor, rows_per_program: int = ROWS_PER_PROGRAM
) -> torch.Tensor:
    """src [R, C] (rows contiguous), rows [n] int -> [n, C] on rows' device."""
    if src.dim() != 2 or src.stride(1) != 1:
        raise ValueError("gather_rows_triton: src must be 2-D with contiguous rows")
    n, cols = rows.numel(), src.shape[1]
    out = torch.empty(n, cols, dtype=src.dtype, device=rows.device)
    if n:
        grid = (triton.cdiv(n, rows_per_program),)
        _gather_rows_kernel[grid](
            src, rows.reshape(-1), out, n, src.stride(0), out.stride(0),
            COLS=cols, COLS_P=triton.next_power_of_2(cols), ROWS=rows_per_program,
        )  # fmt: skip
    return out
