"""python -m lazyrt.batch: JSONL questions in, JSONL answers out; resumable, bad lines do not stop it."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

from tqdm import tqdm

from lazyrt.batch_input import Job, key, parse_line
from lazyrt.config import RECOMPUTE_POLICIES, EngineConfig, check_host_kv_cache_tokens

EXAMPLE = """\
example:
  $ cat questions.jsonl
  {"id": "q1", "docs": ["Quenta is the capital of Arvania."], "question": "What is the capital of Arvania?"}
  {"id": "q2", "prompt": "The tallest mountain on Earth is", "sampling_params": {"max_tokens": 8}}
  $ python -m lazyrt.batch --input questions.jsonl --output answers.jsonl --max-tokens 32
  $ cat answers.jsonl
  {"id": "q1", "line": 1, "text": "The capital of Arvania is Quenta.", "meta": {"prompt_tokens": 57, ...}}
  {"id": "q2", "line": 2, "text": " Mount Everest, ...", "meta": {...}}

Each input line is {"id", "docs", "question", "system"?, "sampling_params"?} (a doc is a text or
{"id": ...} of a document registered with POST /v1/documents / Engine.add_document) or {"id", "prompt",
"sampling_params"?}. One output line per input line, in input order: {"id", "line", "text", "meta"}, or
{"id", "line", "error": {"message"}} for a bad line (the job goes on); blank lines are skipped.
Re-running with the same --output skips ids already there and appends the rest (lines that failed
on the way to the server, a connection error or a 5xx, are retried: their error records are replaced
by new ones at the end). --endpoint URL uses a running
`python -m lazyrt.launch` instead of loading a model here."""


@dataclass
class Totals:
    requests: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    chunk_hits: int = 0
    chunk_misses: int = 0

    def add(self, rec: dict) -> None:
        self.requests += 1
        if "error" in rec:
            self.errors += 1
            return
        m = rec.get("meta") or {}
        self.prompt_tokens += m.get("prompt_tokens", 0)
        self.completion_tokens += m.get("completion_tokens", 0)
        self.cached_tokens += m.get("cached_tokens", 0)
        self.chunk_hits += m.get("chunk_hits", 0)
        self.chunk_misses += m.get("chunk_misses", 0)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m lazyrt.batch",
        description="Run RAG questions / prompts from a JSONL file through lazyrt.",
        epilog=EXAMPLE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--input", required=True, help="input JSONL file")
    p.add_argument("--output", required=True, help="output JSONL file (appended to; finished ids skipped)")
    p.add_argument("--model", default=None, help="model for the local engine (default: embedded SmolLM2)")
    p.add_argument("--endpoint", default=None, help="URL of a running lazyrt server instead of a local model")
    p.add_argument("--api-key", default=None, help="API key for --endpoint")
    p.add_argument(
        "--concurrency", type=int, default=None, help="requests in flight (default: 32 local, 8 endpoint)"
    )
    p.add_argument("--device", default=None, help="local engine device: auto (default), cpu, cuda")
    p.add_argument("--cache-mode", default=None, help="local engine: lazy (default), block, prefix, none")
    p.add_argument("--kv-cache-tokens", type=int, default=None, help="local engine KV budget in tokens")
    p.add_argument("--host-kv-cache-tokens", type=int, default=None,
                   help="local engine, lazy/block: host-memory KV tier for evicted documents (0 = off)")
    p.add_argument("--recompute-policy", default=None, choices=RECOMPUTE_POLICIES,
                   help="local engine selective recompute (lazy/block; see python -m lazyrt.launch --help)")
    p.add_argument("--recompute-pages", type=int, default=None, help="recompute budget: pages per later doc")
    p.add_argument("--recompute-ratio", type=float, default=None, help="recompute budget: 0-1 of later docs")
    p.add_argument("--shared-chunk-attention", action=argparse.BooleanOptionalAction, default=None,
                   help="local engine, lazy: read each document a step's requests share once (default on)")
    p.add_argument("--overlap-schedule", action=argparse.BooleanOptionalAction, default=None,
                   help="local engine: build the next step while the device runs this one (default on)")
    p.add_argument("--document-store", default=None, metavar="PATH|none",
                   help="local engine: the registered documents {\"id\"} docs name (default: the model's "
                   "file under $LAZYRT_CACHE_DIR/documents/)")
    g = p.add_argument_group("sampling defaults (a line's sampling_params override them)")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--min-p", type=float, default=0.0,
                   help="keep tokens at least this times as likely as the likeliest (0 = off)")
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--doc-attention-temperature", type=float, default=None,
                   help="lazy/block: temperature on the question's logits over document tokens (1 = off)")
    g.add_argument("--doc-attention-scale", type=float, default=None,
                   help="lazy/block: factor on the attention mass documents receive (1 = off)")
    g.add_argument("--doc-positions", choices=("sequential", "parallel"), default=None,
                   help="lazy/block: documents one after another, or all right after the shared prefix")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--stop-after", type=int, default=None, help=argparse.SUPPRESS)  # test hook: interrupt
    return p


# Error records a re-run retries: the request never got a final answer (batch_runners.EndpointRunner).
RETRIED_ERRORS = ("transport_error", "server_error")


def _record(raw: bytes) -> dict | None:
    try:
        rec = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return rec if isinstance(rec, dict) and isinstance(rec.get("line"), int) else None


def _retried(rec: dict) -> bool:
    err = rec.get("error")
    return isinstance(err, dict) and err.get("type") in RETRIED_ERRORS


def read_done(path: str) -> set[tuple]:
    """(key, line) of each input already answered. The file is rewritten first without a torn last
    line (killed mid-write; a complete record missing only its newline stays) and without the
    records of lines a re-run retries (RETRIED_ERRORS)."""
    if not os.path.exists(path):
        return set()
    with open(path, "rb") as f:
        data = f.read()
    *lines, tail = data.split(b"\n")  # tail: what follows the last newline (b"" when none)
    if _record(tail) is not None:
        lines.append(tail)
    keep, done = [], set()
    for raw in lines:
        rec = _record(raw)
        if rec is not None and _retried(rec):
            continue
        keep.append(raw + b"\n")
        if rec is not None:
            done.add((key(rec.get("id"), rec["line"]), rec["line"]))
    kept = b"".join(keep)
    if kept != data:  # (a new file moved into place: a kill meanwhile loses nothing)
        with open(path + ".tmp", "wb") as f:
            f.write(kept)
        os.replace(path + ".tmp", path)
    return done


def read_jobs(path: str, done: set[tuple], defaults: dict) -> tuple[list[Job], int]:
    """Jobs still to do (bad lines included, as error jobs) and how many lines were already done."""
    done_keys = {k for k, _ in done}
    jobs, seen, skipped = [], set(), 0
    # (undecodable bytes kept as surrogates, so a bad line fails alone and the rest still run)
    with open(path, encoding="utf-8", errors="surrogateescape") as f:
        for n, text in enumerate(f, 1):
            if not text.strip():
                continue
            job = _not_utf8(text, n) or parse_line(text, n, defaults)
            k = key(job.id, n)
            dup = job.id is not None and k in seen
            seen.add(k)
            # A duplicate's error record is tied to its line; any other id is done wherever it was.
            if (k, n) in done or (not dup and k in done_keys):
                skipped += 1
                continue
            if dup and job.error is None:
                job.error = f"line {n}: duplicate id {job.id!r} (an earlier line has it)"
            jobs.append(job)
    return jobs, skipped


def _not_utf8(text: str, n: int) -> Job | None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:  # a surrogate: the byte read_jobs could not decode
        byte = ord(text[e.start]) - 0xDC00
        return Job(n, None, error=f"line {n}: not valid UTF-8 (byte 0x{byte:02x} at column {e.start + 1})")
    return None


def make_runner(args: argparse.Namespace):
    if args.endpoint:
        from lazyrt.batch_runners import EndpointRunner

        runner = EndpointRunner(args.endpoint, args.concurrency or 8, args.api_key)
        runner.check()
        return runner
    from lazyrt.batch_runners import LocalRunner
    from lazyrt.runtime.engine.engine import Engine

    opts = ("kv_cache_tokens", "host_kv_cache_tokens", "recompute_policy", "recompute_pages")
    opts += ("recompute_ratio", "shared_chunk_attention", "overlap_schedule", "document_store")
    kw = {k: getattr(args, k) for k in opts if getattr(args, k) is not None}
    engine = Engine(args.model, device=args.device or "auto", cache_mode=args.cache_mode or "lazy", **kw)
    return LocalRunner(engine, args.concurrency or 32)


def results(runner, jobs: list[Job]) -> Iterator[tuple[Job, dict]]:
    """Bad lines get their error record in place; the rest go to the runner, order kept."""
    good = runner.run(j for j in jobs if j.error is None)
    try:
        for job in jobs:
            if job.error is not None:
                yield job, {"error": {"message": job.error, "type": "invalid_line"}}
            else:
                yield next(good)
    finally:
        good.close()  # stopped early: the runner drops what it has queued now


# Options of the local engine: a running server (--endpoint) has its own, set on lazyrt.launch.
LOCAL_ENGINE_OPTIONS = ("model", "device", "cache_mode", "kv_cache_tokens", "host_kv_cache_tokens",
                        "recompute_policy", "recompute_pages", "recompute_ratio", "shared_chunk_attention",
                        "overlap_schedule", "document_store")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.endpoint:
        given = ["--" + o.replace("_", "-") for o in LOCAL_ENGINE_OPTIONS if getattr(args, o) is not None]
        if given:
            parser.error(f"{', '.join(given)} configure the local engine; with --endpoint the server's own "
                         "settings apply (pass them to python -m lazyrt.launch)")
    if args.concurrency is not None and args.concurrency < 1:
        parser.error(f"--concurrency must be at least 1, got {args.concurrency}")
    if args.host_kv_cache_tokens is not None:  # fail before reading the input or loading a model
        try:
            mode, page_size = args.cache_mode or "lazy", EngineConfig.page_size
            check_host_kv_cache_tokens(mode, args.host_kv_cache_tokens, page_size)
        except ValueError as e:
            parser.error(f"--host-kv-cache-tokens: {e}")
    defaults = {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "min_p": args.min_p,
        "seed": args.seed,
    }
    for name in ("doc_attention_temperature", "doc_attention_scale", "doc_positions"):
        if getattr(args, name) is not None:
            defaults[name] = getattr(args, name)
    from lazyrt.sampling_params import SamplingParamError, SamplingParams

    try:
        SamplingParams.from_dict(defaults)
    except SamplingParamError as e:  # each default is a flag of its own name
        parser.error(f"--{e.param.replace('_', '-')} {e.value!r}: {e.why}")
    try:
        done = read_done(args.output)
        jobs, skipped = read_jobs(args.input, done, defaults)
    except (OSError, ValueError) as e:
        print(f"lazyrt.batch: {e}", file=sys.stderr)
        return 2
    try:  # opened before a model loads: a path that cannot be written fails now, not after it
        out = open(args.output, "a", encoding="utf-8") if jobs else None
    except OSError as e:
        print(f"lazyrt.batch: --output {args.output}: cannot write it: {e.strerror or e}", file=sys.stderr)
        return 2
    totals = Totals()
    start = time.perf_counter()
    gen_start = start  # after the model load (or the server check): tok/s counts generation only
    stopped = False
    if out is not None:
        with out:
            try:
                runner = make_runner(args)
            except Exception as e:  # no model / no server: the job itself cannot run
                print(f"lazyrt.batch: cannot start: {e}", file=sys.stderr)
                return 1
            gen_start = time.perf_counter()
            stopped = _run(args, runner, jobs, out, totals, gen_start)
    end = time.perf_counter()
    generation = end - gen_start
    chunks = totals.chunk_hits + totals.chunk_misses
    summary = {
        "requests": totals.requests,
        "errors": totals.errors,
        "skipped_already_done": skipped,
        "remaining": len(jobs) - totals.requests,
        "prompt_tokens": totals.prompt_tokens,
        "completion_tokens": totals.completion_tokens,
        "cached_tokens": totals.cached_tokens,
        "elapsed_s": round(end - start, 3),
        "load_s": round(gen_start - start, 3),  # the model load, or the server's health check
        "generation_s": round(generation, 3),
        "tok_per_s": round(totals.completion_tokens / generation, 2) if generation > 0 else 0.0,
        "chunk_hit_ratio": round(totals.chunk_hits / chunks, 4) if chunks else None,
        "stopped_early": stopped,
    }
    print("lazyrt.batch summary: " + json.dumps(summary), file=sys.stderr)
    return 130 if stopped and args.stop_after is None else 0


def _run(args: argparse.Namespace, runner, jobs: list[Job], out, totals: Totals, start: float) -> bool:
    """Writes each job's record as it completes; returns whether the run stopped early."""
    bar = tqdm(total=len(jobs), disable=args.no_progress, unit="req", file=sys.stderr)

    def write(job: Job, res: dict) -> None:
        rec = {"id": job.id, "line": job.line, **res}
        out.write(json.dumps(rec, ensure_ascii=False) + "\n")
        out.flush()  # written as it completes: an interrupt loses little
        totals.add(rec)
        bar.update(1)

    it = results(runner, jobs)
    try:
        for job, res in it:
            write(job, res)
            elapsed = time.perf_counter() - start
            bar.set_postfix(tok_s=f"{totals.completion_tokens / max(elapsed, 1e-9):.1f}", err=totals.errors)
            if args.stop_after is not None and totals.requests >= args.stop_after:
                return True
        return False
    except KeyboardInterrupt:
        it.close()  # the runner cancels what is queued; the answers it already has are kept
        for job, res in getattr(runner, "received", []):
            write(job, res)
        return True
    finally:
        it.close()
        bar.close()


if __name__ == "__main__":
    sys.exit(main())
