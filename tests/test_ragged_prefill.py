"""Lazy prefill steps at consecutive positions as one dense causal attention over gathered, rotated keys
(kernels/ragged_prefill.py) against the lazy attention reference, on fresh random tables; and which
of a real engine's steps qualify."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch

from lazyrt import Engine, RagPrompt, SamplingParams
from lazyrt.kernels.attention_ref import lazy_attention_ref, store_kv_ref
from lazyrt.kernels.backend import TorchAttentionBackend
from lazyrt.kernels.metadata import AttentionMetadata
from lazyrt.kernels.ragged_prefill import (
    RaggedKeys,
    contiguous_keys,
    decode_split,
    ragged_causal_attention_ref,
    ragged_prefill_attention,
    sequences_that_fit,
    split_keys,
    split_prefill_attention,
)
from lazyrt.kernels.rope import RopeCache, apply_rope_ref
from lazyrt.models.config import ModelConfig
from lazyrt.runtime.scheduler.request import RequestState
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


def _tables(seqs: list, kv_heads: int, head_dim: int, page: int):
    """A step's pages and metadata for seqs = [(runs, new)]: runs [(first position, tokens)] each from
    a page boundary, the sequence's new tokens the last `new` of its last run. Pages in random order;
    slots past valid_len are NaN."""
    qo, kvp, positions, pos_base, valid_len = [0], [0], [], [], []
    for runs, new in seqs:
        for pos, n in runs:
            for j in range(-(-n // page)):
                pos_base.append(pos + j * page)
                valid_len.append(min(page, n - j * page))
        end = runs[-1][0] + runs[-1][1]
        positions += range(end - new, end)
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
        rotate_keys=True, max_q_len=max(n for _, n in seqs),
    )  # fmt: skip
    return kv, meta


def _fitting(page: int):
    """A sequence whose keys are at consecutive positions: an optional prefix (partly filled last page,
    as a system prompt before a chunk), then its own run (earlier tokens + the new ones) from a page
    boundary; positions start anywhere; at most 2 keys per new token."""
    pos, runs, new = random.randint(0, 40), [], random.randint(2, 4 * page)
    if random.random() < 0.7:
        runs.append((pos, random.randint(1, new // 2)))  # at most 2 keys a new token in all
        pos += runs[-1][1]
    runs.append((pos, random.randint(0, new // 2) + new))
    return runs, new


def _other(page: int):
    """A sequence the lazy kernel keeps: a decode over a long context, or a question over documents
    placed apart (a gap in positions) or mostly cached."""
    if random.random() < 0.5:
        return [(0, random.randint(3, 6 * page))], 1
    runs, pos = [], 0
    for _ in range(random.randint(1, 3)):
        pos += random.randint(0, 3)  # a gap or none
        runs.append((pos, random.randint(9, 3 * page + 9)))  # more than twice the new tokens
        pos += runs[-1][1]
    new = random.randint(1, 4)
    runs.append((pos, new))
    return runs, new


def _steps(kv_heads: int, head_dim: int, page: int, seqs: int):
    return _tables([_fitting(page) for _ in range(seqs)], kv_heads, head_dim, page)


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


def test_many_new_tokens_fit_at_any_key_ratio():
    """A long document's later prefill step, or a long question over cached documents: many cached keys
    before the new tokens. At least any_ratio_tokens new tokens fit whatever the ratio (their attention
    is compute-bound); fewer do not; a gap still does not."""
    page = 4
    for _ in range(10):
        n = random.randint(4, 12)
        cached = random.randint(3 * n, 10 * n)  # more than twice the new tokens
        seq = ([(0, 9), (9, cached + n)], n)
        gap = ([(0, 9), (10, cached + n)], n)
        _, meta = _tables([seq, ([(0, 30)], 1), gap], 1, 8, page)  # a decode between
        t = _tables_of(meta)
        assert sequences_that_fit(*t, any_ratio_tokens=n).tolist() == [True, False, False]
        assert sequences_that_fit(*t, any_ratio_tokens=n + 1).tolist() == [False, False, False]
        assert split_keys(*t, min_tokens=1, any_ratio_tokens=n) is not None
        _, alone = _tables([seq], 1, 8, page)
        assert contiguous_keys(*_tables_of(alone)) is None  # 256 by default
        _, long_seq = _tables([([(0, 9), (9, 4 * 256)], 256)], 1, 8, page)
        assert contiguous_keys(*_tables_of(long_seq)) is not None


def _tables_of(meta: AttentionMetadata) -> tuple:
    return (meta.qo_indptr, meta.positions, meta.kv_indptr, meta.kv_indices, meta.pos_base, meta.valid_len)


def _torch_ragged(kv: torch.Tensor, ragged: RaggedKeys, rope: RopeCache, scale: float):
    """The ragged part through the torch references (rows of ragged.qo_indptr)."""
    qo, kvp = ragged.qo_indptr, ragged.kv_indptr
    return lambda q: ragged_prefill_attention(
        q, kv, ragged,
        rotate=lambda k, p: apply_rope_ref(k, p, rope),
        attend=lambda q, k, v: ragged_causal_attention_ref(q, k, v, qo, kvp, scale),
    )  # fmt: skip


@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("llama3", [False, True])
def test_split_steps_equal_lazy_attention(group, llama3):
    """A mixed step (documents' prefill beside decodes and questions over documents placed apart, in
    random order): the fitting sequences through the ragged path, the others through the lazy
    reference over split_rest's tables, equal the lazy reference over the whole step."""
    page, kv_heads, head_dim = 4, 2, 16
    rope, scale = _rope(head_dim, llama3), head_dim**-0.5
    for _ in range(20):
        kinds = [True] * random.randint(1, 3) + [False] * random.randint(1, 4)
        random.shuffle(kinds)
        kv, meta = _tables([_fitting(page) if k else _other(page) for k in kinds], kv_heads, head_dim, page)
        assert sequences_that_fit(*_tables_of(meta)).tolist() == kinds
        arrays = split_keys(*_tables_of(meta), min_tokens=1)
        assert arrays is not None
        qo = meta.qo_indptr.tolist()
        fit_rows = [r for b, k in enumerate(kinds) if k for r in range(qo[b], qo[b + 1])]
        assert arrays["q_rows"].tolist() == fit_rows
        assert sorted(arrays["q_rows"].tolist() + arrays["rest_rows"].tolist()) == list(range(qo[-1]))
        ragged = RaggedKeys.from_arrays(arrays, torch.device("cpu"))
        rest = AttentionMetadata.split_rest(arrays, torch.device("cpu"))
        assert rest.max_q_len == max(qo[b + 1] - qo[b] for b, k in enumerate(kinds) if not k)
        q = torch.randn(qo[-1], kv_heads * group, head_dim)
        got = split_prefill_attention(
            q, ragged, _torch_ragged(kv, ragged, rope, scale),
            lambda q_rest, kv=kv, rest=rest: lazy_attention_ref(q_rest, kv, rest, rope, scale),
        )  # fmt: skip
        want = lazy_attention_ref(q, kv, meta, rope, scale)
        assert not torch.isnan(got).any()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_split_keys_declines_steps_it_cannot_help():
    page = 4
    for _ in range(10):
        fit = [_fitting(page) for _ in range(random.randint(1, 3))]
        _, whole = _tables(fit, 1, 8, page)
        assert split_keys(*_tables_of(whole), min_tokens=1) is None  # every sequence fits: no split
        assert contiguous_keys(*_tables_of(whole)) is not None
        _, none_fit = _tables([_other(page) for _ in range(3)], 1, 8, page)
        assert split_keys(*_tables_of(none_fit), min_tokens=1) is None
        _, mixed = _tables(fit + [_other(page)], 1, 8, page)
        new = sum(n for _, n in fit)
        assert split_keys(*_tables_of(mixed), min_tokens=new) is not None
        assert split_keys(*_tables_of(mixed), min_tokens=new + 1) is None  # too few tokens to pay


