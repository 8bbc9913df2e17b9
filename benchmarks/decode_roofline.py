"""Decode step time at batch 1..64 against the HBM roofline (issues 6, 14).

Step time = wall time of --steps pure decode steps of the lazyrt Engine (every request already
prefilled, so no step carries a prefill piece), for B prompts of --context tokens: by default RAG
prompts (lazy) of 5 documents drawn by Zipf(--alpha) popularity from a pool of 100, as in
rag_serving.py; --cache-mode none: plain random prompts, every request reads its own KV.
Per-request roofline = (weight bytes + B x context x KV bytes per token) / measured device-to-device
copy bandwidth; floor = the same with each distinct document's KV counted once (what a step that
reads every shared document once must move); weights floor = weight bytes / bandwidth. (An earlier
version timed generate(max_tokens=N) minus generate(max_tokens=1): with chunked prefill, early
requests decode beside later requests' prefill pieces, so that difference mostly timed mixed
prefill steps.)

GPU:  python benchmarks/decode_roofline.py                      (llama-3.1-8b, dummy bf16, cuda)
      python benchmarks/decode_roofline.py --no-shared-chunk-attention   (per-request KV reads)
      python benchmarks/decode_roofline.py --cache-mode none --batches 1 8 32  (plain prompts)
CPU smoke:  python benchmarks/decode_roofline.py --model tiny-llama --device cpu --batches 1 2 \
              --context 32 --steps 4
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time

import torch

QUESTION_TOKENS = 16  # lazy/block prompts: docs + a question of this many tokens


def copy_bandwidth(device: str, mb: int = 1024) -> float:
    """Bytes/s of a device-to-device copy (read + write counted)."""
    n = mb * (1 << 20) // 2
    a = torch.empty(n, dtype=torch.float16, device=device)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    sync(device)
    reps = 10
    t = time.perf_counter()
    for _ in range(reps):
        b.copy_(a)
    sync(device)
    return 2 * a.numel() * a.element_size() * reps / (time.perf_counter() - t)


def sync(device: str) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def prompt_len(p) -> int:
    """Tokens of a plain prompt (token ids) or of a RagPrompt with token-id parts."""
    if isinstance(p, list):
        return len(p)
    return len(p.prefix) + sum(len(d) for d in p.docs) + len(p.suffix)


def decode_headroom(prompts: list) -> int:
    """Output tokens a request may make before the last prompt is prefilled (>= 256 tokens a step)."""
    return sum(prompt_len(p) for p in prompts) // 256 + 8


def decode_step_seconds(eng, prompts: list, steps: int, around_steps=None, warmup_steps: int = 4,
                        after_steps=None) -> float:
    """Wall seconds per pure decode step: prefill every prompt first (stepping the engine core until
    each request has its first token), run `warmup_steps` untimed decode steps (without them, the first
    timed window of a new batch took 17.6 ms a step at batch 64 on the H100, the next one ~13 ms),
    then time `steps` more steps, in which every request decodes.
    around_steps: optional context-manager factory wrapped around the timed steps (a profiler).
    after_steps: optional callable run right after the timed steps, before the batch drains (to read
    the runner's state as the timed steps left it)."""
    from lazyrt import SamplingParams
    from lazyrt.runtime.scheduler.request import RequestState

    # early requests decode while later ones prefill: give them room to still be running when timed
    sp = SamplingParams(max_tokens=warmup_steps + steps + decode_headroom(prompts), temperature=0.0,
                        ignore_eos=True)
    reqs = [eng._make_request(p, sp) for p in prompts]
    core = eng.core
    for r in reqs:
        core.add(r)
    dev = str(eng.model.device)
    try:
        while any(not r.output_ids for r in reqs):
            core.step()
        for _ in range(warmup_steps):
            core.step()
        sync(dev)
        with around_steps() if around_steps else contextlib.nullcontext():
            t = time.perf_counter()
            for _ in range(steps):
                core.step()
            sync(dev)
            elapsed = time.perf_counter() - t
        if after_steps is not None:
            after_steps()
        if any(r.state is RequestState.FINISHED for r in reqs):
            raise RuntimeError("a request finished inside the timed window: not a pure decode batch")
        while any(r.state is not RequestState.FINISHED for r in reqs):
            core.step()
    finally:
        for r in reqs:
            core.abort(r.rid)
    return elapsed / steps


def add_workload_args(p: argparse.ArgumentParser, batches: list[int]) -> None:
    """The engine and prompt options decode_roofline.py and decode_profile.py share."""
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--batches", type=int, nargs="+", default=batches)
    p.add_argument("--context", type=int, default=10368, help="prompt tokens a request (5 x 2048 + 128)")
    p.add_argument("--steps", type=int, default=32, help="decode steps timed")
    p.add_argument("--cache-mode", default="lazy", help="none: plain prompts; lazy/block: RAG prompts")
    p.add_argument("--alpha", type=float, default=2.1, help="lazy/block: Zipf exponent of doc popularity")
    p.add_argument("--shared-chunk-attention", action=argparse.BooleanOptionalAction, default=True,
                   help="lazy: read each shared document once per step (the engine's default)")
    p.add_argument("--overlap-schedule", action=argparse.BooleanOptionalAction, default=True,
                   help="build the next step while the device runs this one (the engine's default)")
    p.add_argument("--docs-per-request", type=int, default=5, help="lazy/block: documents a request")
    p.add_argument("--pool-docs", type=int, default=100, help="lazy/block: documents to draw them from")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="ranks (GPUs) the model is split over")
    p.add_argument("--tp-peer-all-reduce", action=argparse.BooleanOptionalAction, default=True,
                   help="TP on CUDA: small all-reduces via symmetric memory (no: all NCCL)")  # fmt: skip
    p.add_argument("--tp-fused-all-reduce-norm", action=argparse.BooleanOptionalAction, default=None,
                   help="TP > 1: each layer's all-reduce, residual add and RMSNorm in one kernel "
                   "(default: the engine's, on with the peer all-reduce)")
    p.add_argument("--cuda-graph-max-batch", type=int, default=64, help="0: every step launches eagerly")
    p.add_argument("--split-last-round", action=argparse.BooleanOptionalAction, default=True,
                   help="lazy: cut the longest document pieces that spill into a last round of the shared "
                   "kernel's programs (shared_chunk.split_last_round, the engine's default; TP=1 only)")


