"""Where a cached RAG request's time to first token goes (Engine in-process, no HTTP).

Dummy Llama-3.1-8B, 5 cached documents of 2,048 tokens, a 16-token question, max_tokens=1: TTFT is
one scheduler step with the question's prefill. Times each part of that step with CUDA syncs
(schedule, message encode/decode, flatten, GPU forward, sampling) and prints torch.profiler's top
ops for one step.

    python benchmarks/ttft_profile.py --device cuda            # H100
    python benchmarks/ttft_profile.py --model tiny-llama --device cpu --doc-tokens 64   # smoke
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from lazyrt import Engine, RagPrompt, SamplingParams


def cached_documents(args, device: str, cache_mode: str, graph_batch: int) -> tuple:
    """A dummy-weight Engine whose args.docs documents of args.doc_tokens are computed and cached
    (one request ran over them): (engine, rng, prefix, docs, toks(n) -> n random ids, 1-token params).
    Also benchmarks/experiments/question_launch.py's set-up."""
    engine = Engine(args.model, load_format="dummy", device=device, cache_mode=cache_mode,
                    kv_cache_tokens=args.docs * args.doc_tokens * 4,
                    cuda_graph_max_batch=graph_batch)  # fmt: skip
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    toks = lambda n: [rng.randrange(1000, vocab) for _ in range(n)]  # noqa: E731
    prefix, docs = toks(24), [toks(args.doc_tokens) for _ in range(args.docs)]
    sp = SamplingParams(max_tokens=1, ignore_eos=True)
    engine.generate([RagPrompt(prefix, docs, toks(args.question_tokens))], sp)  # computes the chunks
    return engine, rng, prefix, docs, toks, sp


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--cache-mode", default="lazy")
    p.add_argument("--doc-tokens", type=int, default=2048)
    p.add_argument("--docs", type=int, default=5)
    p.add_argument("--question-tokens", type=int, default=16)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--cuda-graph-max-batch", type=int, default=64,
                   help="0: every step eager (the question step was eager before small-step graphs)")
    args = p.parse_args(argv)
    dev = args.device
    graphs = args.cuda_graph_max_batch
    engine, rng, prefix, docs, toks, sp = cached_documents(args, dev, args.cache_mode, graphs)
    sync = torch.cuda.synchronize if dev.startswith("cuda") else (lambda: None)
    parts: dict[str, list[float]] = {}
    core, worker, runner = engine.core, engine.worker, engine.runner

    def timed(name, fn):
        def wrapped(*a, **k):
            sync()
            t0 = time.perf_counter()
            out = fn(*a, **k)
            sync()
            parts.setdefault(name, []).append((time.perf_counter() - t0) * 1e3)
            return out

        return wrapped

    core.scheduler.schedule = timed("schedule", core.scheduler.schedule)
    core._encoder.encode = timed("encode StepMsg", core._encoder.encode)
    worker._decoder.decode = timed("decode StepMsg", worker._decoder.decode)
    runner.build_metadata = timed("metadata to device", runner.build_metadata)
    worker.model.forward = timed("model forward", worker.model.forward)
    worker.execute = timed("worker step total", worker.execute)
    totals = []
    for _ in range(args.iters):
        order = rng.sample(docs, len(docs))
        t0 = time.perf_counter()
        out = engine.generate([RagPrompt(prefix, order, toks(args.question_tokens))], sp)[0]
        totals.append((time.perf_counter() - t0) * 1e3)
        assert out["meta"]["chunk_hits"] == len(docs), out["meta"]
    name = torch.cuda.get_device_name() if dev.startswith("cuda") else "cpu"
    print(f"device {name}; model {args.model}; {args.docs} cached docs x {args.doc_tokens} tokens")
    print(f"question {args.question_tokens} tokens; median of {args.iters} requests; "
          f"cuda_graph_max_batch {args.cuda_graph_max_batch}: {runner.graph_steps} steps replayed")
    print("| part | ms (median) |\n|---|---|")
    for name, v in parts.items():
        print(f"| {name} | {statistics.median(v):.2f} |")
    print(f"| Engine.generate (whole request) | {statistics.median(totals):.2f} |")
    acts = [torch.profiler.ProfilerActivity.CPU] + (
        [torch.profiler.ProfilerActivity.CUDA] if dev.startswith("cuda") else []
    )
    with torch.profiler.profile(activities=acts) as prof:
        engine.generate([RagPrompt(prefix, rng.sample(docs, len(docs)), toks(args.question_tokens))], sp)
    key = "cuda_time_total" if dev.startswith("cuda") else "cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=14, max_name_column_width=48))
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=10, max_name_column_width=48))


if __name__ == "__main__":
    main()
