"""Host time of one decode step's bookkeeping at RAG shape, no model: plan -> StepMsg -> wire bytes ->
worker plan -> flattened arrays -> tensors. 64 requests x (prefix + 5 x 2,048-token docs + own run),
page size 16 (41k page-table entries). Run: python benchmarks/experiments/host_step_overhead.py
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from lazyrt.runtime.ipc.messages import decode, encode
from lazyrt.runtime.scheduler.plan import ForwardItem, StepPlan
from lazyrt.runtime.scheduler.request import Request, Segment
from lazyrt.runtime.scheduler.step_wire import StepDecoder, StepEncoder
from lazyrt.runtime.worker.step_inputs import StepInputs
from lazyrt.sampling_params import SamplingParams


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--docs", type=int, default=5)
    p.add_argument("--doc-tokens", type=int, default=2048)
    p.add_argument("--own-tokens", type=int, default=40, help="tokens already in each request's own run "
                   "(none/prefix mode: the whole prompt, e.g. 4096)")
    p.add_argument("--steps", type=int, default=0, help="also time N consecutive decode steps, the own run "
                   "growing by one token a step (from_plan on the growing tables)")
    p.add_argument("--iters", type=int, default=200)
    args = p.parse_args(argv)
    ps, rng = 16, random.Random(0)
    plan = StepPlan()
    for r in range(args.batch):
        segs, pos = [Segment(rng.sample(range(100000), 2), 0, 20)], 20
        for _ in range(args.docs):
            segs.append(Segment(rng.sample(range(100000), -(-args.doc_tokens // ps)), pos, args.doc_tokens))
            pos += args.doc_tokens
        own_n = args.own_tokens
        own = Segment(rng.sample(range(100000), -(-(own_n + 64) // ps)), pos, own_n)
        segs.append(own)
        req = Request(r, SamplingParams(max_tokens=64))
        req.output_ids = [1]
        plan.items.append(ForwardItem([5], pos + own_n - 1, segs, own, request=req))
    enc, dec = StepEncoder(), StepDecoder()
    StepInputs.from_plan(dec.decode(decode(encode(enc.encode(plan, [])))), ps)  # first step: full tables

    def timed(fn):
        t0 = time.perf_counter()
        for _ in range(args.iters):
            out = fn()
        return (time.perf_counter() - t0) / args.iters * 1e3, out

    rows = []
    ms, msg = timed(lambda: enc.encode(plan, []))
    rows.append(("StepEncoder.encode", ms))
    ms, wire = timed(lambda: encode(msg))
    rows.append((f"msgpack encode ({len(wire)} bytes)", ms))
    ms, msg2 = timed(lambda: decode(wire))
    rows.append(("msgpack decode", ms))
    ms, plan2 = timed(lambda: dec.decode(msg2))
    rows.append(("StepDecoder.decode", ms))
    ms, s = timed(lambda: StepInputs.from_plan(plan2, ps))
    rows.append((f"StepInputs.from_plan ({len(s.kv_indices)} entries)", ms))
    ms, _ = timed(lambda: [torch.from_numpy(x) for x in (s.kv_indices, s.pos_base, s.valid_len)])
    rows.append(("arrays -> tensors", ms))
    print("| part | ms |\n|---|---|")
    for name, v in rows:
        print(f"| {name} | {v:.3f} |")
    print(f"| total | {sum(v for _, v in rows):.3f} |")
    if args.steps:
        t0 = time.perf_counter()
        for _ in range(args.steps):  # what a decode step sees: each own run one token longer
            for it in plan2.items:
                it.target.num_tokens += 1
                it.start_pos += 1
            StepInputs.from_plan(plan2, ps)
        ms = (time.perf_counter() - t0) / args.steps * 1e3
        print(f"| from_plan over growing own runs (mean of {args.steps} decode steps) | {ms:.3f} |")


if __name__ == "__main__":
    main()
