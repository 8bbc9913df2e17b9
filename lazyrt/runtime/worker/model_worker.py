"""ModelWorker: the only owner of the device, the model weights and the KV page tensors.

It runs one StepMsg at a time and samples one token per requesting item (it holds the logits;
per-request torch generators give seeded sampling). The scheduler never sees a tensor. A deferred
StepMsg (overlapped scheduling, scheduler/engine_core.py) is launched and answered with the
previous deferred step's tokens, so the host builds one step while the device runs the last.
"""

from __future__ import annotations

import logging
import time
import traceback
from collections.abc import Callable

import torch

from lazyrt.cache.host_pool import HostKVPool
from lazyrt.cache.page_pool import PagePool
from lazyrt.config import EngineConfig
from lazyrt.models.config import ModelConfig, UnsupportedModelError
from lazyrt.models.llama import LlamaModel
from lazyrt.models.loader import load_model
from lazyrt.models.tensor_parallel import kv_replicas, vocab_parallel
from lazyrt.retrieval.device_fill import reserved_device_bytes
from lazyrt.retrieval.host_attention import RetrievalOptions
from lazyrt.runtime.ipc.messages import StepMsg, StepResult, WorkerReady
from lazyrt.runtime.scheduler.plan import StepPlan
from lazyrt.runtime.scheduler.step_wire import StepDecoder
from lazyrt.runtime.worker.grammar import GrammarConstraints
from lazyrt.runtime.worker.logits_processing import LogitsProcessing, logprob_entries, token_logprobs
from lazyrt.runtime.worker.model_runner import ModelRunner
from lazyrt.runtime.worker.sampler import sample_tokens_device
from lazyrt.runtime.worker.tp_group import RankWatch, TPGroup, TPGroupBroken
from lazyrt.runtime.worker.tp_ranks import PlanLinks, TPMember
from lazyrt.sampling_params import SamplingParams

logger = logging.getLogger("lazyrt.worker")

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(device: str) -> str:
    dev = "cuda" if device == "auto" and torch.cuda.is_available() else device
    return "cpu" if dev == "auto" else dev


class StartupOutOfMemory(RuntimeError):
    """The device (or, for a CPU pool or the host tier, the host) ran out of memory while the worker set
    up its KV pool, runner or CUDA graphs."""


def startup_oom_message(cfg: EngineConfig, pool: PagePool | None, free_after_weights: int | None) -> str:
    """What a start-up out-of-memory error says: how the KV pool was sized and which flags leave more
    room (the memory the pool does not take holds the CUDA graphs and the steps' activations)."""
    gib = 1 << 30
    if cfg.kv_cache_tokens is not None:
        sizing = [f"kv_cache_tokens={cfg.kv_cache_tokens}"]
    else:
        sizing = [f"kv_cache_memory_fraction={cfg.kv_cache_memory_fraction} of the free memory"]
    if free_after_weights:
        sizing.append(f"{free_after_weights / gib:.1f} GiB free after loading the weights")
    if pool is None:
        where = f"allocating the KV pool ({'; '.join(sizing)})"
    else:
        took = pool.kv_all.nbytes
        if free_after_weights:
            sizing.append(f"{(free_after_weights - took) / gib:.1f} GiB left")
        sizing.insert(0, f"{pool.num_pages} pages")
        where = f"setting up after the KV pool took {took / gib:.1f} GiB ({'; '.join(sizing)})"
    return (
        f"the device ran out of memory at start-up, {where}: pass a smaller --kv-cache-memory-fraction "
        "(kv_cache_memory_fraction) or --kv-cache-tokens, a smaller --max-step-tokens, or "
        "--cuda-graph-max-batch 0 (no CUDA graphs)"
    )


def host_out_of_memory(e: BaseException) -> bool:
    """Whether e is the host's allocator failing (torch's CPU allocator raises a RuntimeError)."""
    if isinstance(e, MemoryError):
        return True
    msg = str(e)
    return isinstance(e, RuntimeError) and (
        "can't allocate memory" in msg or "DefaultCPUAllocator" in msg or "not enough memory" in msg
    )