def make_workload(args):
    """(engine, prompts(b) -> (prompts, distinct document tokens), document tokens) for the args."""
    from lazyrt import Engine, RagPrompt

    max_b = max(args.batches)
    rag = args.cache_mode in ("lazy", "block")
    doc_tokens = (args.context - QUESTION_TOKENS) // args.docs_per_request if rag else 0
    headroom = decode_headroom([[0] * args.context] * max_b)
    # lazy keeps each pool document once and a request owns only its question + outputs; block
    # also copies its documents per request; none holds a full context per request
    shared = args.pool_docs * (doc_tokens + 16) if rag else 0
    own = QUESTION_TOKENS if args.cache_mode == "lazy" else args.context
    eng = Engine(
        model=None if args.model == "default" else args.model,
        device=args.device,
        dtype=args.dtype,
        load_format=args.load_format,
        cache_mode=args.cache_mode,
        max_running_requests=max_b,
        shared_chunk_attention=args.shared_chunk_attention,
        overlap_schedule=args.overlap_schedule,
        kv_cache_tokens=shared + max_b * (own + args.steps + 16 + headroom),
        tensor_parallel_size=args.tensor_parallel_size,
        tp_peer_all_reduce=getattr(args, "tp_peer_all_reduce", True),  # callers building their own args
        tp_fused_all_reduce_norm=getattr(args, "tp_fused_all_reduce_norm", None),
        cuda_graph_max_batch=args.cuda_graph_max_batch,
    )
    if not getattr(args, "split_last_round", True):  # callers building their own args
        if args.tensor_parallel_size > 1:
            raise SystemExit("--no-split-last-round: TP=1 only (the ranks' runners are in other processes)")
        eng.runner.shared_round_items = 0
    gen = torch.Generator().manual_seed(0)
    vocab = min(eng.model_config.vocab_size, 32000)

    def rand(n: int) -> list[int]:
        return torch.randint(100, vocab, (n,), generator=gen).tolist()

    pool = [rand(doc_tokens) for _ in range(args.pool_docs)] if rag else []
    weights = torch.tensor([1 / (i + 1) ** args.alpha for i in range(args.pool_docs)]) if rag else None

    def pick_docs() -> list[int]:  # docs_per_request distinct docs by popularity, in drawn order
        return torch.multinomial(weights, args.docs_per_request, replacement=False, generator=gen).tolist()

    def prompts(b: int) -> tuple[list, int]:
        """b prompts and the tokens of the distinct documents they use."""
        if not rag:
            return [rand(args.context) for _ in range(b)], 0
        picks = [pick_docs() for _ in range(b)]
        distinct = len({d for row in picks for d in row})
        rag_prompts = [RagPrompt([], [pool[i] for i in row], rand(QUESTION_TOKENS)) for row in picks]
        return rag_prompts, distinct * doc_tokens

    return eng, prompts, doc_tokens


