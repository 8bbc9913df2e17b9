"""Host time of a whole pure decode step at the b64 RAG shape, on the CPU: the real EngineCore ->
Scheduler -> StepEncoder -> ModelWorker -> StepDecoder -> ModelRunner -> CUDA-graph buffer fills ->
sampling -> EngineCore._apply path, with the device work stubbed out, so what is timed is the host
work a GPU step has to hide (issue 14: ~11 ms a step on the H100's host, 12.4 ms of kernels).

Workload (decode_roofline.py's, which the H100 figures come from): --batch RAG prompts of 5
documents x 2,070 tokens drawn by Zipf(--alpha) from a pool of 100 + a 16-token question, page size
16, lazy cache mode, shared-chunk attention and overlapped scheduling on (the engine's defaults).
The model is a dummy preset with Llama-3.1-8B's head grouping (32 query / 8 KV heads: shared-chunk
work items of 16 pairs) and 128K positions, but a 1-layer width-64 body; its forward and logits are
replaced by stubs returning zeros ([n, hidden] and [n, 16] logits: the sampler's argmax over a real
vocabulary is device work on a GPU), so no model math is timed. CUDA graphs are emulated: the
runner gets a DecodeGraphs whose buffers live on the CPU and whose "replay" does nothing, so a step
takes the GPU's path (StepInputs -> shared-chunk arrays -> static buffer fills) minus the pinned
staging and the launch. The stubs' own time is measured and subtracted (it is tiny).

Prints the mean host ms per decode step over --steps timed steps (after every request has its first
token and --warmup more steps), then a cProfile of --profile-steps more steps: the step's parts
(cumulative, per step) and the top functions by own time.

Run: python benchmarks/experiments/host_step_e2e.py            (b64, ~1 min on the 2-core CPU box)
     python benchmarks/experiments/host_step_e2e.py --wire     (+ msgpack of StepMsg/StepResult, as
                                                                 the server's processes exchange them)
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from benchmarks.decode_roofline import decode_headroom, make_workload  # noqa: E402
from lazyrt.models import dummy  # noqa: E402
from lazyrt.runtime.ipc.messages import decode, encode  # noqa: E402
from lazyrt.runtime.scheduler.request import RequestState  # noqa: E402
from lazyrt.runtime.worker import cuda_graph  # noqa: E402
from lazyrt.sampling_params import SamplingParams  # noqa: E402

PRESET = "host-bench-llama"  # Llama-3.1-8B's heads and context, a body too small to matter
dummy.PRESETS.setdefault(
    PRESET,
    dummy._llama(64, 1, 32, 8, 64, 49152, max_position_embeddings=131072, bos_token_id=1, eos_token_id=2),
)
STUB_VOCAB = 16

# The step's parts in the profile table: (label, function name, file suffix)
PARTS = [
    ("EngineCore.step", "step", "scheduler/engine_core.py"),
    ("  Scheduler.schedule", "schedule", "scheduler/scheduler.py"),
    ("  StepEncoder.encode", "encode", "scheduler/step_wire.py"),
    ("  msgpack encode/decode (--wire)", "_wire", "host_step_e2e.py"),
    ("  ModelWorker.execute", "execute", "worker/model_worker.py"),
    ("    StepDecoder.decode", "decode", "scheduler/step_wire.py"),
    ("    ModelRunner.execute", "execute", "worker/model_runner.py"),
    ("      ModelRunner.step_inputs", "step_inputs", "worker/model_runner.py"),
    ("        StepInputs.from_plan", "from_plan", "worker/step_inputs.py"),
    ("      ModelRunner._shared", "_shared", "worker/model_runner.py"),
    ("        shared_arrays", "shared_arrays", "worker/step_inputs.py"),
    ("      DecodeGraphs.run", "run", "worker/cuda_graph.py"),
    ("    sample_tokens_device", "sample_tokens_device", "worker/sampler.py"),
    ("  Scheduler.on_step_done", "on_step_done", "scheduler/scheduler.py"),
    ("  EngineCore._apply", "_apply", "scheduler/engine_core.py"),
]


class _NoGraph:
    def replay(self) -> None:
        pass


class HostGraphs(cuda_graph.DecodeGraphs):
    """DecodeGraphs with CPU buffers and nothing captured: run() fills the buffers as on CUDA."""

    def _capture(self, b: int, doc_logits: bool, shared: bool = False, few: bool = False):
        return _NoGraph(), torch.zeros(b, STUB_VOCAB)


class Stubs:
    """The model's forward and logits replaced by zeros; their time is kept to subtract."""

    def __init__(self, model) -> None:
        self.seconds = 0.0
        self.hidden = model.config.hidden_size
        model.forward = self.forward
        model.logits = self.logits

    def forward(self, input_ids, meta, rope, backend, *a, **kw) -> torch.Tensor:
        t = time.perf_counter()
        out = torch.zeros(len(input_ids), self.hidden)
        self.seconds += time.perf_counter() - t
        return out

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        t = time.perf_counter()
        out = torch.zeros(len(hidden), STUB_VOCAB)
        self.seconds += time.perf_counter() - t
        return out


