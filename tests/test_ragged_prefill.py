"""Lazy prefill steps at consecutive positions as one dense causal attention over gathered, rotated keys
(kernels/ragged_prefill.py) against the lazy attention reference, on fresh random tables; and which
of a real engine's steps qualify."""

from __future__ import annotations

import os
import random

import pytest
import torch

from lazyrt import Engine, RagPrompt, SamplingParams
from lazyrt.kernels.attention_ref import lazy_attention_ref
from lazyrt.kernels.metadata import AttentionMetadata
from lazyrt.kernels.ragged_prefill import (
    RaggedKeys,
    contiguous_keys,
    ragged_causal_attention_ref,
    ragged_prefill_attention,
)
from lazyrt.kernels.rope import RopeCache, apply_rope_ref
from lazyrt.models.config import ModelConfig
from lazyrt.runtime.worker.model_runner import ModelRunner

SEED = int.from_bytes(os.urandom(4), "little")
print(f"test_ragged_prefill seed {SEED}")


@pytest.fixture(autouse=True)
def _seed(request):
    s = SEED + sum(map(ord, request.node.name))
    torch.manual_seed(s)
    random.seed(s)


def _rope(head_dim: int, llama3: bool) -> RopeCache:
    scaling = None
    if llama3:
        scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 64}  # fmt: skip
    cfg = ModelConfig(model_type="llama", vocab_size=8, hidden_size=head_dim, intermediate_size=8,
                      num_layers=1, num_heads=1, num_kv_heads=1, head_dim=head_dim, rope_theta=10000.0,
                      rope_scaling=scaling)  # fmt: skip
    return RopeCache.build(cfg, 1024)


