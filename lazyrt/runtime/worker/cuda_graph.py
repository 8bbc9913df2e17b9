"""Decode steps replayed from CUDA graphs: one graph per batch size, metadata in static buffers.

Launch overhead dominates a decode step of a small model (hundreds of small kernels); a graph
replays them in one go. Padded rows have an empty page table and write their K/V to a scratch page.
Steps with document attention (per-entry logit scale and mass) replay a second set of graphs,
captured up front when the engine is configured with document attention, else each the first time a
step of its size needs it.
"""

from __future__ import annotations

import numpy as np
import torch

from lazyrt.kernels.metadata import AttentionMetadata
from lazyrt.runtime.worker.step_inputs import StepInputs

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128)


class DecodeGraphs:
    def __init__(
        self, runner, max_batch: int, max_entries_per_seq: int, scratch_page: int, doc_attention: bool = False
    ):
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
        self.entry_logit_scale = torch.ones(e, dtype=torch.float32, device=dev)
        self.entry_log_mass = torch.zeros(e, dtype=torch.float32, device=dev)
        self.scratch_page = scratch_page
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.doc_graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # on first use
        self.pool = torch.cuda.graph_pool_handle()
        for b in reversed(self.sizes):  # largest first: smaller graphs reuse its memory
            self.graphs[b] = self._capture(b, doc_logits=False)
            if doc_attention:
                self.doc_graphs[b] = self._capture(b, doc_logits=True)

    def _meta(self, b: int, doc_logits: bool) -> AttentionMetadata:
        meta = AttentionMetadata(
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
        if doc_logits:
            meta.entry_logit_scale, meta.entry_log_mass = self.entry_logit_scale, self.entry_log_mass
        return meta

    def _forward(self, b: int, doc_logits: bool) -> torch.Tensor:
        r = self.runner
        hidden = r.model.forward(self.input_ids[:b], self._meta(b, doc_logits), r.rope, r.backend)
        return r.model.logits(hidden)

    @torch.inference_mode()
    def _capture(self, b: int, doc_logits: bool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        # The warm-up forwards really run: every row must store to the scratch page and read nothing.
        self.store_pages.fill_(self.scratch_page)
        self.kv_indptr.zero_()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # compile Triton kernels and settle allocations outside the capture
                self._forward(b, doc_logits)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self._forward(b, doc_logits)
        return graph, out

    def fits(self, s: StepInputs) -> bool:
        return (
            s.is_decode
            and len(s.input_ids) <= self.sizes[-1]
            and s.max_kv_entries <= self.max_entries
        )

    @torch.inference_mode()
    def run(self, s: StepInputs) -> torch.Tensor:
        n = len(s.input_ids)
        b = next(x for x in self.sizes if x >= n)
        doc_logits = s.entry_logit_scale is not None
        graphs = self.doc_graphs if doc_logits else self.graphs
        if b not in graphs:  # before the buffers are filled: the capture's forwards clobber them
            graphs[b] = self._capture(b, doc_logits)
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
        if doc_logits:
            put(self.entry_logit_scale, s.entry_logit_scale)
            put(self.entry_log_mass, s.entry_log_mass)
        graph, out = graphs[b]
        graph.replay()
        return out[:n]
