"""python -m lazyrt.launch: serve a model over HTTP (lazyrt /generate and the OpenAI API).

Every engine option comes from EngineConfig (the same dataclass Engine takes); the server adds
host, port, API key and log level.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys

from lazyrt.cache.eviction import EVICTION_POLICIES
from lazyrt.config import CACHE_MODES, DTYPES, RECOMPUTE_POLICIES, EngineConfig, option_flags
from lazyrt.models import dummy
from lazyrt.models.loader import _ACCEPTED, LOAD_FORMATS, _gguf_file, default_model_path
from lazyrt.runtime.server.serve import ServerOptions, serve
from lazyrt.runtime.worker.tp_ranks import check_devices


def build_parser() -> argparse.ArgumentParser:
    d = EngineConfig()
    p = argparse.ArgumentParser(
        prog="python -m lazyrt.launch",
        usage="%(prog)s [options]  (--help lists them)",  # an error stays two lines, not the 45 of every flag
        description="Serve a model: POST /generate, /v1/completions, /v1/chat/completions "
        "(OpenAI-compatible, "
        "with an extra body field `documents`: texts or {\"id\"} of registered documents), "
        "POST/GET/DELETE /v1/documents, GET /health, /v1/models, /metrics, /cache_stats, "
        "POST /flush_cache.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model", default=None, help="HF model dir or .gguf file; default: embedded SmolLM2-135M")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=_port, default=30000, help="port to listen on (0 = any free port, logged)")
    p.add_argument("--device", default=d.device, help="auto | cpu | cuda | cuda:N")
    p.add_argument("--dtype", default=d.dtype, choices=DTYPES, help="auto = float32 on CPU, bfloat16 on CUDA")
    p.add_argument("--cache-mode", default=d.cache_mode, choices=CACHE_MODES, help="document KV reuse mode")
    p.add_argument(
        "--eviction-policy",
        default=d.eviction_policy,
        choices=EVICTION_POLICIES,
        help="which unused document chunks leave the KV cache first: lru = least recently used, "
        "lfu = least frequently used with aging, gdsf = greedy-dual-size-frequency (hits per page)",
    )
    p.add_argument("--page-size", type=int, default=d.page_size, help="tokens per KV page (power of two)")
    p.add_argument(
        "--kv-cache-tokens",
        type=int,
        default=d.kv_cache_tokens,
        help="KV cache size in tokens; default: from memory",
    )
    p.add_argument(
        "--host-kv-cache-tokens",
        type=int,
        default=d.host_kv_cache_tokens,
        help="lazy/block: host-memory KV tier in tokens (pinned on CUDA); document chunks evicted from the "
        "device KV cache move there and are copied back when reused instead of recomputed; 0 = off",
    )
    p.add_argument(
        "--retrieval-attention",
        action=argparse.BooleanOptionalAction,
        default=d.retrieval_attention,
        help="lazy + host tier: attend to document chunks found only in the host tier where they lie "
        "(exact sink keys + top-k retrieved keys per chunk) instead of copying them back when the device "
        "KV cache has no free pages for them",
    )
    p.add_argument("--retrieval-top-k", type=int, default=d.retrieval_top_k,
                   help="keys retrieved per host-tier chunk and query head (>= the chunk's keys: exact)")
    p.add_argument("--retrieval-sink", type=int, default=d.retrieval_sink,
                   help="first keys of each host-tier chunk always attended exactly")
    p.add_argument("--retrieval-scan", type=float, default=d.retrieval_scan,
                   help="share of a host-tier chunk's keys the index search scans, in (0, 1]")
    p.add_argument("--retrieval-build-threads", type=int, default=d.retrieval_build_threads,
                   help="threads building host-tier chunks' indexes off the step (a chunk is attended "
                   "exactly until its index is built); 0 = the step that needs an index builds it")
    p.add_argument("--retrieval-share-lists", action=argparse.BooleanOptionalAction,
                   default=d.retrieval_share_lists,
                   help="on a GPU, the query heads of a KV head share one set of scanned lists per token "
                   "(fewer keys read from host memory; each head keeps its own top-k; default on)")
    p.add_argument("--retrieval-exact-prefill", action=argparse.BooleanOptionalAction,
                   default=d.retrieval_exact_prefill,
                   help="a question's prefill attends every key of its host-tier chunks (their pages read "
                   "whole) instead of each token retrieving its own top-k")
    p.add_argument("--worker-cpu-threads", type=int, default=d.worker_cpu_threads,
                   help="torch CPU threads of the model worker (default: 4 when it drives a GPU without "
                   "--retrieval-attention and OMP_NUM_THREADS is unset, else torch's default)")
    p.add_argument(
        "--kv-cache-memory-gb",
        type=float,
        default=d.kv_cache_memory_gb,
        help="CPU KV budget without --kv-cache-tokens",
    )
    p.add_argument(
        "--kv-cache-memory-fraction",
        type=float,
        default=d.kv_cache_memory_fraction,
        help="CUDA KV budget without --kv-cache-tokens: this share (0-0.95] of the GPU memory free "
        "after loading the weights (lower it to share the GPU with another process)",
    )
    p.add_argument(
        "--max-running-requests", type=int, default=d.max_running_requests, help="batch size limit"
    )
    p.add_argument("--max-step-tokens", type=int, default=d.max_step_tokens, help="prefill tokens per step")
    p.add_argument("--max-model-len", type=int, default=d.max_model_len,
                   help="cap on the context length, at most the model's own; None = the model's")
    p.add_argument(
        "--load-format", default=d.load_format, choices=LOAD_FORMATS, help="dummy = random weights"
    )
    p.add_argument(
        "--cuda-graph-max-batch",
        type=int,
        default=d.cuda_graph_max_batch,
        help="CUDA-graph decode up to this batch",
    )
    p.add_argument(
        "--recompute-head-pages",
        type=int,
        default=d.recompute_head_pages,
        help="sink fix for lazy/block modes: recompute the first N KV pages of each document after the "
        "first in the request's context (N * page-size extra prefill tokens and N pages per doc); 0 = off",
    )
    p.add_argument(
        "--recompute-policy",
        default=d.recompute_policy,
        choices=RECOMPUTE_POLICIES,
        help="selective recompute for lazy/block modes, which pages of the documents after the first "
        "are recomputed in the request's context: head = first pages of each, tail = last pages before "
        "the question, question = pages holding the question's rarer tokens (IDF within the prompt), "
        "deviation = pages whose layer-1 KV moves most in context (one probe step; CacheBlend-style); "
        "budget from --recompute-pages or --recompute-ratio",
    )
    p.add_argument(
        "--recompute-pages",
        type=int,
        default=d.recompute_pages,
        help="selective recompute budget: pages per document after the first; 0 = off",
    )
    p.add_argument(
        "--recompute-ratio",
        type=float,
        default=d.recompute_ratio,
        help="selective recompute budget: share (0-1) of the pages of the documents after the first; 0 = off",
    )
    p.add_argument(
        "--doc-attention-temperature",
        type=float,
        default=d.doc_attention_temperature,
        help="lazy/block: the question's and generated tokens' logits on document tokens are divided by "
        "this (APE-style; < 1 sharpens); 1 = plain block attention; per request: sampling_params",
    )
    p.add_argument(
        "--doc-attention-scale",
        type=float,
        default=d.doc_attention_scale,
        help="lazy/block: the attention mass on document tokens is multiplied by this; 1 = off; "
        "per request: sampling_params",
    )
    p.add_argument(
        "--doc-positions",
        choices=("sequential", "parallel"),
        default=d.doc_positions,
        help="lazy/block: 'parallel' places every document right after the shared prefix and the question "
        "after the longest one (APE-style); not with selective recompute; per request: sampling_params",
    )
    p.add_argument(
        "--shared-chunk-attention",
        action=argparse.BooleanOptionalAction,
        default=d.shared_chunk_attention,
        help="lazy: a step reads each document shared by several of its requests once for all of them "
        "(same outputs; --no-shared-chunk-attention reads per request)",
    )
    p.add_argument(
        "--lazy-flashinfer-prefill",
        action=argparse.BooleanOptionalAction,
        default=d.lazy_flashinfer_prefill,
        help="lazy, CUDA: documents' own prefill and plain prompts (keys at consecutive positions) run "
        "FlashInfer's ragged prefill over keys gathered and rotated on the fly; "
        "--no-lazy-flashinfer-prefill keeps them on the lazy kernel",
    )
    p.add_argument(
        "--overlap-schedule",
        action=argparse.BooleanOptionalAction,
        default=d.overlap_schedule,
        help="plan and build the next step on the host while the device runs the current one "
        "(same outputs; --no-overlap-schedule waits for each step's tokens first)",
    )
    p.add_argument(
        "--late-planning",
        action=argparse.BooleanOptionalAction,
        default=d.late_planning,
        help="with --overlap-schedule: plan a decode-only step shortly before the one on the device ends, "
        "so requests arriving meanwhile join it (same outputs; --no-late-planning plans it at once)",
    )
    p.add_argument(
        "--worker-in-scheduler",
        action=argparse.BooleanOptionalAction,
        default=d.worker_in_scheduler,
        help="run the model worker inside the scheduler process, called directly rather than over ZMQ "
        "(two fewer process hops a step; same outputs; the default; --no-worker-in-scheduler: a model "
        "worker process of its own)",
    )
    p.add_argument(
        "--tokenizer-in-http",
        action=argparse.BooleanOptionalAction,
        default=d.tokenizer_in_http,
        help="tokenize and detokenize inside the HTTP process instead of a process of their own (one "
        "process hop less each way; requests are tokenized on a thread of the HTTP process; same "
        "outputs; the default; --no-tokenizer-in-http: a tokenizer process of its own)",
    )
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=d.tensor_parallel_size,
        help="split the model Megatron-style over N ranks, one process each (CUDA: one GPU per rank, "
        "NCCL; CPU: gloo); heads must divide by N",
    )
    p.add_argument(
        "--kv-peer-addr",
        default=None,
        metavar="ADDR",
        help="peer KV: this replica's address for the other replicas on this host (tcp://127.0.0.1:PORT "
        "or ipc://PATH); with --kv-peers, each document is cached by one replica and read from its pages "
        "by the others (route requests by load: `lazyrt.router --policy least_loaded`)",
    )
    p.add_argument(
        "--kv-peers",
        nargs="+",
        default=[],
        metavar="ADDR",
        help="peer KV: the other replicas' --kv-peer-addr (every replica lists the others; on GPUs each "
        "must see the others' devices: pick its own with --device cuda:N, not CUDA_VISIBLE_DEVICES)",
    )
    p.add_argument(
        "--kv-peer-timeout",
        type=float,
        default=d.kv_peer_timeout_s,
        metavar="SECONDS",
        help="peer KV: compute a peer's documents here when it has not answered in this many seconds",
    )
    p.add_argument(
        "--tp-peer-all-reduce",
        action=argparse.BooleanOptionalAction,
        default=d.tp_peer_all_reduce,
        help="CUDA, --tensor-parallel-size > 1: decode-sized all-reduces through torch's one-shot "
        "symmetric-memory kernel over NVLink peer memory (no multicast) instead of NCCL, which still "
        "takes large ones and all of them where peer memory is unavailable",
    )
    p.add_argument(
        "--tp-fused-all-reduce-norm",
        action=argparse.BooleanOptionalAction,
        default=d.tp_fused_all_reduce_norm,
        help="CUDA, --tensor-parallel-size > 1: each layer's all-reduce, residual add and RMSNorm in "
        "one kernel for decode-sized steps (FlashInfer's TensorRT-LLM fusion; JIT-built on first use). "
        "Default: on wherever --tp-peer-all-reduce is; separate kernels where it cannot be set up",
    )
    p.add_argument(
        "--document-store",
        default=d.document_store,
        metavar="PATH|none",
        help="sqlite file of the documents registered with POST /v1/documents (kept across restarts); "
        "default: $LAZYRT_CACHE_DIR/documents/<model id>.sqlite; none = no store",
    )
    p.add_argument("--seed", type=int, default=d.seed, help="seed for dummy weights")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (except /health)")
    p.add_argument("--served-model-name", default=None, help="model name in the API; default from --model")
    p.add_argument(
        "--log-level", default="info", choices=("debug", "info", "warning", "error"), help="logging level"
    )
    return p


def _port(value: str) -> int:
    try:
        port = int(value)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be an integer in [0, 65535], got {value!r}")
    return port


def flag_error(parser: argparse.ArgumentParser, message: str) -> str:
    """EngineConfig's 'option=value: why' (or 'option: why', 'a and b: why'), prefixed with the
    command-line flags of the options it names."""
    known = {s for a in parser._actions for s in a.option_strings}
    flags = [f for f in option_flags(message) if f in known]
    return f"{', '.join(flags)}: {message}" if flags else message


def check_model_option(model: str | None, load_format: str) -> None:
    """What load_model will find at --model, checked before any process starts (ValueError naming
    model): the path exists and is a .gguf file (with GGUF's magic) or a model directory."""
    if load_format == "dummy":  # a preset name, or a path whose shape it takes: the loader checks
        return
    try:
        path = default_model_path() if model is None else os.path.expanduser(model)
    except FileNotFoundError as e:
        raise ValueError(f"model=None (the default model): {e}") from None
    if not os.path.exists(path):
        hint = " (a dummy preset: add --load-format dummy)" if model in dummy.PRESETS else ""
        raise ValueError(f"model={model!r}: no such file or directory{hint}; expected {_ACCEPTED}")
    gguf = _gguf_file(path)
    if gguf is not None:
        try:
            with open(gguf, "rb") as f:
                magic = f.read(4)
        except OSError as e:
            raise ValueError(f"model={model!r}: cannot read {gguf}: {e.strerror}") from None
        if magic != b"GGUF":
            raise ValueError(f"model={model!r}: {gguf} is not a GGUF file (it does not start with GGUF)")
    elif os.path.isfile(path):
        raise ValueError(f"model={model!r}: a file, but not a .gguf one; expected {_ACCEPTED}")
    elif not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"model={model!r}: the directory has no config.json (nor a single .gguf file); "
                         f"expected {_ACCEPTED}")  # fmt: skip