class _TorchRaggedBackend(TorchAttentionBackend):
    """The CPU engine's backend with the ragged and split paths of FlashInferPrefillBackend, through
    the torch references (FlashInfer is CUDA-only)."""

    splits = 0
    shared_rests = 0  # split steps whose other sequences went through shared-chunk attention
    parted_rests = 0  # split steps whose other sequences mixed decodes with longer ones (decode_split)

    def forward(self, layer, q, k, v, meta):
        if meta.ragged is None:
            return super().forward(layer, q, k, v, meta)
        kv, r = self.kv_layers[layer], meta.ragged
        store_kv_ref(kv, k, v, meta.store_pages, meta.store_slots)
        ragged_part = _torch_ragged(kv, r, self.rope, self.sm_scale)
        if r.q_rows is None:
            return ragged_part(q)
        rest = meta.ragged_rest
        self.splits += layer == 0
        self.shared_rests += layer == 0 and rest.shared is not None
        self.parted_rests += layer == 0 and rest.parts is not None
        return split_prefill_attention(q, r, ragged_part, lambda q_rest: self.attend(layer, q_rest, rest))


@pytest.mark.parametrize("running", ["plain", "rag"])
def test_engine_splits_a_document_prefill_beside_decodes(running):
    """A lazy CPU engine whose runner takes the ragged path (torch references): a request's documents
    computed while other requests decode run as a split step, and every request's greedy tokens,
    logprobs and every step's logits equal the lazy kernels' alone. "rag": three running requests
    over the same documents, so the split step's decodes go through shared-chunk attention."""
    engine = Engine(model="tiny-llama", load_format="dummy", device="cpu", overlap_schedule=False,
                    dtype="float32")  # fmt: skip
    vocab = engine.model_config.vocab_size
    toks = lambda n: [random.randrange(10, vocab) for _ in range(n)]  # noqa: E731
    prefix, question = toks(9), toks(5)
    if running == "plain":  # its decodes: more keys than the docs
        first = [toks(400)]
    else:
        shared = [toks(random.randint(150, 250)) for _ in range(2)]
        first = [RagPrompt(prefix, random.sample(shared, 2), toks(random.randint(3, 9))) for _ in range(3)]
    docs = [toks(random.randint(70, 110)) for _ in range(2)]
    sp = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=0)

    def serve() -> list[tuple[list[int], list[float]]]:
        core, outs = engine.core, {}

        def step() -> None:
            for out in core.step():
                ids, lps = outs.setdefault(out.rid, ([], []))
                ids += out.token_ids
                lps += [lp[0] for lp in out.logprobs]

        reqs = [engine._make_request(p, sp) for p in first]
        for r in reqs:
            core.add(r)
        while sum(len(ids) for ids, _ in outs.values()) < 3 * len(reqs):  # their prefill, two decodes
            step()
        reqs.append(engine._make_request(RagPrompt(prefix, docs, question), sp))
        core.add(reqs[-1])
        while any(r.state is not RequestState.FINISHED for r in reqs):
            step()
        return [outs[r.rid] for r in reqs]

    runner = engine.runner
    logits: list[torch.Tensor] = []  # each step's sampled logits (random weights' tokens move little)
    model_logits = runner.model.logits
    runner.model.logits = lambda hidden: logits.append(model_logits(hidden)) or logits[-1]
    want = serve()
    want_logits, logits[:] = list(logits), []
    assert all(len(ids) == 12 for ids, _ in want)
    engine.flush_cache()
    runner.backend = _TorchRaggedBackend(runner.pool.kv, runner.rope, runner.backend.sm_scale)
    runner.ragged_prefill = True
    got = serve()
    backend = runner.backend
    assert backend.splits >= 1 and runner.ragged_steps >= backend.splits
    assert backend.shared_rests == (backend.splits if running == "rag" else 0)
    for (ids_g, lp_g), (ids_w, lp_w) in zip(got, want):
        assert ids_g == ids_w
        torch.testing.assert_close(torch.tensor(lp_g), torch.tensor(lp_w), rtol=1e-4, atol=1e-4)
    assert len(logits) == len(want_logits)
    for g, w in zip(logits, want_logits):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("ragged", [False, True])
