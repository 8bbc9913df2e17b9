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
