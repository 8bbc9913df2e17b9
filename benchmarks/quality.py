"""Answer quality of cache modes on synthetic RAG QA: does deferring positions cost answers?

Each question is answered by `Engine.rag_batch` (the model's chat template, docs in the user turn,
greedy) once per cache mode, with one Engine per mode for the whole run, so document chunks are
reused across questions. `none` (full causal attention, nothing reused) is the quality reference;
`block` and `lazy` both use block attention (each doc attends to the shared prefix and itself),
`block` by materializing re-rotated copies, `lazy` by rotating keys in the kernel.
Selective recompute (engine options recompute_policy + recompute_pages / recompute_ratio,
lazyrt/runtime/scheduler/recompute.py): `MODE+POLICY<N>` recomputes N pages per doc after the first,
`MODE+POLICY<P>%` P% of those docs' pages, in the request's context; POLICY is head | tail |
question | deviation. `lazy+head2` = the sink fix (first 2 pages of each doc after the first);
`lazy+question10%` = the 10% of pages that best match the question's rarer tokens;
`lazy+deviation10%`, `lazy+deviation2` = the engine's deviation policy (10% of those pages, 2 pages
per doc). A `/apeT,S` suffix adds document attention (temperature T and scale S on the question's
attention to the documents): `lazy/ape0.7,1.5`, `lazy+tail2/ape0.7,1.5`.

    python benchmarks/quality.py --questions 200 --modes none block lazy --out docs/data/quality.json
    python benchmarks/quality.py --questions 200 --modes none lazy lazy+head1 lazy+head2 \
        --max-tokens 32 --out docs/data/quality_heads.json
    python benchmarks/quality.py --set multihop --modes none lazy lazy+deviation10% --out mh.json
    python benchmarks/quality.py --merge a.json b.json --out all.json   # runs split over processes

Question sets (--set, benchmarks/quality_data.py): `single` (one fact of one entity, same-kind
distractors), `multihop` (two documents linked by a town), `distractor` (single facts next to
documents of other kinds with the same name).

Reports accuracy per mode (with a 95% Wilson interval), greedy-token agreement of lazy with block
and with none, answer-level agreement, chunk hit ratio and timing, and accuracy per question kind
(kind.fact; source.town>kind.fact for multihop chains).
Data: benchmarks/quality_data.py (fixed seed, no downloads).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from quality_data import QUESTION_SETS, is_correct, make_dataset  # noqa: E402
from tqdm import tqdm  # noqa: E402

from lazyrt import Engine, SamplingParams  # noqa: E402

BASE_MODES = ("none", "prefix", "block", "lazy")
_RECOMPUTE_MODE = re.compile(r"^(lazy|block)\+(head|tail|question|deviation)(\d+(?:\.\d+)?)(%?)$")


_DOC_ATTENTION = re.compile(r"^(.*)/ape(\d+(?:\.\d+)?),(\d+(?:\.\d+)?)$")


def parse_mode(mode: str) -> tuple[str, dict]:
    """'lazy' -> ('lazy', {}); 'lazy+head2' -> ('lazy', {policy head, 2 pages per doc});
    'lazy+question10%' -> ('lazy', {policy question, ratio 0.1}): cache mode and engine options.
    A '/apeT,S' suffix adds document attention: temperature T, scale S (e.g. lazy/ape0.7,1.5); a
    '/par' suffix places every document right after the prefix (doc_positions="parallel")."""
    if mode.endswith("/par"):
        cache_mode, opts = parse_mode(mode[: -len("/par")])
        if cache_mode not in ("lazy", "block") or "recompute_policy" in opts:
            raise argparse.ArgumentTypeError(f"mode {mode!r}: /par needs lazy or block without recompute")
        return cache_mode, {**opts, "doc_positions": "parallel"}
    m = _DOC_ATTENTION.match(mode)
    if m is not None:
        cache_mode, opts = parse_mode(m.group(1))
        temp, scale = float(m.group(2)), float(m.group(3))
        if cache_mode not in ("lazy", "block") or temp <= 0 or scale <= 0:
            raise argparse.ArgumentTypeError(f"mode {mode!r}: /apeT,S needs lazy or block and T, S > 0")
        return cache_mode, {**opts, "doc_attention_temperature": temp, "doc_attention_scale": scale}
    if mode in BASE_MODES:
        return mode, {}
    m = _RECOMPUTE_MODE.match(mode)
    ok = m is not None and (m.group(4) or m.group(3).isdigit()) and float(m.group(3)) > 0
    if ok and m.group(4):
        ok = float(m.group(3)) <= 100
    if not ok:
        raise argparse.ArgumentTypeError(
            f"mode {mode!r}: one of {', '.join(BASE_MODES)}, or (lazy|block)+(head|tail|question|deviation)N "
            "(N >= 1 pages per doc after the first recomputed in context) or ...P% (P% of those "
            "docs' pages), e.g. lazy+head2, lazy+question10%, lazy+deviation10%"
        )
    opts = {"recompute_policy": m.group(2)}
    if m.group(4):
        opts["recompute_ratio"] = float(m.group(3)) / 100
    else:
        opts["recompute_pages"] = int(m.group(3))
    return m.group(1), opts


def _mode_arg(mode: str) -> str:
    parse_mode(mode)
    return mode


def run_mode(mode: str, questions, args) -> dict:
    t0 = time.perf_counter()
    cache_mode, recompute = parse_mode(mode)
    engine = Engine(
        cache_mode=cache_mode,
        device=args.device,
        dtype=args.dtype,
        kv_cache_tokens=args.kv_cache_tokens,
        **recompute,
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
    cost = recompute_cost(engine, questions, outs, args.system, sp)
    ttft = ttft_probe(engine, questions[: args.ttft_questions], args.system)
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
        **cost,
        **ttft,
    }


def recompute_cost(engine: Engine, questions, outs, system, sp: SamplingParams) -> dict:
    """What the mode recomputes, independent of chunk hits: recomputed doc tokens as a share of the
    tokens of the docs after the first and of the prompt, and the prompt share a request serves from
    cached chunks when every chunk hits (prefix + docs - recomputed). lazy/block: the count each
    output reports (meta recomputed_tokens); an engine without it: the scheduler's plan (head_lens)."""
    recomputed = later = prompt = docs = 0
    sources = set()
    for q, o in zip(questions, outs):
        req = engine._make_request(engine.rag_prompt(q.docs, q.question, system), sp)
        if engine.config.cache_mode in ("lazy", "block"):
            if "recomputed_tokens" in o["meta"]:
                recomputed += o["meta"]["recomputed_tokens"]
                sources.add("meta")
            else:
                recomputed += sum(engine.scheduler.head_lens(req))
                sources.add("head_lens")
        else:  # none / prefix: every prompt token is computed in context
            recomputed += sum(len(d) for d in req.docs[1:])
            sources.add("prompt")
        later += sum(len(d) for d in req.docs[1:])
        docs += len(req.prefix) + sum(len(d) for d in req.docs)
        prompt += req.prompt_len
    full_hit = 0.0 if engine.config.cache_mode in ("none", "prefix") else (docs - recomputed) / prompt
    return {
        "recomputed_doc_tokens": recomputed,
        "recomputed_source": "+".join(sorted(sources)),
        "recomputed_share_of_later_docs": recomputed / later if later else 0.0,
        "recomputed_share_of_prompt": recomputed / prompt if prompt else 0.0,
        "cached_share_at_full_hit": full_hit,
        "mean_prompt_tokens": prompt / len(questions),
    }


