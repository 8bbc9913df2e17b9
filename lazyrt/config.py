"""EngineConfig: every server/engine option in one place, shared by the CLI and Engine."""

from __future__ import annotations

import re
from dataclasses import dataclass, fields

from lazyrt.cache.eviction import EVICTION_POLICIES
from lazyrt.documents import check_store_option
from lazyrt.sampling_params import positive_number

DTYPES = ("auto", "float32", "float16", "bfloat16")
CACHE_MODES = ("lazy", "block", "prefix", "none")
# Selective recompute policies (lazyrt/runtime/scheduler/recompute.py picks the pages)
RECOMPUTE_POLICIES = ("head", "tail", "question", "deviation")
# Where a RAG prompt's documents sit (lazy/block only): one after another, or all at the position
# right after the shared prefix (APE's parallel encoding; the question follows the longest doc).
DOC_POSITIONS = ("sequential", "parallel")


@dataclass
class EngineConfig:
    model: str | None = None  # HF dir, .gguf file, dummy preset name; None = embedded SmolLM2
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"  # auto = float32 on CPU, bfloat16 on CUDA
    page_size: int = 16
    cache_mode: str = "lazy"
    # Chunk eviction: lru | lfu | gdsf (lazyrt/cache/eviction.py). lfu (with aging) recomputes the
    # fewest document tokens under a tight KV budget (docs/benchmarks.md, issue 6).
    eviction_policy: str = "lfu"
    kv_cache_tokens: int | None = None  # KV budget in tokens; None = from memory
    # Host-memory KV tier (lazy/block only): document chunks evicted from the device pool move to
    # this many tokens of (pinned, on CUDA) host memory and are copied back when reused instead of
    # recomputed; 0 = off (evicted chunks are dropped).
    host_kv_cache_tokens: int = 0
    # Retrieval attention (lazy + host tier; lazyrt/retrieval/): a document chunk found only in the
    # host tier is attended where it lies instead of copied back when the device pool has no free
    # pages for it: each query head attends exactly to the chunk's first retrieval_sink keys and to
    # the retrieval_top_k keys an index over the chunk returns (scanning retrieval_scan of its
    # keys, and at least 2 x top_k), merged with the device part by log-sum-exp. top_k >= a chunk's
    # keys: exact.
    retrieval_attention: bool = False
    retrieval_top_k: int = 128
    retrieval_sink: int = 16
    retrieval_scan: float = 0.05
    # Threads that build a host chunk's indexes off the step; until a chunk-layer's index is built the
    # chunk is attended exactly (all its keys) there. 0: the step that first needs an index builds it
    # and waits (reproducible: every step after the first searches).
    retrieval_build_threads: int = 1
    # On CUDA (host parts computed on the GPU, reading the pinned host tier): the query heads of one
    # KV head share one set of scanned lists per token (ranked by the sum of their scores, twice one
    # head's scan budget; each head keeps its own top-k): 0.68x the keys read over PCIe for 0.90 of
    # the top-10 found (per-head: 0.92), 2.3x faster decode (docs/benchmarks.md). The CPU path scans
    # per query head.
    retrieval_share_lists: bool = True
    # A question's prefill (a step with several query rows of a request) attends every key of its
    # host-tier chunks, their pages read whole, instead of each token searching its own top-k: faster
    # on a GPU (contiguous reads) and exact, so the question's KV that later tokens attend is too.
    retrieval_exact_prefill: bool = True
    # torch CPU threads of the model worker; None = auto (lazyrt/runtime/worker/cpu_threads.py): 4 in a
    # server's CUDA worker without retrieval attention or OMP_NUM_THREADS, torch's default otherwise
    worker_cpu_threads: int | None = None
    kv_cache_memory_gb: float = 2.0  # CPU budget when kv_cache_tokens is None
    # CUDA budget when kv_cache_tokens is None: this share of the memory free once the weights are
    # loaded (the rest is for activations, CUDA graphs, other engines in the process)
    kv_cache_memory_fraction: float = 0.8
    max_running_requests: int = 64
    max_step_tokens: int = 8192  # prefill tokens per step (decodes ride along)
    max_model_len: int | None = None  # cap on the model's context length
    load_format: str = "auto"
    cuda_graph_max_batch: int = 64  # decode steps up to this batch replay CUDA graphs; 0 = off
    # Selective recompute (lazy/block only; runtime/scheduler/recompute.py): pages of the documents after the
    # first recomputed in the request's context (own pages; the rest shared from the chunk).
    # Which pages: head | tail | question (IDF-weighted question-token overlap) | deviation (the
    # pages whose layer-1 KV moves most when computed in context, CacheBlend-style; one probe step).
    recompute_policy: str = "head"
    # Budget, one of: pages per document after the first, or a share of those documents' pages.
    recompute_pages: int = 0
    recompute_ratio: float = 0.0
    # Legacy sink fix: = recompute_policy="head", recompute_pages=N; 0 = off.
    recompute_head_pages: int = 0
    # Document attention (lazy/block only; APE-style, docs/quality.md): for the tokens after the
    # documents (question, generated tokens, recomputed pages), logits on document tokens are divided
    # by this temperature and the attention mass on them is multiplied by this scale. 1 and 1 = plain
    # block attention. A request's sampling params may override both.
    doc_attention_temperature: float = 1.0
    doc_attention_scale: float = 1.0
    # Document positions (lazy/block only): "sequential" = the prompt's own positions; "parallel" =
    # every document starts right after the shared prefix and the question follows the longest one
    # (APE-style parallel encoding; no selective recompute). A request's sampling params may override.
    doc_positions: str = "sequential"
    # lazy only: steps whose requests share documents read each shared run of pages once for all
    # its queries (kernels/shared_chunk.py) instead of once per request; same outputs.
    shared_chunk_attention: bool = True
    # lazy only, CUDA with FlashInfer: sequences whose keys sit at consecutive positions with their new
    # tokens last and at most 2 keys per new token or at least 256 new tokens (a document's own prefill
    # after its prefix, a plain prompt) run FlashInfer's ragged prefill over their keys gathered and rotated
    # (kernels/ragged_prefill.py) instead of the lazy kernel, beside the step's other sequences; same
    # outputs to bf16 rounding (served side by side in docs/benchmarks.md).
    lazy_flashinfer_prefill: bool = True
    # Overlapped scheduling: plan and build step N+1 on the host while the device runs step N
    # (scheduler/engine_core.py); same outputs, one step's compute wasted when a request hits EOS.
    overlap_schedule: bool = True
    # Late planning (server, with overlap_schedule; scheduler/late_planning.py): when the next step
    # would only carry running decodes, plan it shortly before the step in flight is expected to end
    # on the device, not as it starts, so a request arriving meanwhile joins it (lower time to first
    # token at low load). Device idle is avoided by a measured margin; the outputs are the same.
    late_planning: bool = True
    # Server only (the offline Engine always calls its worker in process): the model worker runs inside
    # the scheduler process, called directly instead of over ZMQ: two fewer process hops on every
    # step's way to the device and back (each costs ~0.5-1 ms when its process was idle). On by
    # default with tokenizer_in_http (H100, 2026-11-27, 099fceb, 70 requests a layout: TTFT p50 at
    # 1 req/s 19.6 -> 18.8 ms, at saturation 1535 -> 1458 ms, output 995 -> 1014 tok/s; docs/
    # benchmarks.md); False: a worker process of its own (--no-worker-in-scheduler).
    worker_in_scheduler: bool = True
    # Server: tokenize and detokenize inside the HTTP process instead of a process of their own (one
    # hop less each way; requests are tokenized on a thread of their own, in arrival order, so a long
    # new document does not hold the event loop). On by default (see worker_in_scheduler); False: a
    # tokenizer process (--no-tokenizer-in-http).
    tokenizer_in_http: bool = True
    # Tensor parallelism: the model split Megatron-style over this many ranks, one worker process per
    # rank (one GPU each on CUDA over NCCL; gloo on CPU), each holding its share of the KV heads.
    tensor_parallel_size: int = 1
    # CUDA tensor parallelism: decode-sized all-reduces through torch's one-shot symmetric-memory kernel
    # (NVLink peer memory, no multicast; worker/peer_all_reduce.py) instead of NCCL; NCCL where it
    # cannot be set up and for large tensors.
    tp_peer_all_reduce: bool = True
    # With the peer path: each layer's all-reduce, residual add and RMSNorm in one kernel for
    # decode-sized steps (worker/fused_all_reduce_norm.py; TP=2 decode 0.4-0.5 ms a step faster on 2
    # H200s). None: wherever the peer path is on; True: required (an error without the peer path);
    # False: off. Separate kernels where it cannot be built or set up (logged).
    tp_fused_all_reduce_norm: bool | None = None
    # Registered documents (lazyrt/documents.py; requests name them by id): a sqlite file path;
    # None = $LAZYRT_CACHE_DIR/documents/<model id>.sqlite; "none" = no store.
    document_store: str | None = None
    # Peer KV (server only): replicas on one host keep one copy of each document between them and read
    # each other's pages (runtime/scheduler/peer_kv.py). This replica's peer address first, then every
    # other replica's (tcp://127.0.0.1:PORT or ipc://PATH); empty = off.
    kv_peers: tuple[str, ...] = ()
    # Peer KV: how long to wait for a peer's answer before computing its documents here.
    kv_peer_timeout_s: float = 10.0
    seed: int = 0

    def validate(self) -> None:
        if self.cache_mode not in CACHE_MODES:
            raise ValueError(f"cache_mode={self.cache_mode!r}: must be one of {', '.join(CACHE_MODES)}")
        if self.eviction_policy not in EVICTION_POLICIES:
            raise ValueError(
                f"eviction_policy={self.eviction_policy!r}: must be one of {', '.join(EVICTION_POLICIES)}"
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r}: must be one of {', '.join(DTYPES)}")
        if not isinstance(self.device, str) or not re.fullmatch(r"auto|cpu|cuda(:[0-9]+)?", self.device):
            raise ValueError(f"device={self.device!r}: must be auto, cpu or cuda[:N]")
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size={self.page_size}: must be a power of two")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < self.page_size:
            raise ValueError(f"kv_cache_tokens={self.kv_cache_tokens}: must hold at least one page")
        check_host_kv_cache_tokens(self.cache_mode, self.host_kv_cache_tokens, self.page_size)
        check_retrieval_options(self)
        f = self.kv_cache_memory_fraction
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0.0 < f <= 0.95:
            raise ValueError(f"kv_cache_memory_fraction={f!r}: must be a number in (0, 0.95]")
        t = self.worker_cpu_threads
        if t is not None and (isinstance(t, bool) or not isinstance(t, int) or t < 1):
            raise ValueError(f"worker_cpu_threads={t!r}: must be an integer >= 1, or None for auto")
        if not positive_number(self.kv_cache_memory_gb):
            raise ValueError(f"kv_cache_memory_gb={self.kv_cache_memory_gb!r}: must be a finite number > 0")
        for name in ("max_running_requests", "max_step_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r}: must be an integer >= 1")
        m = self.max_model_len
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
            raise ValueError(f"max_model_len={m!r}: must be an integer >= 1, or None for the model's own")
        sd = self.seed
        if isinstance(sd, bool) or not isinstance(sd, int) or not -(2**63) <= sd < 2**64:
            raise ValueError(f"seed={sd!r}: must be an integer in [-2**63, 2**64) (a torch generator seed)")
        g = self.cuda_graph_max_batch
        if isinstance(g, bool) or not isinstance(g, int) or g < 0:
            raise ValueError(f"cuda_graph_max_batch={g!r}: must be an integer >= 0 (0 = no CUDA graphs)")
        check_recompute_options(
            self.recompute_policy, self.recompute_pages, self.recompute_ratio, self.recompute_head_pages
        )
        check_doc_attention(self.cache_mode, self.doc_attention_temperature, self.doc_attention_scale)
        recompute = bool(self.recompute_pages or self.recompute_ratio or self.recompute_head_pages)
        if recompute and self.cache_mode not in ("lazy", "block"):
            budgets = ("recompute_pages", "recompute_ratio", "recompute_head_pages")
            name = next(n for n in budgets if getattr(self, n))
            raise ValueError(
                f"{name}={getattr(self, name)!r}: selective recompute needs cache_mode lazy or block "
                f"(documents cached as chunks); cache_mode is {self.cache_mode!r}"
            )
        check_doc_positions(self.cache_mode, self.doc_positions, recompute)
        check_store_option(self.document_store)
        check_tensor_parallel_size(self)
        check_kv_peers(self)
        if self.tp_fused_all_reduce_norm is True and not self.tp_peer_all_reduce:
            raise ValueError("tp_fused_all_reduce_norm=True needs tp_peer_all_reduce (its workspace is in "
                             "the peer path's memory)")  # fmt: skip


