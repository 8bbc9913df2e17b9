"""Where the host waits for the device in steady-state steps (CUDA only): runs a batch of requests that
use the per-request features (penalties, logit bias, min_tokens, logprobs, seeded sampling, a JSON
schema) once to warm up, then again under torch.cuda's sync debug mode, and prints each Python line
that made a synchronizing call, with its count. With the overlap schedule, the only expected waits
are the ones for the previous step's tokens.

    python benchmarks/sync_check.py [--model smollm2-135m] [--batch 8] [--steps 16]
"""

from __future__ import annotations

import argparse
import collections
import random
import warnings

import torch

from lazyrt import Engine, SamplingParams


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=16)
    args = p.parse_args()
    eng = Engine(args.model, load_format=args.load_format, device="cuda", kv_cache_tokens=65536)
    rng = random.Random(0)
    schema = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
    kinds = [dict(repetition_penalty=1.2, presence_penalty=0.3), dict(logit_bias={100: 2.0}, min_tokens=4),
             dict(logprobs=3), dict(temperature=0.8, seed=1), dict(json_schema=schema), {}]  # fmt: skip
    sps = [SamplingParams(max_tokens=args.steps, **kinds[i % len(kinds)]) for i in range(args.batch)]

    def prompts():
        return [[rng.randrange(100, 30000) for _ in range(32)] for _ in range(args.batch)]

    eng.generate(prompts(), sps)  # warm-up: graphs, grammar compile, allocator
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            eng.generate(prompts(), sps)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    where = collections.Counter(f"{w.filename}:{w.lineno}" for w in seen if "synchroniz" in str(w.message))
    print(f"{sum(where.values())} synchronizing calls over about {args.steps} steps")
    for loc, n in where.most_common():
        print(f"{n:6d}  {loc}")


if __name__ == "__main__":
    main()
