"""Per-step attention metadata: FlashInfer-style CSR page tables plus lazyrt's per-entry positions."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from lazyrt.kernels.host_copy import to_device
from lazyrt.kernels.ragged_prefill import RaggedKeys
from lazyrt.kernels.shared_chunk import SharedChunkMeta


@dataclass
class AttentionMetadata:
    """Describes one forward step over a batch of B sequences with T new tokens in all.

    Page-table entry e of sequence b (kv_indptr[b] <= e < kv_indptr[b+1]) says: page kv_indices[e]
    holds valid_len[e] tokens whose positions *in this request* are pos_base[e] + slot. A new token
    at position p sees every cached slot with position <= p (the page table only lists what the
    sequence may see, so this one rule gives causal, block and chunk attention alike).
    """

    qo_indptr: torch.Tensor  # [B+1] int32, new tokens of each sequence
    positions: torch.Tensor  # [T] int64, position of each new token in its request
    kv_indptr: torch.Tensor  # [B+1] int32
    kv_indices: torch.Tensor  # [E] int32 page ids
    pos_base: torch.Tensor  # [E] int32 position of slot 0 of the page in this request
    valid_len: torch.Tensor  # [E] int32 filled slots of the page
    store_pages: torch.Tensor  # [T] int64 page that receives each new token's K/V
    store_slots: torch.Tensor  # [T] int64 slot in that page
    rotate_keys: bool  # lazy mode: pages hold unrotated keys, attention rotates them
    max_q_len: int = 0  # host-side maxima, so GPU kernels launch without a device sync
    max_kv_entries: int = 0
    # Every sequence's table is pages 0.. of its positions, all full but the last: the layout
    # plain paged attention (FlashInfer) understands.
    dense_pages: bool = False
    # Per-entry transform of the attention logits (None = off; both set or neither): a key of entry e
    # scores logit * entry_logit_scale[e] + entry_log_mass[e], where logit = sm_scale * q.k. So
    # 1 / entry_logit_scale is a temperature on the entry's keys and exp(entry_log_mass) a factor on
    # the attention mass they receive (APE-style document attention; scale 1 and mass 0 change nothing).
    entry_logit_scale: torch.Tensor | None = None  # [E] float32
    entry_log_mass: torch.Tensor | None = None  # [E] float32
    # Shared-chunk attention (kernels/shared_chunk.py): when set, the step attends through these
    # segments (the same keys as the page table, each distinct run of pages read once for all its
    # queries) instead of per sequence; the page table still describes the step.
    shared: SharedChunkMeta | None = None
    # Retrieval attention (lazyrt/retrieval/host_attention.py): parts of `shared` past its segments'
    # pairs that the backend fills per layer with `host.fill(layer, q, o, lse)` before the merge.
    host: Any = None
    # Lazy mode, FlashInfer: the step's keys are at consecutive positions with its new tokens last, so
    # it runs as dense causal attention over these gathered keys (kernels/ragged_prefill.py).
    ragged: RaggedKeys | None = None
    # with ragged in a split step (ragged.q_rows set): the step's other sequences, their own page
    # tables (q rows ragged.rest_rows), attended by the lazy kernel after the step's one store
    ragged_rest: AttentionMetadata | None = None
    # A step attended in parts, each (its rows of q, its sequences' own tables; ragged_prefill.decode_split):
    # decodes launched apart from longer sequences, after the step's one store
    parts: tuple[tuple[Any, AttentionMetadata], ...] | None = None

    @classmethod
    def split_rest(cls, keys: dict[str, Any], device: torch.device) -> AttentionMetadata:
        """A split step's other sequences (ragged_prefill.split_keys' rest_* tables) for the lazy kernel
        alone."""
        return cls.from_tables(keys, device, "rest_")

    @classmethod
    def from_tables(cls, tables: dict[str, Any], device: torch.device, prefix: str = "") -> AttentionMetadata:
        """Some of a lazy step's sequences on their own (ragged_prefill.sequence_tables, its names after
        prefix): their K/V is stored with the whole step's, so no store here."""

        def t(name: str, dtype: torch.dtype) -> torch.Tensor:
            return to_device(tables[prefix + name], device, dtype)

        qo, kvp = tables[prefix + "qo_indptr"], tables[prefix + "kv_indptr"]
        none = torch.zeros(0, dtype=torch.long, device=device)
        return cls(
            qo_indptr=t("qo_indptr", torch.int32), positions=t("positions", torch.long),
            kv_indptr=t("kv_indptr", torch.int32), kv_indices=t("kv_indices", torch.int32),
            pos_base=t("pos_base", torch.int32), valid_len=t("valid_len", torch.int32),
            store_pages=none, store_slots=none, rotate_keys=True,
            max_q_len=int((qo[1:] - qo[:-1]).max()), max_kv_entries=int((kvp[1:] - kvp[:-1]).max()),
        )  # fmt: skip

    @property
    def has_entry_logits(self) -> bool:
        if (self.entry_logit_scale is None) != (self.entry_log_mass is None):
            raise ValueError("entry_logit_scale and entry_log_mass: set both or neither")
        return self.entry_logit_scale is not None

    @property
    def batch_size(self) -> int:
        return self.qo_indptr.numel() - 1
