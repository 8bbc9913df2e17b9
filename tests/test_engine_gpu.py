"""Engine on CUDA (Triton kernels): same greedy tokens as the CPU path; an 8B-shaped dummy serves a batch."""

from __future__ import annotations

import random

import pytest
import torch

from lazyrt import Engine, RagPrompt, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

FACTS = [
    "The Zorblat river flows through Quenta and is {n} km long.",
    "Mount Feller in Arvania is {n} metres tall.",
    "The glass market of Quenta opened in the year {n}.",
    "Arvania's currency, the lumen, is split into {n} sparks.",
    "The lighthouse of Port Ellin has {n} steps.",
    "Professor Imra Solt wrote {n} books about tides.",
]


def _rag_items(n: int, rng: random.Random) -> list[tuple[list[str], str]]:
    docs = [f.format(n=rng.randint(10, 9000)) for f in FACTS]
    items = []
    for _ in range(n):
        d = rng.sample(docs, rng.randint(2, 4))
        items.append((d, rng.choice(["How long is the river?", "How tall is Mount Feller?", "Summarize."])))
    return items


@pytest.mark.parametrize("mode", ["lazy", "block"])
def test_cuda_matches_cpu_on_20_rag_prompts(mode):
    rng = random.Random()
    items = _rag_items(20, rng)
    sp = SamplingParams(max_tokens=16)
    cpu = Engine(device="cpu", cache_mode=mode, kv_cache_tokens=32768)
    gpu = Engine(device="cuda", dtype="float32", cache_mode=mode, kv_cache_tokens=32768)
    batch = [{"docs": d, "question": q, "sampling_params": {"max_tokens": 16}} for d, q in items]
    out_gpu = gpu.rag_batch(batch)  # batched on the GPU: chunk sharing and mixed steps
    for (d, q), og in zip(items, out_gpu):
        oc = cpu.rag(d, q, sampling_params=sp)
        assert og["token_ids"] == oc["token_ids"], (d, q)
    assert sum(o["meta"]["chunk_hits"] for o in out_gpu) > 0


def test_dummy_llama31_8b_serves_64_request_rag_batch():
    engine = Engine(
        "llama-3.1-8b", load_format="dummy", device="cuda", dtype="bfloat16", kv_cache_tokens=200_000
    )
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    docs = [[rng.randrange(1000, vocab) for _ in range(512)] for _ in range(20)]
    prompts = [
        RagPrompt(
            list(range(1000, 1032)), rng.sample(docs, 5), [rng.randrange(1000, vocab) for _ in range(32)]
        )
        for _ in range(64)
    ]
    outs = engine.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))
    assert len(outs) == 64 and all(len(o["token_ids"]) == 16 for o in outs)
    assert sum(o["meta"]["chunk_hits"] for o in outs) > 0
    s = engine.cache_stats()
    assert s["held_pages"] == 0 and s["free_pages"] + s["chunk_pages"] + s["radix_pages"] == s["total_pages"]


def question(rng: random.Random) -> list[int]:
    return [rng.randrange(1000, 40000) for _ in range(8)]


def test_block_copies_fused_kernel_matches_reference():
    """Block mode on CUDA: the one-launch copy + re-rotate kernel gives the same greedy tokens as the
    torch reference copy, inside the engine (dummy SmolLM2 shape, fp32, shared docs at shuffled
    offsets, so copies with many different deltas)."""
    from lazyrt.kernels.attention_ref import copy_rerotate_pages_ref

    rng = random.Random()
    docs = [[rng.randrange(1000, 40000) for _ in range(rng.randint(20, 90))] for _ in range(6)]
    prompts = [
        RagPrompt(list(range(1000, 1010)), rng.sample(docs, 3), question(rng))
        for _ in range(12)
    ]
    outs = []
    for reference in (False, True):
        engine = Engine("smollm2-135m", load_format="dummy", device="cuda", dtype="float32",
                        cache_mode="block", kv_cache_tokens=32768)  # fmt: skip
        if reference:
            engine.runner._copy_rerotate = copy_rerotate_pages_ref
        outs.append([o["token_ids"] for o in engine.generate(prompts, SamplingParams(max_tokens=12))])
        assert engine.cache_stats()["held_pages"] == 0
        del engine
        torch.cuda.empty_cache()
    assert outs[0] == outs[1]



