"""Where a lone cached request's question step spends the worker's host time before its kernels run
(issue 14: the served split puts ~3.4 ms of the H100's TTFT in `launch`, the device idle meanwhile).

In process (Engine, overlapped scheduling, CUDA graphs, dummy weights), each timed request is alone
with its documents cached and a fresh question, max_tokens=1, after --idle-s of sleep (a served
request at 1 req/s runs its host path cold). perf_counter around the parts of the worker's call that
launches the question step, no syncs: StepMsg decode + step inputs (ModelRunner.step_inputs), the
shared-chunk arrays, the graph buffer uploads, graph.replay() itself, and the rest (logits row pick,
sampling launch, the tokens' copy). On the device: from an event queued just before replay() to one
just after it, against the graph's kernel time alone (a replay with the device already busy), which
says whether the device waits for replay() to return before it starts.

    python benchmarks/experiments/question_launch.py [--idle-s 0.2] [--iters 20]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from benchmarks.ttft_profile import cached_documents  # noqa: E402
from lazyrt import RagPrompt  # noqa: E402
from lazyrt.runtime.worker import cuda_graph  # noqa: E402


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--docs", type=int, default=5)
    p.add_argument("--doc-tokens", type=int, default=2048)
    p.add_argument("--question-tokens", type=int, default=16)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--idle-s", type=float, nargs="+", default=[0.2, 0.0], help="one table each")
    args = p.parse_args(argv)
    engine, rng, prefix, docs, toks, sp = cached_documents(args, "cuda", "lazy", 64)

    cur: dict[str, float] = {}
    worker, runner = engine.worker, engine.runner

    def timed(name, fn):
        def wrapped(*a, **k):
            t = time.perf_counter()
            out = fn(*a, **k)
            cur[name] = cur.get(name, 0.0) + (time.perf_counter() - t) * 1e3
            return out

        return wrapped

    execute = timed("worker call that launches it", worker._execute)
    worker._execute = lambda msg: execute(msg) if msg.items else worker.__class__._execute(worker, msg)
    runner.step_inputs = timed("step inputs", runner.step_inputs)
    runner._shared_arrays = timed("shared-chunk arrays", runner._shared_arrays)
    uploads = runner.graphs._uploads
    for name in ("begin", "put", "end"):
        setattr(uploads, name, timed("graph buffer uploads", getattr(uploads, name)))
    gpu: list[tuple] = []
    last: list = [None]  # the graph the question step replayed
    real_replay = torch.cuda.CUDAGraph.replay

    def replay(graph):
        last[0] = graph
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        t = time.perf_counter()
        real_replay(graph)
        cur["replay()"] = cur.get("replay()", 0.0) + (time.perf_counter() - t) * 1e3
        b.record()
        gpu.append((a, b))

    cuda_graph.torch.cuda.CUDAGraph.replay = replay
    for idle in args.idle_s:
        table(engine, idle, args, rng, docs, prefix, toks, sp, cur, gpu, last, real_replay)


def table(engine, idle, args, rng, docs, prefix, toks, sp, cur, gpu, last, real_replay) -> None:
    rows = []
    for i in range(args.iters + 2):
        order = rng.sample(docs, len(docs))
        time.sleep(idle)
        cur.clear()
        gpu.clear()
        out = engine.generate([RagPrompt(prefix, order, toks(args.question_tokens))], sp)[0]
        assert out["meta"]["chunk_hits"] == len(docs), out["meta"]
        torch.cuda.synchronize()
        if gpu and i >= 2:
            cur["device: replay() queued -> done"] = gpu[0][0].elapsed_time(gpu[0][1])
            rows.append(dict(cur))
    # the graph's kernel time alone: the same replay queued behind a busy device
    g, busy = last[0], []
    if g is not None:
        for _ in range(5):
            torch.cuda._sleep(20_000_000)  # keep the device busy while the replay is queued
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            real_replay(g)
            b.record()
            torch.cuda.synchronize()
            busy.append(a.elapsed_time(b))
    print(f"device {torch.cuda.get_device_name()}; {args.docs} cached docs x {args.doc_tokens}, "
          f"{args.question_tokens}-token question; {len(rows)} requests, {idle} s idle before each")
    print("| part (ms, median) | |\n|---|---:|")
    for name in rows[0]:
        print(f"| {name} | {statistics.median(r.get(name, 0.0) for r in rows):.3f} |")
    if busy:
        print(f"| its graph's kernels alone (queued behind a busy device) | {statistics.median(busy):.3f} |")

if __name__ == "__main__":
    main()