def host_oom_message(
    cfg: EngineConfig, pool: PagePool | None, pages: int | None, page_bytes: int | None
) -> str:
    """What a start-up out-of-memory error of the host's allocator says (the KV pool on CPU, or the
    host tier): how large the pool was and which flags size it."""
    gib = 1 << 30
    if cfg.kv_cache_tokens is not None:
        sizing, flags = [f"kv_cache_tokens={cfg.kv_cache_tokens}"], ["--kv-cache-tokens"]
    else:
        sizing, flags = [f"kv_cache_memory_gb={cfg.kv_cache_memory_gb}"], ["--kv-cache-memory-gb"]
    sizing.append(f"page_size={cfg.page_size}")
    flags.append("--page-size")
    if pool is None:
        size = ""
        if pages is not None and page_bytes is not None:  # (and a scratch page)
            size = f" of {pages} pages, {(pages + 1) * page_bytes / gib:.1f} GiB"
        where = f"allocating the KV pool{size}"
    else:
        where = f"setting up after the KV pool took {pool.kv_all.nbytes / gib:.1f} GiB"
        if cfg.host_kv_cache_tokens:  # the host tier: allocated next
            sizing.append(f"host_kv_cache_tokens={cfg.host_kv_cache_tokens}")
            flags.append("--host-kv-cache-tokens")
    return (
        f"the host ran out of memory at start-up, {where} ({', '.join(sizing)}): pass a smaller "
        f"{', '.join(flags[:-1])} or {flags[-1]}"
    )


def _raised_in_gguf_reader(e: BaseException) -> bool:
    return any(
        str(frame.f_globals.get("__name__", "")).split(".")[0] == "gguf"
        for frame, _ in traceback.walk_tb(e.__traceback__)
    )


