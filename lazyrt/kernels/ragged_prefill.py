"""Lazy-mode prefill steps whose keys sit at consecutive positions, through one dense causal attention.

A document chunk computed after its prefix, or a plain prompt, attends to keys at positions
p0, p0 + 1, ... with its new tokens last: ordinary causal attention. Lazy mode's pages hold the keys
unrotated, so such a step gathers its keys out of the pages, rotates them by position into a ragged
buffer, and runs FlashInfer's ragged causal prefill over it (the pages keep the unrotated keys).
It pays one more pass over each key, so a sequence takes it only where its new tokens are most of its
keys or are many (`sequences_that_fit`); short questions over cached documents and decodes keep the
lazy kernels. A step whose every sequence fits runs whole (`contiguous_keys`); a mixed one (a
document's prefill beside running decodes, the usual step under load) splits (`split_keys`): the
fitting sequences' rows through the ragged path, the others through the lazy kernel over their own
page tables. A lazy step's decodes beside longer sequences get a launch of their own
(`decode_split`: one launch would take the longer sequences' query tiles for the decodes too).

`ragged_causal_attention_ref` is the torch reference of the dense part (FlashInfer's ragged prefill
with causal=True: each sequence's queries are its last keys). `ragged_prefill_attention` and
`split_prefill_attention` are the whole paths with their rotation and attention passed in (torch on
the CPU, Triton + FlashInfer on CUDA).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

_I64 = np.int64

# a sequence's keys may be at most this many times its new tokens (each is read once more to gather it)
MAX_KEY_RATIO = 2.0
# ... unless it has at least this many new tokens: then its attention is compute-bound and FlashInfer's
# speed pays for the gather at any ratio (H100, 8,192 cached keys before them: 256 new tokens took
# 0.77-0.83x the lazy kernel's time, 64 took 1.17-2.04x; docs/kernels.md)
ANY_RATIO_NEW_TOKENS = 256
# a mixed step splits off its fitting sequences when they bring at least this many new tokens
MIN_SPLIT_TOKENS = 128
# a step through the lazy kernel launches its decodes apart from its longer sequences when they read
# at least this many keys (measured: 16 decodes x 10,240 keys paid, 0.71-0.93x even with FlashInfer's
# launches for the rest; 4 x 10,240 paid at 128 new tokens beside them, not at 32: docs/kernels.md)
MIN_SPLIT_DECODE_KEYS = 1 << 17


@dataclass
class RaggedKeys:
    """The gather of a qualifying step's keys, sequence by sequence (see contiguous_keys)."""

    page_idx: torch.Tensor  # [L] int64 page of each key
    slot_idx: torch.Tensor  # [L] int64 its slot
    key_pos: torch.Tensor  # [L] int64 its position in its request (the rotation)
    kv_indptr: torch.Tensor  # [B+1] int32 each sequence's keys, on the host (FlashInfer's plan reads it)
    qo_indptr: torch.Tensor  # [B+1] int32 each sequence's new tokens, on the host
    # a split step (split_keys): these sequences' rows in the step and the other sequences' rows,
    # which the lazy kernel attends (meta.ragged_rest); None = every row is here
    q_rows: slice | torch.Tensor | None = None
    rest_rows: slice | torch.Tensor | None = None

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray], device: torch.device) -> RaggedKeys:
        def dev(name: str) -> torch.Tensor:
            return torch.from_numpy(arrays[name]).to(device, non_blocking=True)

        split = "q_rows" in arrays
        return cls(
            page_idx=dev("page_idx"),
            slot_idx=dev("slot_idx"),
            key_pos=dev("key_pos"),
            kv_indptr=torch.from_numpy(arrays["kv_indptr"].astype(np.int32)),
            qo_indptr=torch.from_numpy(arrays["qo_indptr"].astype(np.int32)),
            q_rows=rows_index(arrays["q_rows"], device) if split else None,
            rest_rows=rows_index(arrays["rest_rows"], device) if split else None,
        )


