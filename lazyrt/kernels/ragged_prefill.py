"""Lazy-mode prefill steps whose keys sit at consecutive positions, through one dense causal attention.

A document chunk computed after its prefix, or a plain prompt, attends to keys at positions
p0, p0 + 1, ... with its new tokens last: ordinary causal attention. Lazy mode's pages hold the keys
unrotated, so such a step gathers its keys out of the pages, rotates them by position into a ragged
buffer, and runs FlashInfer's ragged causal prefill over it (the pages keep the unrotated keys).
It pays one more read of each key, so it is taken only where the step's new tokens are most of its
keys (`contiguous_keys` decides and builds the gather); questions over cached documents keep the
lazy kernels.

`ragged_causal_attention_ref` is the torch reference of the dense part (FlashInfer's ragged prefill
with causal=True: each sequence's queries are its last keys). `ragged_prefill_attention` is the
whole path with its rotation and attention passed in (torch on the CPU, Triton + FlashInfer on CUDA).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

_I64 = np.int64

# the step's keys may be at most this many times its new tokens (each is read once more to gather it)
MAX_KEY_RATIO = 2.0


@dataclass
class RaggedKeys:
    """The gather of a qualifying step's keys, sequence by sequence (see contiguous_keys)."""

    page_idx: torch.Tensor  # [L] int64 page of each key
    slot_idx: torch.Tensor  # [L] int64 its slot
    key_pos: torch.Tensor  # [L] int64 its position in its request (the rotation)
    kv_indptr: torch.Tensor  # [B+1] int32 each sequence's keys, on the host (FlashInfer's plan reads it)
    qo_indptr: torch.Tensor  # [B+1] int32 each sequence's new tokens, on the host

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray], device: torch.device) -> RaggedKeys:
        def dev(name: str) -> torch.Tensor:
            return torch.from_numpy(arrays[name]).to(device, non_blocking=True)

        return cls(
            page_idx=dev("page_idx"),
            slot_idx=dev("slot_idx"),
            key_pos=dev("key_pos"),
            kv_indptr=torch.from_numpy(arrays["kv_indptr"].astype(np.int32)),
            qo_indptr=torch.from_numpy(arrays["qo_indptr"].astype(np.int32)),
        )


def contiguous_keys(
    qo_indptr,
    positions,
    kv_indptr,
    kv_indices,
    pos_base,
    valid_len,
    max_key_ratio: float = MAX_KEY_RATIO,
) -> dict[str, np.ndarray] | None:
    """The gather of a step's keys (host arrays: page_idx, slot_idx, key_pos, kv_indptr, qo_indptr) when
    every sequence's page table lists keys at consecutive positions (each entry's pos_base right after
    the one before it) whose last keys are its new tokens, at their positions, and the step's keys are
    at most max_key_ratio times its new tokens; else None. Then the lazy rule (a new token at p sees
    the listed keys at positions <= p) is plain causal attention over those keys."""
    qo = np.asarray(qo_indptr, dtype=_I64)
    pos = np.asarray(positions, dtype=_I64)
    indptr = np.asarray(kv_indptr, dtype=_I64)
    base = np.asarray(pos_base, dtype=_I64)
    valid = np.asarray(valid_len, dtype=_I64)
    n_new = np.diff(qo)
    if len(n_new) == 0 or (n_new < 1).any() or len(base) == 0:
        return None
    total_keys = int(valid.sum())
    if total_keys > max_key_ratio * int(n_new.sum()):
        return None
    # consecutive: every entry but a sequence's first starts where the one before it ends
    first = np.zeros(len(base), dtype=bool)
    first[indptr[:-1][np.diff(indptr) > 0]] = True
    ends = base + valid
    if not np.all(first[1:] | (base[1:] == ends[:-1])):
        return None
    key_start = np.concatenate(([0], np.cumsum(valid)))  # each entry's first key
    seq_keys = key_start[indptr]  # [B+1]: each sequence's keys
    # the new tokens are each sequence's last keys, at their positions
    q_seq = np.repeat(np.arange(len(n_new)), n_new)
    key_of_q = seq_keys[q_seq + 1] - n_new[q_seq] + (np.arange(len(pos)) - qo[q_seq])
    if (key_of_q < seq_keys[q_seq]).any():
        return None
    slot = np.arange(total_keys, dtype=_I64) - np.repeat(key_start[:-1], valid)
    key_pos = np.repeat(base, valid) + slot
    if not np.array_equal(key_pos[key_of_q], pos):
        return None
    return {
        "page_idx": np.repeat(np.asarray(kv_indices, dtype=_I64), valid),
        "slot_idx": slot,
        "key_pos": key_pos,
        "kv_indptr": seq_keys,
        "qo_indptr": qo,
    }


def gather_keys(kv: torch.Tensor, ragged: RaggedKeys) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's keys and values [L, kv_heads, head_dim] out of one layer's pages
    [num_pages, 2, page_size, kv_heads, head_dim], as stored (keys unrotated)."""
    return kv[ragged.page_idx, 0, ragged.slot_idx], kv[ragged.page_idx, 1, ragged.slot_idx]


def ragged_prefill_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    ragged: RaggedKeys,
    rotate: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """q [T, q_heads, head_dim] (rotated at its positions) over the step's gathered keys:
    rotate(keys, key_pos) then attend(q, keys, values), the dense causal attention."""
    k, v = gather_keys(kv, ragged)
    return attend(q, rotate(k, ragged.key_pos), v)


def ragged_causal_attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    sm_scale: float,
) -> torch.Tensor:
    """Causal attention per sequence over ragged keys: sequence b's n new tokens (q rows
    qo_indptr[b]:qo_indptr[b+1]) are its last n keys (k rows kv_indptr[b]:kv_indptr[b+1]); query i
    sees keys 0 .. L - n + i. GQA by repeating each KV head. fp32 inside, q's dtype out."""
    out = torch.empty_like(q)
    group = q.shape[1] // k.shape[1]
    qo, kvp = qo_indptr.tolist(), kv_indptr.tolist()
    for b in range(len(qo) - 1):
        qb = q[qo[b] : qo[b + 1]].float()
        kb = k[kvp[b] : kvp[b + 1]].float().repeat_interleave(group, dim=1)
        vb = v[kvp[b] : kvp[b + 1]].float().repeat_interleave(group, dim=1)
        n, length = qb.shape[0], kb.shape[0]
        scores = torch.einsum("qhd,khd->hqk", qb, kb) * sm_scale
        seen = torch.arange(length)[None, :] <= (length - n + torch.arange(n))[:, None]
        scores = scores.masked_fill(~seen.to(scores.device), float("-inf"))
        out[qo[b] : qo[b + 1]] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vb).to(q.dtype)
    return out
