"""How much slower one request's host work runs when it comes alone (issue 14's TTFT at 1 req/s) than
in a warm loop: the tokenizer process's `RequestTokenizer.tokenize` of a RAG request whose 5
documents' tokens are cached, and the msgpack decode of the TokenizedReq the scheduler receives.

Each is timed four ways, median of --iters: back to back (the warm loop a profiler shows), once
after the process slept 1 ms, once after it slept --idle-s (a server process between requests at
1 req/s: blocked in zmq's poll), and once after it spun --idle-s on other Python code (awake, its
caches and predictors full of other work).
The served hops of docs/benchmarks.md ("Where an all-cached request's 16.6 ms at the server goes")
are of the second kind.

Run: python benchmarks/experiments/cold_hop.py [--idle-s 0.2] [--iters 20]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from collections.abc import Callable

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from lazyrt.models import gguf_convert, loader  # noqa: E402
from lazyrt.runtime.ipc.messages import GenerateReq, decode, encode  # noqa: E402
from lazyrt.runtime.tokenizer.request_tokenizer import RequestTokenizer  # noqa: E402
from lazyrt.sampling_params import SamplingParams  # noqa: E402


def timed(fn: Callable[[], object], iters: int, before: Callable[[], None]) -> float:
    """Median ms of fn() over iters calls, each after before()."""
    ts = []
    for _ in range(iters):
        before()
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--idle-s", type=float, default=0.2, help="sleep / spin before each cold call")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--doc-words", type=int, default=700, help="words a document (~2,000 tokens)")
    p.add_argument("--tokenizer-dir", default=os.environ.get("LAZYRT_TOKENIZER_DIR"),
                   help="a tokenizer directory (default: $LAZYRT_TOKENIZER_DIR, else the default model's)")
    args = p.parse_args(argv)

    from transformers import AutoTokenizer

    tok_dir = args.tokenizer_dir or gguf_convert.ensure_converted(loader.default_model_path(), None)
    tok = AutoTokenizer.from_pretrained(tok_dir)
    rt = RequestTokenizer(tok, 32768, len(tok))
    rng = random.Random(0)
    words = "alpha beta gamma delta river stone paper light cloud tree apple house".split()
    docs = [" ".join(f"{rng.choice(words)}{rng.randrange(100)}" for _ in range(args.doc_words))
            for _ in range(5)]
    req = GenerateReq(1, SamplingParams(max_tokens=1, temperature=0.0), text="What is item 3 about?",
                      docs=docs, system="Answer from the documents.", text_mode="rag")  # fmt: skip
    tokenized = rt.tokenize(req)  # the documents' tokens are cached from here on
    wire = encode(tokenized)
    print(f"documents: {[len(d) for d in tokenized.docs]} tokens; TokenizedReq {len(wire)} bytes")

    def nothing() -> None:
        pass

    def sleep() -> None:
        time.sleep(args.idle_s)

    def nap() -> None:
        time.sleep(0.001)

    def spin() -> None:
        end = time.perf_counter() + args.idle_s
        n = 0
        while time.perf_counter() < end:
            n += 1

    print(f"| work (ms) | warm loop | after sleeping 1 ms | after sleeping {args.idle_s} s | after a spin |")
    print("|---|---:|---:|---:|---:|")
    for name, fn in (("tokenize (documents cached)", lambda: rt.tokenize(req)),
                     ("decode TokenizedReq", lambda: decode(wire))):  # fmt: skip
        row = [timed(fn, max(args.iters, 50), nothing), timed(fn, args.iters, nap),
               timed(fn, args.iters, sleep), timed(fn, args.iters, spin)]
        print(f"| {name} | " + " | ".join(f"{v:.3f}" for v in row) + " |")


if __name__ == "__main__":
    main()