def rag_prompts(rng: random.Random, n: int) -> list[RagPrompt]:
    """n prompts of 3 documents each from a pool of 6 random-token documents (20-90 tokens)."""
    docs = [[rng.randrange(1000, 40000) for _ in range(rng.randint(20, 90))] for _ in range(6)]
    return [RagPrompt(list(range(1000, 1010)), rng.sample(docs, 3), question(rng)) for _ in range(n)]


def engine_tokens(mode: str, reference: bool, prompts, sps, check=None, **kw) -> list[list[int]]:
    """Greedy tokens of a dummy-SmolLM2 fp32 CUDA engine; reference: attention by the torch reference,
    per request (no shared-chunk attention), every step eager (no CUDA graphs) and synchronous (no
    overlapped scheduling). check(engine) runs after generating."""
    from lazyrt.kernels.attention_ref import lazy_attention_ref

    kw = dict(kw, shared_chunk_attention=False, overlap_schedule=False) if reference else dict(kw)
    kw.setdefault("cuda_graph_max_batch", 0 if reference else 64)
    engine = Engine("smollm2-135m", load_format="dummy", device="cuda", dtype="float32", cache_mode=mode,
                    kv_cache_tokens=32768, **kw)  # fmt: skip
    if reference:
        backend = getattr(engine.runner.backend, "fallback", engine.runner.backend)
        backend._attend = lambda q, kv, meta, rope, sm, **_: lazy_attention_ref(q, kv, meta, rope, sm)
    tokens = [o["token_ids"] for o in engine.generate(prompts, sps)]
    if check is not None:
        check(engine)
    del engine
    torch.cuda.empty_cache()
    return tokens


def test_doc_attention_triton_matches_reference_in_engine():
    """Document attention on CUDA: the Triton kernel's per-entry logits give the torch reference
    attention's greedy tokens inside the engine (decode steps replay the document-attention CUDA
    graphs; the reference runs eager), and lazy = block (dummy SmolLM2 shape, fp32)."""
    prompts = rag_prompts(random.Random(), 8)
    sp = SamplingParams(max_tokens=12, ignore_eos=True, doc_attention_temperature=0.7,
                        doc_attention_scale=1.6)  # fmt: skip

    def replayed_graphs(engine):
        assert engine.runner.graphs.doc_graphs  # decode steps replayed graphs

    outs = {
        (mode, reference): engine_tokens(mode, reference, prompts, sp, None if reference else replayed_graphs)
        for mode in ("lazy", "block")
        for reference in (False, True)
    }
    assert outs["lazy", False] == outs["lazy", True] == outs["block", False] == outs["block", True]

def test_deviation_recompute_triton_matches_reference():
    """Deviation recompute on CUDA (fp32): the probe's per-page scores and the greedy tokens with
    the Triton kernels equal those with the torch reference attention, and lazy = block (dummy
    SmolLM2 shape)."""
    from lazyrt.kernels.attention_ref import lazy_attention_ref

    rng = random.Random()
    docs = [[rng.randrange(1000, 40000) for _ in range(rng.randint(30, 90))] for _ in range(6)]
    prompts = [RagPrompt(list(range(1000, 1010)), rng.sample(docs, 3), question(rng)) for _ in range(6)]
    sp = SamplingParams(max_tokens=10, ignore_eos=True)
    kw = dict(load_format="dummy", device="cuda", dtype="float32", kv_cache_tokens=32768,
              recompute_policy="deviation", recompute_ratio=0.25)  # fmt: skip
    outs, scores = {}, {}
    for mode, reference in (("lazy", False), ("lazy", True), ("block", False)):
        engine = Engine("smollm2-135m", cache_mode=mode, cuda_graph_max_batch=0 if reference else 64,
                        shared_chunk_attention=not reference, **kw)  # fmt: skip
        if reference:
            backend = getattr(engine.runner.backend, "fallback", engine.runner.backend)
            backend._attend = lambda q, kv, meta, rope, sm, **_: lazy_attention_ref(q, kv, meta, rope, sm)
        calls = []
        orig = engine.runner.probe_deviation
        engine.runner.probe_deviation = lambda items, *a, f=orig, c=calls: c.append(f(items, *a)) or c[-1]
        outs[mode, reference] = [o["token_ids"] for o in engine.generate(prompts, sp)]
        scores[mode, reference] = torch.tensor([x for c in calls for page in c for x in page])
        del engine
        torch.cuda.empty_cache()
    assert len(scores["lazy", False]) > 0
    assert outs["lazy", False] == outs["lazy", True] == outs["block", False]
    torch.testing.assert_close(scores["lazy", False], scores["lazy", True], rtol=1e-3, atol=1e-6)
    torch.testing.assert_close(scores["block", False], scores["lazy", True], rtol=1e-3, atol=1e-6)