def sequences_that_fit(
    qo_indptr,
    positions,
    kv_indptr,
    kv_indices,
    pos_base,
    valid_len,
    max_key_ratio: float = MAX_KEY_RATIO,
    any_ratio_tokens: int = ANY_RATIO_NEW_TOKENS,
) -> np.ndarray:
    """Per sequence (bool [B]): it is plain causal (_causal_sequences) and has at most max_key_ratio
    keys per new token or at least any_ratio_tokens new tokens."""
    del kv_indices  # any page may hold any run: only positions matter
    causal, n_new, n_keys = _causal_sequences(qo_indptr, positions, kv_indptr, pos_base, valid_len)
    return causal & ((n_keys <= max_key_ratio * n_new) | (n_new >= any_ratio_tokens))


def _causal_sequences(qo_indptr, positions, kv_indptr, pos_base, valid_len) -> tuple[np.ndarray, ...]:
    """(causal [B], new tokens [B], keys [B]): a sequence is causal when its page table lists keys at
    consecutive positions (each entry's pos_base right after the one before it) and its last keys are
    its new tokens at their positions. Then the lazy rule (a new token at p sees the listed keys at
    positions <= p) is plain causal attention over its keys. O(B + E + T) on the host."""
    qo = np.asarray(qo_indptr, dtype=_I64)
    pos = np.asarray(positions, dtype=_I64)
    indptr = np.asarray(kv_indptr, dtype=_I64)
    base = np.asarray(pos_base, dtype=_I64)
    valid = np.asarray(valid_len, dtype=_I64)
    n_new, n_entries = np.diff(qo), np.diff(indptr)
    seqs = len(n_new)
    n_keys = _keys_per_sequence(indptr, valid)
    ok = (n_new >= 1) & (n_entries > 0)
    if not ok.any():
        return ok, n_new, n_keys
    seq_of_entry = np.repeat(np.arange(seqs), n_entries)
    # consecutive: an entry after another of its sequence starts where that one ends
    same = seq_of_entry[1:] == seq_of_entry[:-1]
    ok[seq_of_entry[1:][same & (base[1:] != (base + valid)[:-1])]] = False
    # then key i of a sequence sits at its first entry's pos_base + i, and the new tokens are its last
    first_base = base[np.minimum(indptr[:-1], len(base) - 1)]
    q_seq = np.repeat(np.arange(seqs), n_new)
    expect = (first_base + n_keys - n_new)[q_seq] + np.arange(len(pos)) - qo[q_seq]
    ok[q_seq[expect != pos]] = False
    return ok, n_new, n_keys


