"""Small steps with prefill rows replayed from the shared CUDA graphs (issue 14: a question over cached
documents launched eagerly cost ~4 ms of host time on the H100). Shared-chunk attention attends each
row through its (row, position) pairs, so a graph captured for b decode rows serves any step of up
to b rows with at most SHARED_MAX_Q_LEN new tokens an item: one request's question alone, or
questions beside running decodes.

On the CPU the graphs are emulated: a "replay" runs the model forward over the graph's static
buffers (what a real replay reads), with the shared buffers cut to the live step's lengths (the
Triton kernel reads its live count from a buffer; the torch path walks every entry). So these tests
check what the replay path feeds the model (buffer fills, padding rows, the forced shared arrays of
a lone request, the sampled rows picked from every row's logits) against the eager engine's greedy
tokens; test_engine_gpu.py runs the real graphs and kernels."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import cpu_engine
from test_shared_chunk_engine import pool_prompts

from lazyrt import SamplingParams
from lazyrt.kernels.shared_chunk import SharedChunkMeta
from lazyrt.runtime.worker import cuda_graph


class _EagerReplay:
    def __init__(self, graphs: EagerGraphs, b: int, shared: bool, few: bool, out: torch.Tensor):
        self.graphs, self.b, self.shared, self.few, self.out = graphs, b, shared, few, out

    def replay(self) -> None:
        if self.shared:  # the step's work items counted in the longest one's keys, from the buffers
            sh = self.graphs.sh
            n = int(sh["num_work"][0])
            lens = [int(sh["chunk_len"][int(c)]) for c in sh["work_chunk"][:n]]
            wave = -(-sum(lens) // max(lens)) if lens else 0
            EagerGraphs.shared_keys.append((self.b, self.few, wave))
        self.out.copy_(self.graphs._forward(self.b, False, self.shared, self.few))


class EagerGraphs(cuda_graph.DecodeGraphs):
    """DecodeGraphs on the CPU: capture records a forward over the static buffers; replay runs it."""

    live: dict[str, int] = {}
    small_replays = 0
    small_shapes: list = []
    shared_keys: list = []  # (batch, few, the step's work items in its longest's keys) of each shared replay

    def _capture(self, b: int, doc_logits: bool, shared: bool = False, few: bool = False):
        self._uploads.forget()
        self.kv_indptr.zero_()  # as a capture does: its warm-up forwards clobber the buffers
        self.store_pages.fill_(self.scratch_page)
        rep = _EagerReplay(self, b, shared, few, torch.zeros(b, self.runner.model.config.vocab_size))
        return rep, rep.out

    def _meta(self, b: int, doc_logits: bool, shared: bool = False, few: bool = False):
        meta = super()._meta(b, doc_logits, shared, few)
        if shared and self.live:
            sh = {k: getattr(meta.shared, k)[:n] for k, n in self.live.items()}
            meta.shared = SharedChunkMeta(**sh, block_pairs=meta.shared.block_pairs, num_work_host=0)
        return meta

    def run(self, s, shared=None):
        if shared is not None:
            pad = next(x for x in self.sizes if x >= len(s.input_ids)) - len(s.input_ids)
            self.live = {k: len(v) + (pad if k == "row_part_indptr" else 0) for k, v in shared.items()}
            EagerGraphs.small_replays += not s.is_decode
            if not s.is_decode:
                EagerGraphs.small_shapes.append((len(s.input_ids), s.max_q_len, s.num_seqs))
        return super().run(s, shared)


def graph_engine(path: str, **kw):
    engine = cpu_engine(path, "lazy", **kw)
    orig = cuda_graph.DecodeGraphs
    cuda_graph.DecodeGraphs = EagerGraphs  # enable_cuda_graphs imports it from the module
    try:
        engine.runner.enable_cuda_graphs(64, engine.max_context)
    finally:
        cuda_graph.DecodeGraphs = orig
    return engine


@pytest.mark.parametrize("overlap", [True, False])
def test_small_steps_replayed_give_the_eager_tokens(overlap, tiny_model_dir):
    """Lone requests (nothing to share: the shared arrays are forced) and batches arriving while others
    decode (questions beside decodes in one step) give the eager engine's greedy tokens."""
    path = tiny_model_dir("llama")
    rng = random.Random()
    prompts = pool_prompts(rng, 49152, 6)
    sps = [SamplingParams(max_tokens=rng.randint(3, 8), ignore_eos=True) for _ in prompts]
    want = cpu_engine(path, "lazy", overlap_schedule=overlap)
    ref = [[o["token_ids"] for o in want.generate([p], [sp])] for p, sp in zip(prompts[:2], sps)]
    ref.append([o["token_ids"] for o in want.generate(prompts, sps)])

    EagerGraphs.small_replays = 0
    engine = graph_engine(path, overlap_schedule=overlap)
    got = [[o["token_ids"] for o in engine.generate([p], [sp])] for p, sp in zip(prompts[:2], sps)]
    lone = EagerGraphs.small_replays
    got.append([o["token_ids"] for o in engine.generate(prompts, sps)])
    assert got == ref
    assert lone >= 2  # each lone request's question step was replayed
    assert EagerGraphs.small_replays > lone
    assert engine.runner.graph_steps > EagerGraphs.small_replays  # and the decode steps


