"""FlashInfer for what it already does well: paged prefill over dense page tables (prefix / none
modes, where keys are stored rotated and every page but a sequence's last is full).

Anything else (lazy mode's per-chunk positions, block mode's partly filled chunk tails, decode
steps, which replay Triton CUDA graphs) goes to the Triton backend. FlashInfer is imported lazily
so the CPU path never needs it.
"""

from __future__ import annotations

import torch

from lazyrt.kernels.metadata import AttentionMetadata
from lazyrt.kernels.rope import RopeCache

WORKSPACE_BYTES = 256 << 20


def flashinfer_available() -> bool:
    try:
        import flashinfer  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means: not usable here
        return False
    return True


class FlashInferPrefillBackend:
    def __init__(self, fallback, kv_layers: list[torch.Tensor], rope: RopeCache, sm_scale: float):
        import flashinfer

        self.fallback = fallback  # TritonAttentionBackend
        self.kv_layers = kv_layers
        self.sm_scale = sm_scale
        kv = kv_layers[0]
        self.page_size, self.kv_heads, self.head_dim = kv.shape[2], kv.shape[3], kv.shape[4]
        workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=kv.device)
        self.wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
        self._planned: AttentionMetadata | None = None

    def handles(self, meta: AttentionMetadata) -> bool:
        # no per-entry logit transform in FlashInfer's kernels: those steps go to Triton
        return (
            meta.dense_pages
            and not meta.rotate_keys
            and meta.max_q_len > 1
            and not meta.has_entry_logits
            and meta.shared is None
        )

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        if not self.handles(meta):
            return self.fallback.forward(layer, q, k, v, meta)
        kv = self.kv_layers[layer]
        k = self.fallback._rope(k, meta.positions, self.fallback.rope)
        self.fallback._store(kv, k, v, meta.store_pages, meta.store_slots)
        if self._planned is not meta:  # plan once per step, at its first layer
            last = meta.valid_len[meta.kv_indptr[1:].long() - 1]
            self.wrapper.plan(
                meta.qo_indptr, meta.kv_indptr, meta.kv_indices, last,
                q.shape[1], self.kv_heads, self.head_dim, self.page_size,
                causal=True, pos_encoding_mode="NONE", sm_scale=self.sm_scale,
                q_data_type=q.dtype, kv_data_type=kv.dtype,
            )  # fmt: skip
            self._planned = meta
        return self.wrapper.run(q, kv)