def test_parallel_doc_positions_triton_matches_reference():
    """Parallel document positions on CUDA (fp32): the Triton kernels (decode in CUDA graphs) give the
    torch reference attention's greedy tokens, and lazy = block (block's prefill leaves FlashInfer's
    dense path: its docs' positions overlap); sequential requests in the same batch share the chunks."""
    prompts = rag_prompts(random.Random(), 8)
    sps = [SamplingParams(max_tokens=12, ignore_eos=True, doc_positions=("parallel", "sequential")[i % 2])
           for i in range(len(prompts))]  # fmt: skip
    outs = {
        (mode, reference): engine_tokens(mode, reference, prompts, sps)
        for mode in ("lazy", "block")
        for reference in (False, True)
    }
    assert outs["lazy", False] == outs["lazy", True] == outs["block", False] == outs["block", True]

def test_doc_attention_decode_graphs_match_eager():
    """Document attention in CUDA graphs: replayed decode steps give the eager steps' greedy tokens
    (fp32: graphs size the split-KV by their captured table bound, eager steps by the step's own,
    so bf16 sums round differently and dummy weights' near-tied logits flip), for requests
    with and without document attention mixed in one batch: graphs captured on first use by a
    request's override, or up front when the engine is configured with document attention."""
    prompts = rag_prompts(random.Random(), 8)
    doc = dict(doc_attention_scale=0.5, doc_attention_temperature=0.9)
    sps = [SamplingParams(max_tokens=8, ignore_eos=True, **({} if i % 3 == 0 else doc)) for i in range(8)]
    outs = {}
    for configured in (False, True):
        for graphs in (64, 0):
            engine = Engine("smollm2-135m", load_format="dummy", device="cuda", dtype="float32",
                            kv_cache_tokens=32768, cuda_graph_max_batch=graphs,
                            **(dict(doc_attention_scale=0.7) if configured else {}))  # fmt: skip
            if graphs:
                captured = engine.runner.graphs.doc_graphs
                assert len(captured) == (len(engine.runner.graphs.sizes) if configured else 0)
            outs[configured, graphs] = [o["token_ids"] for o in engine.generate(prompts, sps)]
            outs[configured, graphs, 1] = [o["token_ids"] for o in engine.generate(prompts[:1], sps[1:2])]
            if graphs:
                assert len(engine.runner.graphs.doc_graphs) >= 2
            del engine
            torch.cuda.empty_cache()
    for configured in (False, True):
        assert outs[configured, 64] == outs[configured, 0]
        assert outs[configured, 64, 1] == outs[configured, 0, 1]