class ModelWorker:
    def __init__(
        self, cfg: EngineConfig, tp: TPMember | None = None, tp_check: Callable[[], None] | None = None
    ):
        """tp: this worker's rank in a tensor-parallel group (required when
        cfg.tensor_parallel_size > 1; rank 0 forwards every step to the others, tp_ranks.py).
        tp_check: raises if another rank's process has died (while the group forms, and when a step
        fails: its collective broke off)."""
        if (tp.rendezvous.size if tp is not None else 1) != cfg.tensor_parallel_size:
            raise ValueError(
                f"tensor_parallel_size={cfg.tensor_parallel_size}: the worker needs a TPMember of a "
                "group of that size"
            )
        dev = resolve_device(cfg.device)
        if tp is not None and dev.startswith("cuda"):
            dev = f"cuda:{tp.rank}"  # one GPU per rank
            torch.cuda.set_device(dev)
        elif dev.startswith("cuda:"):
            torch.cuda.set_device(dev)  # Triton launches on the current device, not the tensors'
        dtype_name = (
            cfg.dtype if cfg.dtype != "auto" else ("bfloat16" if dev.startswith("cuda") else "float32")
        )
        if dev == "cpu" and dtype_name != "float32" and (tp is None or tp.rank == 0):
            logger.warning(
                "dtype=%s on CPU: CPU matmuls in half precision are far slower than in float32 (a decode "
                "step of the default model took ~100x longer in bfloat16); dtype=auto uses float32 there",
                dtype_name,
            )
        # ranks >= 1 only run steps (rank 0 samples for them): no tokenizer, no transformers import
        # a rank reads (or, dummy, makes) only its slices: a model too big for one device loads
        try:
            loaded = load_model(
                cfg.model, load_format=cfg.load_format, dtype=DTYPES[dtype_name], seed=cfg.seed, device=dev,
                tokenizer=tp is None or tp.rank == 0,
                tp_shard=(tp.rank, tp.rendezvous.size) if tp is not None else None,
            )
        except (ValueError, IndexError, KeyError, EOFError) as e:
            if isinstance(e, UnsupportedModelError) or not _raised_in_gguf_reader(e):
                raise
            # a truncated or corrupt GGUF (its magic is right: the launcher checked): the reader's own
            # error (an index or reshape failure) does not say which file or what is wrong with it
            raise ValueError(f"model={cfg.model!r}: cannot read the GGUF file (truncated or corrupt?): "
                             f"{type(e).__name__}: {e}") from e  # fmt: skip
        self.config = cfg
        self.tokenizer = loaded.tokenizer
        self.model_id = loaded.model_id
        self.model_config = loaded.config  # the whole model's (a rank's shard: self.model.config)
        local_config = loaded.shard_config or loaded.config  # (split before CUDA fuses q/k/v, gate/up)
        weights = {k: v.to(dev) for k, v in loaded.weights.items()}
        loaded.weights.clear()  # the model owns (and on CUDA fuses) the weights from here
        # rank 0 forwards each step to the other ranks; every rank joins the group once its shard is in
        self._followers = PlanLinks(tp.rendezvous) if tp is not None and tp.rank == 0 else None
        fused = cfg.tp_peer_all_reduce and cfg.tp_fused_all_reduce_norm is not False  # None: with peer
        fused_hidden = local_config.hidden_size if fused else None
        self.tp = (
            TPGroup(tp.rendezvous, tp.rank, torch.device(dev), tp_check,
                    peer_dtype=DTYPES[dtype_name] if cfg.tp_peer_all_reduce else None,
                    fused_norm_hidden=fused_hidden)  # fmt: skip
            if tp is not None
            else None
        )
        self._tp_check = tp_check
        # set when a step failed on this rank or a rank died: the group's collectives no longer pair up
        self._broken: str | None = None
        self._rank_watch = RankWatch(tp_check, self._rank_died) if tp_check is not None and self.tp else None
        reduce = self.tp.all_reduce if self.tp is not None else None
        # vocab parallel (tensor_parallel.vocab_parallel): this rank's embedding / lm_head rows only
        split_vocab = tp is not None and vocab_parallel(loaded.config, tp.rendezvous.size)
        self.model = LlamaModel(
            local_config,
            weights,
            all_reduce=reduce,
            all_gather=self.tp.all_gather if split_vocab else None,
            vocab_start=tp.rank * local_config.vocab_size if split_vocab else 0,
            reduce_add_norm=self.tp.reduce_add_norm if self.tp is not None and self.tp.fused else None,
        )
        del weights
        if dev.startswith("cuda"):
            torch.cuda.empty_cache()  # the unfused copies: give them back before sizing the KV pool
        self.max_context = min(loaded.config.max_context, cfg.max_model_len or 1 << 62)
        self._free_after_weights = (
            torch.cuda.mem_get_info(self.model.device)[0] if self.model.device.type == "cuda" else None
        )
        self._kv_pages: int | None = None  # (set once the pool is sized: a failure's message)
        try:
            self._set_up_pool_and_runner(cfg, local_config, loaded.config, DTYPES[dtype_name], dev)
        except torch.cuda.OutOfMemoryError as e:
            raise StartupOutOfMemory(startup_oom_message(cfg, getattr(self, "pool", None),
                                                         self._free_after_weights)) from e  # fmt: skip
        except (RuntimeError, MemoryError) as e:  # the host's allocator (a CPU pool, the host tier)
            if not host_out_of_memory(e):
                raise
            c, dtype = local_config, DTYPES[dtype_name]
            page = PagePool.bytes_per_page(c.num_layers, cfg.page_size, c.num_kv_heads, c.head_dim, dtype)
            raise StartupOutOfMemory(host_oom_message(cfg, getattr(self, "pool", None), self._kv_pages,
                                                      page)) from e  # fmt: skip
        eos = set(loaded.config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_ids = eos
        self._generators: dict[int, torch.Generator | None] = {}
        self._logits = LogitsProcessing(loaded.config.vocab_size, self.model.device, eos)
        # tensor-parallel ranks >= 1 take rank 0's tokens: no tokenizer, so no grammar state either
        self._grammar = (
            GrammarConstraints(self.tokenizer, loaded.config.vocab_size, eos, self.model.device)
            if self.tokenizer is not None
            else None
        )
        self._decoder = StepDecoder()
        self._deferred: DeferredTokens | None = None  # the launched step whose tokens are not sent yet
        # a launched step with constrained rows, sampled at the start of the next call (its masks are
        # computed on the grammar thread meanwhile): (rows, logits, processed logits, prepared masks,
        # the timing event where it began on the device)
        self._unsampled: tuple | None = None

    def _set_up_pool_and_runner(
        self, cfg: EngineConfig, c: ModelConfig, whole: ModelConfig, dtype: torch.dtype, dev: str
    ) -> None:
        """The KV pool (sized from what the weights left), the host tier, the runner and its CUDA
        graphs: the start-up allocations after the weights."""
        self._kv_pages = self._num_pages(dtype, c)
        self.pool = PagePool(
            c.num_layers, self._kv_pages, cfg.page_size, c.num_kv_heads, c.head_dim, dtype, dev,
            scratch_pages=1, shared=bool(cfg.kv_peers),  # peer replicas map it (peer KV)
        )  # fmt: skip
        host_pages = cfg.host_kv_cache_tokens // cfg.page_size
        self.host_kv = HostKVPool(self.pool, host_pages) if host_pages else None
        self.runner = ModelRunner(
            self.model,
            self.pool,
            self.max_context,
            rotate_keys=cfg.cache_mode == "lazy",
            shared_chunk_attention=cfg.shared_chunk_attention,
            lazy_flashinfer_prefill=cfg.lazy_flashinfer_prefill,
            host_kv=self.host_kv,
            retrieval=RetrievalOptions(
                cfg.retrieval_top_k, cfg.retrieval_sink, cfg.retrieval_scan, cfg.retrieval_build_threads,
                str(dev) if torch.device(dev).type == "cuda" else None, cfg.retrieval_share_lists,
                cfg.retrieval_exact_prefill,
            )
            if cfg.retrieval_attention
            else None,
            tp_size=cfg.tensor_parallel_size,
            kv_replicas=kv_replicas(whole, cfg.tensor_parallel_size),
        )
        # A server configured with document attention uses it in every step (its variants warmed up and
        # its graphs captured now, not on first use mid-traffic; a request's own override still
        # captures on demand).
        doc_attention = (cfg.doc_attention_temperature, cfg.doc_attention_scale) != (1, 1)
        t0 = time.perf_counter()
        try:
            if steps := self.runner.warm_up_attention(doc_attention):  # 0 off CUDA
                logger.info("attention kernels warmed up: %d steps in %.1f s", steps,
                            time.perf_counter() - t0)
        except Exception as e:  # serving still works: a step compiles what it needs on first use
            logger.warning("attention kernel warm-up failed (kernels compile on first use instead): %s: %s",
                           type(e).__name__, str(e)[:300])  # fmt: skip
        # Under tensor parallelism the graphs capture the NCCL all-reduces too: every rank captures the
        # same batch sizes in the same order (the warm-up runs before each capture are collectives),
        # and every rank replays the same graph in each step.
        if self.model.device.type == "cuda" and cfg.cuda_graph_max_batch > 0:
            self.runner.enable_cuda_graphs(
                min(cfg.cuda_graph_max_batch, cfg.max_running_requests), self.max_context, doc_attention
            )

    def _num_pages(self, dtype: torch.dtype, model_config: ModelConfig | None = None) -> int:
        """KV pages from the budget for model_config's KV heads (this rank's; default the whole
        model's); under tensor parallelism the smallest rank's count, so all hold the same page ids."""
        n = self._rank_pages(dtype, model_config or self.model_config)
        return self.tp.min_int(n) if self.tp is not None else n

    def _rank_pages(self, dtype: torch.dtype, c: ModelConfig) -> int:
        ps = self.config.page_size
        if self.config.kv_cache_tokens is not None:
            return -(-self.config.kv_cache_tokens // ps)
        per_page = PagePool.bytes_per_page(c.num_layers, ps, c.num_kv_heads, c.head_dim, dtype)
        budget = int(self.config.kv_cache_memory_gb * (1 << 30))
        sized_by = f"kv_cache_memory_gb={self.config.kv_cache_memory_gb}"
        if torch.cuda.is_available() and self.model.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.model.device)
            budget = int(free * self.config.kv_cache_memory_fraction)
            budget -= self._retrieval_reserve(c, budget)
            sized_by = (f"kv_cache_memory_fraction={self.config.kv_cache_memory_fraction} of "
                        f"{free / (1 << 30):.1f} GiB free")  # fmt: skip
        if budget < per_page:  # not one page: no pool silently past the budget
            raise ValueError(
                f"page_size={ps}: one KV page takes {per_page / (1 << 20):.1f} MiB, more than the KV budget "
                f"({budget / (1 << 20):.1f} MiB, {sized_by}); pass a smaller page_size or a larger budget, "
                "or size the pool with kv_cache_tokens"
            )
        return budget // per_page

    def _retrieval_reserve(self, c: ModelConfig, budget: int) -> int:
        """Device bytes kept out of a pool sized from free memory for retrieval attention's index data
        (reserved_device_bytes); raises when the budget cannot hold it and a pool."""
        cfg = self.config
        if not cfg.retrieval_attention or not cfg.host_kv_cache_tokens:
            return 0
        reserve = reserved_device_bytes(cfg.host_kv_cache_tokens, c.num_layers, c.num_kv_heads, c.head_dim)
        if reserve >= budget // 2:
            raise ValueError(
                f"retrieval_attention: the device fill's index data for host_kv_cache_tokens="
                f"{cfg.host_kv_cache_tokens} needs ~{reserve / 2**30:.1f} GiB of device memory, half or more "
                f"of the KV budget ({budget / 2**30:.1f} GiB, kv_cache_memory_fraction="
                f"{cfg.kv_cache_memory_fraction}); lower host_kv_cache_tokens or set kv_cache_tokens"
            )
        return reserve

    def close(self) -> None:
        """Closes rank 0's links to the other tensor-parallel ranks and its communicator (nothing to
        do otherwise)."""
        if self._rank_watch is not None:
            self._rank_watch.stop()
        if self._followers is not None:
            self._followers.close()
        if self.tp is not None:
            self.tp.close()

    def ready_info(self) -> WorkerReady:
        return WorkerReady(
            model_id=self.model_id,
            tokenizer_path=str(getattr(self.tokenizer, "name_or_path", "")),
            num_pages=self.pool.num_pages,
            page_size=self.pool.page_size,
            max_context=self.max_context,
            vocab_size=self.model_config.vocab_size,
            eos_ids=sorted(self.eos_ids),
            device=str(self.model.device),
            host_pages=self.host_kv.num_pages if self.host_kv is not None else 0,
            page_bytes=PagePool.bytes_per_page(
                self.pool.num_layers, self.pool.page_size, self.pool.num_kv_heads, self.pool.head_dim,
                self.pool.dtype,
            )
            * self.config.tensor_parallel_size,  # a page id's KV on every rank
            kv_export=self.pool.export,
        )

    def execute(self, msg: StepMsg) -> StepResult:
        """Runs one step. Under tensor parallelism a failed step (on any rank) or a dead rank breaks
        the group: TPGroupBroken, now and for every later step (the engine must be restarted)."""
        if self._broken is not None:
            raise TPGroupBroken(self._broken)
        if self._followers is not None:
            self._followers.send(msg)  # the other ranks run the same step alongside
        try:
            result = self._execute(msg)
        except BaseException as e:
            # the scheduler drops its step in flight and aborts the requests: start clean
            self._deferred, self._unsampled, self.runner.prev_tokens = None, None, None
            if self._grammar is not None:
                self._grammar.drop_pending()
            if isinstance(e, torch.cuda.OutOfMemoryError) and torch.cuda.is_available():
                torch.cuda.empty_cache()  # hand the failed step's cached blocks back before the next
            if self.tp is not None:
                self._break_group(e)
            raise
        if self._broken is not None:  # a rank died while the step ran: its collectives were aborted
            raise TPGroupBroken(self._broken)
        return result

    def _break_group(self, e: BaseException) -> None:
        """Raises TPGroupBroken (from e) naming why: a dead rank if there is one, else this rank's error.
        The other ranks may be waiting in a collective this rank left mid-step (or have run ahead of
        it), so no later step could pair its collectives with theirs."""
        why = None
        # a collective that broke off because a peer died: name the dead rank (its exit may take a moment
        # to show after its connections closed)
        for _ in range(10 if self._tp_check is not None else 0):
            try:
                self._tp_check()
            except Exception as dead:
                why = str(dead)
                break
            time.sleep(0.1)
        if why is None:
            lines = str(e).strip().splitlines()
            why = f"a step failed on tensor-parallel rank {self.tp.rank}: {type(e).__name__}" + (
                f": {lines[0]}" if lines else ""
            )
        self._mark_broken(why)
        raise TPGroupBroken(self._broken) from e

    def _rank_died(self, e: Exception) -> None:
        """RankWatch: another rank's process died. Rank 0 may be waiting in a collective with it;
        aborting the communicator ends that wait (on NCCL) and the step in flight raises."""
        self._mark_broken(str(e))

    def _mark_broken(self, why: str) -> None:
        self._broken = f"{why}; the ranks can no longer run steps together: restart the engine"
        self.tp.abort()

    def _execute(self, msg: StepMsg) -> StepResult:
        began = time.perf_counter()
        if self._unsampled is not None:  # before the releases: its rows' generators and matchers
            rows, logits, processed, prepared, start = self._unsampled
            self._unsampled = None
            processed = self._grammar.finish(processed, prepared)
            self._deferred = self._in_flight(rows, *self._sample(rows, logits, processed), start)
        for rid in msg.release:
            self._generators.pop(rid, None)
            self._logits.release(rid)
            if self._grammar is not None:
                self._grammar.release(rid)
        plan = self._decoder.decode(msg)
        if self._deferred is not None and not msg.defer:
            if plan.items or plan.probes or plan.has_copies:
                raise RuntimeError("a synchronous step was sent while a deferred one is in flight")
            prev, self._deferred = self._deferred, None  # a collect: the deferred step's tokens
            return self._answer(prev.result())
        scores = tops = None
        start = self._device_mark() if msg.defer else None
        if any(it.request is not None and it.request.score_len > 0 for it in plan.items):
            logits, scores, tops = self._execute_scoring(plan)
        else:
            logits = self.runner.execute(plan)
        citations = self.runner.take_citations()
        probe_scores = self.runner.probe_deviation(plan.probes) if plan.probes else None
        rows = [it.request for it in plan.items if it.request is not None]
        for req in rows:
            if req.rid not in self._generators:
                self._generators[req.rid] = _generator(req.params)
        tokens = logprobs = None
        if rows:
            params, rids = [r.params for r in rows], [r.rid for r in rows]
            processed = self._logits.apply(logits, rids, params, [r.suffix for r in rows])  # stub: prompt
            # after the forward is launched: the grammar masks are computed while the device runs it
            prepared = (
                self._grammar.prepare(rids, params, logits.shape[-1]) if self._grammar is not None else None
            )
            if prepared is not None and msg.defer and self.tp is None:
                # sampled at the start of the next call: the scheduler plans it meanwhile
                prev, self._deferred = self._deferred, None
                self._unsampled = (rows, logits, processed, prepared, start)
                return self._answer_deferred(prev, began)
            if prepared is not None:
                processed = self._grammar.finish(processed, prepared)
            tokens, logprobs = self._sample(rows, logits, processed)
        if not msg.defer:
            self.runner.prev_tokens = None  # the scheduler has every token before its next plan
            if tokens is None and self.model.device.type == "cuda":
                torch.cuda.current_stream().synchronize()  # an answer means the step's work is done
            sampled = tokens.tolist() if tokens is not None else []
            lps = logprob_entries(len(sampled), [r.params for r in rows], logprobs)
            result = StepResult(
                sampled, scores, probe_scores, logprobs=lps, score_top=tops or None, citations=citations,
                ready_at=time.time(),
            )  # fmt: skip
            return self._answer(result)
        prev, self._deferred = self._deferred, self._in_flight(rows, tokens, logprobs, start)
        return self._answer_deferred(prev, began)

    def _answer_deferred(self, prev: DeferredTokens | None, began: float) -> StepResult:
        """The answer to a deferred step, once it is launched: the previous one's tokens (waiting for
        them), with the time this call took to launch it (late planning's margin)."""
        launch_ms = (time.perf_counter() - began) * 1e3
        result = prev.result() if prev is not None else StepResult([])
        result.launch_ms = launch_ms
        return self._answer(result)

    def _device_mark(self) -> torch.cuda.Event | None:
        """A timing event queued where a deferred step's work starts on the device (CUDA only)."""
        if self.model.device.type != "cuda":
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _in_flight(
        self, rows: list, tokens: torch.Tensor | None, logprobs: tuple | None, start: torch.cuda.Event | None
    ) -> DeferredTokens:
        """A deferred step's sampled tokens: the next step's decode inputs on the device, and the
        host's copy on its way."""
        self.runner.prev_tokens = (tokens, {r.rid: i for i, r in enumerate(rows)}) if rows else None
        cuda = self.model.device.type == "cuda"
        return DeferredTokens(tokens, [r.params for r in rows], logprobs, start, cuda)

    def _sample(self, rows: list, logits: torch.Tensor, processed: torch.Tensor) -> tuple:
        """Draws each row's token from its processed logits; logprobs (if asked) from the model's."""
        params, rids = [r.params for r in rows], [r.rid for r in rows]
        tokens = sample_tokens_device(processed, params, [self._generators[r.rid] for r in rows])
        if self.tp is not None:  # rank 0's draw for everyone (unseeded generators differ by rank)
            tokens = self.tp.broadcast(tokens.contiguous())
        self._logits.advance(rids, tokens)
        if self._grammar is not None:
            self._grammar.advance(rids, params, tokens)
        return tokens, token_logprobs(logits, tokens, params)

    def _answer(self, result: StepResult) -> StepResult:
        result.shared_chunk_steps = self.runner.shared_steps
        result.graph_steps = self.runner.graph_steps
        result.ragged_prefill_steps = self.runner.ragged_steps
        result.decode_split_steps = self.runner.decode_splits
        if self._grammar is not None:  # (after the step's mask job: its failures are in)
            result.failed = self._grammar.take_failed() or None
        return result

    @torch.inference_mode()
    def _execute_scoring(self, plan: StepPlan) -> tuple[torch.Tensor, dict[int, list[float]], dict]:
        """ModelRunner.execute, but keeping every row's hidden state: a scoring item's last score_len
        tokens get log P(token | everything before it) from the row before each. Same model path;
        rare (select), so it skips CUDA graphs."""
        self.runner.run_copies(plan)  # host tier moves and block-mode page copies
        plan = StepPlan(items=plan.items)
        s = self.runner.step_inputs(plan)
        input_ids, meta = self.runner.step_metadata(plan, s)
        hidden = self.model.forward(input_ids, meta, self.runner.rope, self.runner.backend)
        logits = self.model.logits(hidden[torch.tensor(s.sample_rows, device=self.model.device)])
        scores: dict[int, list[float]] = {}
        tops: dict[int, list] = {}
        for i, it in enumerate(plan.items):
            n = it.request.score_len if it.request is not None else 0
            if n <= 0:
                continue
            end = int(s.qo_indptr[i + 1])
            if n >= end - int(s.qo_indptr[i]):
                raise ValueError("a scored continuation needs at least one computed token before it")
            rows = torch.arange(end - n - 1, end - 1, device=self.model.device)
            lp = torch.log_softmax(self.model.logits(hidden[rows]).float(), dim=-1)
            targets = input_ids[end - n : end].to(lp.device)
            scores[it.request.rid] = lp.gather(1, targets[:, None])[:, 0].tolist()
            k = it.request.params.logprobs
            if k:  # echo with top logprobs: each scored position's k most likely tokens too
                top_lp, top_ids = torch.topk(lp, k, dim=-1)
                tops[it.request.rid] = [top_ids.tolist(), top_lp.tolist()]
        return logits, scores, tops


class DeferredTokens:
    """A launched step's sampled tokens (and logprobs, if asked) on their way to the host (pinned
    copies + an event on CUDA); with `start` (a timing event where the step began), its device time."""

    def __init__(
        self,
        tokens: torch.Tensor | None,
        params: list[SamplingParams] | None = None,
        logprobs: tuple | None = None,
        start: torch.cuda.Event | None = None,
        cuda: bool = False,
    ):
        """cuda: the step ran on CUDA (its result waits for the device even when it sampled nothing:
        an answer means its work is done, which peer KV relies on)."""
        self.host, self.event, self.params = tokens, None, params or []
        self.logprobs = logprobs
        self.start = start
        if tokens is not None and tokens.is_cuda:  # pinned: the copy itself must not wait
            self.host = _pinned_copy(tokens)
            if logprobs is not None:
                rows, *tensors = logprobs
                self.logprobs = (rows, *(_pinned_copy(t) for t in tensors))
        if cuda or (tokens is not None and tokens.is_cuda):
            self.event = torch.cuda.Event(enable_timing=start is not None)
            self.event.record()

    def result(self) -> StepResult:
        device_ms = None
        if self.event is not None:
            self.event.synchronize()
            if self.start is not None:  # queued before the step's work: done too
                device_ms = self.start.elapsed_time(self.event)
        tokens = self.host.tolist() if self.host is not None else []
        lps = logprob_entries(len(tokens), self.params, self.logprobs)
        return StepResult(tokens, logprobs=lps, device_ms=device_ms, ready_at=time.time())


def _pinned_copy(t: torch.Tensor) -> torch.Tensor:
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


def _generator(params: SamplingParams) -> torch.Generator | None:
    if params.temperature == 0:
        return None
    g = torch.Generator()
    g.manual_seed(params.seed if params.seed is not None else torch.seed())
    return g