def _steps(kv_heads: int, head_dim: int, page: int, seqs: int):
    """Random sequences whose keys are at consecutive positions: an optional prefix (partly filled last
    page, as a system prompt before a chunk), then the sequence's own run (earlier tokens + the new
    ones) from a page boundary; positions start anywhere. Slots past valid_len are NaN."""
    qo, kvp, positions, pos_base, valid_len = [0], [0], [], [], []
    for _ in range(seqs):
        pos = random.randint(0, 40)
        runs = []
        if random.random() < 0.7:
            runs.append(random.randint(1, 3 * page))  # the prefix
        new = random.randint(2, 3 * page)
        prior = random.randint(0, new // 2)
        runs.append(prior + new)
        for n in runs:
            for j in range(-(-n // page)):
                pos_base.append(pos + j * page)
                valid_len.append(min(page, n - j * page))
            pos += n
        positions += range(pos - new, pos)
        qo.append(qo[-1] + new)
        kvp.append(len(pos_base))
    num_pages = len(pos_base) + 5
    perm = torch.randperm(num_pages)[: len(pos_base)]
    kv = torch.randn(num_pages, 2, page, kv_heads, head_dim)
    for e, p in enumerate(perm.tolist()):
        kv[p, :, valid_len[e] :] = float("nan")
    i32 = dict(dtype=torch.int32)
    meta = AttentionMetadata(
        qo_indptr=torch.tensor(qo, **i32), positions=torch.tensor(positions, dtype=torch.long),
        kv_indptr=torch.tensor(kvp, **i32), kv_indices=perm.to(torch.int32),
        pos_base=torch.tensor(pos_base, **i32), valid_len=torch.tensor(valid_len, **i32),
        store_pages=torch.zeros(0, dtype=torch.long), store_slots=torch.zeros(0, dtype=torch.long),
        rotate_keys=True,
    )  # fmt: skip
    return kv, meta


def _arrays(meta: AttentionMetadata, ratio: float = 2.0):
    return contiguous_keys(meta.qo_indptr, meta.positions, meta.kv_indptr, meta.kv_indices, meta.pos_base,
                           meta.valid_len, max_key_ratio=ratio)  # fmt: skip


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("llama3", [False, True])
def test_consecutive_steps_equal_lazy_attention(group, llama3):
    page, kv_heads, head_dim = 4, 2, 16
    rope, scale = _rope(head_dim, llama3), head_dim**-0.5
    for _ in range(20):
        kv, meta = _steps(kv_heads, head_dim, page, random.randint(1, 4))
        q = torch.randn(int(meta.qo_indptr[-1]), kv_heads * group, head_dim)
        arrays = _arrays(meta, ratio=10.0)
        assert arrays is not None
        ragged = RaggedKeys.from_arrays(arrays, torch.device("cpu"))
        qo, kvp = ragged.qo_indptr, ragged.kv_indptr
        got = ragged_prefill_attention(
            q, kv, ragged,
            rotate=lambda k, p: apply_rope_ref(k, p, rope),
            attend=lambda q, k, v, qo=qo, kvp=kvp: ragged_causal_attention_ref(q, k, v, qo, kvp, scale),
        )  # fmt: skip
        want = lazy_attention_ref(q, kv, meta, rope, scale)
        assert not torch.isnan(got).any()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_steps_that_are_not_plain_causal_do_not_qualify():
    page = 4
    for _ in range(20):
        kv, meta = _steps(1, 8, page, random.randint(1, 3))
        assert _arrays(meta, ratio=10.0) is not None
        e = int(meta.kv_indptr[1]) - 1
        if e > 0:  # a gap before a sequence's last entry: a document placed apart
            gapped = AttentionMetadata(**{**meta.__dict__, "pos_base": meta.pos_base.clone()})
            gapped.pos_base[e] += 1
            gapped.positions = meta.positions.clone()
            gapped.positions[: int(meta.qo_indptr[1])] += 1
            assert _arrays(gapped, ratio=10.0) is None
            swapped = AttentionMetadata(**{**meta.__dict__, "kv_indices": meta.kv_indices.clone(),
                                           "pos_base": meta.pos_base.clone(),
                                           "valid_len": meta.valid_len.clone()})  # fmt: skip
            for name in ("kv_indices", "pos_base", "valid_len"):  # entries out of position order
                t = getattr(swapped, name)
                t[[e - 1, e]] = t[[e, e - 1]]
            assert _arrays(swapped, ratio=10.0) is None
        # new tokens that are not the sequence's last keys (a token attending past itself)
        early = AttentionMetadata(**{**meta.__dict__, "positions": meta.positions - 1})
        assert _arrays(early, ratio=10.0) is None
        # more keys than the ratio allows
        keys, new = int(meta.valid_len.sum()), int(meta.qo_indptr[-1])
        assert _arrays(meta, ratio=keys / new + 1e-6) is not None
        assert _arrays(meta, ratio=keys / new - 0.01) is None


def test_engine_steps_that_qualify(monkeypatch):
    """A lazy engine's steps: each document's own prefill qualifies (consecutive after the prefix,
    its tokens new), and so does a plain prompt; the question over cached documents does not (its
    keys are mostly cached)."""
    seen: list[tuple[int, int, bool]] = []
    build = ModelRunner.build_metadata

    def record(self, s):
        input_ids, meta = build(self, s)
        q = int(meta.qo_indptr[-1])
        ok = _arrays(meta) is not None
        seen.append((q, int(meta.valid_len.sum()), ok))
        return input_ids, meta

    monkeypatch.setattr(ModelRunner, "build_metadata", record)
    engine = Engine(model="tiny-llama", load_format="dummy", device="cpu", overlap_schedule=False)
    vocab = engine.model_config.vocab_size
    toks = lambda n: [random.randrange(10, vocab) for _ in range(n)]  # noqa: E731
    docs = [toks(random.randint(40, 90)) for _ in range(3)]
    sp = SamplingParams(max_tokens=1, ignore_eos=True)
    prefix = toks(11)
    engine.generate([RagPrompt(prefix, docs, toks(6))], sp)
    first = list(seen)
    seen.clear()
    engine.generate([toks(50)], sp)
    plain = list(seen)
    seen.clear()
    engine.generate([RagPrompt(prefix, docs[::-1], toks(6))], sp)  # its documents cached
    again = list(seen)
    # the first request computed its documents: steps of many new tokens, all consecutive
    assert any(ok and q >= 40 for q, _, ok in first), first
    assert plain and all(ok for _, _, ok in plain), plain
    # the question over the three cached documents reads ~200 cached keys for 6 new tokens
    assert again and not any(ok for q, keys, ok in again if keys > 2 * q), again
