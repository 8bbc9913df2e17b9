"""Torch reference of lazy paged attention and of the KV store: the CPU path and the kernels' oracle."""

from __future__ import annotations

import torch

from lazyrt.kernels.metadata import AttentionMetadata
from lazyrt.kernels.rope import RopeCache, apply_rope_ref


def store_kv_ref(
    kv: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pages: torch.Tensor, slots: torch.Tensor
) -> None:
    """Write k, v [T, kv_heads, head_dim] into kv [num_pages, 2, page_size, kv_heads, head_dim]."""
    kv[pages, 0, slots] = k.to(kv.dtype)
    kv[pages, 1, slots] = v.to(kv.dtype)


def gather_keys_values(
    kv: torch.Tensor, kv_indices: torch.Tensor, pos_base: torch.Tensor, valid_len: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """K, V [N, kv_heads, head_dim] and their positions [N] for the valid slots of some entries."""
    page_size = kv.shape[2]
    slot = torch.arange(page_size, device=kv.device)
    pages = kv[kv_indices.long()]  # [E, 2, page_size, H, D]
    valid = slot[None, :] < valid_len[:, None]
    pos = (pos_base[:, None].long() + slot[None, :])[valid]
    return pages[:, 0][valid], pages[:, 1][valid], pos


def per_key(
    scale: torch.Tensor, mass: torch.Tensor, valid_len: torch.Tensor, e0: int, e1: int, page_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Entries e0..e1's logit scale and log mass repeated for each valid slot, in gather order."""
    n = valid_len[e0:e1].long().clamp(0, page_size)
    return (
        torch.repeat_interleave(scale[e0:e1].float(), n),
        torch.repeat_interleave(mass[e0:e1].float(), n),
    )


def lazy_attention_ref(
    q: torch.Tensor,
    kv: torch.Tensor,
    meta: AttentionMetadata,
    rope: RopeCache | None,
    sm_scale: float,
) -> torch.Tensor:
    """Attention of new tokens q [T, q_heads, head_dim] (already rotated) over paged K/V.

    With meta.rotate_keys, each key is rotated by pos_base + slot here, at attention time; otherwise
    keys are taken as stored (already rotated). With meta.entry_logit_scale / entry_log_mass, each
    key's logit is scaled and shifted by its entry's values. Computes in fp32, returns q's dtype.
    """
    out = torch.empty_like(q)
    q_heads, kv_heads = q.shape[1], kv.shape[3]
    group = q_heads // kv_heads
    qo, kvp = meta.qo_indptr.tolist(), meta.kv_indptr.tolist()
    entry_logits = meta.has_entry_logits
    for b in range(meta.batch_size):
        e0, e1 = kvp[b], kvp[b + 1]
        k, v, kpos = gather_keys_values(
            kv, meta.kv_indices[e0:e1], meta.pos_base[e0:e1], meta.valid_len[e0:e1]
        )
        if meta.rotate_keys:
            k = apply_rope_ref(k.float(), kpos, rope)
        qb = q[qo[b] : qo[b + 1]].float()
        qpos = meta.positions[qo[b] : qo[b + 1]]
        k = k.float().repeat_interleave(group, dim=1)
        v = v.float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", qb, k) * sm_scale
        if entry_logits:
            scale, mass = per_key(
                meta.entry_logit_scale, meta.entry_log_mass, meta.valid_len, e0, e1, kv.shape[2]
            )
            scores = scores * scale + mass
        visible = kpos[None, :] <= qpos[:, None]
        scores = scores.masked_fill(~visible[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[qo[b] : qo[b + 1]] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
    return out


def rerotate_pages_ref(kv: torch.Tensor, pages: torch.Tensor, delta: int, rope: RopeCache) -> None:
    """Block-mode materialization: rotate the stored keys of `pages` by `delta` more positions."""
    k = kv[pages, 0]  # [n, page_size, H, D]
    flat = k.reshape(-1, *k.shape[2:])
    pos = torch.full((flat.shape[0],), delta, dtype=torch.long, device=kv.device)
    kv[pages, 0] = apply_rope_ref(flat.float(), pos, rope).to(kv.dtype).view_as(k)


def copy_rerotate_pages_ref(
    kv_all: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, delta: torch.Tensor, rope: RopeCache
) -> None:
    """Block-mode materialization for every layer of kv_all [layers, pages, 2, page_size, H, D]: page
    dst[i] gets src[i]'s K and V, its keys rotated by delta[i] more positions (negative: backwards)."""
    half = rope.rotary_dim // 2
    d = delta.long()
    cos = rope.cos[d.abs(), :half][:, None, None, :]  # [n, 1, 1, half]
    sin = rope.sin[d.abs(), :half][:, None, None, :] * d.sign()[:, None, None, None].to(rope.sin.dtype)
    for kv in kv_all:
        block = kv[src.long()].clone()  # [n, 2, page_size, H, D]
        k = block[:, 0].float()
        x1, x2 = k[..., :half], k[..., half : 2 * half]
        rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, k[..., 2 * half :]], dim=-1)
        block[:, 0] = rotated.to(kv.dtype)
        kv[dst.long()] = block
