"""How a group of host parts' query rows are laid out for the batched fill, shared by the CPU fill
(host_attention.py) and the device fill (device_fill.py): the queries turned into each part's frame,
per KV head, and the outputs back to the parts' rows."""

from __future__ import annotations

import torch

from lazyrt.kernels.rope import RopeCache


def part_queries(
    qp: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope: RopeCache, kv_heads: int
) -> torch.Tensor:
    """qp [G, m, q_heads, d] (each part's query rows, rotated at their positions), turned back by each
    part's start (cos / sin [G, 1, 1, rotary_dim // 2] at it): [G, kv_heads, m * group, d]."""
    rd, half = rope.rotary_dim, rope.rotary_dim // 2
    q1, q2 = qp[..., :half], qp[..., half:rd]
    qp = torch.cat([q1 * cos + q2 * sin, q2 * cos - q1 * sin, qp[..., rd:]], dim=-1)
    G, m, qh, d = qp.shape
    group = qh // kv_heads
    return qp.view(G, m, kv_heads, group, d).transpose(1, 2).reshape(G, kv_heads, m * group, d)


def part_rows(
    o: torch.Tensor, lse: torch.Tensor, m: int, keep: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """o [G, kv_heads, m * group, d] / lse [G, kv_heads, m * group] -> the parts' real rows
    ([rows, q_heads, d] / [rows, q_heads]; keep: their indices among the G * m padded rows)."""
    G, H, _, d = o.shape
    o = o.view(G, H, m, -1, d).permute(0, 2, 1, 3, 4).reshape(G * m, -1, d)
    lse = lse.view(G, H, m, -1).permute(0, 2, 1, 3).reshape(G * m, -1)
    return o[keep], lse[keep]
