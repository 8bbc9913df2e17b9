"""Attention backends: store this step's K/V into pages, then attend. The model calls one per layer."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from lazyrt.kernels.attention_ref import lazy_attention_ref, store_kv_ref
from lazyrt.kernels.metadata import AttentionMetadata
from lazyrt.kernels.ragged_prefill import into_rows
from lazyrt.kernels.rope import RopeCache, apply_rope_ref
from lazyrt.kernels.shared_chunk import merge_parts_ref, shared_chunk_attention_torch


def attend_parts(
    q: torch.Tensor, meta: AttentionMetadata, attend: Callable[..., torch.Tensor]
) -> torch.Tensor:
    """A step attended in parts (meta.parts): each part's rows of q through attend(q_rows, its
    metadata), into those rows."""
    return into_rows(q, ((rows, lambda x, m=part: attend(x, m)) for rows, part in meta.parts))


class AttentionBackend(Protocol):
    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor: ...


class TorchAttentionBackend:
    """CPU path: torch reference kernels. q arrives rotated, k unrotated."""

    def __init__(self, kv_layers: list[torch.Tensor], rope: RopeCache, sm_scale: float):
        self.kv_layers = kv_layers
        self.rope = rope
        self.sm_scale = sm_scale

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        kv = self.kv_layers[layer]
        if not meta.rotate_keys:
            k = apply_rope_ref(k, meta.positions, self.rope)
        store_kv_ref(kv, k, v, meta.store_pages, meta.store_slots)
        return self.attend(layer, q, meta)

    def attend(self, layer: int, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Attention over meta's tables (K/V already stored): its shared-chunk segments when set, else
        per sequence."""
        if meta.parts is not None:
            return attend_parts(q, meta, lambda q_part, m: self.attend(layer, q_part, m))
        kv = self.kv_layers[layer]
        if meta.shared is not None:
            sh = meta.shared
            o, lse = shared_chunk_attention_torch(q, kv, meta.positions, sh, self.rope, self.sm_scale)
            if meta.host is not None:
                meta.host.fill(layer, q, o, lse)
            return merge_parts_ref(o, lse, sh).to(q.dtype)
        return lazy_attention_ref(q, kv, meta, self.rope, self.sm_scale)


class TritonAttentionBackend:
    """CUDA path: Triton kernels (imported lazily, so the CPU path never needs Triton)."""

    def __init__(self, kv_layers: list[torch.Tensor], rope: RopeCache, sm_scale: float):
        from lazyrt.kernels import triton_attention, triton_kv, triton_shared_chunk

        self._attend = triton_attention.lazy_attention_triton
        self._shared = triton_shared_chunk.shared_chunk_attention_triton
        self._merge = triton_shared_chunk.merge_parts_triton
        self._store = triton_kv.store_kv_triton
        self._rope = triton_kv.apply_rope_triton
        self.kv_layers = kv_layers
        self.rope = rope
        self.sm_scale = sm_scale

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        kv = self.kv_layers[layer]
        if not meta.rotate_keys:
            k = self._rope(k, meta.positions, self.rope)
        self._store(kv, k, v, meta.store_pages, meta.store_slots)
        return self.attend(layer, q, meta)

    def attend(self, layer: int, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Attention over meta's tables (K/V already stored): the shared-chunk kernel and its merge
        when meta has segments, else the lazy kernel per sequence."""
        if meta.parts is not None:
            return attend_parts(q, meta, lambda q_part, m: self.attend(layer, q_part, m))
        kv = self.kv_layers[layer]
        if meta.shared is not None:
            sh = meta.shared
            o, lse = self._shared(q, kv, meta.positions, sh, self.rope, self.sm_scale, programs=sh.programs)
            if meta.host is not None:
                meta.host.fill(layer, q, o, lse)
            return self._merge(o, lse, sh, q.dtype)
        return self._attend(
            q,
            kv,
            meta,
            self.rope,
            self.sm_scale,
            max_q_len=meta.max_q_len or None,
            max_kv_entries=meta.max_kv_entries or None,
        )


def make_backend(
    device: torch.device,
    kv_layers: list[torch.Tensor],
    rope: RopeCache,
    sm_scale: float,
    use_flashinfer: bool,
):
    """CPU: torch references. CUDA: Triton, with FlashInfer prefill for dense page tables when asked
    (non-lazy modes in fp16/bf16; FlashInfer has no fp32 kernels)."""
    if device.type != "cuda":
        return TorchAttentionBackend(kv_layers, rope, sm_scale)
    triton_backend = TritonAttentionBackend(kv_layers, rope, sm_scale)
    if use_flashinfer and kv_layers[0].dtype in (torch.float16, torch.bfloat16):
        from lazyrt.kernels.flashinfer_backend import FlashInferPrefillBackend, flashinfer_available

        if flashinfer_available():
            return FlashInferPrefillBackend(triton_backend, kv_layers, rope, sm_scale)
    return triton_backend
