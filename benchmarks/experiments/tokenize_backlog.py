"""What the tokenizer spends on a burst of RAG requests that arrive at once (issue 14's saturation
point: 60 or 120 requests, Zipf 2.1 over 100 documents x 2,048 tokens, 5 a request), one request at
a time (each tokenizes its own new documents, as before 4bbff84) against the way a queue is taken
now (TokenizerLoop.on_http_many: the new documents of them all in one batch, which a fast tokenizer
encodes on all cores, then each request). Fresh tokenizer caches for each; the
same request bodies rag_serving.py sends.

Run: python benchmarks/experiments/tokenize_backlog.py [--tokenizer-dir DIR] [--num-requests 60]
(DIR: a config + tokenizer dir; default the default model's tokenizer)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from rag_serving import load_tokenizer, request_body, single_token_words  # noqa: E402
from rag_workload import SYSTEM_PROMPT, WorkloadConfig, build_workload  # noqa: E402

from lazyrt.runtime.ipc.messages import GenerateReq  # noqa: E402
from lazyrt.runtime.tokenizer.request_tokenizer import RequestTokenizer  # noqa: E402
from lazyrt.sampling_params import SamplingParams  # noqa: E402


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer-dir", default=None)
    p.add_argument("--num-requests", type=int, default=60)
    p.add_argument("--zipf-alpha", type=float, default=2.1)
    p.add_argument("--repeats", type=int, default=3, help="median of this many fresh runs each way")
    args = p.parse_args(argv)
    tok = load_tokenizer(args.tokenizer_dir, None, "auto")
    cfg = WorkloadConfig(num_docs=100, doc_tokens=2048, docs_per_request=5, question_tokens=16,
                         num_requests=args.num_requests, popularity="zipf", zipf_alpha=args.zipf_alpha,
                         rate=float("inf"), seed=0)  # fmt: skip
    wl = build_workload(cfg, single_token_words(tok))
    sp = SamplingParams(max_tokens=64)
    reqs = []
    for i in range(args.num_requests):
        b = request_body(wl, i, 64)
        reqs.append(GenerateReq(i, sp, text=b["text"], docs=b["docs"], system=SYSTEM_PROMPT, text_mode="rag"))

    def one_by_one() -> tuple[float, int]:
        rt = RequestTokenizer(tok, 1 << 20, len(tok))
        t = time.perf_counter()
        for r in reqs:
            rt.tokenize(r)
        return time.perf_counter() - t, rt.doc_cache.misses

    def as_a_queue() -> tuple[float, int]:
        rt = RequestTokenizer(tok, 1 << 20, len(tok))
        t = time.perf_counter()
        rt.prefetch_docs(reqs)  # TokenizerLoop.prefetch (up to PREFETCH_TEXTS new documents)
        for r in reqs:
            rt.tokenize(r)
        return time.perf_counter() - t, rt.doc_cache.misses

    print(f"{args.num_requests} requests, {os.cpu_count()} CPUs, tokenizer {type(tok).__name__}")
    print(f"| way | ms (median of {args.repeats}) | documents tokenized |")
    print("|---|---:|---:|")
    for name, fn in (("one request at a time", one_by_one), ("as a queue (on_http_many)", as_a_queue)):
        runs = [fn() for _ in range(args.repeats)]
        print(f"| {name} | {statistics.median(r[0] for r in runs) * 1e3:.1f} | {runs[0][1]} |")


if __name__ == "__main__":
    main()