def _keys_per_sequence(indptr: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """Keys each sequence lists (int64 [B]): the sum of its entries' valid_len."""
    return np.diff(np.concatenate(([0], np.cumsum(valid)))[indptr])


def gather_arrays(
    qo_indptr, kv_indptr, kv_indices, pos_base, valid_len, seqs: np.ndarray
) -> dict[str, np.ndarray]:
    """The gather of the keys of the sequences marked in seqs (bool [B], each as sequences_that_fit
    says): page_idx, slot_idx and key_pos per key, and the subset's own kv_indptr and qo_indptr."""
    qo = np.asarray(qo_indptr, dtype=_I64)
    indptr = np.asarray(kv_indptr, dtype=_I64)
    valid = np.asarray(valid_len, dtype=_I64)
    entry = np.repeat(seqs, np.diff(indptr))
    v, base = valid[entry], np.asarray(pos_base, dtype=_I64)[entry]
    key_start = np.concatenate(([0], np.cumsum(v)))
    slot = np.arange(int(key_start[-1]), dtype=_I64) - np.repeat(key_start[:-1], v)
    n_keys = np.diff(np.concatenate(([0], np.cumsum(valid)))[indptr])
    return {
        "page_idx": np.repeat(np.asarray(kv_indices, dtype=_I64)[entry], v),
        "slot_idx": slot,
        "key_pos": np.repeat(base, v) + slot,
        "kv_indptr": np.concatenate(([0], np.cumsum(n_keys[seqs]))),
        "qo_indptr": np.concatenate(([0], np.cumsum(np.diff(qo)[seqs]))),
    }


def ragged_keys(
    qo_indptr,
    positions,
    kv_indptr,
    kv_indices,
    pos_base,
    valid_len,
    max_key_ratio: float = MAX_KEY_RATIO,
    min_tokens: int = MIN_SPLIT_TOKENS,
    any_ratio_tokens: int = ANY_RATIO_NEW_TOKENS,
    whole: bool = True,
    split: bool = True,
) -> dict[str, np.ndarray] | None:
    """How a lazy prefill step takes the ragged path, its sequences checked once: whole (every sequence
    causal, and at most max_key_ratio keys per new token in all, or every sequence fits:
    contiguous_keys), else split (split_keys), else None. Host arrays for RaggedKeys.from_arrays and,
    split, AttentionMetadata.split_rest."""
    causal, n_new, n_keys = _causal_sequences(qo_indptr, positions, kv_indptr, pos_base, valid_len)
    fits = causal & ((n_keys <= max_key_ratio * n_new) | (n_new >= any_ratio_tokens))
    if whole and len(causal) and causal.all():
        if fits.all() or int(n_keys.sum()) <= max_key_ratio * int(n_new.sum()):  # one launch either way
            return gather_arrays(qo_indptr, kv_indptr, kv_indices, pos_base, valid_len, causal)
    if not split or fits.all() or not fits.any() or int(n_new[fits].sum()) < min_tokens:
        return None
    arrays = gather_arrays(qo_indptr, kv_indptr, kv_indices, pos_base, valid_len, fits)
    arrays["q_rows"] = np.flatnonzero(np.repeat(fits, n_new))
    rest = sequence_tables(qo_indptr, positions, kv_indptr, kv_indices, pos_base, valid_len, ~fits)
    arrays.update({"rest_" + name: a for name, a in rest.items()})
    return arrays


def sequence_tables(
    qo_indptr, positions, kv_indptr, kv_indices, pos_base, valid_len, seqs
) -> dict[str, np.ndarray]:
    """The page tables of the sequences marked in seqs (bool [B]) on their own: qo_indptr, positions,
    kv_indptr, kv_indices, pos_base, valid_len, and "seqs" (their indices in the step) and "rows" (their
    rows in the step's q)."""
    qo, indptr = np.asarray(qo_indptr, dtype=_I64), np.asarray(kv_indptr, dtype=_I64)
    seqs = np.asarray(seqs, dtype=bool)
    n_new = np.diff(qo)
    rows, entry = np.repeat(seqs, n_new), np.repeat(seqs, np.diff(indptr))
    return {
        "seqs": np.flatnonzero(seqs),
        "rows": np.flatnonzero(rows),
        "qo_indptr": np.concatenate(([0], np.cumsum(n_new[seqs]))),
        "positions": np.asarray(positions, dtype=_I64)[rows],
        "kv_indptr": np.concatenate(([0], np.cumsum(np.diff(indptr)[seqs]))),
        "kv_indices": np.asarray(kv_indices)[entry],
        "pos_base": np.asarray(pos_base)[entry],
        "valid_len": np.asarray(valid_len)[entry],
    }


def decode_split(
    qo_indptr, positions, kv_indptr, kv_indices, pos_base, valid_len, min_keys: int = MIN_SPLIT_DECODE_KEYS
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]] | None:
    """A step that mixes decodes with sequences of several new tokens, as two launches: (the longer
    sequences' tables, the decodes' tables), each as sequence_tables; None when it has only one kind
    or its decodes read fewer than min_keys keys in all. One launch of the lazy kernel takes the
    longer sequences' query tiles for every sequence, so each decode runs its keys through the
    prefill path (H200, 64 decodes over 10,240 keys beside one small document: 2.6 ms a layer in one
    launch, 1.0 split off; docs/kernels.md)."""
    n_new = np.diff(np.asarray(qo_indptr, dtype=_I64))
    decode = n_new == 1
    if decode.all() or not decode.any():
        return None
    n_keys = _keys_per_sequence(np.asarray(kv_indptr, dtype=_I64), np.asarray(valid_len, dtype=_I64))
    if int(n_keys[decode].sum()) < min_keys:
        return None
    tables = (qo_indptr, positions, kv_indptr, kv_indices, pos_base, valid_len)
    return sequence_tables(*tables, ~decode), sequence_tables(*tables, decode)


