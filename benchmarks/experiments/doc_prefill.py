"""What computing new documents and plain prompts costs in lazy mode with and without
`--lazy-flashinfer-prefill` (issue 14: "chunk KV computed by FlashInfer"): each timed request brings
--docs new documents of --doc-tokens after a shared prefix (max_tokens=1: its steps are the documents'
prefill and the question), then one plain prompt of --plain-tokens. In process, Engine, dummy weights;
each setting in a fresh engine, one after the other, the device synchronized around each request.

    python benchmarks/experiments/doc_prefill.py [--model llama-3.1-8b] [--docs 4] [--doc-tokens 2048]
    python benchmarks/experiments/doc_prefill.py --model tiny-llama --device cpu --doc-tokens 64 --iters 2
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from lazyrt import Engine, RagPrompt, SamplingParams  # noqa: E402


def run(args: argparse.Namespace, flashinfer: bool) -> dict:
    engine = Engine(args.model, load_format="dummy", device=args.device, cache_mode="lazy",
                    kv_cache_tokens=args.kv_cache_tokens, lazy_flashinfer_prefill=flashinfer)  # fmt: skip
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    rng = random.Random(args.seed)
    vocab = engine.model_config.vocab_size
    toks = lambda n: [rng.randrange(1000, vocab) for _ in range(n)]  # noqa: E731
    prefix, sp = toks(24), SamplingParams(max_tokens=1, ignore_eos=True)
    docs_ms, plain_ms = [], []
    for i in range(args.iters + 1):  # the first of each is a warm-up
        prompt = RagPrompt(prefix, [toks(args.doc_tokens) for _ in range(args.docs)], toks(16))
        sync()
        t = time.perf_counter()
        out = engine.generate([prompt], sp)[0]
        sync()
        if i:
            docs_ms.append((time.perf_counter() - t) * 1e3)
        assert out["meta"]["chunk_misses"] == args.docs, out["meta"]
        sync()
        t = time.perf_counter()
        engine.generate([toks(args.plain_tokens)], sp)
        sync()
        if i:
            plain_ms.append((time.perf_counter() - t) * 1e3)
    row = {
        "lazy_flashinfer_prefill": flashinfer,
        "ragged_path": engine.runner.ragged_prefill,
        "ragged_steps": engine.runner.ragged_steps,
        "docs_request_ms": statistics.median(docs_ms),
        "plain_prompt_ms": statistics.median(plain_ms),
    }
    del engine
    gc.collect()
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return row


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--docs", type=int, default=4)
    p.add_argument("--doc-tokens", type=int, default=2048)
    p.add_argument("--plain-tokens", type=int, default=8192)
    p.add_argument("--kv-cache-tokens", type=int, default=262144)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--settings", nargs="+", choices=["off", "on"], default=["off", "on"])
    p.add_argument("--out", help="append the rows here (JSON lines)")
    args = p.parse_args(argv)
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(f"{name}; {args.model}; {args.docs} new documents x {args.doc_tokens} tokens a request; "
          f"plain prompt {args.plain_tokens} tokens; median of {args.iters}")  # fmt: skip
    print("| --lazy-flashinfer-prefill | steps through FlashInfer | request with new documents (ms) "
          "| plain prompt (ms) |")
    print("|---|---:|---:|---:|")
    for setting in args.settings:
        row = run(args, setting == "on")
        row.update(device=name, model=args.model, docs=args.docs, doc_tokens=args.doc_tokens,
                   plain_tokens=args.plain_tokens)  # fmt: skip
        ms = f"{row['docs_request_ms']:.1f} | {row['plain_prompt_ms']:.1f}"
        print(f"| {setting} | {row['ragged_steps']} | {ms} |")
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
