"""Retrieval attention in the engine (issue 15): a request whose documents do not all fit the device
pool is admitted, the chunks found only in the host tier are attended where they lie (sink + top-k
keys per chunk, merged by log-sum-exp with the device part), and with top-k covering every key the
tokens equal a roomy engine's (full lazy attention). No page leaks in either tier; bad options named."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from lazyrt import Engine, RagPrompt, SamplingParams
from lazyrt.config import EngineConfig
from lazyrt.kernels.attention_ref import lazy_attention_ref
from lazyrt.kernels.metadata import AttentionMetadata
from lazyrt.kernels.rope import RopeCache, apply_rope_ref
from lazyrt.kernels.shared_chunk import (
    SharedChunkMeta,
    build_arrays,
    group_segments,
    merge_parts_ref,
    shared_chunk_attention_torch,
)
from lazyrt.retrieval.host_attention import (
    HostAttention,
    HostIndexCache,
    HostPart,
    RetrievalOptions,
    add_host_pairs,
)

VOCAB = 49152


def ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, VOCAB) for _ in range(n)]


class _Rope:
    rope_theta, rope_scaling, rotary_dim = 10000.0, None, 16


# ---- the math: host parts + device parts merged = attention over everything ----------------------
def test_host_parts_merge_to_full_attention():
    """Query rows over some runs of device pages and some of host pages: shared-chunk parts for the
    device runs, HostAttention (exact: top-k covers every key) for the host runs, merged, equal
    lazy_attention_ref over the same keys all on the device (fresh random keys, GQA 2)."""
    g = torch.Generator().manual_seed(random.randrange(1 << 30))
    ps, kvh, qh, d, layers = 4, 2, 4, 16, 2
    rope = RopeCache.build(_Rope(), 256)
    dev = torch.randn(layers, 24, 2, ps, kvh, d, generator=g)

    class Host:  # HostKVPool's layout: [pages, layers, 2, page_size, kv_heads, head_dim]
        kv = torch.randn(10, layers, 2, ps, kvh, d, generator=g)

    # two sequences: device run, host run, device run (own tokens last); the host runs differ
    runs = [
        [("dev", [0, 1, 2], 10, 0), ("host", [3, 4, 5], 11, 10), ("dev", [6, 7], 6, 21)],
        [("host", [3, 4, 5], 11, 0), ("dev", [0, 1, 2], 10, 11), ("host", [8], 3, 21), ("dev", [9], 2, 24)],
    ]
    q_rows = [(20, 26), (24, 25)]  # (first position of its queries, one past the last)
    T = sum(b - a for a, b in q_rows)
    q = torch.randn(T, qh, d, generator=g)
    positions = torch.cat([torch.arange(a, b) for a, b in q_rows])
    qr = apply_rope_ref(q, positions, rope)
    qo = np.cumsum([0] + [b - a for a, b in q_rows])
    for layer in range(layers):
        # the reference: host pages copied into device pages 12.., one page table per sequence
        kv = dev[layer].clone()
        entries, bases, valid, indptr = [], [], [], [0]
        for seq in runs:
            for kind, pages, n, start in seq:
                for i, p in enumerate(pages):
                    if kind == "host":
                        kv[12 + p] = Host.kv[p, layer]
                    entries.append(12 + p if kind == "host" else p)
                    bases.append(start + i * ps)
                    valid.append(min(ps, n - i * ps))
            indptr.append(len(entries))
        i32 = torch.int32
        meta = AttentionMetadata(
            qo_indptr=torch.tensor(qo, dtype=i32), positions=positions,
            kv_indptr=torch.tensor(indptr, dtype=i32), kv_indices=torch.tensor(entries, dtype=i32),
            pos_base=torch.tensor(bases, dtype=i32), valid_len=torch.tensor(valid, dtype=i32),
            store_pages=torch.zeros(T, dtype=torch.long), store_slots=torch.zeros(T, dtype=torch.long),
            rotate_keys=True,
        )  # fmt: skip
        want = lazy_attention_ref(qr, kv, meta, rope, d**-0.5)
        seqs = [
            (range(qo[i], qo[i + 1]), [(p, n, s) for kind, p, n, s in seq if kind == "dev"])
            for i, seq in enumerate(runs)
        ]
        segments, _, _ = group_segments(seqs, ps, 8)
        arrays = build_arrays(segments, ps, T, 4)
        parts = [
            HostPart(range(qo[i], qo[i + 1]), tuple(p), n, s)
            for i, seq in enumerate(runs)
            for kind, p, n, s in seq
            if kind == "host"
        ]
        add_host_pairs(arrays, parts)
        sh = SharedChunkMeta.from_arrays(arrays, 4, "cpu")
        o, lse = shared_chunk_attention_torch(qr, dev[layer], positions, sh, rope, d**-0.5)
        exact = RetrievalOptions(10**6, 2, 0.05)
        host = HostAttention(parts, Host.kv, rope, d**-0.5, exact, HostIndexCache())
        host.fill(layer, qr, o, lse)
        got = merge_parts_ref(o, lse, sh)
        torch.testing.assert_close(got, want.float(), atol=1e-5, rtol=1e-5)


# ---- the engine -----------------------------------------------------------------------------------
def _workload(rng: random.Random):
    """Three documents computed, three more that push them to the host, then requests over all six
    (more than the device pool holds), in shuffled order."""
    prefix, docs = ids(rng, 20), [ids(rng, rng.randint(30, 44)) for _ in range(6)]
    warm = [RagPrompt(prefix, docs[:3], ids(rng, 4)), RagPrompt(prefix, docs[3:], ids(rng, 4))]
    big = [RagPrompt(prefix, rng.sample(docs, 6), ids(rng, 5)) for _ in range(2)]
    return warm, big


def _tight(path: str, top_k: int, **kw) -> Engine:
    # prefix 2 pages + 3 docs of <= 3 pages + own 1-2 pages: the device holds one warm request, not six docs
    return Engine(
        path, device="cpu", kv_cache_tokens=16 * 14, host_kv_cache_tokens=16 * 40, retrieval_attention=True,
        retrieval_top_k=top_k, retrieval_sink=4, max_running_requests=1, **kw,
    )  # fmt: skip


def _run(eng: Engine, prompts: list, sp: SamplingParams) -> list[dict]:
    return [eng.generate(p, sp)[0] for p in prompts]  # one at a time: the same steps everywhere


@pytest.mark.parametrize("overlap", [True, False])
def test_exact_when_top_k_covers_every_key(overlap, tiny_model_dir):
    path = tiny_model_dir("llama")
    warm, big = _workload(random.Random())
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    roomy = Engine(path, device="cpu", kv_cache_tokens=8192)
    want = [o["token_ids"] for o in _run(roomy, warm + big, sp)]
    eng = _tight(path, 10**6, overlap_schedule=overlap)
    outs = _run(eng, warm + big, sp)
    assert [o["token_ids"] for o in outs] == want
    # the warm documents went to the host; the device has room for some of them at most
    attended = [o["meta"].get("host_attended_chunks", 0) for o in outs]
    assert attended[:2] == [0, 0] and all(a >= 1 for a in attended[2:])
    assert all(o["meta"]["chunk_hits"] == 6 for o in outs[2:])
    s = eng.cache_stats()
    assert s["chunk_host_attended"] == sum(attended) and s["held_pages"] == 0
    assert eng.runner.retrieval_steps >= 2 * 6 and eng.runner.host_indexes.builds == 0  # exact: no index
    eng.flush_cache()
    host = eng.scheduler.chunks.host_pool
    assert eng.pool.num_free == eng.pool.num_pages and host.num_free == host.num_pages


def test_top_k_retrieval_builds_each_index_once(tiny_model_dir):
    """top-k below the chunk's keys: the engine builds an index per (host segment, layer) and reuses
    it across steps and requests; the requests run to the end and leave no pages held. (Builds in
    the step: retrieval_build_threads=0.)"""
    path = tiny_model_dir("llama")
    warm, big = _workload(random.Random())
    sp = SamplingParams(max_tokens=3, ignore_eos=True)
    eng = _tight(path, 8, retrieval_build_threads=0)
    outs = _run(eng, warm + big, sp)
    assert all(len(o["token_ids"]) == 3 for o in outs)
    layers = eng.model_config.num_layers
    s = eng.cache_stats()
    # each host chunk gets one index per layer, built once and reused by the later steps/requests
    assert 0 < eng.runner.host_indexes.builds <= 3 * layers
    assert eng.runner.retrieval_steps >= 2 * 3 and s["chunk_host_attended"] >= 2 and s["held_pages"] == 0


def test_background_index_builds_serve_every_request(tiny_model_dir):
    """The default retrieval_build_threads=1: steps attend a chunk exactly until its index is built
    off the step; the requests run to the end, the indexes get built (each once) and no page is held."""
    path = tiny_model_dir("llama")
    warm, big = _workload(random.Random())
    eng = _tight(path, 8)
    assert eng.config.retrieval_build_threads == 1
    outs = _run(eng, warm + big, SamplingParams(max_tokens=3, ignore_eos=True))
    assert all(len(o["token_ids"]) == 3 for o in outs)
    assert eng.runner.host_indexes.wait(60)
    # each chunk that went to the host is indexed once per layer: as it left (or at first use)
    s = eng.cache_stats()
    assert 0 < eng.runner.host_indexes.builds <= s["chunk_offloads"] * eng.model_config.num_layers
    assert s["held_pages"] == 0


def test_chunks_are_indexed_as_they_leave_the_device(tiny_model_dir):
    """With builder threads, a chunk offloaded to the host tier is indexed right away from its device
    pages (every layer, one k-means over several layers' heads): the indexes exist before any request
    attends the chunk on the host, and the requests that then search them get the tokens of an engine
    that builds each index in the step from the host copy."""
    path = tiny_model_dir("llama")
    rng = random.Random()
    warm, big = _workload(rng)
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    eng, in_step = _tight(path, 8, retrieval_build_threads=2), _tight(path, 8, retrieval_build_threads=0)
    layers = eng.model_config.num_layers
    got = _run(eng, warm, sp)
    indexes = eng.runner.host_indexes
    assert indexes.wait(60)
    s = eng.cache_stats()
    assert s["chunk_offloads"] >= 1 and s["chunk_host_attended"] == 0  # no request has searched yet
    assert indexes.builds == s["chunk_offloads"] * layers  # (every warm document has > 8 + 4 keys)
    for p in big:
        got += _run(eng, [p], sp)
        assert indexes.wait(60)
    assert eng.cache_stats()["chunk_host_attended"] >= 2
    assert [o["token_ids"] for o in got] == [o["token_ids"] for o in _run(in_step, warm + big, sp)]


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(retrieval_attention=True, host_kv_cache_tokens=0), "host_kv_cache_tokens"),
        (dict(retrieval_attention=True, host_kv_cache_tokens=64, cache_mode="block"), "cache_mode lazy"),
        (dict(retrieval_top_k=0), "retrieval_top_k"),
        (dict(retrieval_sink=-1), "retrieval_sink"),
        (dict(retrieval_scan=0.0), "retrieval_scan"),
        (dict(retrieval_scan=1.5), "retrieval_scan"),
        (dict(retrieval_build_threads=-1), "retrieval_build_threads"),
        (dict(retrieval_build_threads=1.5), "retrieval_build_threads"),
        (dict(retrieval_share_lists="yes"), "retrieval_share_lists"),
        (dict(retrieval_exact_prefill=1), "retrieval_exact_prefill"),
        (dict(retrieval_attention=True, host_kv_cache_tokens=64, doc_attention_temperature=2.0),
         "doc_attention"),  # fmt: skip
    ],
)
def test_bad_retrieval_options_name_the_option(kw, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kw).validate()


def test_retrieval_flags_reach_the_config(capsys):
    from lazyrt.launch import build_parser

    args = build_parser().parse_args(
        ["--retrieval-attention", "--retrieval-top-k", "64", "--retrieval-sink", "8",
         "--retrieval-scan", "0.1", "--retrieval-build-threads", "0", "--no-retrieval-share-lists",
         "--no-retrieval-exact-prefill"]  # fmt: skip
    )
    got = (args.retrieval_attention, args.retrieval_top_k, args.retrieval_sink, args.retrieval_scan,
           args.retrieval_build_threads, args.retrieval_share_lists,
           args.retrieval_exact_prefill)  # fmt: skip
    assert got == (True, 64, 8, 0.1, 0, False, False)
    defaults = build_parser().parse_args([])
    assert defaults.retrieval_share_lists is True and defaults.retrieval_exact_prefill is True


def test_share_lists_and_exact_prefill_reach_the_worker(monkeypatch, tiny_model_dir):
    """--no-retrieval-share-lists / --no-retrieval-exact-prefill reach EngineConfig (launch) and the worker's
    RetrievalOptions."""
    import lazyrt.launch

    seen = []
    monkeypatch.setattr(lazyrt.launch, "serve", lambda cfg, opts: seen.append(cfg) or 0)
    monkeypatch.setattr(lazyrt.launch, "check_devices", lambda cfg: None)
    argv = ["--device", "cpu", "--retrieval-attention", "--host-kv-cache-tokens", "1024",
            "--no-retrieval-share-lists", "--no-retrieval-exact-prefill"]  # fmt: skip
    assert lazyrt.launch.main(argv) == 0
    assert seen[0].retrieval_share_lists is False and seen[0].retrieval_exact_prefill is False
    eng = _tight(tiny_model_dir("llama"), 8, retrieval_share_lists=False, retrieval_exact_prefill=False)
    assert eng.runner.retrieval.share_lists is False and eng.runner.retrieval.exact_prefill is False
    assert _tight(tiny_model_dir("llama"), 8).runner.retrieval.share_lists is True  # the default


def test_per_request_top_k(tiny_model_dir):
    """A request's retrieval_top_k overrides the engine's: covering every key gives full attention's
    tokens on an engine whose own top-k is 2; a server without retrieval refuses the field by name."""
    path = tiny_model_dir("llama")
    warm, big = _workload(random.Random())
    exact = SamplingParams(max_tokens=6, ignore_eos=True, retrieval_top_k=10**6)
    want = [o["token_ids"] for o in _run(Engine(path, device="cpu", kv_cache_tokens=8192), warm + big,
                                         SamplingParams(max_tokens=6, ignore_eos=True))]  # fmt: skip
    eng = _tight(path, 2)
    got = _run(eng, warm + big, exact)
    assert [o["token_ids"] for o in got] == want
    s = eng.cache_stats()
    assert s["chunk_host_attended"] >= 2 and eng.runner.host_indexes.wait(60)
    # the only indexes are those built as chunks left the device (for the engine's top-k): the
    # exact requests never asked for one
    assert eng.runner.host_indexes.builds == s["chunk_offloads"] * eng.model_config.num_layers
    with pytest.raises(ValueError, match="retrieval_top_k"):
        SamplingParams(retrieval_top_k=0)
    from lazyrt.runtime.scheduler.scheduler import RequestRejected

    plain = Engine(path, device="cpu", kv_cache_tokens=1024)
    with pytest.raises(RequestRejected, match="retrieval_top_k") as e:
        plain.generate(big[0], exact)
    assert e.value.param == "sampling_params.retrieval_top_k"


def test_http_retrieval_top_k_is_parsed_and_checked():
    from lazyrt.runtime.server.protocol import ApiError, parse_completion

    body = {"prompt": "hi", "documents": ["a doc"], "retrieval_top_k": 32}
    assert parse_completion(body, "m").req.sampling.retrieval_top_k == 32
    with pytest.raises(ApiError, match="retrieval_top_k"):
        parse_completion({**body, "retrieval_top_k": 0}, "m")


def test_reserved_device_bytes_cover_the_index_data_the_device_fill_holds():
    """reserved_device_bytes (what a CUDA pool sized from free memory leaves for retrieval attention)
    counts each indexed key's share of the index data that IndexEntry.on_device copies to the device:
    at least what a real index of a host chunk holds, and not much more."""
    from lazyrt.retrieval.device_fill import DEVICE_STACK_BYTES, DEVICE_WORK_ELEMENTS, reserved_device_bytes
    from lazyrt.retrieval.host_attention import IndexEntry
    from lazyrt.retrieval.key_index import build_key_index

    n, kvh, d = random.randint(600, 900), 2, 32
    keys = torch.randn(n, kvh, d)
    entry = IndexEntry(build_key_index(keys, sink=4), keys)
    held = sum(t.numel() * t.element_size() for t in entry.on_device("cpu"))
    fixed = 4 * DEVICE_WORK_ELEMENTS * 4
    index = (reserved_device_bytes(n, 1, kvh, d) - fixed) // 2  # the index data + its stacks (a copy)
    assert index < DEVICE_STACK_BYTES
    assert held <= index <= 1.2 * held


def test_retrieval_reserve_leaves_room_or_names_the_option():
    """The worker's KV budget from free memory minus the device fill's reservation: none without
    retrieval attention; a clear error naming host_kv_cache_tokens when it would take half the budget."""
    from types import SimpleNamespace

    from lazyrt.retrieval.device_fill import reserved_device_bytes
    from lazyrt.runtime.worker.model_worker import ModelWorker

    c = SimpleNamespace(num_layers=4, num_kv_heads=2, head_dim=64)  # a ModelConfig's fields it reads
    off = SimpleNamespace(config=EngineConfig(host_kv_cache_tokens=4096))
    assert ModelWorker._retrieval_reserve(off, c, 1 << 30) == 0
    on = SimpleNamespace(config=EngineConfig(host_kv_cache_tokens=4096, retrieval_attention=True))
    want = reserved_device_bytes(4096, 4, 2, 64)
    assert ModelWorker._retrieval_reserve(on, c, 4 * want) == want
    with pytest.raises(ValueError, match="host_kv_cache_tokens=4096"):
        ModelWorker._retrieval_reserve(on, c, 2 * want - 1)
