"""Host time of a lone request's way to its first token when its documents are cached (issue 14's
TTFT at 1 req/s), on the CPU: EngineCore.add -> Scheduler (admission: chunk lookups) -> StepEncoder
-> ModelWorker -> ModelRunner (step inputs, shared-chunk arrays, CUDA-graph buffer fills) ->
sampling -> EngineCore._apply, with the model's forward and logits stubbed out and CUDA graphs
emulated as in host_step_e2e.py (whose stubs this reuses). What is timed is the host work in front
of and behind the question step's ~8 ms of device time on the H100 (in process, `Engine.generate` of
such a request took 10.7-10.9 ms there).

Workload: decode_roofline.py's lazy RAG prompts (5 documents x 2,070 tokens by Zipf popularity
from a pool of 100, a 16-token question). --warm requests run first (their documents get cached);
then each timed request is one of them with a fresh question, max_tokens=1, alone in the engine.

Run: python benchmarks/experiments/host_question_e2e.py [--wire] [--no-overlap]
"""

from __future__ import annotations

import argparse
import cProfile
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from benchmarks.decode_roofline import QUESTION_TOKENS  # noqa: E402
from benchmarks.experiments.host_step_e2e import Stubs, profile_table, stubbed_engine  # noqa: E402
from lazyrt.prompt import RagPrompt  # noqa: E402
from lazyrt.runtime.scheduler.request import RequestState  # noqa: E402
from lazyrt.sampling_params import SamplingParams  # noqa: E402


def make_request(eng, prompt: RagPrompt):
    """As the scheduler receives it (the tokenizer's work is not timed here)."""
    return eng._make_request(prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))


def first_token_seconds(eng, req, stubs: Stubs) -> float:
    """Host seconds from adding the request to its first token (the stubs' own time left out)."""
    core = eng.core
    stubs.seconds = 0.0
    t = time.perf_counter()
    core.add(req)
    while not req.output_ids:
        core.step()
    took = time.perf_counter() - t - stubs.seconds
    while core.has_work:  # the deferred step's collect, the finish
        core.step()
    if req.state is not RequestState.FINISHED or req.cached_tokens < sum(map(len, req.docs)):
        raise RuntimeError("the timed request did not find its documents cached")
    return took


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--context", type=int, default=10368, help="prompt tokens a request (5 x 2,070 + 16)")
    p.add_argument("--alpha", type=float, default=2.1)
    p.add_argument("--warm", type=int, default=8, help="requests run first; the timed ones reuse their docs")
    p.add_argument("--repeats", type=int, default=40, help="timed requests")
    p.add_argument("--profile-repeats", type=int, default=40, help="requests under cProfile (0: none)")
    p.add_argument("--top", type=int, default=25, help="functions listed by own time")
    p.add_argument("--graph-batch", type=int, default=64, help="the engine's cuda_graph_max_batch")
    p.add_argument("--no-overlap", action="store_true", help="synchronous steps (overlap off)")
    p.add_argument("--wire", action="store_true", help="msgpack the StepMsg and StepResult (server path)")
    p.add_argument("--idle-s", type=float, default=0.0,
                   help="sleep before each timed request: its host path runs cold, as a served request's "
                        "does at 1 req/s (experiments/cold_hop.py)")  # fmt: skip
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # as host_step_e2e.py: the 2-core box's thread-pool wake-ups are noise

    eng, prompts, stubs = stubbed_engine(args.warm, args.graph_batch, args.context, args.alpha, 4,
                                         not args.no_overlap, args.wire)  # fmt: skip
    warm, _ = prompts(args.warm)
    eng.generate(warm, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    gen = torch.Generator().manual_seed(1)

    def fresh(i: int) -> RagPrompt:
        w = warm[i % len(warm)]
        question = torch.randint(100, 32000, (QUESTION_TOKENS,), generator=gen).tolist()
        return RagPrompt(w.prefix, w.docs, question)

    for i in range(4):  # warm-up: graph buffers, first-use paths
        first_token_seconds(eng, make_request(eng, fresh(i)), stubs)
    graph0 = eng.runner.graph_steps
    reqs = [make_request(eng, fresh(i)) for i in range(args.repeats)]
    ms = []
    for r in reqs:
        time.sleep(args.idle_s)
        ms.append(first_token_seconds(eng, r, stubs) * 1e3)
    graphs = eng.runner.graph_steps - graph0
    mode = ("overlap" if eng.core.overlap else "sync") + (", wire" if args.wire else "")
    mode += f", {args.idle_s} s idle before each" if args.idle_s else ""
    print(f"lone cached request, {mode}: {args.repeats} requests, question steps from graphs: {graphs}")
    print(f"| host ms to the first token | median {statistics.median(ms):.3f} | best {min(ms):.3f} |")
    if args.profile_repeats:
        reqs = [make_request(eng, fresh(i)) for i in range(args.profile_repeats)]
        prof = cProfile.Profile()
        for r in reqs:
            time.sleep(args.idle_s)
            prof.enable()
            first_token_seconds(eng, r, stubs)
            prof.disable()
        profile_table(prof, args.profile_repeats, args.top)
    return {"host_ms": statistics.median(ms), "best_ms": min(ms)}


if __name__ == "__main__":
    main()
