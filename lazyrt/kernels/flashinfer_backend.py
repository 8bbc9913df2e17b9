"""FlashInfer for what it already does well: paged prefill over dense page tables (prefix / none
modes, where keys are stored rotated and every page but a sequence's last is full), and with
lazy_flashinfer_prefill lazy mode's prefill steps at consecutive positions: ragged prefill over their
keys gathered and rotated (kernels/ragged_prefill.py; meta.ragged says which).

Anything else (lazy mode's per-chunk positions, block mode's partly filled chunk tails, decode
steps, which replay Triton CUDA graphs) goes to the Triton backend. FlashInfer is imported lazily
so the CPU path never needs it.
"""

from __future__ import annotations

import torch

from lazyrt.kernels.metadata import AttentionMetadata
from lazyrt.kernels.ragged_prefill import RaggedKeys, ragged_prefill_attention, split_prefill_attention
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
        # lazy mode's consecutive prefill steps (one workspace: a step plans one of the two wrappers)
        self.ragged = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD")
        self._ragged_planned: RaggedKeys | None = None

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
        if meta.ragged is not None and meta.rotate_keys:
            return self.ragged_forward(layer, q, k, v, meta)
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

    def ragged_forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Lazy mode: store the unrotated K/V, then dense causal attention over the step's keys
        gathered from the pages and rotated by position (meta.ragged); in a split step only its
        fitting sequences' rows, the others through the lazy kernel (meta.ragged_rest)."""
        kv = self.kv_layers[layer]
        self.fallback._store(kv, k, v, meta.store_pages, meta.store_slots)
        r = meta.ragged
        if self._ragged_planned is not r:  # plan once per step, at its first layer
            self.ragged.plan(
                r.qo_indptr, r.kv_indptr, q.shape[1], self.kv_heads, self.head_dim,
                causal=True, pos_encoding_mode="NONE", sm_scale=self.sm_scale,
                q_data_type=q.dtype, kv_data_type=kv.dtype,
            )  # fmt: skip
            self._ragged_planned = r
        rope = self.fallback.rope

        def ragged_part(q_part: torch.Tensor) -> torch.Tensor:
            rotate = lambda keys, pos: self.fallback._rope(keys, pos, rope)  # noqa: E731
            return ragged_prefill_attention(q_part, kv, r, rotate=rotate, attend=self.ragged.run)

        if r.q_rows is None:
            return ragged_part(q)
        rest = meta.ragged_rest
        return split_prefill_attention(q, r, ragged_part, lambda q_r: self.fallback.attend(layer, q_r, rest))

    def warm_up_ragged(self, q_heads: int) -> int:
        """Run one small ragged step (FlashInfer compiles the kernel on first use, which mid-serving
        would stall every request in flight); the pool's first page is read, nothing written.
        Returns the steps run (1)."""
        kv = self.kv_layers[0]
        n = min(self.page_size, 8)
        dev = kv.device
        r = RaggedKeys(
            page_idx=torch.zeros(n, dtype=torch.long, device=dev),
            slot_idx=torch.arange(n, device=dev),
            key_pos=torch.arange(n, device=dev),
            kv_indptr=torch.tensor([0, n], dtype=torch.int32),
            qo_indptr=torch.tensor([0, n], dtype=torch.int32),
        )
        q = torch.zeros(n, q_heads, self.head_dim, dtype=kv.dtype, device=dev)
        meta = AttentionMetadata(
            qo_indptr=r.qo_indptr.to(dev), positions=r.key_pos,
            kv_indptr=torch.tensor([0, 1], dtype=torch.int32, device=dev),
            kv_indices=torch.zeros(1, dtype=torch.int32, device=dev),
            pos_base=torch.zeros(1, dtype=torch.int32, device=dev),
            valid_len=torch.full((1,), n, dtype=torch.int32, device=dev),
            store_pages=torch.zeros(0, dtype=torch.long, device=dev),
            store_slots=torch.zeros(0, dtype=torch.long, device=dev),
            rotate_keys=True, ragged=r,
        )  # fmt: skip
        empty = q[:0, : self.kv_heads]
        self.ragged_forward(0, q, empty, empty, meta)
        torch.cuda.synchronize(dev)
        self._ragged_planned = None
        return 1
