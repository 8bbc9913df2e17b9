"""FlashInfer prefill backend (dense page tables, keys stored rotated) vs the Triton backend, bf16 on CUDA."""

from __future__ import annotations

import os

import pytest
import torch

from lazyrt.kernels.metadata import AttentionMetadata
from lazyrt.kernels.rope import RopeCache
from lazyrt.models.config import ModelConfig

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_flashinfer_prefill_matches_triton_on_dense_tables():
    from lazyrt.kernels.backend import TritonAttentionBackend
    from lazyrt.kernels.flashinfer_backend import FlashInferPrefillBackend

    dev, ps, hq, hk, d = "cuda", 16, 32, 8, 128
    cfg = ModelConfig("llama", 1000, hq * d, 1, 1, hq, hk, d, rope_theta=500000.0)
    rope = RopeCache.build(cfg, 8192, dev)
    seq_lens, q_lens = [700, 1234, 97], [64, 128, 97]  # the last is a whole-prompt prefill
    num_pages = sum(-(-n // ps) for n in seq_lens) + 4
    kv_fi = torch.randn(num_pages, 2, ps, hk, d, device=dev, dtype=torch.bfloat16)
    kv_tr = kv_fi.clone()
    perm = torch.randperm(num_pages - 4).tolist()
    qo, kvp, idx, base, valid, pos, spages, sslots = [0], [0], [], [], [], [], [], []
    for n, m in zip(seq_lens, q_lens):
        pages = [perm.pop() for _ in range(-(-n // ps))]
        idx += pages
        base += [j * ps for j in range(len(pages))]
        valid += [min(ps, n - j * ps) for j in range(len(pages))]
        kvp.append(len(idx))
        qo.append(qo[-1] + m)
        for p in range(n - m, n):
            pos.append(p)
            spages.append(pages[p // ps])
            sslots.append(p % ps)

    def t(x, dt=torch.int32):
        return torch.tensor(x, dtype=dt, device=dev)

    meta = AttentionMetadata(
        t(qo), t(pos, torch.long), t(kvp), t(idx), t(base), t(valid), t(spages, torch.long),
        t(sslots, torch.long), rotate_keys=False, max_q_len=max(q_lens), max_kv_entries=max(
            b - a for a, b in zip(kvp, kvp[1:])), dense_pages=True,
    )  # fmt: skip
    T = qo[-1]
    q = torch.randn(T, hq, d, device=dev, dtype=torch.bfloat16)
    k = torch.randn(T, hk, d, device=dev, dtype=torch.bfloat16)
    v = torch.randn(T, hk, d, device=dev, dtype=torch.bfloat16)
    triton_b = TritonAttentionBackend([kv_tr], rope, d**-0.5)
    fi = FlashInferPrefillBackend(TritonAttentionBackend([kv_fi], rope, d**-0.5), [kv_fi], rope, d**-0.5)
    assert fi.handles(meta)
    out_fi = fi.forward(0, q, k, v, meta)
    out_tr = triton_b.forward(0, q, k, v, meta)
    assert torch.equal(kv_fi, kv_tr)  # same store (keys rotated at their positions)
    err = (out_fi.float() - out_tr.float()).norm() / out_tr.float().norm()
    assert err < 1e-2, float(err)


def test_prefix_mode_engine_uses_flashinfer_and_reuses_radix():
    """Smoke: a bf16 prefix-mode engine routes prefill through FlashInfer and reuses radix pages.
    (Exactness is the test above; bf16 greedy tokens may legitimately differ across batch shapes.)
    LAZYRT_GPU_MODEL_DIR may name a config+tokenizer dir, served with dummy weights."""
    from lazyrt import Engine, SamplingParams
    from lazyrt.kernels.flashinfer_backend import FlashInferPrefillBackend

    model_dir = os.environ.get("LAZYRT_GPU_MODEL_DIR")
    kw = {"load_format": "dummy"} if model_dir else {}
    engine = Engine(
        model_dir, device="cuda", dtype="bfloat16", cache_mode="prefix", kv_cache_tokens=65536, **kw
    )
    assert isinstance(engine.runner.backend, FlashInferPrefillBackend)
    base = "Explain the water cycle in three short sentences. " * 8
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    outs = engine.generate([base + "First,", base + "Second,"], sp)
    again = engine.generate([base + "Third,"], sp)[0]
    assert all(len(o["token_ids"]) == 12 for o in outs + [again])
    assert again["meta"]["cached_tokens"] >= 64
    s = engine.cache_stats()
    assert s["held_pages"] == 0 and s["free_pages"] + s["radix_pages"] == s["total_pages"]


@pytest.mark.parametrize("mixed", [False, True])
def test_lazy_ragged_prefill_matches_the_lazy_reference(mixed):
    """Lazy mode's consecutive prefill steps through FlashInfer's ragged prefill (keys gathered from the
    pages and rotated by position, llama3-scaled RoPE): the store leaves the keys unrotated and the
    output equals the fp32 lazy reference to bf16 rounding; a prefix before a page-aligned chunk
    (partly filled page between them), GQA 4. mixed: with running decodes and a question over cached
    keys among them, the step splits (those through the lazy Triton kernel; the chunk finished in a
    second step has 2.6 keys a new token, but 333 new tokens: through FlashInfer)."""
    from lazyrt.kernels.attention_ref import lazy_attention_ref
    from lazyrt.kernels.backend import TritonAttentionBackend
    from lazyrt.kernels.flashinfer_backend import FlashInferPrefillBackend
    from lazyrt.kernels.ragged_prefill import RaggedKeys, contiguous_keys, split_keys

    dev, ps, hq, hk, d = "cuda", 16, 32, 8, 128
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}  # fmt: skip
    cfg = ModelConfig("llama", 1000, hq * d, 1, 1, hq, hk, d, rope_theta=500000.0, rope_scaling=scaling)
    rope = RopeCache.build(cfg, 8192, dev)
    # (prefix tokens, earlier chunk tokens, new tokens) per sequence: documents after a system prompt,
    # a plain prompt, a chunk finished in a second step
    shapes = [(24, 0, 2048), (0, 0, 700), (37, 512, 333)]
    if mixed:  # decodes (3,000 and 9 keys), a 16-token question after 565 cached keys, among them
        shapes = [(0, 2999, 1), shapes[0], (0, 8, 1), (37, 512, 16), shapes[1], shapes[2]]
    num_pages = sum(-(-p // ps) + -(-(c + n) // ps) for p, c, n in shapes) + 4
    kv = torch.randn(num_pages, 2, ps, hk, d, device=dev, dtype=torch.bfloat16)
    free = torch.randperm(num_pages - 4).tolist()
    qo, kvp, idx, base, valid, pos, spages, sslots = [0], [0], [], [], [], [], [], []
    for prefix, prior, new in shapes:
        at = 0
        for n in (prefix, prior + new):
            pages = [free.pop() for _ in range(-(-n // ps))]
            idx += pages
            base += [at + j * ps for j in range(len(pages))]
            valid += [min(ps, n - j * ps) for j in range(len(pages))]
            at += n
        for j in range(prior, prior + new):  # the run's new tokens, stored by the step
            pos.append(prefix + j)
            spages.append(pages[j // ps])
            sslots.append(j % ps)
        kvp.append(len(idx))
        qo.append(qo[-1] + new)

    def t(x, dt=torch.int32):
        return torch.tensor(x, dtype=dt, device=dev)

    meta = AttentionMetadata(t(qo), t(pos, torch.long), t(kvp), t(idx), t(base), t(valid),
                             t(spages, torch.long), t(sslots, torch.long), rotate_keys=True)  # fmt: skip
    arrays = (split_keys if mixed else contiguous_keys)(qo, pos, kvp, idx, base, valid)
    assert arrays is not None
    meta.ragged = RaggedKeys.from_arrays(arrays, torch.device(dev))
    if mixed:
        assert arrays["rest_qo_indptr"].tolist() == [0, 1, 2, 18]
        meta.ragged_rest = AttentionMetadata.split_rest(arrays, torch.device(dev))
    T = qo[-1]
    q = torch.randn(T, hq, d, device=dev, dtype=torch.bfloat16)
    k = torch.randn(T, hk, d, device=dev, dtype=torch.bfloat16)
    v = torch.randn(T, hk, d, device=dev, dtype=torch.bfloat16)
    fi = FlashInferPrefillBackend(TritonAttentionBackend([kv], rope, d**-0.5), [kv], rope, d**-0.5)
    assert fi.warm_up_ragged(hq) == 1
    out = fi.forward(0, q, k, v, meta)
    sp, ss = t(spages, torch.long), t(sslots, torch.long)
    assert torch.equal(kv[sp, 0, ss], k) and torch.equal(kv[sp, 1, ss], v)  # stored unrotated
    want = lazy_attention_ref(q, kv, meta, rope, d**-0.5)
    err = (out.float() - want.float()).norm() / want.float().norm()
    assert err < 1e-2, float(err)


def test_lazy_engine_runs_document_prefill_through_flashinfer():
    """Smoke: a bf16 lazy engine with lazy_flashinfer_prefill computes its documents and a plain prompt
    through the ragged path (the question over cached documents keeps the lazy kernels)."""
    from lazyrt import Engine, RagPrompt, SamplingParams

    model_dir = os.environ.get("LAZYRT_GPU_MODEL_DIR")
    kw = {"load_format": "dummy"} if model_dir else {}
    engine = Engine(model_dir, device="cuda", dtype="bfloat16", kv_cache_tokens=65536,
                    lazy_flashinfer_prefill=True, **kw)  # fmt: skip
    assert engine.runner.ragged_prefill
    sp = SamplingParams(max_tokens=8, ignore_eos=True)
    docs = ["The water cycle moves water between the sea, the air and the land. " * 12,
            "Clouds form when rising air cools and its water vapour condenses. " * 12]  # fmt: skip
    rag = RagPrompt("Answer from the documents.", docs, "How do clouds form?")
    out = engine.generate([rag, "Tell me about rain. " * 20], sp)
    assert all(len(o["token_ids"]) == 8 for o in out)
    assert engine.runner.ragged_steps >= 1


def _serve_beside_decodes(engine, pick, field: str, late_question: int, late_docs: list[int]) -> list[float]:
    """Six requests over three shared documents decode while a seventh (late_docs new documents, a
    late_question-token question) joins; for every attention launch over metadata that pick(step's
    metadata) returns, the output against the same launch with its `field` removed (the path it
    replaces): relative differences, one a layer."""
    import random

    from lazyrt import RagPrompt, SamplingParams
    from lazyrt.runtime.scheduler.request import RequestState

    runner = engine.runner
    chosen, errors = set(), []
    step_metadata, attend = runner.step_metadata, runner.backend.fallback.attend

    def record(plan, s):
        input_ids, meta = step_metadata(plan, s)
        if pick(meta) is not None:
            chosen.add(id(pick(meta)))
        return input_ids, meta

    def check(layer, q, meta):
        out = attend(layer, q, meta)
        if id(meta) in chosen:
            kept = getattr(meta, field)
            setattr(meta, field, None)
            want = attend(layer, q, meta).float()
            setattr(meta, field, kept)
            errors.append(float((out.float() - want).norm() / want.norm()))
        return out

    runner.step_metadata, runner.backend.fallback.attend = record, check
    vocab = engine.model_config.vocab_size
    toks = lambda n: [random.randrange(10, vocab) for _ in range(n)]  # noqa: E731
    shared, prefix = [toks(1500), toks(900), toks(2000)], toks(20)
    sp = SamplingParams(max_tokens=10, ignore_eos=True)
    reqs = [engine._make_request(RagPrompt(prefix, random.sample(shared, 3), toks(12)), sp) for _ in range(6)]
    for r in reqs:
        engine.core.add(r)
    for _ in range(3):
        engine.core.step()
    docs = [toks(n) for n in late_docs] or shared
    reqs.append(engine._make_request(RagPrompt(prefix, docs, toks(late_question)), sp))
    engine.core.add(reqs[-1])
    while any(r.state is not RequestState.FINISHED for r in reqs):
        engine.core.step()
    return errors


def _gpu_engine(**kw):
    from lazyrt import Engine

    model_dir = os.environ.get("LAZYRT_GPU_MODEL_DIR")
    load = {"load_format": "dummy"} if model_dir else {}
    return Engine(model_dir, device="cuda", dtype="bfloat16", kv_cache_tokens=65536, overlap_schedule=False,
                  **load, **kw)  # fmt: skip


def test_lazy_engine_split_steps_read_shared_documents_through_the_shared_kernel():
    """A document's prefill beside running requests over the same documents: the split step's other
    rows (their decodes) go through shared-chunk attention, and each such launch equals the lazy
    Triton kernel over the same rows' page tables to bf16 rounding; every request finishes."""
    engine = _gpu_engine(lazy_flashinfer_prefill=True)
    assert engine.runner.ragged_prefill and engine.runner.shared_chunk_attention
    rest = lambda meta: meta.ragged_rest if meta.ragged_rest is not None and meta.ragged_rest.shared else None  # noqa: E731
    errors = _serve_beside_decodes(engine, rest, "shared", late_question=12, late_docs=[700, 600])
    assert len(errors) >= engine.model_config.num_layers and max(errors) < 2e-2, errors


def test_lazy_engine_launches_decodes_apart_from_a_long_question():
    """Running requests decode while another's 100-token question over cached documents runs (too long
    for shared-chunk attention, too few tokens for FlashInfer): the step launches its decodes apart
    (decode_split, forced here at any key count), and its attention equals one lazy-kernel launch of
    the whole step to bf16 rounding; every request finishes."""
    engine = _gpu_engine()
    engine.runner.split_decode_keys = 1
    parted = lambda meta: meta if meta.parts is not None else None  # noqa: E731
    errors = _serve_beside_decodes(engine, parted, "parts", late_question=100, late_docs=[])
    assert engine.runner.decode_splits >= 1
    assert len(errors) >= engine.model_config.num_layers and max(errors) < 2e-2, errors