class WireLink:
    """The worker behind a msgpack round trip each way, as between the server's processes."""

    def __init__(self, worker) -> None:
        self.worker = worker

    def execute(self, msg):
        return _wire(self.worker.execute(_wire(msg)))


def _wire(msg):
    return decode(encode(msg))


def stubbed_engine(batch: int, graph_batch: int, context: int, alpha: float, steps: int, overlap: bool,
                   wire: bool):  # fmt: skip
    """(engine, prompts(b), stubs): decode_roofline's lazy RAG workload on the PRESET model with its
    forward and logits stubbed, CUDA graphs up to graph_batch emulated (HostGraphs), and the worker
    behind a msgpack round trip when wire."""
    wl = argparse.Namespace(
        model=PRESET, load_format="dummy", device="cpu", dtype="float32", batches=[batch],
        context=context, steps=steps, cache_mode="lazy", alpha=alpha, shared_chunk_attention=True,
        overlap_schedule=overlap, docs_per_request=5, pool_docs=100, tensor_parallel_size=1,
        cuda_graph_max_batch=graph_batch,
    )  # fmt: skip
    eng, prompts, _ = make_workload(wl)
    stubs = Stubs(eng.model)
    cuda_graph.DecodeGraphs = HostGraphs  # enable_cuda_graphs imports it from the module
    try:
        eng.runner.enable_cuda_graphs(graph_batch, eng.max_context)
    finally:
        cuda_graph.DecodeGraphs = HostGraphs.__base__
    if wire:
        eng.core.worker = WireLink(eng.worker)
    return eng, prompts, stubs