def test_steps_too_large_for_a_graph_run_eagerly(tiny_model_dir):
    """A question longer than SHARED_MAX_Q_LEN tokens runs eagerly: same tokens, only the decode
    steps after it (and small steps before it) replayed."""
    path = tiny_model_dir("llama")
    rng = random.Random()
    prompts = pool_prompts(rng, 49152, 1, doc_lens=(70, 90))  # each document's own step too large
    prompts[0].suffix = [rng.randrange(100, 49152) for _ in range(80)]  # > 64 new tokens
    sp = [SamplingParams(max_tokens=4, ignore_eos=True)]
    want = [o["token_ids"] for o in cpu_engine(path, "lazy").generate(prompts, sp)]
    EagerGraphs.small_shapes = []
    engine = graph_engine(path)
    assert [o["token_ids"] for o in engine.generate(prompts, sp)] == want
    # (the system prefix's own step, a few tokens, may be replayed; the question's 80 rows are not)
    assert all(q_len <= 64 for _, q_len, _ in EagerGraphs.small_shapes), EagerGraphs.small_shapes
    assert engine.runner.graph_steps == len(EagerGraphs.small_shapes) + 3  # + the decode steps


@pytest.mark.parametrize("wave_programs", [0, None])
def test_shared_graph_by_the_steps_work_items(wave_programs, tiny_model_dir, monkeypatch):
    """Each batch has a shared graph for launches within one resident wave of work items and one
    past it (the kernel's launch settings differ); a step replays the one its work items (counted in
    the longest item's keys) x kv heads pick: past the wave when a wave holds nothing, within it at a
    tiny model's few items."""
    from lazyrt.kernels import waves

    if wave_programs is not None:
        monkeypatch.setattr(waves, "WAVE_PROGRAMS_PER_SM", wave_programs)
    path = tiny_model_dir("llama")
    rng = random.Random()
    prompts = pool_prompts(rng, 49152, 4)
    sps = [SamplingParams(max_tokens=4, ignore_eos=True) for _ in prompts]
    want = [o["token_ids"] for o in cpu_engine(path, "lazy").generate(prompts, sps)]
    EagerGraphs.shared_keys = []
    engine = graph_engine(path)
    graphs = engine.runner.graphs
    assert set(graphs.shared_graphs) == {(b, few) for b in graphs.sizes if b > 1 for few in (False, True)}
    assert [o["token_ids"] for o in engine.generate(prompts, sps)] == want
    assert EagerGraphs.shared_keys
    wave = 132 * waves.WAVE_PROGRAMS_PER_SM  # (132 SMs off CUDA)
    kv_heads = engine.runner.pool.num_kv_heads
    for b, few, items in EagerGraphs.shared_keys:
        assert few == (0 < items * kv_heads <= wave) == (wave_programs is None), (b, few, items)
