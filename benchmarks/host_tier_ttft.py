"""Time to first token when a request's documents come back from the host KV tier (issue 15), beside
the same request when its documents are recomputed and when they are still on the device.

One engine (dummy weights in the model's real shapes) with a device pool that holds about
`--room-requests` requests' documents and a host tier `--host-factor` times that. Per trial:
  1. request A with `--docs-per-request` new documents: every document computed (recompute);
  2. requests over other new documents until A's documents have all moved to the host;
  3. A again with another question: host hit (the copies back run at the start of its step);
  4. A again with a third question: device hit.
Each is `generate(max_tokens=1)` alone in the engine, timed on the host around the call (the
prefill step and the first sampled token), synchronized. The table gives medians over `--trials`.

GPU:  python benchmarks/host_tier_ttft.py --out host_tier_ttft.json
CPU smoke:  python benchmarks/host_tier_ttft.py --model tiny-llama --device cpu --doc-tokens 64 --trials 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--doc-tokens", type=int, default=2048)
    p.add_argument("--docs-per-request", type=int, default=5)
    p.add_argument("--question-tokens", type=int, default=16)
    p.add_argument("--room-requests", type=float, default=2.5, help="device pool, in requests' documents")
    p.add_argument("--host-factor", type=float, default=4.0, help="host tier size / device pool size")
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--out", default=None, help="JSON with every timing")
    args = p.parse_args()

    from lazyrt import Engine, RagPrompt, SamplingParams

    per_request = args.docs_per_request * (args.doc_tokens + 16)
    device_tokens = int(args.room_requests * per_request) + 256
    eng = Engine(args.model, device=args.device, dtype=args.dtype, load_format="dummy",
                 kv_cache_tokens=device_tokens, host_kv_cache_tokens=int(args.host_factor * device_tokens))
    gen = torch.Generator().manual_seed(0)
    vocab = min(eng.model_config.vocab_size, 32000)
    rand = lambda n: torch.randint(100, vocab, (n,), generator=gen).tolist()  # noqa: E731
    prefix = rand(16)
    sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)

    def new_docs() -> list[list[int]]:
        return [rand(args.doc_tokens) for _ in range(args.docs_per_request)]

    def ttft(docs: list[list[int]]) -> tuple[float, dict]:
        before = eng.cache_stats()
        sync()
        t = time.perf_counter()
        eng.generate(RagPrompt(prefix, docs, rand(args.question_tokens)), sp)
        sync()
        ms = (time.perf_counter() - t) * 1e3
        after = eng.cache_stats()
        return ms, {k: after[k] - before[k] for k in ("chunk_device_hits", "chunk_host_hits", "chunk_misses")}

    ttft(new_docs())  # warm-up: compiles, allocations
    rows = []
    for _ in range(args.trials):
        a = new_docs()
        recompute, c1 = ttft(a)
        for _ in range(int(args.room_requests) + 2):  # push A's documents to the host
            ttft(new_docs())
        host_hit, c2 = ttft(a)
        device_hit, c3 = ttft(a)
        # (the shared system prefix is a chunk too: it may be in either tier)
        if c2["chunk_host_hits"] < args.docs_per_request or c3["chunk_host_hits"] > 0:
            raise RuntimeError(f"expected every document from the host, then from the device, got {c2}, {c3}")
        rows.append({"recompute_ms": recompute, "device_hit_ms": device_hit, "host_hit_ms": host_hit,
                     "counts": [c1, c2, c3]})
    med = {k: statistics.median(r[k] for r in rows) for k in ("recompute_ms", "device_hit_ms", "host_hit_ms")}
    st = eng.cache_stats()
    print(f"{args.model} on {args.device}: {args.docs_per_request} x {args.doc_tokens}-token documents, "
          f"question {args.question_tokens} tokens, medians of {args.trials} trials")
    print("| documents from | TTFT (ms) | vs recompute |")
    print("|---|---|---|")
    names = (("recomputed", "recompute_ms"), ("host tier", "host_hit_ms"), ("device", "device_hit_ms"))
    for name, key in names:
        print(f"| {name} | {med[key]:.1f} | {med[key] / med['recompute_ms']:.2f} |")
    gib = lambda k: st[k] / 2**30  # noqa: E731
    print(f"host tier moved {gib('host_load_bytes'):.2f} GiB in, {gib('host_offload_bytes'):.2f} GiB out")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "median_ms": med, "trials": rows,
                       "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"},
                      f, indent=1)


if __name__ == "__main__":
    main()