# EngineConfig fields whose command-line flag is spelt otherwise than --the-field-name
FLAG_OF = {"kv_peer_timeout_s": "--kv-peer-timeout"}


def option_flags(message: str) -> list[str]:
    """The command-line flags of the EngineConfig options an error message names ('option=value: why',
    'option: why', 'a and b: why'; a bare word counts only as 'word=' at the start), in order, leaving
    out flags the message already spells."""
    names = {f.name for f in fields(EngineConfig)}
    flags: list[str] = []
    for name in re.findall(r"\b[a-z][a-z0-9]*(?:_[a-z0-9]+)*\b", message):
        if name in names and (name in FLAG_OF or "_" in name or message.startswith(name + "=")):
            flag = FLAG_OF.get(name, "--" + name.replace("_", "-"))
            if flag not in flags and flag not in message:
                flags.append(flag)
    return flags


def check_kv_peers(cfg: EngineConfig) -> None:
    """Validates kv_peers (ValueError naming it): this replica's address and at least one other, all
    distinct, tcp:// or ipc://; chunk modes only; one device, no host-tier retrieval attention."""
    t = cfg.kv_peer_timeout_s
    if not positive_number(t):
        raise ValueError(f"kv_peer_timeout_s={t!r}: must be a finite number of seconds > 0")
    peers = cfg.kv_peers
    if not peers:
        return
    if isinstance(peers, str) or len(peers) < 2 or len(set(peers)) != len(peers):
        raise ValueError(f"kv_peers={peers!r}: needs this replica's address and at least one other "
                         "replica's, all distinct")  # fmt: skip
    for a in peers:
        if not isinstance(a, str) or not a.startswith(("tcp://", "ipc://")) or a in ("tcp://", "ipc://"):
            raise ValueError(f"kv_peers: {a!r} is not a ZMQ address (tcp://127.0.0.1:PORT or ipc://PATH)")
        if a.startswith("tcp://") and ("*" in a or a.count(":") < 2):
            raise ValueError(f"kv_peers: {a!r}: name a host and a port (replicas share one host: tcp://127.0.0.1:PORT)")
    if cfg.cache_mode not in ("lazy", "block"):
        raise ValueError(f"kv_peers: needs cache_mode lazy or block (documents cached as chunks), not "
                         f"{cfg.cache_mode!r}")  # fmt: skip
    if cfg.tensor_parallel_size != 1:
        raise ValueError("kv_peers: not supported with tensor_parallel_size > 1 yet")
    if cfg.retrieval_attention:
        raise ValueError("kv_peers: not supported with retrieval_attention")