def check_document_store_option(option: str | None) -> None:
    """--document-store PATH, checked before any process starts (ValueError naming document_store):
    not a directory, an SQLite file if it exists, and creatable where it does not (it is created by
    the first registration)."""
    if option is None or option == "none":
        return
    path = os.path.abspath(os.path.expanduser(option))
    if os.path.isdir(path):
        raise ValueError(f"document_store={option!r}: is a directory; give the path of a file")
    if os.path.isfile(path):
        try:
            with open(path, "rb") as f:
                head = f.read(16)
        except OSError as e:
            raise ValueError(f"document_store={option!r}: cannot read it: {e.strerror}") from None
        if head and head != b"SQLite format 3\x00":
            raise ValueError(f"document_store={option!r}: exists and is not an SQLite file")
        return
    parent = os.path.dirname(path)
    while not os.path.exists(parent):  # the directories to create: the nearest existing one must take them
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(
            f"document_store={option!r}: cannot be created ({parent} is not a writable directory)"
        )


def check_device_option(device: str) -> None:
    """--device cuda[:N]: a CUDA device torch can use (ValueError naming device), before any process
    starts rather than a traceback from the model worker."""
    if not device.startswith("cuda"):
        return
    import torch  # (already imported with the loader)

    if not torch.cuda.is_available():
        raise ValueError(f"device={device!r}: no CUDA device is available to torch (use cpu or auto)")
    n = torch.cuda.device_count()
    if ":" in device and int(device.split(":", 1)[1]) >= n:
        raise ValueError(f"device={device!r}: there are {n} CUDA devices (cuda:0 to cuda:{n - 1})")


