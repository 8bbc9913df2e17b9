"""Decode steps replayed from CUDA graphs: one graph per batch size, metadata in static buffers.

Launch overhead dominates a decode step of a small model (hundreds of small kernels); a graph
replays them in one go. Padded rows have an empty page table and write their K/V to a scratch page.
Steps with document attention (per-entry logit scale and mass) replay a second set of graphs,
captured up front when the engine is configured with document attention, else each the first time a
step of its size needs it. Steps with shared-chunk attention (kernels/shared_chunk.py) replay a
third set, captured up front for batches of 2 and more: the shared kernel's persistent grid reads
its live work count from a buffer, so one launch serves every step whose segments fit the buffers.
"""

from __future__ import annotations

import numpy as np
import torch

from lazyrt.kernels.metadata import AttentionMetadata
from lazyrt.kernels.shared_chunk import SharedChunkMeta, wave_items
from lazyrt.kernels.waves import within_one_wave
from lazyrt.runtime.worker.step_inputs import StepInputs

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128)


class DecodeGraphs:
    def __init__(
        self,
        runner,
        max_batch: int,
        max_entries_per_seq: int,
        scratch_page: int,
        doc_attention: bool = False,
        shared: tuple[int, int] | None = None,
    ):
        """shared: (pages per piece, pairs per work item) of shared-chunk attention, or None (off)."""
        self.runner = runner
        dev = runner.device
        self.max_entries = max_entries_per_seq
        self.sizes = [b for b in DEFAULT_BATCH_SIZES if b <= max_batch] or [1]
        n, e = self.sizes[-1], self.sizes[-1] * max_entries_per_seq
        self.qo_indptr = torch.arange(n + 1, dtype=torch.int32, device=dev)  # never put: outside the arena
        # The buffers a step puts, as views of one arena (cuda_graph.Uploads copies a step's puts in
        # a few contiguous ranges): the ones every step puts first, the page tables (unchanged
        # between patched decode steps, often not copied) last.
        i64, i32, f32 = torch.long, torch.int32, torch.float32
        p = 0
        if shared is not None:
            piece_pages = shared[0]
            # each row's parts: its pieces (+ one per run cut short of a piece); distinct pages <= E
            p = n * (max_entries_per_seq // piece_pages + 32)
        specs = [(k, n, i64) for k in ("input_ids", "positions", "store_pages", "store_slots")]
        sh_specs = [
            ("num_work", 1, i32), ("row_part_indptr", n + 1, i32), ("chunk_kv_indptr", p + 1, i32),
            ("chunk_len", p, i32), ("pair_indptr", p + 1, i32), ("pair_row", p, i32),
            ("pair_start", p, i32), ("work_chunk", p, i32), ("work_pair", p, i32), ("row_parts", p, i32),
            ("chunk_kv_indices", e, i32),
        ] if shared is not None else []  # fmt: skip
        specs += sh_specs + [("kv_indptr", n + 1, i32), ("kv_indices", e, i32), ("pos_base", e, i32),
                             ("valid_len", e, i32), ("entry_logit_scale", e, f32),
                             ("entry_log_mass", e, f32)]  # fmt: skip
        self.arena, self.views = arena_views(specs, dev)
        views = self.views
        for name in ("input_ids", "positions", "store_pages", "store_slots", "kv_indptr", "kv_indices",
                     "pos_base", "valid_len", "entry_logit_scale", "entry_log_mass"):  # fmt: skip
            setattr(self, name, views[name])
        self.store_pages.fill_(scratch_page)
        self.entry_logit_scale.fill_(1.0)
        self.scratch_page = scratch_page
        self._uploads = Uploads(dev, arena=self.arena, buffers=views)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.doc_graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # on first use
        # (batch, few): the shared kernel's launch settings differ within one resident wave of work
        # items and past it (triton_shared_chunk.launch_settings); a graph fixes them, so each batch
        # has both and the step's items (shared_chunk.wave_items) pick one
        self.shared_graphs: dict[tuple[int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.shared_block_pairs = 0
        if shared is not None:
            from lazyrt.kernels.triton_shared_chunk import persistent_programs

            self.shared_block_pairs = shared[1]
            self.sh = {name: views[name] for name, _, _ in sh_specs}
            self.shared_programs = persistent_programs(dev)
        # (no pool off CUDA: benchmarks/experiments/host_step_e2e.py fills the buffers on the CPU)
        self.pool = torch.cuda.graph_pool_handle() if dev.type == "cuda" else None
        for b in reversed(self.sizes):  # largest first: smaller graphs reuse its memory
            self.graphs[b] = self._capture(b, doc_logits=False)
            if doc_attention:
                self.doc_graphs[b] = self._capture(b, doc_logits=True)
            if shared is not None and b > 1:
                for few in (False, True):
                    self.shared_graphs[b, few] = self._capture(b, doc_logits=False, shared=True, few=few)

    def _meta(self, b: int, doc_logits: bool, shared: bool = False, few: bool = False) -> AttentionMetadata:
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
        if shared:
            sh = dict(self.sh, row_part_indptr=self.sh["row_part_indptr"][: b + 1])
            # wave_items_host only picks the launch settings here (the grid is fixed): 1 = within a
            # wave, 0 = not known, taken as past it
            meta.shared = SharedChunkMeta(
                **sh, block_pairs=self.shared_block_pairs, num_work_host=int(few),
                programs=self.shared_programs, wave_items_host=int(few),
            )  # fmt: skip
        return meta

    def _forward(self, b: int, doc_logits: bool, shared: bool = False, few: bool = False) -> torch.Tensor:
        r = self.runner
        meta = self._meta(b, doc_logits, shared, few)
        hidden = r.model.forward(self.input_ids[:b], meta, r.rope, r.backend)
        return r.model.logits(hidden)

    @torch.inference_mode()
    def _capture(
        self, b: int, doc_logits: bool, shared: bool = False, few: bool = False
    ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        # The warm-up forwards really run: every row must store to the scratch page and read nothing.
        self._uploads.forget()  # (and the buffers no longer hold what was last put)
        self.store_pages.fill_(self.scratch_page)
        self.kv_indptr.zero_()
        if shared:
            self.sh["num_work"].zero_()
            self.sh["row_part_indptr"].zero_()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # compile Triton kernels and settle allocations outside the capture
                self._forward(b, doc_logits, shared, few)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # tensor parallel: NCCL's watchdog thread polls its own events while this thread captures the
        # all-reduces; "thread_local" checks only this thread's calls
        mode = "global" if self.runner.model.all_reduce is None else "thread_local"
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode=mode):
            out = self._forward(b, doc_logits, shared, few)
        return graph, out

    def fits_shared(self, s: StepInputs, arrays: dict[str, np.ndarray]) -> bool:
        """A decode step (fits holds) has a shared graph and its shared-chunk arrays
        (shared_chunk.build_arrays) fit the graph buffers."""
        b = next(x for x in self.sizes if x >= len(s.input_ids))
        return (b, False) in self.shared_graphs and all(
            len(v) <= self.sh[k].numel() for k, v in arrays.items() if k != "row_part_indptr"
        )

    def fits(self, s: StepInputs) -> bool:
        return (
            s.is_decode
            and len(s.input_ids) <= self.sizes[-1]
            and s.max_kv_entries <= self.max_entries
        )

    def fits_small(self, s: StepInputs, max_q_len: int) -> bool:
        """A step with prefill rows (a question, a short prompt, beside running decodes) that a
        shared graph can replay: its rows fit a captured size and no item has more than max_q_len
        new tokens. Shared-chunk attention attends every row through its (row, position) pairs, so
        a shared graph of b rows serves any mix of decode and prefill rows up to b; its logits
        cover every row and the caller picks the sampled ones."""
        return (
            not s.is_decode
            and s.entry_logit_scale is None
            and s.max_q_len <= max_q_len
            and len(s.input_ids) in range(2, self.sizes[-1] + 1)
            and bool(self.shared_graphs)
        )

    @torch.inference_mode()
    def run(self, s: StepInputs, shared: dict[str, np.ndarray] | None = None) -> torch.Tensor:
        """Replays the step's graph; shared: its shared-chunk arrays (then fits_shared must hold)."""
        n = len(s.input_ids)
        b = next(x for x in self.sizes if x >= n)
        doc_logits = s.entry_logit_scale is not None
        graphs = self.shared_graphs if shared is not None else self.doc_graphs if doc_logits else self.graphs
        key = b
        if shared is not None:
            items = wave_items(shared) * self.runner.pool.num_kv_heads
            key = (b, within_one_wave(items, self.runner.device))
        if key not in graphs:  # before the buffers are filled: the capture's forwards clobber them
            assert shared is None, "shared graphs are captured up front"
            graphs[b] = self._capture(b, doc_logits)
        pad = b - n
        up = self._uploads
        up.begin()
        up.put("input_ids", self.input_ids, s.input_ids, pad, 0)
        up.put("positions", self.positions, s.positions, pad, 0)
        up.put("store_pages", self.store_pages, s.store_pages, pad, self.scratch_page)
        up.put("store_slots", self.store_slots, s.store_slots, pad, 0)
        if shared is None:  # (attention with shared-chunk segments reads them instead of these tables)
            up.put("kv_indptr", self.kv_indptr, s.kv_indptr, pad, len(s.kv_indices))
            up.put("kv_indices", self.kv_indices, s.kv_indices)
            up.put("pos_base", self.pos_base, s.pos_base)
            up.put("valid_len", self.valid_len, s.valid_len)
        if doc_logits:
            up.put("entry_logit_scale", self.entry_logit_scale, s.entry_logit_scale)
            up.put("entry_log_mass", self.entry_log_mass, s.entry_log_mass)
        if shared is not None:
            for k, v in shared.items():
                if k == "row_part_indptr":  # padded rows: no parts
                    up.put(k, self.sh[k], v, pad, int(v[-1]))
                else:
                    up.put(k, self.sh[k], v)
        up.end()
        if s.fill is not None:  # tokens the previous step is sampling (overlapped scheduling)
            rows, src, tokens = s.fill
            self.input_ids[rows] = tokens[src]  # after the copies: they write input_ids
            up.forget("input_ids")  # the buffer now holds more than what was put
        graph, out = graphs[key]
        graph.replay()
        return out[:n]


def arena_views(specs: list[tuple[str, int, torch.dtype]], device: torch.device) -> tuple[torch.Tensor, dict]:
    """One zeroed uint8 tensor holding a buffer per (name, numel, dtype), each 64-byte aligned: (the
    arena, name -> its typed view)."""
    offsets, at = [], 0
    for _, numel, dtype in specs:
        offsets.append(at)
        at += -(-max(numel, 1) * dtype.itemsize // 64) * 64
    arena = torch.zeros(at, dtype=torch.uint8, device=device)
    views = {name: arena[off : off + numel * dtype.itemsize].view(dtype)
             for (name, numel, dtype), off in zip(specs, offsets)}  # fmt: skip
    return arena, views


# Dirty ranges of the arena closer than this many bytes go out as one copy (the gap between them
# copied too): one copy costs ~35 us of host time on the H100 machine, a few KB more of it nothing.
MERGE_GAP_BYTES = 1 << 16


class Uploads:
    """Host values into the graphs' static buffers, without a pinned allocation per copy, and in few
    copies: one per buffer cost ~35 us of host time each on the H100 machine (slicing and copy_),
    ~0.5 ms for a question step's 15 buffers, in front of its first token. On CUDA the buffers are
    views of one arena (arena_views) with a pinned host mirror (two sets, used in turn; an event per
    set says when the copies out of it are done, so a set is rewritten only after its last copies
    ran); `put` writes the mirror and `end` copies the step's written ranges, merged where they are
    close: the bytes between two ranges are copied too, so the mirror's copy of any buffer there is
    first brought up to what the device holds (its last put); a range holding a buffer the device
    holds no known put of (never put, or `forget`: written on the device) is never copied over.
    The CPU buffers are written directly. A buffer
    whose values are the same array object (and padding) as its last put is not copied again: a
    decode step patched from the last one (step_inputs.decode_inputs) shares the page-table arrays
    that did not change. Values must not change in place once put."""

    def __init__(
        self,
        device: torch.device,
        stage: bool | None = None,
        arena: torch.Tensor | None = None,
        buffers: dict[str, torch.Tensor] | None = None,
    ):
        """stage: go through host mirrors (default: on CUDA; tests force it on the CPU; needs the
        arena). arena: the uint8 tensor the buffers are views of (arena_views); buffers: every view
        of it by name (one not yet put is then never copied over)."""
        self.cuda = device.type == "cuda"
        self.stage = self.cuda if stage is None else stage
        self._arena = arena if self.stage else None
        if self.stage and arena is None:
            raise ValueError("Uploads through host mirrors needs the arena the buffers are views of")
        self._mirrors: list[torch.Tensor] = []
        # arena buffers: name -> (byte offset, the two mirrors' numpy views, itemsize), by offset
        self._places: dict[str, tuple[int, list[np.ndarray], int]] = {}
        if self._arena is not None:
            self._mirrors = [torch.zeros(arena.numel(), dtype=torch.uint8, pin_memory=self.cuda)
                             for _ in range(2)]  # fmt: skip
            for name, t in sorted((buffers or {}).items(), key=lambda kv: kv[1].data_ptr()):
                off, n = t.data_ptr() - arena.data_ptr(), t.numel() * t.element_size()
                if not (0 <= off <= arena.numel() - n and t.is_contiguous()):
                    raise ValueError(f"graph buffer {name} is not a view of the arena")
                self._places[name] = (off, [m[off : off + n].view(t.dtype).numpy() for m in self._mirrors],
                                      t.element_size())  # fmt: skip
        self._events = [torch.cuda.Event(), torch.cuda.Event()] if self.cuda else []
        self._recorded = [False, False]
        self._set = 0
        self._last: dict[str, tuple] = {}  # name -> (values, pad, pad value) now in the buffer
        self._mirrored: list[dict[str, tuple]] = [{}, {}]  # each mirror: name -> the put it holds
        self._dirty: list[tuple[int, int, str]] = []  # this step's written ranges (bytes)
        self.copies = 0  # arena copies made (tests)

    def begin(self) -> None:
        """Before a step's puts: the mirror set about to be written has finished its last copies."""
        if self.cuda and self._recorded[self._set]:
            self._events[self._set].synchronize()
        self._dirty = []

    def put(self, name: str, dst: torch.Tensor, values: np.ndarray, pad: int = 0, pad_value=0) -> None:
        """dst[:len(values)] = values, then `pad` entries of pad_value."""
        key = (values, pad, pad_value)
        last = self._last.get(name)
        if last is not None and last[0] is values and last[1:] == key[1:]:
            return
        if self.stage:
            off, views, itemsize = self._places[name]
            _write(views[self._set], key)
            self._mirrored[self._set][name] = key
            self._dirty.append((off, off + (len(values) + pad) * itemsize, name))
        else:
            _write(dst.numpy(), key)
        self._last[name] = key

    def end(self) -> None:
        """After a step's puts (before its replay): copy them, mark the set's copies, use the other
        set next."""
        if self._dirty:
            mirror = self._mirrors[self._set]
            for lo, hi in self._ranges():
                self._arena[lo:hi].copy_(mirror[lo:hi], non_blocking=True)
                self.copies += 1
            self._dirty = []
        if self.cuda:
            self._events[self._set].record()
            self._recorded[self._set] = True
        self._set ^= 1

    def _ranges(self) -> list[tuple[int, int]]:
        """This step's dirty ranges merged across gaps under MERGE_GAP_BYTES that hold only buffers
        whose last put this mirror can be brought up to (then it is)."""
        written = {name for _, _, name in self._dirty}
        out: list[list[int]] = []
        for lo, hi, _ in sorted(self._dirty):
            if out and lo - out[-1][1] <= MERGE_GAP_BYTES and self._refresh_between(out[-1][1], lo, written):
                out[-1][1] = max(out[-1][1], hi)
            else:
                out.append([lo, hi])
        return [(lo, hi) for lo, hi in out]

    def _refresh_between(self, lo: int, hi: int, written: set[str]) -> bool:
        """Makes this mirror hold the device's values of every buffer starting in [lo, hi) (what the
        device holds past a buffer's put is read by no graph); False if one has no known put."""
        s = self._set
        for name, (off, views, itemsize) in self._places.items():
            if off >= hi:
                break
            if off + views[s].size * itemsize <= lo or name in written:
                continue
            last = self._last.get(name)
            if last is None:
                return False
            if self._mirrored[s].get(name) is not last:
                _write(views[s], last)
                self._mirrored[s][name] = last
        return True

    def forget(self, name: str | None = None) -> None:
        """The buffer (every buffer: None) was written by something else: put it again next time."""
        if name is None:
            self._last.clear()
        else:
            self._last.pop(name, None)


def _write(host: np.ndarray, key: tuple) -> None:
    """host[:n] = values, then pad entries of pad_value (key: (values, pad, pad_value))."""
    values, pad, pad_value = key
    n = len(values)
    host[:n] = values
    host[n : n + pad] = pad_value
