"""Chunk eviction policy: hit ratio vs KV budget (issue 6). A cache simulation through the real
scheduler, no model.

The chunk hit ratio depends only on which KV the scheduler keeps, not on the model's numbers, so
this drives the real `Scheduler` (admission, chunk table, radix, eviction) and `EngineCore` (the
step loop) with a stand-in worker whose `execute(StepMsg) -> StepResult` returns one token per
sampled item and computes nothing. The page pool is a tensor-free allocator (device "meta"), as in
the server's scheduler process. Runs in seconds on a CPU.

Workload: benchmarks/rag_workload.py's request stream (the same doc ids as rag_serving.py's
--sweep-kv-budget with the same seed): `--docs` documents of `--doc-tokens` tokens, 5 per request
drawn by Zipf(alpha=2.1) popularity, `--num-requests` requests, closed loop with `--concurrency`
requests in flight (a new one is added as soon as one finishes), `--output-tokens` output tokens
each (ignore_eos), a 16-token system prefix every chunk is conditioned on and a 16-token question.
Documents are synthetic token ids (no tokenizer). `--doc-tokens-min N` draws each document's length
uniformly from [N, --doc-tokens] instead (mixed sizes, where gdsf and lfu differ).

Per policy and budget: chunk hit ratio = doc hits / (doc hits + doc misses) over all requests (from
each request's meta, counted once at admission; a doc being computed for another request counts as a
hit), chunk evictions, and recomputed chunk tokens (every chunk prefill the worker was asked for).

`--host-tier M ...` (issue 15): each point also with a host KV tier of M x the device budget
(`host_kv_cache_tokens`): chunks evicted from the device move to the host and come back by a copy
(a host hit) instead of a recompute; the table then compares recomputed tokens per host size.

    python benchmarks/eviction_sweep.py --out eviction_sweep.jsonl
    python benchmarks/eviction_sweep.py --policies lfu --host-tier 0 1 4
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from rag_workload import WorkloadConfig, build_workload  # noqa: E402

from lazyrt.cache.eviction import EVICTION_POLICIES  # noqa: E402
from lazyrt.cache.page_pool import PagePool  # noqa: E402
from lazyrt.runtime.ipc.messages import StepMsg, StepResult  # noqa: E402
from lazyrt.runtime.scheduler.engine_core import EngineCore  # noqa: E402
from lazyrt.runtime.scheduler.request import Request  # noqa: E402
from lazyrt.runtime.scheduler.scheduler import Scheduler  # noqa: E402
from lazyrt.sampling_params import SamplingParams  # noqa: E402

DEFAULT_BUDGETS = [20480, 30720, 40960, 61440, 81920, 122880, 163840, 245760]


class NullWorker:
    """Stands in for the model worker: one token per sampled item, nothing computed."""

    def __init__(self) -> None:
        self.chunk_tokens = 0  # tokens of chunk prefills (items that sample nothing)
        self.steps = 0

    def execute(self, msg: StepMsg) -> StepResult:
        self.steps += 1
        self.chunk_tokens += sum(len(it.token_ids) for it in msg.items if it.rid < 0)
        return StepResult(tokens=[1 for it in msg.items if it.rid >= 0])


def make_docs(num_docs: int, max_tokens: int, min_tokens: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    docs = []
    for d in range(num_docs):
        n = rng.randint(min_tokens, max_tokens)
        # Distinct ids per document (never a shared prefix); ids stay below a 32k vocabulary.
        docs.append([100 + (d * 7919 + j * 31) % 30000 for j in range(n)])
    return docs


def run_point(args, policy: str, budget: int, requests, docs, host_tier: float = 0.0) -> dict:
    pool = PagePool(1, budget // args.page_size, args.page_size, 1, 1, torch.float32, "meta")
    host_pages = int(budget * host_tier) // args.page_size
    sched = Scheduler(pool, "lazy", "sim", max_step_tokens=args.max_step_tokens, eviction_policy=policy,
                      host_kv_pages=host_pages)  # fmt: skip
    worker = NullWorker()
    core = EngineCore(sched, worker, eos_ids=set())
    params = SamplingParams(max_tokens=args.output_tokens, temperature=0.0, ignore_eos=True)
    prefix = list(range(1, 17))
    pending = list(requests)
    pending.reverse()
    hits = misses = done = 0
    t0 = time.perf_counter()

    def submit() -> None:
        r = pending.pop()
        suffix = [40000 + r.index % 1000] + list(range(50, 50 + args.question_tokens - 1))
        req = Request(r.index, params, prefix=prefix, docs=[docs[i] for i in r.doc_ids], suffix=suffix)
        req.max_new_tokens = args.output_tokens
        core.add(req)

    while pending and len(core.requests) < args.concurrency:
        submit()
    while core.has_work:
        for out in core.step():
            if out.finish_reason is not None:
                hits += out.meta["chunk_hits"]
                misses += out.meta["chunk_misses"]
                done += 1
                if pending:
                    submit()
    assert done == len(requests), (done, len(requests))
    assert sched.held_pages() == 0 and pool.num_free + sched.chunks.num_pages + sched.radix.num_pages == (
        pool.num_pages
    )
    st = sched.chunks.stats
    # every chunk's first computation (the prefix chunk and each document used) no cache can save
    first_use = len(prefix) + sum(len(docs[i]) for i in {i for r in requests for i in r.doc_ids})
    return {
        "first_use_tokens": first_use,
        "policy": policy,
        "kv_cache_tokens": budget,
        "host_kv_cache_tokens": host_pages * args.page_size,
        "host_tier": host_tier,
        "chunk_host_hits": st.host_hits,
        "chunk_offloads": st.offloads,
        "chunk_loads": st.loads,
        "host_evictions": st.host_evictions,
        "chunk_hit_ratio": hits / max(hits + misses, 1),
        "chunk_hits": hits,
        "chunk_misses": misses,
        "chunk_evictions": sched.chunks.stats.evictions,
        "recomputed_chunk_tokens": worker.chunk_tokens,
        "steps": worker.steps,
        "sim_s": round(time.perf_counter() - t0, 3),
    }


def markdown(rows: list[dict], policies: list[str]) -> str:
    head = "| KV budget (tokens) | " + " | ".join(
        f"{p} hit ratio | {p} evictions | {p} recomputed tokens" for p in policies
    )
    lines = [head + " |", "|" + "---:|" * (1 + 3 * len(policies))]
    by = {(r["policy"], r["kv_cache_tokens"]): r for r in rows}
    for b in sorted({r["kv_cache_tokens"] for r in rows}):
        cells = []
        for p in policies:
            r = by[(p, b)]
            cells += [
                f"{r['chunk_hit_ratio']:.3f}",
                str(r["chunk_evictions"]),
                str(r["recomputed_chunk_tokens"]),
            ]
        lines.append(f"| {b} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def host_markdown(rows: list[dict], policy: str, tiers: list[float]) -> str:
    """Per device budget and host tier size: hit ratio (both tiers), host hits, chunk tokens computed
    again after an eviction (all computed tokens minus each chunk's first computation), and how many
    times fewer than with no host tier."""
    head = "| KV budget (tokens) | " + " | ".join(
        f"host {m:g}x: hit ratio | host {m:g}x: host hits | host {m:g}x: tokens recomputed after eviction"
        + (f" | host {m:g}x: fewer" if m else "")
        for m in tiers
    )
    lines = [head + " |", "|" + "---:|" * (1 + sum(4 if m else 3 for m in tiers))]
    by = {(r["host_tier"], r["kv_cache_tokens"]): r for r in rows if r["policy"] == policy}
    for b in sorted({r["kv_cache_tokens"] for r in rows}):
        base = by.get((0.0, b))
        cells = []
        for m in tiers:
            r = by[(m, b)]
            redo = r["recomputed_chunk_tokens"] - r["first_use_tokens"]
            cells += [f"{r['chunk_hit_ratio']:.3f}", str(r["chunk_host_hits"]), str(redo)]
            if m and base:  # against the same budget without a host tier
                was = base["recomputed_chunk_tokens"] - base["first_use_tokens"]
                cells.append("-" if was == 0 else f"{was / redo:.1f}x" if redo else "all")
            elif m:
                cells.append("")
        lines.append(f"| {b} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policies", nargs="+", default=list(EVICTION_POLICIES), choices=EVICTION_POLICIES)
    p.add_argument("--kv-budgets", type=int, nargs="+", default=DEFAULT_BUDGETS, help="KV cache tokens")
    p.add_argument("--docs", type=int, default=100)
    p.add_argument("--doc-tokens", type=int, default=2048)
    p.add_argument("--doc-tokens-min", type=int, default=None, help="mixed sizes: lengths in [min, max]")
    p.add_argument("--docs-per-request", type=int, default=5)
    p.add_argument("--question-tokens", type=int, default=16)
    p.add_argument("--num-requests", type=int, default=200)
    p.add_argument("--zipf-alpha", type=float, default=2.1)
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight (closed loop)")
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-step-tokens", type=int, default=8192)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="append one JSON line per point")
    p.add_argument("--host-tier", type=float, nargs="+", default=[0.0],
                   help="host KV tier sizes, as multiples of each device budget (0 = none)")
    return p.parse_args(argv)


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    cfg = WorkloadConfig(
        num_docs=args.docs,
        doc_tokens=1,  # the text documents are not used: token-id documents below
        docs_per_request=args.docs_per_request,
        question_tokens=args.question_tokens,
        num_requests=args.num_requests,
        popularity="zipf",
        zipf_alpha=args.zipf_alpha,
        rate=math.inf,
        seed=args.seed,
    )
    requests = build_workload(cfg, ["w"]).requests
    docs = make_docs(args.docs, args.doc_tokens, args.doc_tokens_min or args.doc_tokens, args.seed)
    cpu = platform.processor() or platform.machine()
    machine = f"{cpu}, {os.cpu_count()} CPUs, Python {platform.python_version()}"
    rows = []
    t = time.perf_counter()
    for policy, tier, budget in ((p, m, b) for p in args.policies for m in args.host_tier
                                 for b in args.kv_budgets):  # fmt: skip
        row = run_point(args, policy, budget, requests, docs, tier)
        row.update(
            num_requests=args.num_requests,
            num_docs=args.docs,
            doc_tokens=args.doc_tokens,
            doc_tokens_min=args.doc_tokens_min,
            zipf_alpha=args.zipf_alpha,
            concurrency=args.concurrency,
            output_tokens=args.output_tokens,
            page_size=args.page_size,
            seed=args.seed,
            machine=machine,
        )
        rows.append(row)
        print(
            f"[evict] {policy:5s} host={tier:g}x budget={budget:7d} hit={row['chunk_hit_ratio']:.3f} "
            f"host_hits={row['chunk_host_hits']} "
            f"evictions={row['chunk_evictions']} recomputed={row['recomputed_chunk_tokens']} "
            f"({row['sim_s']:.1f}s)",
            flush=True,
        )
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")
    print()
    if args.host_tier == [0.0]:
        print(markdown(rows, args.policies))
    for policy in args.policies if args.host_tier != [0.0] else []:
        print(f"{policy}:\n" + host_markdown(rows, policy, args.host_tier))
    print(f"\n[evict] {len(rows)} points in {time.perf_counter() - t:.1f}s on {machine}")
    return rows


if __name__ == "__main__":
    main()
