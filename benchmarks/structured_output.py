"""Structured-output overhead per decode step (issue 16).

`mask` (default): the host time the worker's grammar step adds per decode step at batch B, every row
under its own JSON schema matcher: GrammarConstraints.apply (feed last step's tokens to the matchers,
fill the batch's bitmasks in one llguidance call, upload, mask the logits) + advance, on logits of
the real vocabulary on --device (CUDA: synchronized after each step, so the device's masking is in
the figure). The rows are teacher-forced along tokenized schema-valid JSON documents (RAG answers
with citations), so the matchers walk the path real outputs take, keys, strings and numbers alike.

`--engine`: the lazyrt Engine's decode throughput at batch B with and without a JSON schema: B
fresh prompts per run (no prefix-cache hits), max_tokens N, each run --repeats times alternating
and the fastest kept; the schema (an array of at least 100 answer objects) cannot finish within N
tokens, so both runs generate exactly B x N tokens (the unconstrained run ignores EOS).

CPU:  python benchmarks/structured_output.py --batches 1 16 64
      python benchmarks/structured_output.py --engine --model tiny-llama --batches 1 8 --steps 16
GPU:  python benchmarks/structured_output.py --device cuda --batches 1 16 64
      python benchmarks/structured_output.py --engine --device cuda --batches 1 16 64   (8B dummy)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time

import torch

ANSWER = {
    "type": "object",
    "properties": {
        "answer": {"type": "string", "maxLength": 160},
        "citations": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
                      "maxItems": 5},  # fmt: skip
        "confidence": {"enum": ["low", "medium", "high"]},
        "score": {"type": "number"},
    },
    "required": ["answer", "citations", "confidence", "score"],
    "additionalProperties": False,
}
WORDS = "the capital river mount currency answer document cites because north of was is in and a".split()


def answer_doc(rng: random.Random) -> str:
    """A random instance of ANSWER, written as the grammar writes JSON (', ' and ': ')."""
    text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 25)))[:160]
    doc = {"answer": text, "citations": rng.sample(range(100), rng.randint(1, 5)),
           "confidence": rng.choice(["low", "medium", "high"]), "score": round(rng.random(), 3)}  # fmt: skip
    return json.dumps(doc)


def load_tokenizer(name: str | None):
    from lazyrt.models.loader import load_model

    if name:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(name)
    return load_model(None, load_format="dummy").tokenizer


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def bench_mask(args: argparse.Namespace) -> list[dict]:
    from lazyrt import SamplingParams
    from lazyrt.runtime.worker.grammar import GrammarConstraints

    tok = load_tokenizer(args.tokenizer_dir)
    vocab = args.vocab or len(tok)
    eos = {tok.eos_token_id}
    rng = random.Random(0)
    rows = []
    for b in args.batches:
        docs = [tok.encode(answer_doc(rng), add_special_tokens=False) for _ in range(b)]
        steps = min(args.steps, min(len(d) for d in docs))
        gc = GrammarConstraints(tok, vocab, eos, args.device)
        params = [SamplingParams(json_schema=ANSWER)] * b
        free = [SamplingParams()] * b
        rids = list(range(b))
        logits = torch.randn(b, vocab, device=args.device)
        gc.apply(logits, rids, params)  # builds the tokenizer info and compiles the schema once
        for rid in rids:
            gc.release(rid)
        times, base = [], []
        for t in range(steps):
            sync(args.device)
            t0 = time.perf_counter()
            gc.apply(logits, rids, free)  # the unconstrained path: nothing to do
            base.append(time.perf_counter() - t0)
            tokens = torch.tensor([d[t] for d in docs], device=args.device)
            t0 = time.perf_counter()
            out = gc.apply(logits, rids, params)
            gc.advance(rids, params, tokens)
            sync(args.device)
            times.append(time.perf_counter() - t0)
            del out
        gc.flush()
        assert not any(m.is_error() for m in gc._matchers.values()), "a forced token left the grammar"
        row = {"batch": b, "steps": steps, "vocab": vocab, "device": args.device,
               "ms_per_step_median": 1e3 * statistics.median(times),
               "ms_per_step_p90": 1e3 * sorted(times)[int(0.9 * (len(times) - 1))],
               "ms_per_step_unconstrained": 1e3 * statistics.median(base),
               "cpus": os.cpu_count()}  # fmt: skip
        print(json.dumps(row))
        rows.append(row)
    return rows


def bench_engine(args: argparse.Namespace) -> list[dict]:
    from lazyrt import Engine, SamplingParams

    eng = Engine(model=None if args.model == "default" else args.model, load_format=args.load_format,
                 device=args.device, kv_cache_tokens=args.kv_cache_tokens)  # fmt: skip
    schema = {"type": "array", "items": ANSWER, "minItems": 100}
    rng = random.Random(0)
    vocab = min(eng.model_config.vocab_size, 32000)
    grammar = eng.worker._grammar
    if args.grammar_threads:  # llguidance's mask threads (the worker picks half the cores, at most 16)
        import llguidance

        grammar._tokenizer_info()
        grammar._executor = llguidance.LLExecutor(args.grammar_threads)
    rows = []
    for b in args.batches:
        fresh = lambda b=b: [[rng.randrange(100, vocab) for _ in range(64)] for _ in range(b)]  # noqa: E731
        eng.generate(fresh(), SamplingParams(max_tokens=4, json_schema=schema))  # warm up, compile
        res = {}
        runs = {"free": SamplingParams(max_tokens=args.steps, ignore_eos=True),
                "json_schema": SamplingParams(max_tokens=args.steps, json_schema=schema)}
        split = {}
        for name, sp in list(runs.items()) * args.repeats:  # alternating; each one's fastest kept
            prompts = fresh()  # new prompts each run: no prefix-cache hits for either
            before = dict(grammar.timings)
            sync(args.device)
            t0 = time.perf_counter()
            outs = eng.generate(prompts, sp)
            sync(args.device)
            dt = time.perf_counter() - t0
            n = sum(len(o["token_ids"]) for o in outs)
            assert n == b * args.steps, f"{name}: {n} tokens, expected {b * args.steps}"
            if dt < res.get(name, float("inf")):
                res[name] = dt
                if name == "json_schema":  # the grammar thread's time in that run, per job (step)
                    jobs = max(1, grammar.timings["jobs"] - before["jobs"])
                    split = {f"grammar_{k[:-2]}_ms": round(1e3 * (grammar.timings[k] - before[k]) / jobs, 3)
                             for k in ("feed_s", "mask_s", "finish_wait_s")}  # fmt: skip
        row = {"batch": b, "steps": args.steps, "device": args.device, "model": args.model,
               "grammar_threads": args.grammar_threads or "default",
               "s_free": res["free"], "s_json_schema": res["json_schema"],
               "ms_per_step_free": 1e3 * res["free"] / args.steps,
               "ms_per_step_json_schema": 1e3 * res["json_schema"] / args.steps,
               "overhead_pct": 100 * (res["json_schema"] / res["free"] - 1), **split}  # fmt: skip
        if args.profile and args.device.startswith("cuda"):  # device-busy time per step, each run once
            for name, sp in runs.items():
                row[f"device_busy_ms_per_step_{name}"] = device_busy_ms(eng, fresh(), sp) / args.steps
        if args.trace and args.device.startswith("cuda"):  # chrome traces of 12 steps (host threads, kernels)
            for name, sp in runs.items():
                short = SamplingParams(**{**sp.__dict__, "max_tokens": 12})
                device_busy_ms(eng, fresh(), short, trace=f"{args.trace}/trace_{name}_b{b}.json.gz")
        if args.timeline and args.device.startswith("cuda"):
            timeline(eng, fresh(), runs["json_schema"])
        print(json.dumps(row), flush=True)
        rows.append(row)
        if args.out:  # each row as soon as it is measured
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")
    return rows


def timeline(eng, prompts, sp, show: tuple[int, int] = (20, 30)) -> None:
    """Prints, for steps show[0]..show[1] of one run, when (ms, host clock) the worker's call began,
    its mask wait ended, the forward was launched and the call returned; when the grammar job ran;
    and when the device reached the forward and finished it (CUDA events mapped onto the host clock)."""
    w, g = eng.worker, eng.worker._grammar
    marks: list[dict] = []
    now = time.perf_counter

    def ev() -> torch.cuda.Event:
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    orig = (w._execute, g.finish, w.runner.execute, g._fill)

    def execute(msg):
        marks.append({"enter": now()})
        out = orig[0](msg)
        marks[-1]["exit"] = now()
        return out

    def finish(logits, prepared):
        out = orig[1](logits, prepared)
        marks[-1]["masks_in"] = now()
        return out

    def run(plan):
        marks[-1]["launch"], marks[-1]["gpu_start"] = now(), ev()
        out = orig[2](plan)
        marks[-1]["launched"], marks[-1]["gpu_end"] = now(), ev()
        return out

    def fill(*a):
        t0 = now()
        out = orig[3](*a)
        marks[-1].update(job_start=t0, job_end=now())
        return out

    ref = ev()
    ref.synchronize()
    h_ref = now()
    w._execute, g.finish, w.runner.execute, g._fill = execute, finish, run, fill
    try:
        eng.generate(prompts, sp)
        torch.cuda.synchronize()
    finally:
        w._execute, g.finish, w.runner.execute, g._fill = orig
    t0 = marks[show[0]]["enter"]

    def ms(m: dict, k: str) -> str:
        if k not in m:
            return "-"
        v = h_ref + ref.elapsed_time(m[k]) / 1e3 if k.startswith("gpu") else m[k]
        return f"{1e3 * (v - t0):8.2f}"

    keys = ["enter", "masks_in", "launch", "launched", "exit", "job_start", "job_end", "gpu_start", "gpu_end"]
    print("step " + " ".join(f"{k:>9}" for k in keys))
    for i in range(*show):
        print(f"{i:4d} " + " ".join(f"{ms(marks[i], k):>9}" for k in keys))


def device_busy_ms(eng, prompts, sp, trace: str | None = None) -> float:
    """Milliseconds of kernels (summed device self time) for one generate under torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        eng.generate(prompts, sp)
        torch.cuda.synchronize()
    if trace:
        prof.export_chrome_trace(trace)
    return sum(ev.self_device_time_total for ev in prof.events() if ev.device_type.name == "CUDA") / 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--device", default="cpu")
    p.add_argument("--tokenizer-dir", default=os.environ.get("LAZYRT_TOKENIZER_DIR"))
    p.add_argument("--vocab", type=int, default=0, help="mask width (default: the tokenizer's)")
    p.add_argument("--engine", action="store_true", help="Engine decode with and without a schema")
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--repeats", type=int, default=3, help="--engine: runs of each, the fastest kept")
    p.add_argument("--kv-cache-tokens", type=int, default=65536)
    p.add_argument("--profile", action="store_true",
                   help="--engine on CUDA: device-busy time per step (torch.profiler)")  # fmt: skip
    p.add_argument("--trace", default=None, help="--engine on CUDA: write chrome traces (12 steps) here")
    p.add_argument("--timeline", action="store_true",
                   help="--engine on CUDA: host and device times of steps 20-30 of a schema run")  # fmt: skip
    p.add_argument("--grammar-threads", type=int, default=0, help="--engine: llguidance mask threads")
    p.add_argument("--out", default=None, help="append the rows here (JSON lines)")
    args = p.parse_args()
    if args.engine:
        bench_engine(args)  # writes each row as it goes
        return
    rows = bench_mask(args)
    if args.out:
        with open(args.out, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