def test_engine_launches_decodes_apart_from_longer_sequences(ragged):
    """A lazy CPU engine whose steps mix running decodes with a long question over cached documents
    (not shared: more than 64 new tokens; not ragged: 4+ keys a new token) and a new document's
    prefill: the decodes go in a launch of their own (decode_split, here at any key count), through
    shared-chunk attention (they share documents); with the ragged path, inside a split step's other
    sequences. Every step's logits equal the lazy kernels' over whole steps."""
    engine = Engine(model="tiny-llama", load_format="dummy", device="cpu", overlap_schedule=False,
                    dtype="float32")  # fmt: skip
    vocab = engine.model_config.vocab_size
    toks = lambda n: [random.randrange(10, vocab) for _ in range(n)]  # noqa: E731
    prefix, shared = toks(9), [toks(random.randint(150, 250)) for _ in range(2)]
    first = [RagPrompt(prefix, random.sample(shared, 2), toks(random.randint(3, 9))) for _ in range(3)]
    later = [RagPrompt(prefix, shared, toks(random.randint(80, 120))),  # cached documents, long question
             RagPrompt(prefix, [toks(random.randint(140, 200))], toks(4))]  # a new document  # fmt: skip
    sp = SamplingParams(max_tokens=8, ignore_eos=True)

    def serve() -> None:
        core = engine.core
        reqs = [engine._make_request(p, sp) for p in first]
        for r in reqs:
            core.add(r)
        for _ in range(4):  # their prefill and some decodes
            core.step()
        reqs += [engine._make_request(p, sp) for p in later]
        for r in reqs[-2:]:
            core.add(r)
        while any(r.state is not RequestState.FINISHED for r in reqs):
            core.step()

    runner = engine.runner
    logits: list[torch.Tensor] = []
    model_logits = runner.model.logits
    runner.model.logits = lambda hidden: logits.append(model_logits(hidden)) or logits[-1]
    runner.split_decode_keys = 1 << 40  # never: whole steps
    serve()
    want, logits[:] = list(logits), []
    assert runner.decode_splits == 0
    engine.flush_cache()
    runner.split_decode_keys = 1
    if ragged:
        runner.backend = _TorchRaggedBackend(runner.pool.kv, runner.rope, runner.backend.sm_scale)
        runner.ragged_prefill = True
    parts, part_meta = [], runner._part_meta

    def record(plan, tables):
        meta = part_meta(plan, tables)
        parts.append((bool((np.diff(tables["qo_indptr"]) == 1).all()), meta.shared is not None))
        return meta

    runner._part_meta = record
    serve()
    assert runner.decode_splits >= 1
    assert engine.cache_stats()["decode_split_steps"] == runner.decode_splits  # reported to the scheduler
    assert (True, True) in parts  # decodes apart, through shared-chunk attention
    if ragged:
        assert runner.backend.splits >= 1 and runner.backend.parted_rests >= 1
    assert len(logits) == len(want)
    for g, w in zip(logits, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_decode_split_tables_cover_the_step():
    """decode_split on random mixed steps: the two parts' rows and sequences partition the step's, each
    part's tables are its sequences' own (the lazy reference over each part, written into its rows,
    equals the whole step's), and a step of one kind, or whose decodes read fewer keys, stays whole."""
    page, kv_heads, head_dim = 4, 2, 8
    seqs = [_other(page) for _ in range(3)] + [_fitting(page) for _ in range(2)]
    seqs += [(runs, 1) for runs, _ in (_other(page) for _ in range(4))]  # decodes
    random.shuffle(seqs)
    kv, meta = _tables(seqs, kv_heads, head_dim, page)
    tables = _tables_of(meta)
    split = decode_split(*tables, min_keys=1)
    assert split is not None
    longer, decodes = split
    n_new = [b - a for a, b in zip(tables[0], tables[0][1:])]
    assert sorted(longer["seqs"].tolist() + decodes["seqs"].tolist()) == list(range(len(seqs)))
    assert all(n_new[i] == 1 for i in decodes["seqs"]) and all(n_new[i] > 1 for i in longer["seqs"])
    assert sorted(longer["rows"].tolist() + decodes["rows"].tolist()) == list(range(int(tables[0][-1])))
    rope = _rope(head_dim, False)
    q = torch.randn(int(tables[0][-1]), kv_heads * 2, head_dim)
    want = lazy_attention_ref(q, kv, meta, rope, head_dim**-0.5)
    got = torch.empty_like(want)
    for part in split:
        m = AttentionMetadata.from_tables(part, torch.device("cpu"))
        got[part["rows"]] = lazy_attention_ref(q[part["rows"]], kv, m, rope, head_dim**-0.5)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    decode_keys = sum(
        int(meta.valid_len[meta.kv_indptr[i] : meta.kv_indptr[i + 1]].sum()) for i in decodes["seqs"]
    )
    assert decode_split(*tables, min_keys=decode_keys) is not None
    assert decode_split(*tables, min_keys=decode_keys + 1) is None
    only_decodes = _tables([(runs, 1) for runs, _ in seqs], kv_heads, head_dim, page)[1]
    assert decode_split(*_tables_of(only_decodes), min_keys=1) is None
    no_decodes = _tables([s for s in seqs if s[1] > 1], kv_heads, head_dim, page)[1]
    assert decode_split(*_tables_of(no_decodes), min_keys=1) is None


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


def test_a_ragged_warm_up_that_fails_keeps_the_lazy_kernels(caplog):
    """FlashInfer's JIT may not build on a user's machine: the worker then keeps lazy prefill on the lazy
    kernels (with a warning) instead of failing to start or failing steps later."""

    class NoJit:
        def warm_up_ragged(self, q_heads: int) -> int:
            raise RuntimeError("ninja: build stopped (no nvcc)")

    engine = Engine(model="tiny-llama", load_format="dummy", device="cpu")
    runner = engine.runner
    backend, runner.backend, runner.ragged_prefill = runner.backend, NoJit(), True
    assert runner.warm_up_ragged(4) == 0 and not runner.ragged_prefill
    assert "no nvcc" in caplog.text and "lazy kernels" in caplog.text
    runner.backend = backend
    out = engine.generate([[5, 6, 7, 8] * 40], SamplingParams(max_tokens=3, ignore_eos=True))[0]
    assert len(out["token_ids"]) == 3 and runner.ragged_steps == 0
