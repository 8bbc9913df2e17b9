"""ModelRunner: owns the model, the KV pages and the attention backend; runs one StepPlan."""

from __future__ import annotations

import logging

import numpy as np
import torch

from lazyrt.cache.chunk_table import Transfer
from lazyrt.cache.host_pool import HostKVPool
from lazyrt.cache.page_pool import PagePool
from lazyrt.kernels.attention_ref import copy_rerotate_pages_ref
from lazyrt.kernels.backend import make_backend
from lazyrt.kernels.flashinfer_backend import FlashInferPrefillBackend
from lazyrt.kernels.host_copy import to_device
from lazyrt.kernels.metadata import AttentionMetadata
from lazyrt.kernels.ragged_prefill import (
    MIN_SPLIT_DECODE_KEYS,
    RaggedKeys,
    decode_split,
    ragged_keys,
    rows_index,
)
from lazyrt.kernels.rope import RopeCache
from lazyrt.kernels.shared_chunk import SharedChunkMeta, build_arrays, group_segments
from lazyrt.kernels.waves import half_piece_items, round_items
from lazyrt.models.llama import LlamaModel
from lazyrt.retrieval.host_attention import (
    HostAttention,
    HostIndexCache,
    RetrievalOptions,
    add_host_pairs,
    host_rows,
    offload_index_build,
)
from lazyrt.runtime.scheduler.plan import PENDING_TOKEN, ForwardItem, PageCopy, StepPlan
from lazyrt.runtime.scheduler.recompute import PROBE_LAYER
from lazyrt.runtime.worker.citations import DocumentAttention
from lazyrt.runtime.worker.host_segments import has_host_segments, split_host_segments
from lazyrt.runtime.worker.peer_pools import PeerPools
from lazyrt.runtime.worker.step_inputs import (
    SHARED_MAX_Q_LEN,
    SHARED_PIECE_TOKENS,
    DecodeLayout,
    SharedGrouping,
    StepInputs,
    shared_arrays,
)

logger = logging.getLogger("lazyrt.worker")


