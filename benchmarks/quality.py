"""Answer quality of cache modes on synthetic RAG QA: does deferring positions cost answers?

Each question is answered by `Engine.rag_batch` (the model's chat template, docs in the user turn,
greedy) once per cache mode, with one Engine per mode for the whole run, so document chunks are
reused across questions. `none` (full causal attention, nothing reused) is the quality reference;
`block` and `lazy` both use block attention (each doc attends to the shared prefix and itself),
`block` by materializing re-rotated copies, `lazy` by rotating keys in the kernel.
`lazy+headN` / `block+headN` add the sink fix (engine option recompute_head_pages=N): the first N
KV pages of each doc after the first are recomputed in the request's context.

    python benchmarks/quality.py --questions 200 --modes none block lazy --out docs/quality.json
    python benchmarks/quality.py --questions 200 --modes none lazy lazy+head1 lazy+head2 \
        --max-tokens 32 --out docs/quality_heads.json

Reports accuracy per mode, greedy-token agreement of lazy with block and with none, answer-level
agreement, chunk hit ratio and timing. Data: benchmarks/quality_data.py (fixed seed, no downloads).
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from quality_data import is_correct, make_dataset  # noqa: E402
from tqdm import tqdm  # noqa: E402

from lazyrt import Engine, SamplingParams  # noqa: E402

BASE_MODES = ("none", "prefix", "block", "lazy")
_HEAD_MODE = re.compile(r"^(lazy|block)\+head(\d+)$")


def parse_mode(mode: str) -> tuple[str, int]:
    """'lazy' -> ('lazy', 0); 'lazy+head2' -> ('lazy', 2): cache mode and recompute_head_pages."""
    if mode in BASE_MODES:
        return mode, 0
    m = _HEAD_MODE.match(mode)
    if not m:
        raise argparse.ArgumentTypeError(
            f"mode {mode!r}: one of {', '.join(BASE_MODES)}, or lazy+headN / block+headN (N >= 1 pages "
            "of each doc after the first recomputed in context)"
        )
    return m.group(1), int(m.group(2))


def _mode_arg(mode: str) -> str:
    parse_mode(mode)
    return mode


def run_mode(mode: str, questions, args) -> dict:
    t0 = time.perf_counter()
    cache_mode, heads = parse_mode(mode)
    engine = Engine(
        cache_mode=cache_mode,
        device=args.device,
        dtype=args.dtype,
        kv_cache_tokens=args.kv_cache_tokens,
        recompute_head_pages=heads,
        **({"model": args.model} if args.model else {}),
    )
    load_s = time.perf_counter() - t0
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    outs = []
    t0 = time.perf_counter()
    with tqdm(total=len(questions), desc=f"{mode:>10}", unit="q", file=sys.stderr) as bar:
        for i in range(0, len(questions), args.batch):
            chunk = questions[i : i + args.batch]
            items = [{"docs": q.docs, "question": q.question, "system": args.system,
                      "sampling_params": sp} for q in chunk]
            outs.extend(engine.rag_batch(items))
            bar.update(len(chunk))
    wall = time.perf_counter() - t0
    hits = sum(o["meta"]["chunk_hits"] for o in outs)
    misses = sum(o["meta"]["chunk_misses"] for o in outs)
    prompt_tokens = sum(o["meta"]["prompt_tokens"] for o in outs)
    cached = sum(o["meta"]["cached_tokens"] for o in outs)
    correct = [is_correct(o["text"], q.answer) for o, q in zip(outs, questions)]
    return {
        "mode": mode,
        "load_s": load_s,
        "wall_s": wall,
        "questions_per_s": len(questions) / wall,
        "accuracy": sum(correct) / len(correct),
        "correct": correct,
        "texts": [o["text"] for o in outs],
        "token_ids": [o["token_ids"] for o in outs],
        "chunk_hits": hits,
        "chunk_misses": misses,
        "chunk_hit_ratio": hits / (hits + misses) if hits + misses else 0.0,
        "cached_token_ratio": cached / prompt_tokens if prompt_tokens else 0.0,
        "mean_ttft_s": sum(o["meta"]["ttft_s"] for o in outs) / len(outs),
    }


def agreement(a: dict, b: dict) -> dict:
    """Token-exact (whole greedy output), first-token, and answer-level (same correctness) agreement."""
    n = len(a["token_ids"])
    exact = sum(x == y for x, y in zip(a["token_ids"], b["token_ids"]))
    first = sum(x[:1] == y[:1] for x, y in zip(a["token_ids"], b["token_ids"]))
    same_ans = sum(x == y for x, y in zip(a["correct"], b["correct"]))
    # Greedy tokens compared position by position up to the first divergence.
    tok_same = tok_total = 0
    for x, y in zip(a["token_ids"], b["token_ids"]):
        m = max(len(x), len(y))
        k = 0
        while k < min(len(x), len(y)) and x[k] == y[k]:
            k += 1
        tok_same += k
        tok_total += m
    return {
        "pair": f"{a['mode']} vs {b['mode']}",
        "token_exact": exact / n,
        "first_token": first / n,
        "prefix_token_ratio": tok_same / tok_total if tok_total else 1.0,
        "answer_level": same_ans / n,
        "differing_qids": [i for i, (x, y) in enumerate(zip(a["token_ids"], b["token_ids"])) if x != y],
    }


def markdown(results: dict[str, dict], agreements: list[dict], by_kind: dict) -> str:
    ref = results.get("none")
    lines = [
        "| mode | accuracy | vs none | chunk hit ratio | cached prompt tokens | q/s | mean TTFT (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for m, r in results.items():
        rel = f"{r['accuracy'] / ref['accuracy']:.1%}" if ref and ref["accuracy"] else "-"
        lines.append(
            f"| {m} | {r['accuracy']:.1%} ({sum(r['correct'])}/{len(r['correct'])}) | {rel} | "
            f"{r['chunk_hit_ratio']:.1%} | {r['cached_token_ratio']:.1%} | {r['questions_per_s']:.2f} | "
            f"{r['mean_ttft_s']:.2f} |"
        )
    if agreements:
        lines += ["", "| pair | greedy outputs identical | first token | tokens before divergence | "
                  "same correctness |", "|---|---|---|---|---|"]
        for a in agreements:
            lines.append(f"| {a['pair']} | {a['token_exact']:.1%} | {a['first_token']:.1%} | "
                         f"{a['prefix_token_ratio']:.1%} | {a['answer_level']:.1%} |")
    if by_kind:
        modes = list(results)
        lines += ["", "| question kind | n | " + " | ".join(modes) + " |",
                  "|---|---|" + "---|" * len(modes)]
        for k, row in by_kind.items():
            lines.append(f"| {k} | {row['n']} | " + " | ".join(f"{row[m]:.0%}" for m in modes) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--questions", type=int, default=200)
    p.add_argument("--modes", nargs="+", default=["none", "block", "lazy"], type=_mode_arg,
                   help="none | prefix | block | lazy | lazy+headN | block+headN (sink fix: the "
                   "engine's recompute_head_pages=N)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--filler-sentences", type=int, default=0,
                   help="long documents: the facts at a random place among this many filler sentences")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--batch", type=int, default=16, help="questions per rag_batch call")
    p.add_argument("--system", default=None, help="system prompt (default: the chat template's own)")
    p.add_argument("--model", default=None, help="model path (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--device", default="auto")
    p.add_argument("--kv-cache-tokens", type=int, default=131072, help="KV budget of each mode's Engine")
    p.add_argument("--dtype", default="float32",
                   help="float32 (default: exact lazy-vs-block comparison on any device) or auto/bfloat16")
    p.add_argument("--out", default=None, help="write the full results (per-question outputs) as JSON")
    args = p.parse_args(argv)

    questions = make_dataset(args.questions, args.seed, filler_sentences=args.filler_sentences)
    results = {}
    for m in args.modes:
        results[m] = run_mode(m, questions, args)
        if args.out:  # keep what finished if a long run is cut short
            part = {k: {"accuracy": r["accuracy"], "texts": r["texts"], "token_ids": r["token_ids"],
                        "chunk_hit_ratio": r["chunk_hit_ratio"], "wall_s": r["wall_s"]}
                    for k, r in results.items()}
            Path(args.out + ".partial").write_text(json.dumps(part))
    agreements = []
    pairs = [("lazy", "block"), ("lazy", "none"), ("block", "none")]
    for m in results:  # each sink-fix mode vs full attention and vs its own mode without the fix
        base, heads = parse_mode(m)
        if heads:
            pairs += [(m, "none"), (m, base)]
    for x, y in pairs:
        if x in results and y in results:
            agreements.append(agreement(results[x], results[y]))
    by_kind: dict[str, dict] = {}
    for i, q in enumerate(questions):
        row = by_kind.setdefault(f"{q.kind}.{q.fact}", {"n": 0, **{m: 0.0 for m in results}})
        row["n"] += 1
        for m, r in results.items():
            row[m] += r["correct"][i]
    for row in by_kind.values():
        for m in results:
            row[m] /= row["n"]
    by_kind = dict(sorted(by_kind.items()))

    table = markdown(results, agreements, by_kind)
    print(table)
    if args.out:
        payload = {
            "command": "python benchmarks/quality.py " + " ".join(sys.argv[1:] if argv is None else argv),
            "machine": f"{platform.processor() or platform.machine()}, {platform.system()}",
            "args": vars(args),
            "results": {m: {k: v for k, v in r.items()} for m, r in results.items()},
            "agreements": agreements,
            "by_kind": by_kind,
            "questions": [
                {"qid": q.qid, "question": q.question, "answer": q.answer, "answer_doc": q.answer_doc,
                 "docs": q.docs, **{f"{m}_text": results[m]["texts"][q.qid] for m in results}}
                for q in questions
            ],
            "table": table,
        }
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(payload, indent=1))
        Path(args.out + ".partial").unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
