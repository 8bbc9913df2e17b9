"""Attention of queries over one chunk's sink keys and their retrieved top-k keys (torch reference).

Returns the output and the natural log-sum-exp of the scores, so the part merges with the exact
parts of the step (device pages, other chunks) by lse weights, as shared-chunk attention's parts do.
"""

from __future__ import annotations

import torch

from lazyrt.kernels.rope import RopeCache, apply_rope_ref
from lazyrt.retrieval.key_index import (
    KeyIndex,
    check_index,
    check_int,
    check_scan,
    check_tensor,
    search_key_index,
)


def retrieval_attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    index: KeyIndex | None,
    rope: RopeCache,
    sm_scale: float,
    top_k: int,
    scan: float = 0.05,
    local: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [m, q_heads, d] in the chunk's frame (turned by p - pos_base); k, v [n, kv_heads, d]: the
    chunk's keys as stored (unrotated) and values. Each query head attends to the sink keys and its
    top_k retrieved keys; with top_k >= the indexed keys (or index None) to every key: exact
    attention over the chunk. local: the keys already turned to their local positions (any float
    dtype; kept by a caller that searches the chunk often), else turned here.
    Returns (o [m, q_heads, d] fp32, lse [m, q_heads] fp32)."""
    check_tensor("q", q, "[m, q_heads, head_dim]")
    check_tensor("k", k, "[n, kv_heads, head_dim]")
    check_tensor("v", v, "[n, kv_heads, head_dim]")
    n, kv_heads, d = k.shape
    m, q_heads, _ = q.shape
    if not kv_heads or q_heads % kv_heads or not q_heads or q.shape[2] != d or v.shape != k.shape:
        raise ValueError(
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not match (q [m, q_heads, d] "
            "with q_heads a multiple of kv_heads >= 1, k and v [n, kv_heads, d])"
        )
    group = q_heads // kv_heads
    check_int("top_k", top_k, 1)
    check_scan(scan)
    if rope.cos.shape[0] < n:
        raise ValueError(f"rope covers {rope.cos.shape[0]} positions: the chunk has {n} keys")
    if local is not None:
        check_tensor("local", local, "[n, kv_heads, head_dim]")
        if local.shape != k.shape:
            raise ValueError(f"local {tuple(local.shape)} must be k's shape {tuple(k.shape)}")
    if index is not None:
        check_index(index, k, "k")
    if local is None:  # the keys at local slots
        local = apply_rope_ref(k.float(), torch.arange(n, device=k.device), rope)
    if index is None or top_k >= index.num_indexed:
        slots = torch.arange(n).expand(m, q_heads, n)
    else:
        found, _ = search_key_index(index, local, q, top_k, scan)
        sinks = torch.arange(index.sink).expand(m, q_heads, index.sink)
        slots = torch.cat([sinks, found], -1)
    head = (torch.arange(q_heads) // group).view(1, q_heads, 1)
    valid = slots >= 0
    s = slots.clamp(min=0)
    scores = (q.float().unsqueeze(2) * local[s, head].float()).sum(-1) * sm_scale  # [m, q_heads, keys]
    scores = scores.masked_fill(~valid, float("-inf"))
    lse = torch.logsumexp(scores, -1)
    o = (torch.softmax(scores, -1).unsqueeze(-1) * v[s, head].float()).sum(-2)  # only the chosen values
    return o, lse