def check_server_options(args: argparse.Namespace) -> None:
    """The server's own flags (argparse.ArgumentTypeError-style ValueError naming the flag)."""
    for flag, value in (("--host", args.host), ("--api-key", args.api_key),
                        ("--served-model-name", args.served_model_name)):  # fmt: skip
        if value is not None and not value.strip():
            raise ValueError(f"{flag}: must not be empty")
    try:  # what uvicorn binds to: an unknown name is its one-line "Name or service not known", flag unnamed
        socket.getaddrinfo(args.host, args.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, UnicodeError) as e:
        why = getattr(e, "strerror", None) or e
        raise ValueError(f"--host: cannot listen on {args.host!r}: {why}") from None


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig the parsed flags describe (every engine flag lands in one field)."""
    return EngineConfig(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        page_size=args.page_size,
        cache_mode=args.cache_mode,
        eviction_policy=args.eviction_policy,
        kv_cache_tokens=args.kv_cache_tokens,
        host_kv_cache_tokens=args.host_kv_cache_tokens,
        retrieval_attention=args.retrieval_attention,
        retrieval_top_k=args.retrieval_top_k,
        retrieval_sink=args.retrieval_sink,
        retrieval_scan=args.retrieval_scan,
        retrieval_build_threads=args.retrieval_build_threads,
        retrieval_share_lists=args.retrieval_share_lists,
        retrieval_exact_prefill=args.retrieval_exact_prefill,
        worker_cpu_threads=args.worker_cpu_threads,
        kv_cache_memory_gb=args.kv_cache_memory_gb,
        kv_cache_memory_fraction=args.kv_cache_memory_fraction,
        max_running_requests=args.max_running_requests,
        max_step_tokens=args.max_step_tokens,
        max_model_len=args.max_model_len,
        load_format=args.load_format,
        cuda_graph_max_batch=args.cuda_graph_max_batch,
        recompute_head_pages=args.recompute_head_pages,
        recompute_policy=args.recompute_policy,
        recompute_pages=args.recompute_pages,
        recompute_ratio=args.recompute_ratio,
        doc_attention_temperature=args.doc_attention_temperature,
        doc_attention_scale=args.doc_attention_scale,
        doc_positions=args.doc_positions,
        shared_chunk_attention=args.shared_chunk_attention,
        lazy_flashinfer_prefill=args.lazy_flashinfer_prefill,
        overlap_schedule=args.overlap_schedule,
        late_planning=args.late_planning,
        worker_in_scheduler=args.worker_in_scheduler,
        tokenizer_in_http=args.tokenizer_in_http,
        tensor_parallel_size=args.tensor_parallel_size,
        tp_peer_all_reduce=args.tp_peer_all_reduce,
        tp_fused_all_reduce_norm=args.tp_fused_all_reduce_norm,
        document_store=args.document_store,
        kv_peers=kv_peers(args),
        kv_peer_timeout_s=args.kv_peer_timeout,
        seed=args.seed,
    )


def kv_peers(args: argparse.Namespace) -> tuple[str, ...]:
    """EngineConfig.kv_peers from --kv-peer-addr and --kv-peers (one without the other: an error)."""
    if bool(args.kv_peer_addr) != bool(args.kv_peers):
        raise ValueError("--kv-peer-addr and --kv-peers go together (this replica's address and the others')")
    return (args.kv_peer_addr, *args.kv_peers) if args.kv_peer_addr else ()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        check_server_options(args)
        cfg = engine_config(args)
        cfg.validate()
        check_device_option(cfg.device)
        check_devices(cfg)
        check_model_option(cfg.model, cfg.load_format)
        check_document_store_option(cfg.document_store)
    except ValueError as e:
        build_parser().error(flag_error(build_parser(), str(e)))
    opts = ServerOptions(args.host, args.port, args.api_key, args.log_level, args.served_model_name)
    return serve(cfg, opts)


if __name__ == "__main__":
    sys.exit(main())
