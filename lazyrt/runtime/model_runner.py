"""ModelRunner: owns the model, the KV pages and the attention backend; runs one StepPlan."""

from __future__ import annotations

import torch

from lazyrt.cache.page_pool import PagePool
from lazyrt.kernels.attention_ref import rerotate_pages_ref
from lazyrt.kernels.backend import make_backend
from lazyrt.kernels.metadata import AttentionMetadata
from lazyrt.kernels.rope import RopeCache
from lazyrt.models.llama import LlamaModel
from lazyrt.runtime.scheduler import StepPlan


class ModelRunner:
    def __init__(self, model: LlamaModel, pool: PagePool, max_positions: int, rotate_keys: bool):
        self.model = model
        self.pool = pool
        self.device = model.device
        self.rope = RopeCache.build(model.config, max_positions, self.device)
        self.rotate_keys = rotate_keys
        self.backend = make_backend(self.device, pool.kv, self.rope, model.config.head_dim**-0.5)
        self._rerotate = rerotate_pages_ref
        if self.device.type == "cuda":
            from lazyrt.kernels.triton_kv import rerotate_pages_triton

            self._rerotate = rerotate_pages_triton

    def build_metadata(self, plan: StepPlan) -> tuple[torch.Tensor, AttentionMetadata]:
        ps = self.pool.page_size
        ids, positions, store_pages, store_slots = [], [], [], []
        qo, kvp = [0], [0]
        indices, pos_base, valid_len = [], [], []
        for item in plan.items:
            n = len(item.token_ids)
            ids += item.token_ids
            qo.append(qo[-1] + n)
            for p in range(item.start_pos, item.start_pos + n):
                positions.append(p)
                off = p - item.target.start_pos
                store_pages.append(item.target.pages[off // ps])
                store_slots.append(off % ps)
            for seg in item.segments:
                for j in range(-(-seg.num_tokens // ps)):
                    indices.append(seg.pages[j])
                    pos_base.append(seg.start_pos + j * ps)
                    valid_len.append(min(ps, seg.num_tokens - j * ps))
            kvp.append(len(indices))

        def t(x: list[int], dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(x, dtype=dtype, device=self.device)

        meta = AttentionMetadata(
            qo_indptr=t(qo, torch.int32),
            positions=t(positions, torch.long),
            kv_indptr=t(kvp, torch.int32),
            kv_indices=t(indices, torch.int32),
            pos_base=t(pos_base, torch.int32),
            valid_len=t(valid_len, torch.int32),
            store_pages=t(store_pages, torch.long),
            store_slots=t(store_slots, torch.long),
            rotate_keys=self.rotate_keys,
            max_q_len=max(len(it.token_ids) for it in plan.items),
            max_kv_entries=max(b - a for a, b in zip(kvp, kvp[1:])),
        )
        return t(ids, torch.long), meta

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> torch.Tensor | None:
        """Runs the step; returns fp32 logits [n_sampled, vocab] for items with a request, in order."""
        for copy in plan.copies:
            src = torch.tensor(copy.src, device=self.device)
            dst = torch.tensor(copy.dst, device=self.device)
            for kv in self.pool.kv:
                kv[dst] = kv[src]
                self._rerotate(kv, dst, copy.delta, self.rope)
        if not plan.items:
            return None
        input_ids, meta = self.build_metadata(plan)
        hidden = self.model.forward(input_ids, meta, self.rope, self.backend)
        last = [int(meta.qo_indptr[i + 1]) - 1 for i, it in enumerate(plan.items) if it.request is not None]
        if not last:
            return None
        return self.model.logits(hidden[torch.tensor(last, device=self.device)])