def doc_work_items(eng) -> dict:
    """The batch's document grouping as the shared-chunk kernel runs it (TP=1): its longest pieces'
    work items x kv heads against a round of resident programs (shared_chunk.split_last_round)."""
    runner = getattr(eng, "runner", None)
    flat = getattr(getattr(runner, "_grouping", None), "flat", None)
    if flat is None or not len(flat["lens"]):
        return {}
    lens, pairs = flat["lens"], flat["pair_indptr"][1:] - flat["pair_indptr"][:-1]
    items = -(-pairs // runner.shared_block_pairs) * runner.pool.num_kv_heads
    return {"doc_segments": int(len(lens)), "piece_tokens": runner.shared_piece_tokens,
            "long_work_items": int(items[lens == lens.max()].sum()), "round_items": runner.shared_round_items}


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(p, [1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--copy-mb", type=int, default=1024)
    p.add_argument("--out", default=None, help="JSON lines, appended")
    args = p.parse_args(argv)

    rag = args.cache_mode in ("lazy", "block")
    eng, prompts, doc_tokens = make_workload(args)
    cfg = eng.model_config
    dev = str(eng.model.device)
    # LlamaModel keeps its weights in a dict by HF name; tied embeddings are one tensor, counted once
    unique = {t.data_ptr(): t for t in eng.model.w.values()}
    wbytes = sum(t.numel() * t.element_size() for t in unique.values())
    dtype_bytes = eng.model.dtype.itemsize
    kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * dtype_bytes
    bw = copy_bandwidth(dev, args.copy_mb)
    print(f"weights {wbytes / 1e9:.2f} GB, KV {kv_per_token} B/token, copy bandwidth {bw / 1e12:.3f} TB/s")

    decode_step_seconds(eng, prompts(min(args.batches))[0], 4)  # warm-up (compiles, graphs)
    rows = []
    print("| batch | step (ms) | per-request roofline (ms) | floor (ms) | weights floor (ms) "
          "| step / weights floor | tok/s |")
    print("|---|---|---|---|---|---|---|")
    for b in args.batches:
        batch, distinct_doc_tokens = prompts(b)
        steps0 = eng.runner.shared_steps
        grouping: dict = {}  # the timed steps' document grouping, read before the batch drains
        step = decode_step_seconds(eng, batch, args.steps,
                                   after_steps=lambda g=grouping: g.update(doc_work_items(eng)))
        own = args.context - args.docs_per_request * doc_tokens if rag else args.context
        bytes_ = wbytes + b * (args.context + args.steps // 2) * kv_per_token
        floor_bytes = wbytes + (distinct_doc_tokens + b * (own + args.steps // 2)) * kv_per_token
        roof, floor, wfloor = bytes_ / bw, floor_bytes / bw, wbytes / bw
        row = {
            "batch": b,
            "step_ms": step * 1e3,
            "roofline_ms": roof * 1e3,
            "floor_ms": floor * 1e3,
            "weights_floor_ms": wfloor * 1e3,
            "efficiency": roof / step,
            "tokens_per_s": b / step,
            "context": args.context,
            "cache_mode": args.cache_mode,
            "alpha": args.alpha if rag else None,
            "distinct_doc_tokens": distinct_doc_tokens,
            "shared_chunk_attention": args.shared_chunk_attention,
            "overlap_schedule": args.overlap_schedule,
            "shared_steps": eng.runner.shared_steps - steps0,
            **grouping,
            "model": args.model,
            "device": dev,
            "copy_bw_tbs": bw / 1e12,
            "weight_gb": wbytes / 1e9,
        }
        rows.append(row)
        print(f"| {b} | {step * 1e3:.2f} | {roof * 1e3:.2f} | {floor * 1e3:.2f} | {wfloor * 1e3:.2f} | "
              f"{step / wfloor:.2f} | {b / step:.0f} |", flush=True)  # fmt: skip
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")
    return rows


if __name__ == "__main__":
    main()
