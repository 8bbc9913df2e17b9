"""Decode steps replayed from CUDA graphs: one graph per batch size, metadata in static buffers.

Launch overhead dominates a decode step of a small model (hundreds of small kernels); a graph
replays them in one go. Padded rows have an empty page table and write their K/V to a scratch page.
"""

from __future__ import annotations

import numpy as np
import torch

from lazyrt.kernels.metadata import AttentionMetadata
from lazyrt.runtime.worker.step_inputs import StepInputs

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128)


class DecodeGraphs:
    def __init__(self, runner, max_batch: int, max_entries_per_seq: int, scratch_page: int):
        self.runner = runner
        dev = runner.device
        self.max_entries = max_entries_per_seq
        self.sizes = [b for b in DEFAULT_BATCH_SIZES if b <= max_batch] or [1]
        n, e = self.sizes[-1], self.sizes[-1] * max_entries_per_seq
        i32 = dict(dtype=torch.int32, device=dev)
        self.input_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.store_pages = torch.full((n,), scratch_page, dtype=torch.long, device=dev)
        self.store_slots = torch.zeros(n, dtype=torch.long, device=dev)
        self.qo_indptr = torch.arange(n + 1, **i32)
        self.kv_indptr = torch.zeros(n + 1, **i32)
        self.kv_indices = torch.zeros(e, **i32)
        self.pos_base = torch.zeros(e, **i32)
        self.valid_len = torch.zeros(e, **i32)
        self.scratch_page = scratch_page
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle()
        for b in reversed(self.sizes):  # largest first: smaller graphs reuse its memory
            self.graphs[b] = self._capture(b)

    def _meta(self, b: int) -> AttentionMetadata:
        return AttentionMetadata(
            qo_indptr=self.qo_indptr[: b + 1],
            positions=self.positions[:b],
            kv_indptr=self.kv_indptr[: b + 1],
            kv_indices=self.kv_indices,
            pos_base=self.pos_base,
            valid_len=self.valid_len,
            store_pages=self.store_pages[:b],
            store_slots=self.store_slots[:b],
            rotate_keys=self.runner.rotate_keys,
            max_q_len=1,
            max_kv_entries=self.max_entries,
        )

    def _forward(self, b: int) -> torch.Tensor:
        r = self.runner
        hidden = r.model.forward(self.input_ids[:b], self._meta(b), r.rope, r.backend)
        return r.model.logits(hidden)

    @torch.inference_mode()
    def _capture(self, b: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # compile Triton kernels and settle allocations outside the capture
                self._forward(b)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self._forward(b)
        return graph, out

    def fits(self, s: StepInputs) -> bool:
        # steps with document attention (per-entry logit transforms) run eager: no buffers for them
        return (
            s.is_decode
            and s.entry_logit_scale is None
            and len(s.input_ids) <= self.sizes[-1]
            and s.max_kv_entries <= self.max_entries
        )

    @torch.inference_mode()
    def run(self, s: StepInputs) -> torch.Tensor:
        n = len(s.input_ids)
        b = next(x for x in self.sizes if x >= n)
        pad = b - n
        e = len(s.kv_indices)

        def put(dst: torch.Tensor, values: np.ndarray, pad_value: int | None = None) -> None:
            if pad_value is not None and pad:
                values = np.concatenate([values, np.full(pad, pad_value, dtype=values.dtype)])
            dst[: len(values)].copy_(torch.from_numpy(np.ascontiguousarray(values)), non_blocking=True)

        put(self.input_ids, s.input_ids, 0)
        put(self.positions, s.positions, 0)
        put(self.store_pages, s.store_pages, self.scratch_page)
        put(self.store_slots, s.store_slots, 0)
        put(self.kv_indptr, s.kv_indptr, e)
        put(self.kv_indices, s.kv_indices)
        put(self.pos_base, s.pos_base)
        put(self.valid_len, s.valid_len)
        graph, out = self.graphs[b]
        graph.replay()
        return out[:n]