@pytest.mark.parametrize("graphs", [64, 0])
def test_shared_chunk_attention_matches_reference_in_engine(graphs):
    """Shared-chunk attention on CUDA (fp32): requests over a pool of 6 documents share them in
    their decode and question steps; the Triton shared kernel + merge (decode and small question
    steps in its CUDA graphs, or eager) give the per-request torch reference's greedy tokens."""
    prompts = rag_prompts(random.Random(), 12)
    sps = [SamplingParams(max_tokens=12, ignore_eos=True) for _ in prompts]
    replays = []

    def check(engine):
        assert engine.runner.shared_steps > 0
        if graphs:
            # each batch past 1: a graph within one wave of work items, one past it
            assert len(engine.runner.graphs.shared_graphs) == 2 * (len(engine.runner.graphs.sizes) - 1)
            assert any(replays)

    ref = engine_tokens("lazy", True, prompts, sps)
    from lazyrt.runtime.worker.cuda_graph import DecodeGraphs

    orig = DecodeGraphs.run

    def run(self, s, shared=None):
        replays.append(shared is not None)
        small.append(shared is not None and not s.is_decode)
        return orig(self, s, shared)

    small = []
    DecodeGraphs.run = run
    try:
        got = engine_tokens("lazy", False, prompts, sps, check=check, cuda_graph_max_batch=graphs)
        got1 = engine_tokens("lazy", False, prompts[:1], sps[:1], cuda_graph_max_batch=graphs)
    finally:
        DecodeGraphs.run = orig
    assert got == ref
    assert got1 == ref[:1]  # alone: its question step goes through a shared graph all the same
    assert any(small) == bool(graphs)  # question steps (prefill rows) replayed from shared graphs


@pytest.mark.parametrize("graphs", [64, 0])
def test_shared_chunk_last_round_cut_matches_reference_in_engine(graphs, monkeypatch):
    """split_last_round on CUDA: with each step's round forced so that its longest documents spill,
    the cut pieces (each read from its own offset inside its document) through the Triton shared
    kernel + merge give the per-request torch reference's greedy tokens (graphs and eager)."""
    from lazyrt.runtime.worker import step_inputs

    real, cuts = step_inputs.split_last_round, []

    def forced(segments, page_size, block_pairs, kv_heads, round_items, *args, **kwargs):
        longest = max(n for _, n, _ in segments)
        works = [-(-len(pairs) // block_pairs) for _, n, pairs in segments if n == longest]
        rounds = (sum(works) - min(works)) * kv_heads  # the longest segments spill one of theirs
        out = real(segments, page_size, block_pairs, kv_heads, rounds, *args, **kwargs)
        cuts.append(len(out) - len(segments))
        return out

    rng = random.Random()
    docs = [[rng.randrange(1000, 40000) for _ in range(64)] for _ in range(6)]  # equal: all longest
    prompts = [RagPrompt(list(range(1000, 1010)), rng.sample(docs, 3), question(rng)) for _ in range(12)]
    sps = [SamplingParams(max_tokens=12, ignore_eos=True) for _ in prompts]
    ref = engine_tokens("lazy", True, prompts, sps)
    monkeypatch.setattr(step_inputs, "split_last_round", forced)
    got = engine_tokens("lazy", False, prompts, sps, cuda_graph_max_batch=graphs,
                        check=lambda engine: engine.runner.shared_steps > 0 or pytest.fail("no shared step"))
    assert any(c > 0 for c in cuts)
    assert got == ref


def test_overlap_schedule_matches_synchronous_loop_with_graphs():
    """Overlapped scheduling on CUDA (fp32, decode in CUDA graphs with shared-chunk attention): each
    decode step takes its input tokens from the step still running, on the device; greedy and
    seeded-sampled requests of 1..12 tokens give the synchronous loop's tokens."""
    rng = random.Random()
    prompts = rag_prompts(rng, 12)
    sps = [SamplingParams(max_tokens=rng.randint(1, 12), ignore_eos=True) for _ in prompts]
    sps[0] = SamplingParams(max_tokens=10, temperature=0.8, seed=rng.randrange(1 << 30), ignore_eos=True)
    filled = []
    from lazyrt.runtime.worker.cuda_graph import DecodeGraphs

    orig = DecodeGraphs.run

    def run(self, s, shared=None):
        filled.append(s.fill is not None)
        return orig(self, s, shared)

    want = engine_tokens("lazy", False, prompts, sps, overlap_schedule=False)
    DecodeGraphs.run = run
    try:
        got = engine_tokens("lazy", False, prompts, sps, overlap_schedule=True)
    finally:
        DecodeGraphs.run = orig
    assert got == want
    assert [len(t) for t in got] == [sp.max_tokens for sp in sps]
    assert any(filled)  # graph replays really took their tokens from the step in flight