class ModelRunner:
    def __init__(
        self,
        model: LlamaModel,
        pool: PagePool,
        max_positions: int,
        rotate_keys: bool,
        shared_chunk_attention: bool = False,
        lazy_flashinfer_prefill: bool = False,
        host_kv: HostKVPool | None = None,
        retrieval: RetrievalOptions | None = None,
        tp_size: int = 1,
        kv_replicas: int = 1,
    ):
        """tp_size, kv_replicas: tensor parallelism (the model is one rank's shard; each KV head is
        held by kv_replicas ranks): per-head sums in probes and citations are all-reduced."""
        self.model = model
        self.tp_size, self.kv_replicas = tp_size, kv_replicas
        self.host_kv = host_kv  # the host KV tier's pages (None = off)
        self.peer_pools = PeerPools(pool)  # peer KV: other replicas' pools, mapped when a step asks
        # retrieval attention over host segments (None = off); its indexes; steps that used it
        self.retrieval = retrieval
        cuda = model.device.type == "cuda"
        self.host_indexes = HostIndexCache(
            retrieval.build_threads if retrieval is not None else 0, str(model.device) if cuda else None
        )
        if retrieval is not None and host_kv is not None and cuda:
            self.host_indexes.key_tables_for(host_kv.kv)  # read by the device fill (pinned: allocate now)
        self.retrieval_steps = 0
        self._rope_cpu: RopeCache | None = None
        # lazy only: the shared kernel rotates keys by their local index (pages hold unrotated keys)
        self.shared_chunk_attention = shared_chunk_attention and rotate_keys
        c = model.config
        self.shared_block_pairs = max(1, 64 // (c.num_heads // c.num_kv_heads))  # ~64 query rows per item
        # full pieces' worth of document keys under which a step takes half-size pieces
        self.shared_half_items = half_piece_items(pool.num_kv_heads, model.device)
        self.shared_round_items = round_items(model.device)
        self.shared_steps = 0  # steps run through shared-chunk attention (tests, stats)
        self.graph_steps = 0  # steps replayed from a CUDA graph (the rest launch eagerly)
        self.shared_work_items = 0  # summed over the steps grouped for shared-chunk attention (stats)
        self.ragged_steps = 0  # steps through FlashInfer's ragged prefill (lazy_flashinfer_prefill)
        self._piece_keys: dict = {}  # interned PieceKeys (shared_chunk.run_pieces); cleared when large
        self._grouping = SharedGrouping()  # the last step's document-run grouping (shared_arrays)
        self._rest_grouping = SharedGrouping()  # the same for some of a step's sequences (_part_meta)
        self.decode_splits = 0  # lazy steps whose decodes launched apart from longer sequences (decode_split)
        self.split_decode_keys = MIN_SPLIT_DECODE_KEYS
        self._layout = DecodeLayout()  # the last step's batch and inputs (from_plan patches decode steps)
        self.pool = pool
        self.device = model.device
        self.rope = RopeCache.build(model.config, max_positions, self.device)
        self.rotate_keys = rotate_keys
        self.backend = make_backend(
            self.device, pool.kv, self.rope, model.config.head_dim**-0.5,
            use_flashinfer=not rotate_keys or lazy_flashinfer_prefill,
        )  # fmt: skip
        # lazy: consecutive prefill steps through FlashInfer's ragged prefill (where FlashInfer loaded)
        self.ragged_prefill = rotate_keys and isinstance(self.backend, FlashInferPrefillBackend)
        self._copy_rerotate = copy_rerotate_pages_ref
        # the last deferred step's sampled tokens (device) and each request's row in them: a step
        # launched before they reach the host takes its PENDING_TOKEN inputs from here
        self.prev_tokens: tuple[torch.Tensor, dict[int, int]] | None = None
        self._fill_memo: tuple | None = None  # (rows, src, their device tensors): _fill_index
        self._citation_probe: tuple | None = None  # (DocumentAttention, rids) of the last step
        self.graphs = None
        if self.device.type == "cuda":
            from lazyrt.kernels.triton_kv import copy_rerotate_pages_triton

            self._copy_rerotate = copy_rerotate_pages_triton

    def warm_up_attention(self, doc_attention: bool = False) -> int:
        """Compile every variant of the Triton attention kernels a step can launch (CUDA only), so that
        no request waits for a compile mid-serving (a fresh machine's first steps of a new shape
        stalled the engine for seconds: benchmarks/experiments/compile_stalls.py); doc_attention:
        document attention's variants too (a server configured with it). Later starts load them from
        Triton's disk cache. Returns the warm-up steps run (0 off CUDA)."""
        if self.device.type != "cuda":
            return 0
        from lazyrt.kernels.triton_attention import warm_up

        c = self.model.config
        q_heads = self.pool.num_kv_heads * (c.num_heads // c.num_kv_heads)  # this rank's
        scale = c.head_dim**-0.5
        steps = warm_up(self.pool.kv[0], self.rope, q_heads, self.rotate_keys, scale, doc_attention)
        return steps + self.warm_up_ragged(q_heads)

    def warm_up_ragged(self, q_heads: int) -> int:
        """Compile FlashInfer's ragged prefill (on first use otherwise); where it cannot be built or run
        here, lazy prefill keeps the lazy kernels (lazy_flashinfer_prefill is an optimization: a server
        that served before must not fail to start for it). Returns the steps run."""
        if not self.ragged_prefill:
            return 0
        try:
            return self.backend.warm_up_ragged(q_heads)
        except Exception as e:  # noqa: BLE001 - any JIT or launch failure: fall back
            self.ragged_prefill = False
            logger.warning("FlashInfer's ragged prefill failed to warm up (%s: %s); documents' prefill keeps "
                           "the lazy kernels", type(e).__name__, str(e)[:300])  # fmt: skip
            return 0

    def enable_cuda_graphs(self, max_batch: int, max_context: int, doc_attention: bool = False) -> None:
        """Capture decode graphs for batch sizes up to max_batch (CUDA only); with doc_attention the
        document-attention graphs too (else each is captured when a step first needs it)."""
        from lazyrt.runtime.worker.cuda_graph import DecodeGraphs

        ps = self.pool.page_size
        # one entry per page plus slack for segments ending in a partly filled page (chunk tails)
        max_entries = -(-max_context // ps) + 64
        if not self.pool.scratch_pages:
            raise ValueError("CUDA graphs need a PagePool built with scratch_pages=1")
        shared = None
        if self.shared_chunk_attention:
            shared = (max(1, SHARED_PIECE_TOKENS // 2 // ps), self.shared_block_pairs)  # the smaller pieces
        self.graphs = DecodeGraphs(
            self,
            max_batch,
            max_entries,
            scratch_page=self.pool.scratch_pages[0],
            doc_attention=doc_attention,
            shared=shared,
        )

    def step_inputs(self, plan: StepPlan) -> StepInputs:
        """StepInputs.from_plan, with the rows whose token is still in flight mapped to prev_tokens."""
        s = StepInputs.from_plan(plan, self.pool.page_size, self._layout)
        rows = np.flatnonzero(s.input_ids == PENDING_TOKEN)
        if len(rows):
            items = np.searchsorted(s.qo_indptr, rows, side="right") - 1
            reqs = [plan.items[i].request for i in items.tolist()]
            rids = [r.rid if r is not None else None for r in reqs]
            row_of = self.prev_tokens[1] if self.prev_tokens is not None else {}
            src = np.fromiter((row_of.get(r, -1) for r in rids), np.int64, len(rids))
            if self.prev_tokens is None or (src < 0).any():
                raise RuntimeError(f"step items of requests {rids} wait on tokens no step in flight samples")
            s.fill = (*self._fill_index(rows, src), self.prev_tokens[0])
            s.input_ids[rows] = 0  # any valid id until the device fills it in
        return s

    def _fill_index(self, rows: np.ndarray, src: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """rows and src on the device; the last step's tensors when they are the same (a run of
        overlapped decode steps over one batch: two host-to-device copies a step saved)."""
        memo = self._fill_memo
        if memo is None or not (np.array_equal(memo[0], rows) and np.array_equal(memo[1], src)):
            memo = self._fill_memo = (rows, src, to_device(rows, self.device, torch.long),
                                      to_device(src, self.device))  # fmt: skip
        return memo[2], memo[3]

    def build_metadata(self, s: StepInputs) -> tuple[torch.Tensor, AttentionMetadata]:
        def t(x, dtype: torch.dtype) -> torch.Tensor:
            return to_device(x, self.device, dtype)

        meta = AttentionMetadata(
            qo_indptr=t(s.qo_indptr, torch.int32),
            positions=t(s.positions, torch.long),
            kv_indptr=t(s.kv_indptr, torch.int32),
            kv_indices=t(s.kv_indices, torch.int32),
            pos_base=t(s.pos_base, torch.int32),
            valid_len=t(s.valid_len, torch.int32),
            store_pages=t(s.store_pages, torch.long),
            store_slots=t(s.store_slots, torch.long),
            rotate_keys=self.rotate_keys,
            max_q_len=s.max_q_len,
            max_kv_entries=s.max_kv_entries,
            # only prefill steps of non-lazy modes can go to FlashInfer: skip the scan otherwise
            dense_pages=not self.rotate_keys and s.max_q_len > 1 and s.dense_pages(self.pool.page_size),
        )
        if s.entry_logit_scale is not None:
            meta.entry_logit_scale = t(s.entry_logit_scale, torch.float32)
            meta.entry_log_mass = t(s.entry_log_mass, torch.float32)
        input_ids = t(s.input_ids, torch.long)
        if s.fill is not None:
            rows, src, tokens = s.fill
            input_ids[rows] = tokens[src]
        return input_ids, meta

    def _shared(self, plan: StepPlan, s: StepInputs) -> dict | None:
        """The step's shared-chunk arrays (step_inputs.shared_arrays), cached on s (the graph check
        and the metadata ask); the grouping of the runs other than the items' own is reused from
        the previous step when the batch repeats them."""
        if not self.shared_chunk_attention:
            return None
        if s.shared is False:
            s.shared = self._shared_arrays(plan, s)
            if s.shared is not None:
                self.shared_work_items += int(s.shared["num_work"][0])
        return s.shared

    @property
    def shared_piece_tokens(self) -> int:
        """The piece size of the batch's last grouping of its documents (0: none yet)."""
        return self._grouping.key[0] if self._grouping.key is not None else 0

    def _shared_arrays(self, plan: StepPlan, s: StepInputs, force: bool = False) -> dict | None:
        if len(self._piece_keys) > 1 << 16:
            self._piece_keys.clear()
        return shared_arrays(
            plan, s, self.pool.page_size, self.shared_block_pairs, self._grouping, self._piece_keys,
            self._layout, force=force, half_items=self.shared_half_items, kv_heads=self.pool.num_kv_heads,
            round_items=self.shared_round_items,
        )

    def _part_meta(self, plan: StepPlan, tables: dict) -> AttentionMetadata:
        """Some of a lazy step's sequences on their own (ragged_prefill.sequence_tables: a split step's
        other sequences, or one part of decode_split): through shared-chunk attention when they share
        documents enough to pay (shared_arrays over them alone: in a document's prefill step under
        load the running decodes then read each shared document once, as in decode steps), else per
        sequence, with their decodes launched apart when they mix (decode_split)."""
        meta = AttentionMetadata.from_tables(tables, self.device)
        if self.shared_chunk_attention:
            part = StepPlan(items=[plan.items[i] for i in tables["seqs"]])
            sub = StepInputs(qo_indptr=tables["qo_indptr"], input_ids=np.empty(len(tables["rows"]), np.int64))
            arrays = shared_arrays(
                part, sub, self.pool.page_size, self.shared_block_pairs, self._rest_grouping,
                self._piece_keys, half_items=self.shared_half_items, kv_heads=self.pool.num_kv_heads,
                round_items=self.shared_round_items,
            )  # fmt: skip
            if arrays is not None:
                self.shared_steps += 1
                meta.shared = SharedChunkMeta.from_arrays(arrays, self.shared_block_pairs, self.device)
                return meta
        names = ("qo_indptr", "positions", "kv_indptr", "kv_indices", "pos_base", "valid_len")
        split = decode_split(*(tables[n] for n in names), min_keys=self.split_decode_keys)
        if split is not None:
            self.decode_splits += 1
            meta.parts = tuple(self._part(plan, tables, t) for t in split)
        return meta

    def _part(self, plan: StepPlan, tables: dict, part: dict) -> tuple:
        """(rows, metadata) of one part of decode_split over tables (whose own seqs and rows are the
        step's): the part's indices into tables made the step's."""
        step_part = dict(part, seqs=tables["seqs"][part["seqs"]], rows=tables["rows"][part["rows"]])
        return rows_index(part["rows"], self.device), self._part_meta(plan, step_part)

    def step_metadata(self, plan: StepPlan, s: StepInputs) -> tuple[torch.Tensor, AttentionMetadata]:
        """build_metadata, with the step's shared-chunk segments when it has some worth sharing; a lazy
        prefill step: its sequences at consecutive positions through FlashInfer (ragged_keys) and
        the others through _part_meta, or, with none of those, its decodes launched apart
        (decode_split)."""
        input_ids, meta = self.build_metadata(s)
        arrays = self._shared(plan, s)
        if arrays is not None:
            self.shared_steps += 1
            meta.shared = SharedChunkMeta.from_arrays(arrays, self.shared_block_pairs, self.device)
        elif self.rotate_keys and s.max_q_len > 1 and s.entry_logit_scale is None:
            tables = (s.qo_indptr, s.positions, s.kv_indptr, s.kv_indices, s.pos_base, s.valid_len)
            keys = ragged_keys(*tables) if self.ragged_prefill else None
            if keys is not None:
                self.ragged_steps += 1
                meta.ragged = RaggedKeys.from_arrays(keys, self.device)
                if "q_rows" in keys:  # split: the other sequences on their own
                    rest = {name[5:]: a for name, a in keys.items() if name.startswith("rest_")}
                    meta.ragged_rest = self._part_meta(plan, rest)
            elif (split := decode_split(*tables, min_keys=self.split_decode_keys)) is not None:
                self.decode_splits += 1
                every = {"seqs": np.arange(s.num_seqs), "rows": np.arange(len(s.positions))}
                meta.parts = tuple(self._part(plan, every, t) for t in split)
        return input_ids, meta

    def copy_pages(self, copies: list[PageCopy]) -> None:
        """Block mode: all of a step's page copies (every layer) in one kernel launch on CUDA; per
        document and layer launches cost ~15 ms of host time for a 5-document request."""
        src = [p for c in copies for p in c.src]
        dst = [p for c in copies for p in c.dst]
        delta = [c.delta for c in copies for _ in c.src]
        if max(map(abs, delta), default=0) >= self.rope.cos.shape[0]:
            raise ValueError(f"block copy delta {max(map(abs, delta))} exceeds the RoPE table")
        src_t, dst_t, delta_t = (
            torch.tensor(x, dtype=torch.int32, device=self.device) for x in (src, dst, delta)
        )
        self._copy_rerotate(self.pool.kv_all, src_t, dst_t, delta_t, self.rope)

    @torch.inference_mode()
    def run_copies(self, plan: StepPlan) -> None:
        """The step's page copies, queued on the device stream before its kernels (and after every
        earlier step's): host tier offloads, then loads (a load may refill device pages an offload
        of this step reads, or read host pages one fills), then block mode's copies (which may read
        a chunk this step loads)."""
        if (plan.offloads or plan.loads) and self.host_kv is None:
            raise RuntimeError("a step moves pages to or from the host tier, but this worker has none")
        for t in plan.offloads:
            self.host_indexes.invalidate(t.dst)  # those host pages now hold another chunk
            self.host_kv.offload(t.src, t.dst)
            self._index_on_offload(t)
        for t in plan.loads:
            self.host_kv.load(t.src, t.dst)
        if plan.peer_pools:
            self.peer_pools.map(plan.peer_pools)
        if plan.peer_loads:  # after the host loads, before block copies (which may read these chunks)
            self.peer_pools.load(plan.peer_loads)
        if plan.copies:
            self.copy_pages(plan.copies)

    def _index_on_offload(self, t: Transfer) -> None:
        """Retrieval attention with builder threads: a chunk that just left for the host tier is indexed
        now (every layer, off the step, on the build device), so its first step there searches
        instead of attending every key while the indexes build."""
        opts = self.retrieval
        if opts is None or not opts.build_threads or t.num_tokens < 2:
            return
        n = t.num_tokens
        sink = min(opts.sink, n - 1)  # as HostAttention's parts
        if opts.top_k >= n - sink:
            return  # attended exactly: no index
        keys = [(tuple(t.dst), n, layer, sink) for layer in range(self.pool.kv_all.shape[0])]
        # self.rope lives on the worker's device: the build device (CUDA) or the CPU
        build = offload_index_build(self.host_kv.kv, t.dst, n, sink, self.rope, opts.build_device)
        self.host_indexes.prebuild(keys, build)

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> torch.Tensor | None:
        """Runs the step; returns fp32 logits [n_sampled, vocab] for items with a request, in order."""
        self.run_copies(plan)
        self._citation_probe = None
        if not plan.items:
            return None
        if has_host_segments(plan):
            return self._execute_host(plan)
        s = self.step_inputs(plan)
        if any(it.request is not None and it.request.params.citations for it in plan.items):
            input_ids, meta = self.step_metadata(plan, s)
            hidden = self.model.forward(input_ids, meta, self.rope, self._citing(plan, s))
            return self.model.logits(hidden[self._sample_index(s)])
        if self.graphs is not None and self.graphs.fits(s):
            arrays = self._shared(plan, s)
            if arrays is None:
                self.graph_steps += 1
                return self.graphs.run(s)
            if self.graphs.fits_shared(s, arrays):
                self.shared_steps += 1
                self.graph_steps += 1
                return self.graphs.run(s, arrays)
        elif self.graphs is not None and self.graphs.fits_small(s, SHARED_MAX_Q_LEN):
            # a small step with prefill rows (a question over cached documents): replayed through
            # shared-chunk attention even when nothing repeats (its launches cost ~4 ms of host time)
            arrays = self._shared_arrays(plan, s, force=True)
            if arrays is not None and self.graphs.fits_shared(s, arrays):
                self.shared_steps += 1
                self.graph_steps += 1
                logits = self.graphs.run(s, arrays)
                rows = s.sample_rows
                if not len(rows):
                    return None
                if rows[-1] - rows[0] + 1 == len(rows):  # consecutive (a lone question: its last row)
                    return logits[rows[0] : rows[-1] + 1]  # a view: no index upload (~0.1 ms cold)
                return logits[self._sample_index(s)]
        input_ids, meta = self.step_metadata(plan, s)
        hidden = self.model.forward(input_ids, meta, self.rope, self.backend)
        if not s.sample_rows:
            return None
        return self.model.logits(hidden[self._sample_index(s)])

    def _execute_host(self, plan: StepPlan) -> torch.Tensor | None:
        """A step with host segments (retrieval attention): eager, through shared-chunk attention
        over the device segments (every run its own segment where nothing repeats), with one more
        part per (query row, host segment) that HostAttention fills layer by layer."""
        if self.retrieval is None or self.host_kv is None or not self.rotate_keys:
            raise RuntimeError("a step attends host-tier pages, but this worker has no retrieval attention")
        device_plan, parts = split_host_segments(plan)
        s = self.step_inputs(device_plan)
        if s.entry_logit_scale is not None:
            raise RuntimeError("retrieval attention does not support document attention (doc_attention_*)")
        input_ids, meta = self.build_metadata(s)
        ps, qo = self.pool.page_size, s.qo_indptr
        items = device_plan.items
        runs = [[(g.pages, g.num_tokens, g.start_pos) for g in it.segments if g.num_tokens] for it in items]
        seqs = [(range(qo[i], qo[i + 1]), r) for i, r in enumerate(runs)]
        segments, _, _ = group_segments(seqs, ps, SHARED_PIECE_TOKENS)
        arrays = build_arrays(segments, ps, len(s.input_ids), self.shared_block_pairs)
        host = host_rows(parts, qo)
        add_host_pairs(arrays, host)
        meta.shared = SharedChunkMeta.from_arrays(arrays, self.shared_block_pairs, self.device)
        if self._rope_cpu is None:
            self._rope_cpu = self.rope.to("cpu")
        scale = self.model.config.head_dim**-0.5
        opts, indexes = self.retrieval, self.host_indexes
        # on CUDA the host parts are computed on the device, reading the pinned host tier in place
        on_device = self.rope if self.device.type == "cuda" else None
        meta.host = HostAttention(host, self.host_kv.kv, self._rope_cpu, scale, opts, indexes, on_device)
        self.retrieval_steps += 1
        hidden = self.model.forward(input_ids, meta, self.rope, self._citing(plan, s))
        if not s.sample_rows:
            return None
        return self.model.logits(hidden[self._sample_index(s)])

    def _sample_index(self, s: StepInputs) -> torch.Tensor:
        """The step's sampled rows (each item's last token), on the device."""
        return to_device(np.array(s.sample_rows, dtype=np.int64), self.device)

    def _citing(self, plan: StepPlan, s: StepInputs):
        """The step's attention backend; wrapped, when a request asks for citations, to measure each
        document's share of its sampling row's attention (worker/citations.py) into self.citations."""
        sampling = [it for it in plan.items if it.request is not None]
        rows = [(r, it) for r, it in zip(s.sample_rows, sampling) if it.request.params.citations]
        if not rows:
            return self.backend
        scale, layers = self.backend.sm_scale, self.model.config.num_layers
        backend = DocumentAttention(self.backend, rows, self.rope, self.rotate_keys, scale, layers)
        self._citation_probe = (backend, [it.request.rid for _, it in rows])
        return backend

    def take_citations(self) -> dict[int, list[float]] | None:
        """The last step's citations (rid -> each document's attention share), once."""
        probe, self._citation_probe = self._citation_probe, None
        if probe is None:
            return None
        backend, rids = probe
        if self.model.all_reduce is not None:  # each rank's mean over its heads -> mean over all heads
            with torch.inference_mode():  # the masses are inference tensors
                backend.mass = [self.model.all_reduce(m).div_(self.tp_size) for m in backend.mass]
        return dict(zip(rids, backend.result()))

    @torch.inference_mode()
    def probe_deviation(self, items: list[ForwardItem], layer: int = PROBE_LAYER) -> list[list[float]]:
        """Deviation recompute probes (scheduler/recompute.py): each item is a document's tokens in
        its request's context, its target the document's cached pages. Runs the layers before
        `layer` (layer 0's K/V are context-free, so the cached pages already hold the in-context
        ones), writes nothing, and returns per page of each target the mean over its tokens of
        |K_ctx - K_cached|^2 + |V_ctx - V_cached|^2 at `layer`."""
        if not items:
            return []
        if not self.pool.scratch_pages:
            raise ValueError("deviation probes need a PagePool built with scratch_pages=1")
        ps = self.pool.page_size
        s = StepInputs.from_plan(StepPlan(items=items), ps)
        pages, slots = s.store_pages, s.store_slots
        # The targets are shared chunk pages: every store goes to the scratch page instead.
        s.store_pages = np.full_like(pages, self.pool.scratch_pages[0])
        s.store_slots = np.arange(len(slots), dtype=slots.dtype) % ps
        input_ids, meta = self.build_metadata(s)
        k, v = self.model.layer_kv(input_ids, meta, self.rope, self.backend, layer)
        if not self.rotate_keys:  # non-lazy modes store keys rotated at their positions
            k = self.model.ops.rope(k.contiguous(), meta.positions, self.rope)
        kv = self.pool.kv[layer]
        pages_t = torch.as_tensor(pages, device=self.device)
        slots_t = torch.as_tensor(slots, device=self.device)
        dev = (k.float() - kv[pages_t, 0, slots_t].float()).square().sum((1, 2))
        dev += (v.float() - kv[pages_t, 1, slots_t].float()).square().sum((1, 2))
        if self.model.all_reduce is not None:  # this rank's KV heads -> all heads (replicas counted once)
            dev = self.model.all_reduce(dev.contiguous()).div_(self.kv_replicas)
        dev = dev.cpu().numpy()
        out = []
        for i, it in enumerate(items):
            lo, hi = int(s.qo_indptr[i]), int(s.qo_indptr[i + 1])
            page = (s.positions[lo:hi] - it.target.start_pos) // ps
            n = -(-it.target.num_tokens // ps)
            total = np.bincount(page, weights=dev[lo:hi], minlength=n)
            count = np.maximum(np.bincount(page, minlength=n), 1)
            out.append((total / count).tolist())
        return out
