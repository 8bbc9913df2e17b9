"""Tensor parallelism (issue 17): pure decode step time at TP=N beside TP=1, and greedy agreement.

One tensor-parallel size per process (a fresh process gives the GPUs back between sizes); rows append
to --out, and --report prints the side-by-side table:

  python -m benchmarks.tp_decode --tensor-parallel-size 1 --out tp.jsonl
  python -m benchmarks.tp_decode --tensor-parallel-size 2 --out tp.jsonl
  python -m benchmarks.tp_decode --report tp.jsonl

Each run: the engine's start time, the decode step wall time at --batches on decode_roofline.py's
workload (lazy RAG prompts of 5 Zipf-drawn documents, dummy weights), then greedy tokens of
--greedy-prompts random prompts (--greedy-tokens each, ignore_eos), compared across sizes by --report.
CPU smoke:  python -m benchmarks.tp_decode --model tiny-llama --device cpu --batches 2 --context 48 \
              --steps 2 --pool-docs 4 --docs-per-request 2 --greedy-prompts 3 --greedy-tokens 4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch


def run(args) -> list[dict]:
    from benchmarks.decode_roofline import decode_step_seconds, make_workload
    from lazyrt import SamplingParams

    t0 = time.perf_counter()
    eng, prompts, _ = make_workload(args)
    start_s = time.perf_counter() - t0
    tp = args.tensor_parallel_size
    # LlamaModel keeps its weights in a dict by HF name; tied embeddings are one tensor, counted once
    unique = {t.data_ptr(): t for t in eng.model.w.values()}
    rank_gb = sum(t.numel() * t.element_size() for t in unique.values()) / 1e9
    group = getattr(eng.worker, "tp", None)
    all_reduce = "-" if group is None else ("peer" if group.peer is not None else group.pg.name().lower())
    if group is not None and getattr(group, "fused", None) is not None:
        all_reduce = "peer + fused norm"  # the all-reduce, residual add and RMSNorm in one kernel
    base = {"model": args.model, "tp": tp, "device": str(eng.model.device), "context": args.context,
            "cache_mode": args.cache_mode, "graphs": args.cuda_graph_max_batch,
            "all_reduce": all_reduce}  # fmt: skip
    rows: list[dict] = []

    def emit(row: dict) -> None:  # appended at once: the rows survive a step or a close that hangs
        rows.append(row)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")

    emit(dict(base, kind="start", start_s=start_s, rank0_weight_gb=rank_gb))
    print(f"TP={tp}: engine up in {start_s:.1f} s, rank 0 holds {rank_gb:.2f} GB of weights, all-reduce: "
          f"{all_reduce}", flush=True)  # fmt: skip
    decode_step_seconds(eng, prompts(min(args.batches))[0], 4)  # compiles, warms up
    for b in args.batches:
        g0 = eng.runner.graph_steps
        step = decode_step_seconds(eng, prompts(b)[0], args.steps)
        emit(dict(base, kind="step", batch=b, step_ms=step * 1e3,
                         graph_steps=eng.runner.graph_steps - g0))  # fmt: skip
        print(f"TP={tp} batch {b}: {step * 1e3:.2f} ms a step", flush=True)
    if args.greedy_prompts:
        gen = torch.Generator().manual_seed(args.seed)
        vocab = min(eng.model_config.vocab_size, 32000)
        plain = [torch.randint(100, vocab, (args.greedy_len,), generator=gen).tolist()
                 for _ in range(args.greedy_prompts)]  # fmt: skip
        # with the two most likely tokens' logprobs: where two runs part, how near a tie it was
        sp = SamplingParams(max_tokens=args.greedy_tokens, temperature=0.0, ignore_eos=True, logprobs=2)
        emit(dict(base, kind="greedy", **greedy_rows(eng.generate(plain, sp))))
        # the noise floor of the comparison: the same size, each prompt alone (other kernel shapes)
        emit(dict(base, kind="greedy_alone", **greedy_rows([eng.generate(q, sp)[0] for q in plain])))
    eng.close()
    return rows


def greedy_rows(outs: list[dict]) -> dict:
    """Each output's tokens, the sampled tokens' logprobs and the top-2 margin (nats) at each token."""
    def margin(e: dict) -> float:
        top = sorted((t["logprob"] for t in e["top_logprobs"]), reverse=True) + [float("-inf")]
        return top[0] - top[1]

    return {
        "tokens": [o["token_ids"] for o in outs],
        "logprobs": [[e["logprob"] for e in o["logprobs"]] for o in outs],
        "margins": [[margin(e) for e in o["logprobs"]] for o in outs],
    }


def _label(r: dict) -> str:
    """TP size, and the all-reduce path where it was not the default peer kernel."""
    path = {"nccl": " NCCL", "peer + fused norm": " fused"}.get(r.get("all_reduce"), "")
    return str(r["tp"]) + path


def report(path: str) -> str:
    rows = [json.loads(line) for line in open(path) if line.strip()]
    for r in rows:
        r["tp"] = _label(r)
    sizes = sorted({r["tp"] for r in rows}, key=lambda n: (int(n.split()[0]), n))
    last = {}  # the latest row per (kind, tp, batch)
    for r in rows:
        last[(r["kind"], r["tp"], r.get("batch"))] = r
    lines = ["| TP | engine start (s) | rank 0 weights (GB) |", "|---|---|---|"]
    for n in sizes:
        s = last.get(("start", n, None))
        if s:
            lines.append(f"| {n} | {s['start_s']:.1f} | {s['rank0_weight_gb']:.2f} |")
    batches = sorted({r["batch"] for r in rows if r["kind"] == "step"})
    head = " | ".join(f"TP={n} (ms)" for n in sizes)
    ratios = [n for n in sizes if n != "1"]
    lines += ["", f"| batch | {head} | " + " | ".join(f"TP={n} / TP=1" for n in ratios) + " |",
              "|---" * (1 + len(sizes) + len(ratios)) + "|"]  # fmt: skip
    for b in batches:
        ms = {n: last[("step", n, b)]["step_ms"] for n in sizes if ("step", n, b) in last}
        cells = [f"{ms[n]:.2f}" if n in ms else "-" for n in sizes]
        rat = [f"{ms[n] / ms['1']:.2f}" if n in ms and "1" in ms else "-" for n in ratios]
        lines.append(f"| {b} | " + " | ".join(cells + rat) + " |")
    pairs = [(f"TP={n} vs TP=1 (batch of all prompts)", ("greedy", n), ("greedy", "1")) for n in ratios]
    pairs += [(f"TP={n}: batch vs each prompt alone (noise floor)", ("greedy", n), ("greedy_alone", n))
              for n in sizes]  # fmt: skip
    for label, a, b in pairs:
        x, y = last.get((*a, None)), last.get((*b, None))
        if x and y:
            lines.append("\n" + agreement(label, x, y))
    return "\n".join(lines)


def agreement(label: str, x: dict, y: dict) -> str:
    """How two greedy runs of the same prompts agree: identical prompts, where each pair first parts,
    and (rows with logprobs) how near a tie the parting token was, the larger of the two runs' top-2
    margins there, and how far the sampled tokens' logprobs moved before it: a real difference
    parts at a clear margin, rounding only at a near-tie (compare the noise-floor line)."""
    a, b = x["tokens"], y["tokens"]
    same = sum(s == t for s, t in zip(a, b))
    first = [next((i for i, (u, v) in enumerate(zip(s, t)) if u != v), len(s)) for s, t in zip(a, b)]
    out = f"greedy {label}: {same} of {len(a)} prompts identical over {len(a[0])} tokens; first " \
          f"difference at {sorted(first)}"  # fmt: skip
    if "margins" not in x or "margins" not in y:
        return out
    mx, my, lx, ly = x["margins"], y["margins"], x["logprobs"], y["logprobs"]
    parted = [max(mx[k][i], my[k][i]) for k, i in enumerate(first) if i < len(a[k])]
    moved = [abs(u - v) for k, i in enumerate(first) for u, v in zip(lx[k][:i], ly[k][:i])]
    if parted:
        med = statistics.median(parted)
        out += f"; top-2 margin where they part: max {max(parted):.2e}, median {med:.2e} nats"
    if moved:
        out += f"; sampled-token logprobs before that differ by max {max(moved):.2e} nats"
    return out


def main(argv=None) -> None:
    from benchmarks.decode_roofline import add_workload_args

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(p, [1, 16, 64])
    p.add_argument("--greedy-prompts", type=int, default=20, help="0: skip the greedy comparison")
    p.add_argument("--greedy-tokens", type=int, default=32)
    p.add_argument("--greedy-len", type=int, default=64, help="tokens a greedy prompt")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON lines, appended")
    p.add_argument("--report", default=None, metavar="JSONL", help="print the table of these rows only")
    args = p.parse_args(argv)
    if args.report:
        print(report(args.report))
        return
    run(args)
    sys.stdout.flush()
    os._exit(0)  # rows are written; do not wait on the ranks' teardown


if __name__ == "__main__":
    main()