def build(args):
    """(engine, requests added to its core, stubs)."""
    steps = args.warmup + args.repeats * args.steps + args.profile_steps
    eng, prompts, stubs = stubbed_engine(args.batch, args.batch, args.context, args.alpha, steps,
                                         not args.no_overlap, args.wire)  # fmt: skip
    batch, _ = prompts(args.batch)
    n = steps + decode_headroom(batch)
    sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    reqs = [eng._make_request(p, sp) for p in batch]
    for r in reqs:
        eng.core.add(r)
    return eng, reqs, stubs


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=10368, help="prompt tokens a request (5 x 2,070 + 16)")
    p.add_argument("--alpha", type=float, default=2.1)
    p.add_argument("--warmup", type=int, default=8, help="untimed decode steps first")
    p.add_argument("--steps", type=int, default=32, help="timed decode steps a window")
    p.add_argument("--repeats", type=int, default=5, help="timed windows")
    p.add_argument("--profile-steps", type=int, default=16, help="decode steps under cProfile (0: none)")
    p.add_argument("--top", type=int, default=25, help="functions listed by own time")
    p.add_argument("--no-overlap", action="store_true", help="synchronous steps (overlap off)")
    p.add_argument("--wire", action="store_true", help="msgpack the StepMsg and StepResult (server path)")
    args = p.parse_args(argv)
    # One intra-op thread: a torch copy_ of 41k ints took 8 ms with 2 threads on the 2-core box (the
    # pool's wake-up; the GPU host's copies are memcpys into pinned staging), 0.02 ms with 1.
    torch.set_num_threads(1)

    t0 = time.perf_counter()
    eng, reqs, stubs = build(args)
    core = eng.core
    while any(not r.output_ids for r in reqs):  # prefill (stubbed: fast)
        core.step()
    for _ in range(args.warmup):
        core.step()
    setup = time.perf_counter() - t0
    graph0, shared0 = eng.runner.graph_steps, eng.runner.shared_steps
    windows, cpu = [], []  # wall and process CPU ms a step, per window (CPU time: less hurt by a busy box)
    for _ in range(args.repeats):  # several windows: the box is shared, take the median and the best
        stubs.seconds = 0.0
        t, c = time.perf_counter(), time.process_time()
        for _ in range(args.steps):
            core.step()
        windows.append((time.perf_counter() - t - stubs.seconds) / args.steps * 1e3)
        cpu.append((time.process_time() - c - stubs.seconds) / args.steps * 1e3)
    n = args.repeats * args.steps
    graphs, shared = eng.runner.graph_steps - graph0, eng.runner.shared_steps - shared0
    if any(r.state is RequestState.FINISHED for r in reqs) or graphs != n or shared != n:
        raise RuntimeError(f"not a pure decode window: {graphs} graph / {shared} shared of {n} steps")
    host_ms, best = statistics.median(windows), min(windows)
    mode = ("overlap" if core.overlap else "sync") + (", wire" if args.wire else "")
    print(f"batch {args.batch}, {mode}: {args.repeats} x {args.steps} decode steps, setup {setup:.1f} s")
    print(f"| host ms / decode step | median {host_ms:.3f} | best {best:.3f} | CPU-time median "
          f"{statistics.median(cpu):.3f} |  (windows: " + " ".join(f"{w:.2f}" for w in windows) + ")")
    if args.profile_steps:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.profile_steps):
            core.step()
        prof.disable()
        profile_table(prof, args.profile_steps, args.top)
    for r in reqs:
        core.abort(r.rid)
    return {"host_ms": host_ms, "best_ms": best, "cpu_ms": statistics.median(cpu), "batch": args.batch}


def profile_table(prof: cProfile.Profile, steps: int, top: int) -> None:
    """The step's parts (cumulative ms per step under the profiler, which inflates them) and the
    functions with the most own time."""
    st = pstats.Stats(prof)
    print(f"\ncProfile, {steps} steps (ms per step, profiler-inflated)\n| part | calls/step | cumulative |")
    print("|---|---|---|")
    for label, name, suffix in PARTS:
        hits = [(v, k) for k, v in st.stats.items() if k[2] == name and k[0].endswith(suffix)]
        if hits:
            cc, nc, tt, ct, _ = hits[0][0]
            print(f"| {label} | {nc / steps:g} | {ct / steps * 1e3:.3f} |")
    print(f"\ntop {top} by own time (ms per step)\n| function | calls/step | own | cumulative |")
    print("|---|---|---|---|")
    for key in sorted(st.stats, key=lambda k: -st.stats[k][2])[:top]:
        cc, nc, tt, ct, _ = st.stats[key]
        where = f"{os.path.relpath(key[0]) if key[0].startswith('/') else key[0]}:{key[1]}({key[2]})"
        where = where.replace(".venv/lib/python3.12/site-packages/", "")
        print(f"| {where} | {nc / steps:g} | {tt / steps * 1e3:.3f} | {ct / steps * 1e3:.3f} |")


if __name__ == "__main__":
    main()
