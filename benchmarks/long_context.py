"""Long context with most KV in host memory (issue 15): retrieval attention vs full attention.

One request over `--docs` documents of `--doc-tokens` tokens (default 64 x 2,040 = 130,560 tokens: with
the prefix and a 16-token question it fills Llama-3.1-8B's 131,072-token context; 2,048 would not
fit), batch 1 and `--batch` (the same documents, different questions), on one engine per mode, each
in a process of its own (dummy weights in the model's real shapes), each after one untimed first
use (warm-up; under retrieval attention it queues the host documents' index builds, and the timing
starts once they are built):
  full       every document's KV resident on the device (a pool that holds the whole context);
  retrieval  a device pool of `--device-share` of the context's KV and a host tier holding all of
             it; documents are computed `--warm-docs` at a time (so the earlier ones move to the
             host; 0: no warm-up, the first request's documents are computed in rounds by the
             scheduler, in its time to first token), then the request attends the host-resident
             ones through retrieval attention (sink + top-k keys per document, `--top-k`, `--sink`,
             `--scan`), each query head scanning lists of its own (retrieval_share_lists off).
  retrieval-shared  the same with retrieval_share_lists (the engine's default): on a GPU the query
             heads of a KV head share one scanned set per token (2x one head's budget, fewer rows
             read from host memory).
Reported per engine and batch: time to first token, decode seconds per token (the steps after the
batch's last first token, from the requests' own timings), output tokens/s, peak device memory
(torch) and how many of the request's documents were attended in the host tier.

GPU:  python benchmarks/long_context.py --docs 64 --batch 8 --new-tokens 8 --top-k 32 --out long_context.json
CPU smoke:  python benchmarks/long_context.py --model tiny-llama --device cpu --docs 8 --doc-tokens 64 \\
              --batch 2 --new-tokens 4
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch


def say(msg: str) -> None:
    """Progress on stderr (a 128K run's phases take minutes)."""
    print(f"[long_context] {msg}", file=sys.stderr, flush=True)


def profile(eng, prompt, cuda: bool, mode: str) -> None:
    """Where the time goes: one request's prefill alone (1 token), then the same with 8 more tokens
    (the difference is 8 decode steps), each under torch.profiler."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from lazyrt import SamplingParams

    eng.generate(prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))  # warm
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    for tokens in (1, 9):
        with torch_profile(activities=acts) as prof:
            eng.generate(prompt, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
        for key in (["self_cuda_time_total"] if cuda else []) + ["self_cpu_time_total"]:
            table = prof.key_averages().table(sort_by=key, row_limit=14, max_name_column_width=60)
            say(f"{mode}: {tokens} token(s), profile by {key}\n{table}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--docs", type=int, default=64)
    p.add_argument("--doc-tokens", type=int, default=2040)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--device-share", type=float, default=0.125, help="device KV pool / the context's KV")
    p.add_argument("--warm-docs", type=int, default=4,
                   help="documents per warm-up request (0: none, the scheduler computes them in rounds)")
    p.add_argument("--top-k", type=int, default=128)
    p.add_argument("--sink", type=int, default=16)
    p.add_argument("--scan", type=float, default=0.05)
    p.add_argument("--build-threads", type=int, default=1,
                   help="retrieval_build_threads (indexes built off the step; 0: in the step). The decode "
                   "timing starts once every index is built")
    p.add_argument("--modes", nargs="+", default=["full", "retrieval", "retrieval-shared"],
                   choices=["full", "retrieval", "retrieval-shared"],
                   help="retrieval-shared: retrieval with retrieval_share_lists (the query heads of a KV "
                   "head share one set of scanned lists per token)")
    p.add_argument("--out", default=None, help="JSON with every row")
    p.add_argument("--profile", action="store_true",
                   help="after the timings, profile one request's prefill, then its prefill and 8 decode "
                   "tokens, per mode (torch.profiler; the ops by device time and by host time, on stderr)")
    args = p.parse_args()

    if len(args.modes) > 1:  # one process per mode: an engine's device memory is all given back
        rows = []
        for mode in args.modes:
            argv = [a for a in sys.argv[1:]]
            i = argv.index("--modes") if "--modes" in argv else None
            if i is not None:
                j = i + 1
                while j < len(argv) and not argv[j].startswith("--"):
                    j += 1
                argv = argv[:i] + argv[j:]
            argv = [a for k, a in enumerate(argv) if a != "--out" and (k == 0 or argv[k - 1] != "--out")]
            cmd = [sys.executable, __file__, *argv, "--modes", mode]
            child = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
            for line in child.stdout:  # each row as it comes (a long run cut short keeps its rows)
                if line.startswith("{"):
                    rows.append(json.loads(line))
                    print(line, end="", flush=True)
            if child.wait():
                say(f"{mode}: failed (exit {child.returncode})")
        report(args, rows)
        return
    rows = run(args, args.modes[0])
    report(args, rows)


def run(args: argparse.Namespace, mode: str) -> list[dict]:
    from lazyrt import Engine, RagPrompt, SamplingParams

    cuda = args.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    gen = torch.Generator().manual_seed(0)
    context = args.docs * (args.doc_tokens + 16) + 16
    rows = []
    extra = 64 + args.batch * (32 + args.new_tokens)  # prefix, questions, outputs
    if mode == "full":
        kw = dict(kv_cache_tokens=context + extra)
    else:
        warm = max(args.warm_docs, 1) * (args.doc_tokens + 16)  # one round's documents at least
        dev = max(int(args.device_share * context), warm) + extra
        kw = dict(kv_cache_tokens=dev, host_kv_cache_tokens=context + 1024, retrieval_attention=True,
                  retrieval_top_k=args.top_k, retrieval_sink=args.sink, retrieval_scan=args.scan,
                  retrieval_build_threads=args.build_threads,
                  retrieval_share_lists=mode == "retrieval-shared")
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    eng = Engine(args.model, device=args.device, load_format="dummy", max_running_requests=args.batch,
                 **kw)  # fmt: skip
    vocab = min(eng.model_config.vocab_size, 32000)
    gen.manual_seed(0)  # the same documents and questions for every mode

    def rand(n: int, vocab: int = vocab) -> list[int]:
        return torch.randint(100, vocab, (n,), generator=gen).tolist()

    prefix = rand(16)
    docs = [rand(args.doc_tokens) for _ in range(args.docs)]
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    t = time.perf_counter()
    # compute the documents a few at a time (0: the scheduler does it for the first request)
    for i in range(0, args.docs if args.warm_docs else 0, max(args.warm_docs, 1)):
        eng.generate(RagPrompt(prefix, docs[i : i + args.warm_docs], rand(4)), one)
    sync()
    warm_s = time.perf_counter() - t
    indexes = eng.runner.host_indexes
    say(f"{mode}: documents computed in {warm_s:.1f} s; indexes {indexes.builds} built, "
        f"{indexes.pending} queued")
    # First use, untimed: CUDA graphs and kernels warm up, and under retrieval attention the
    # request attends its host documents exactly while their indexes are queued for building.
    t = time.perf_counter()
    eng.generate(RagPrompt(prefix, docs, rand(16)), one)
    sync()
    first_use_s = time.perf_counter() - t
    say(f"{mode}: first use {first_use_s:.1f} s; waiting for {indexes.pending} queued index builds")
    t = time.perf_counter()
    indexes.wait()
    first_builds_s = time.perf_counter() - t
    say(f"{mode}: builds done in {first_builds_s:.1f} s ({indexes.builds} indexes); "
        f"timing batches 1 and {args.batch}")
    for b in (1, args.batch):
        prompts = [RagPrompt(prefix, docs, rand(16)) for _ in range(b)]
        sync()
        t = time.perf_counter()
        first = eng.generate(prompts, one)
        sync()
        ttft = time.perf_counter() - t  # the batch's first tokens, together
        t = time.perf_counter()
        eng.runner.host_indexes.wait()  # (background builds: the first steps attended exactly)
        index_wait = time.perf_counter() - t
        sp = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
        prompts = [RagPrompt(prefix, docs, rand(16)) for _ in range(b)]
        sync()
        t = time.perf_counter()
        outs = eng.generate(prompts, sp)
        sync()
        total = time.perf_counter() - t
        # the steps after the batch's last first token (earlier ones share steps with prefills)
        last = max(outs, key=lambda o: o["meta"]["ttft_s"])["meta"]
        decode = (last["e2e_s"] - last["ttft_s"]) / (args.new_tokens - 1)
        row = {
            "mode": mode, "batch": b, "context_tokens": context, "top_k": args.top_k, "scan": args.scan,
            "ttft_s": ttft,
            "decode_s_per_token": decode, "out_tok_s": b * args.new_tokens / total,
            "host_attended": outs[0]["meta"].get("host_attended_chunks", 0),
            "first_host_attended": first[0]["meta"].get("host_attended_chunks", 0),
            "device_kv_tokens": eng.pool.num_pages * eng.pool.page_size,
            "peak_device_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
            "warm_s": warm_s, "first_use_s": first_use_s, "first_builds_wait_s": first_builds_s,
            "index_builds": eng.runner.host_indexes.builds, "index_wait_s": index_wait,
            "retrieval_steps": eng.runner.retrieval_steps,
        }  # fmt: skip
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.profile:
        profile(eng, RagPrompt(prefix, docs, rand(16)), cuda, mode)
    del eng
    return rows


def report(args: argparse.Namespace, rows: list[dict]) -> None:
    context = args.docs * (args.doc_tokens + 16) + 16
    print(f"\n{args.model}, {args.docs} x {args.doc_tokens}-token documents ({context} tokens), "
          f"top-k {args.top_k}, sink {args.sink}, scan {args.scan}")
    print("| mode | batch | device KV (tokens) | documents on host | TTFT (s) | decode (s/token) | "
          "out tok/s | peak device GiB |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        gib = f"{r['peak_device_gib']:.1f}" if r["peak_device_gib"] is not None else "-"
        print(f"| {r['mode']} | {r['batch']} | {r['device_kv_tokens']} | {r['host_attended']} | "
              f"{r['ttft_s']:.3f} | {r['decode_s_per_token']:.4f} | {r['out_tok_s']:.1f} | {gib} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