def contiguous_keys(
    qo_indptr, positions, kv_indptr, kv_indices, pos_base, valid_len, max_key_ratio: float = MAX_KEY_RATIO
) -> dict[str, np.ndarray] | None:
    """The gather of a step's keys (host arrays: page_idx, slot_idx, key_pos, kv_indptr, qo_indptr) when
    every sequence lists consecutive keys with its new tokens last and either the step has at most
    max_key_ratio keys per new token in all (one launch either way) or every sequence fits
    (sequences_that_fit); else None."""
    tables = (qo_indptr, positions, kv_indptr, kv_indices, pos_base, valid_len)
    return ragged_keys(*tables, max_key_ratio, split=False)


def split_keys(
    qo_indptr,
    positions,
    kv_indptr,
    kv_indices,
    pos_base,
    valid_len,
    max_key_ratio: float = MAX_KEY_RATIO,
    min_tokens: int = MIN_SPLIT_TOKENS,
    any_ratio_tokens: int = ANY_RATIO_NEW_TOKENS,
) -> dict[str, np.ndarray] | None:
    """A mixed step (a document's prefill beside decodes and questions over cached documents): the
    gather of the fitting sequences' keys as contiguous_keys, plus "q_rows" (their rows in the step)
    and the other sequences' for the lazy kernel: "rest_seqs" (their indices), "rest_rows" and their
    page tables (rest_qo_indptr, rest_positions, rest_kv_indptr, rest_kv_indices, rest_pos_base,
    rest_valid_len). None when fewer than min_tokens new tokens fit (the split's extra launches would
    cost more than they save) or every sequence fits (contiguous_keys: no split)."""
    tables = (qo_indptr, positions, kv_indptr, kv_indices, pos_base, valid_len)
    return ragged_keys(*tables, max_key_ratio, min_tokens, any_ratio_tokens, whole=False)


def rows_index(rows: np.ndarray, device: torch.device) -> slice | torch.Tensor:
    """A step's rows as an index: a slice when they are one run (no copy to gather or scatter them)."""
    if len(rows) and int(rows[-1]) - int(rows[0]) + 1 == len(rows):
        return slice(int(rows[0]), int(rows[-1]) + 1)
    return torch.from_numpy(rows).to(device, non_blocking=True)


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


def split_prefill_attention(
    q: torch.Tensor,
    ragged: RaggedKeys,
    ragged_part: Callable[[torch.Tensor], torch.Tensor],
    rest_part: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """A split step: ragged_part(q of ragged.q_rows) (ragged_prefill_attention) and rest_part(q of
    ragged.rest_rows) (the lazy kernel over the other sequences' tables), each into its rows."""
    return into_rows(q, ((ragged.q_rows, ragged_part), (ragged.rest_rows, rest_part)))


def into_rows(q: torch.Tensor, parts) -> torch.Tensor:
    """A step attended in parts: parts = ((rows, attend), ...), each attend(q[rows]) written into its
    rows of the output (shaped as q)."""
    out = torch.empty_like(q)
    for rows, attend in parts:
        out[rows] = attend(q[rows])
    return out


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