def check_tensor_parallel_size(cfg: EngineConfig) -> None:
    """Validates tensor_parallel_size (ValueError naming it): an integer >= 1; above 1 the ranks take
    cuda:0..N-1 (device cuda or auto, not one chosen GPU) and retrieval attention is not supported
    (its host-tier key indexes are not split by rank yet). Head divisibility is checked at load."""
    n = cfg.tensor_parallel_size
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"tensor_parallel_size={n!r}: must be an integer >= 1 (1 = one device)")
    if n == 1:
        return
    if cfg.device.startswith("cuda:"):
        raise ValueError(
            f"tensor_parallel_size={n}: rank r runs on cuda:r; pass device cuda (or auto), not {cfg.device!r}"
        )
    if cfg.retrieval_attention:
        raise ValueError(f"tensor_parallel_size={n}: retrieval_attention is not supported with it yet")


def check_recompute_options(
    policy: str, pages: int, ratio: float, head_pages: int = 0
) -> tuple[str, int, float]:
    """Validates the options; returns (policy, pages per doc, ratio) with the legacy
    recompute_head_pages=N folded in as (head, N, 0). Raises ValueError naming the bad option."""
    for name, v in (("recompute_head_pages", head_pages), ("recompute_pages", pages)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(
                f"{name}={v!r}: must be an integer >= 0 (pages of each document after the first "
                "recomputed in context; 0 = off)"
            )
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0.0 <= ratio <= 1.0:
        raise ValueError(
            f"recompute_ratio={ratio!r}: must be a number in [0, 1] (share of the pages of the documents "
            "after the first recomputed in context; 0 = off)"
        )
    if policy not in RECOMPUTE_POLICIES:
        raise ValueError(f"recompute_policy={policy!r}: must be one of {', '.join(RECOMPUTE_POLICIES)}")
    if pages and ratio:
        raise ValueError("recompute_pages and recompute_ratio: set one budget, not both")
    if head_pages:
        if pages or ratio or policy != "head":
            raise ValueError(
                "recompute_head_pages is the head policy's page budget: use it alone, or use "
                "recompute_policy with recompute_pages / recompute_ratio"
            )
        return "head", head_pages, 0.0
    return policy, pages, float(ratio)


def check_host_kv_cache_tokens(cache_mode: str, tokens: int, page_size: int) -> None:
    """Validates host_kv_cache_tokens (ValueError naming the option): an integer >= 0; when on, it
    holds at least one page and needs a mode with document chunks (only chunks move to the host)."""
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
        raise ValueError(f"host_kv_cache_tokens={tokens!r}: must be an integer >= 0 (0 = no host KV tier)")
    if tokens and tokens < page_size:
        raise ValueError(
            f"host_kv_cache_tokens={tokens}: must hold at least one page ({page_size} tokens) or be 0 (off)"
        )
    if tokens and cache_mode not in ("lazy", "block"):
        raise ValueError(
            f"host_kv_cache_tokens={tokens}: needs cache_mode lazy or block (the host tier holds "
            f"document chunks); cache_mode is {cache_mode!r}"
        )


def check_retrieval_options(cfg: EngineConfig) -> None:
    """Validates the retrieval attention options (ValueError naming the option)."""
    for name in ("retrieval_top_k", "retrieval_sink", "retrieval_build_threads"):
        v, low = getattr(cfg, name), 1 if name == "retrieval_top_k" else 0
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ValueError(f"{name}={v!r}: must be an integer >= {low}")
    sc = cfg.retrieval_scan
    if isinstance(sc, bool) or not isinstance(sc, (int, float)) or not 0.0 < sc <= 1.0:
        raise ValueError(f"retrieval_scan={sc!r}: must be a number in (0, 1] (share of keys scanned)")
    for name in ("retrieval_attention", "retrieval_share_lists", "retrieval_exact_prefill"):
        if not isinstance(getattr(cfg, name), bool):
            raise ValueError(f"{name}={getattr(cfg, name)!r}: must be true or false")
    if not cfg.retrieval_attention:  # (its options would be taken and do nothing)
        defaults = {f.name: f.default for f in fields(EngineConfig)}
        for name in ("retrieval_top_k", "retrieval_sink", "retrieval_scan", "retrieval_build_threads",
                     "retrieval_share_lists", "retrieval_exact_prefill"):  # fmt: skip
            if getattr(cfg, name) != defaults[name]:
                raise ValueError(f"{name}={getattr(cfg, name)!r}: only used with retrieval_attention (off)")
        return
    if cfg.cache_mode != "lazy":
        raise ValueError(
            f"retrieval_attention: needs cache_mode lazy (keys stored unrotated, attended at any "
            f"position); cache_mode is {cfg.cache_mode!r}"
        )
    if not cfg.host_kv_cache_tokens:
        raise ValueError("retrieval_attention: needs a host KV tier (host_kv_cache_tokens > 0)")
    if cfg.recompute_policy == "deviation" and (cfg.recompute_pages or cfg.recompute_ratio):
        raise ValueError(
            "retrieval_attention cannot be combined with recompute_policy='deviation' (its probe "
            "reads the chunk's device pages)"
        )
    if cfg.doc_attention_temperature != 1 or cfg.doc_attention_scale != 1:
        raise ValueError(
            "retrieval_attention cannot be combined with doc_attention_temperature / "
            "doc_attention_scale other than 1 (the retrieved keys are attended plainly)"
        )


def check_doc_attention(cache_mode: str, temperature: float, scale: float) -> None:
    """Validates the document attention temperature and scale (ValueError naming the option); values
    other than 1 need a mode with document chunks (lazy, block)."""
    for name, v in (("doc_attention_temperature", temperature), ("doc_attention_scale", scale)):
        if not positive_number(v):
            raise ValueError(f"{name}={v!r}: must be a finite number > 0 (1 = off)")
        if v != 1 and cache_mode not in ("lazy", "block"):
            raise ValueError(
                f"{name}={v!r}: needs cache_mode lazy or block (documents attended as chunks); "
                f"cache_mode is {cache_mode!r}"
            )


def check_doc_positions(cache_mode: str, doc_positions: str, recompute: bool) -> None:
    """Validates doc_positions (ValueError naming the option): "parallel" needs document chunks
    (lazy, block) and no selective recompute (a recomputed page would see the other documents only
    up to its own position, which they share)."""
    if doc_positions not in DOC_POSITIONS:
        raise ValueError(f"doc_positions={doc_positions!r}: must be one of {', '.join(DOC_POSITIONS)}")
    if doc_positions == "parallel":
        if cache_mode not in ("lazy", "block"):
            raise ValueError(
                f"doc_positions='parallel': needs cache_mode lazy or block (documents attended as "
                f"chunks); cache_mode is {cache_mode!r}"
            )
        if recompute:
            raise ValueError(
                "doc_positions='parallel' cannot be combined with selective recompute "
                "(recompute_pages / recompute_ratio / recompute_head_pages): documents share positions"
            )