def ttft_probe(engine: Engine, questions, system) -> dict:
    """TTFT of single requests (one at a time, 1 output token) after the accuracy run, so every
    chunk is a hit: what the recompute adds to a cached request's first token."""
    if not questions:
        return {}
    sp = SamplingParams(max_tokens=1, temperature=0.0)
    ts = []
    for q in questions:
        out = engine.rag_batch([{"docs": q.docs, "question": q.question, "system": system,
                                 "sampling_params": sp}])[0]
        ts.append(out["meta"]["ttft_s"])
    ts.sort()
    return {"probe_ttft_p50_s": ts[len(ts) // 2], "probe_ttft_mean_s": sum(ts) / len(ts)}


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


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval of a proportion k/n (z=1.96: 95%)."""
    if n == 0:
        return 0.0, 1.0
    p = k / n
    denom = 1 + z * z / n
    center = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, center - half), min(1.0, center + half)


def accuracy_cell(correct: list) -> str:
    """'43.5% (87/200, 36.8-50.4)': accuracy, count, 95% Wilson interval in percent."""
    k, n = sum(correct), len(correct)
    lo, hi = wilson(k, n)
    return f"{k / n if n else 0.0:.1%} ({k}/{n}, {lo * 100:.1f}-{hi * 100:.1f})"


def markdown(results: dict[str, dict], agreements: list[dict], by_kind: dict) -> str:
    ref = results.get("none")
    lines = [
        "| mode | accuracy (95% CI) | vs none | recomputed (of docs after the 1st) | cached prompt tokens "
        "(this run / all hits) | chunk hit ratio | q/s | TTFT p50, 1 req, cached (ms) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for m, r in results.items():
        rel = f"{r['accuracy'] / ref['accuracy']:.1%}" if ref and ref["accuracy"] else "-"
        rec = r.get("recomputed_share_of_later_docs")
        full = r.get("cached_share_at_full_hit")
        ttft = r.get("probe_ttft_p50_s")
        lines.append(
            f"| {m} | {accuracy_cell(r['correct'])} | {rel} | "
            f"{'-' if rec is None else f'{rec:.1%}'} | {r['cached_token_ratio']:.1%} / "
            f"{'-' if full is None else f'{full:.1%}'} | {r['chunk_hit_ratio']:.1%} | "
            f"{r['questions_per_s']:.2f} | {'-' if ttft is None else f'{ttft * 1e3:.1f}'} |"
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
                   help="none | prefix | block | lazy | (lazy|block)+POLICY<N> (N pages per doc after "
                   "the first recomputed in context) | (lazy|block)+POLICY<P>%% (P%% of those pages), "
                   "POLICY head | tail | question | deviation; a /apeT,S suffix adds document "
                   "attention (e.g. lazy+head2, lazy+deviation10%%, lazy/ape0.7,1.5)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--set", dest="question_set", choices=QUESTION_SETS, default="single",
                   help="question set: single (one fact, same-kind distractors), multihop (two "
                   "documents linked by a town), distractor (namesakes of other kinds in the docs)")
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
    p.add_argument("--ttft-questions", type=int, default=0,
                   help="after each mode's run, this many questions one at a time (all chunks hit) "
                   "for a TTFT probe")
    p.add_argument("--out", default=None, help="write the full results (per-question outputs) as JSON")
    p.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                   help="no run: combine the results of earlier runs of the same dataset (e.g. modes "
                   "split over processes) into one report")
    args = p.parse_args(argv)

    if args.merge:
        loaded = [json.loads(Path(f).read_text()) for f in args.merge]
        defaults = {"question_set": "single", "filler_sentences": 0}  # runs from before these options
        for k in ("questions", "seed", "question_set", "filler_sentences", "max_tokens", "system"):
            vals = [{**defaults, **x["args"]}[k] for x in loaded]
            setattr(args, k, vals[0])
            if any(v != vals[0] for v in vals):
                raise SystemExit(f"--merge: the runs differ in {k}")
        results = {m: r for x in loaded for m, r in x["results"].items()}
        order = [m for x in loaded for m in x["args"]["modes"] if m in results]  # a .partial: what finished
        args.modes = [m for m in ("none", "block", "lazy") if m in results] + [
            m for m in order if m not in ("none", "block", "lazy")
        ]
        results = {m: results[m] for m in args.modes}
        questions = make_dataset(args.questions, args.seed, filler_sentences=args.filler_sentences,
                                 question_set=args.question_set)
        return report(results, questions, args, argv)

    questions = make_dataset(args.questions, args.seed, filler_sentences=args.filler_sentences,
                             question_set=args.question_set)
    results = {}
    for m in args.modes:
        results[m] = run_mode(m, questions, args)
        if args.out:  # keep what finished if a long run is cut short
            Path(args.out + ".partial").write_text(json.dumps({"args": vars(args), "results": results}))
    return report(results, questions, args, argv)


def _device_name(device: str) -> str:
    import torch

    if device != "cpu" and torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return "cpu"


def report(results: dict[str, dict], questions, args, argv) -> int:
    agreements = []
    pairs = [("lazy", "block"), ("lazy", "none"), ("block", "none")]
    for m in results:  # each recompute / document-attention mode vs full attention, vs its cache
        base, recompute = parse_mode(m)  # mode without the option, and lazy vs block with it
        if recompute:
            pairs += [(m, "none"), (m, base)]
            if m.startswith("lazy") and "block" + m[4:] in results:
                pairs.append((m, "block" + m[4:]))
    for x, y in pairs:
        if x in results and y in results:
            agreements.append(agreement(results[x], results[y]))
    by_kind: dict[str, dict] = {}
    for i, q in enumerate(questions):
        row = by_kind.setdefault(q.key, {"n": 0, **{m: 0.0 for m in results}})
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
            "device": _device_name(args.device),
            "args": vars(args),
            "results": {m: {k: v for k, v in r.items()} for m, r in results.items()},
            "agreements": agreements,
            "by_kind": by_kind,
            "questions": [
                {"qid": q.qid, "qtype": q.qtype, "key": q.key, "question": q.question, "answer": q.answer,
                 "answer_doc": q.answer_doc, "support_docs": q.support_docs, "docs": q.docs,
                 **{f"{m}_text": results[m]["texts"][q.qid] for m in results}}
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
