"""Host time of one decode step's bookkeeping at RAG shape, no model: plan -> StepMsg -> wire bytes ->
worker plan -> flattened arrays -> tensors -> shared-chunk grouping. 64 requests x (prefix + 5 x
2,048-token docs + own run), page size 16 (41k page-table entries); documents drawn by Zipf(--alpha)
from a pool of --pool (the same pages wherever a document repeats), as in decode_roofline.py.
Run: python benchmarks/experiments/host_step_overhead.py
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from lazyrt.kernels.shared_chunk import build_arrays
from lazyrt.runtime.ipc.messages import decode, encode
from lazyrt.runtime.scheduler.plan import ForwardItem, StepPlan
from lazyrt.runtime.scheduler.request import Request, Segment
from lazyrt.runtime.scheduler.step_wire import StepDecoder, StepEncoder
from lazyrt.runtime.worker.step_inputs import StepInputs, shared_segments
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
    p.add_argument("--pool", type=int, default=100, help="documents to draw from")
    p.add_argument("--alpha", type=float, default=2.1, help="Zipf exponent of document popularity")
    args = p.parse_args(argv)
    ps, rng = 16, random.Random(0)
    doc_pages = -(-args.doc_tokens // ps)
    pool = [list(range(i * doc_pages, (i + 1) * doc_pages)) for i in range(args.pool)]
    weights = [1 / (i + 1) ** args.alpha for i in range(args.pool)]
    next_page = args.pool * doc_pages
    plan = StepPlan()
    for r in range(args.batch):
        segs, pos = [Segment([next_page, next_page + 1], 0, 20)], 20
        next_page += 2
        picks: list[int] = []
        while len(picks) < args.docs:
            d = rng.choices(range(args.pool), weights)[0]
            picks += [d] if d not in picks else []
        for d in picks:
            segs.append(Segment(pool[d], pos, args.doc_tokens))
            pos += args.doc_tokens
        own_n = args.own_tokens
        n_own = -(-(own_n + 64) // ps)
        own = Segment(list(range(next_page, next_page + n_own)), pos, own_n)
        next_page += n_own
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
    ms, segments = timed(lambda: shared_segments(plan2, s, ps))
    plain_grouping = ms  # reported below, not in the total (the engine interns)
    for it in plan2.items:  # as the engine: equal pieces interned to one key object
        for g in it.segments:
            g.pieces = None
    intern: dict = {}
    ms, segments = timed(lambda: shared_segments(plan2, s, ps, intern=intern))
    rows.append(("shared_segments, interned keys", ms))
    if segments is not None:
        ms, arrays = timed(lambda: build_arrays(segments, ps, len(s.input_ids), 16))
        rows.append((f"build_arrays ({len(arrays['pair_row'])} pairs)", ms))
    from lazyrt.runtime.worker.step_inputs import SharedGrouping, shared_arrays

    cache = SharedGrouping()
    shared_arrays(plan2, s, ps, 16, cache, intern)  # the first step of a batch groups its documents
    ms, _ = timed(lambda: shared_arrays(plan2, s, ps, 16, cache, intern))
    cached_ms = ms  # the engine's path since shared_arrays: replaces the two rows above
    print("| part | ms |\n|---|---|")
    for name, v in rows:
        print(f"| {name} | {v:.3f} |")
    print(f"| total | {sum(v for _, v in rows):.3f} |")
    print(f"| (shared_segments without interned keys, not in the total) | {plain_grouping:.3f} |")
    print(f"| (shared_arrays with the batch's document grouping kept from the last step: replaces "
          f"shared_segments + build_arrays) | {cached_ms:.3f} |")
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
