"""Host KV tier on CUDA: pinned host pages, copies queued on the stream without host syncs, and an
engine whose documents come back from the host gives a roomy engine's tokens."""

from __future__ import annotations

import random
import time

import pytest
import torch

from lazyrt import Engine, RagPrompt, SamplingParams
from lazyrt.cache.host_pool import HostKVPool
from lazyrt.cache.page_pool import PagePool

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_copies_are_stream_ordered_without_a_sync():
    dev = PagePool(4, 64, 16, 8, 64, torch.bfloat16, "cuda")
    dev.kv_all.normal_()
    before = dev.kv_all.clone()
    host = HostKVPool(dev, 32)
    assert host.kv.is_pinned()
    src, hpages, back = list(range(10, 30)), list(range(5, 25)), list(range(40, 60))
    host.offload(src, hpages)
    dev.kv_all[:, src] = 0  # queued after the offload: it must have read the pages first
    host.load(hpages, back)
    dev.kv_all[:, hpages] = -1  # device pages that share ids with the host pages: unrelated
    torch.cuda.synchronize()
    assert torch.equal(dev.kv_all[:, back], before[:, src])


def test_copy_bandwidth_report():
    """Not an assertion on speed: prints GB/s of offloads and loads of 8B-shaped pages (2 MiB each)."""
    dev = PagePool(32, 512, 16, 8, 128, torch.bfloat16, "cuda")
    host = HostKVPool(dev, 512)
    pages = list(range(256))
    for name, op in (("offload", host.offload), ("load", host.load)):
        op(pages, pages)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(3):
            op(pages, pages)
        torch.cuda.synchronize()
        gbs = 3 * len(pages) * host.page_bytes / (time.perf_counter() - t) / 1e9
        print(f"host tier {name}: {gbs:.1f} GB/s ({len(pages)} pages of {host.page_bytes >> 20} MiB)")


@pytest.mark.parametrize("overlap", [True, False])
def test_engine_reuses_documents_from_the_host(overlap):
    rng = random.Random()
    kw = dict(load_format="dummy", device="cuda", dtype="float32", overlap_schedule=overlap)
    roomy = Engine("smollm2-135m", kv_cache_tokens=8192, **kw)
    tight = Engine("smollm2-135m", kv_cache_tokens=16 * 14, host_kv_cache_tokens=16 * 64, **kw)
    vocab = roomy.model_config.vocab_size
    ids = lambda n: [rng.randrange(100, vocab) for _ in range(n)]  # noqa: E731
    prefix, docs = ids(20), [ids(rng.randint(30, 45)) for _ in range(6)]
    groups = [docs[:3], docs[3:]]  # take turns: each evicts the other's documents
    prompts = [RagPrompt(prefix, rng.sample(groups[r % 2], 3), ids(4)) for r in range(8)]
    sp = SamplingParams(max_tokens=8, ignore_eos=True)
    for p in prompts:  # one at a time: the same steps on both engines
        assert tight.generate(p, sp)[0]["token_ids"] == roomy.generate(p, sp)[0]["token_ids"]
    s = tight.cache_stats()
    assert s["chunk_host_hits"] > 0 and s["chunk_offloads"] > 0 and s["held_pages"] == 0
    tight.flush_cache()
    assert tight.pool.num_free == tight.pool.num_pages and tight.scheduler.chunks.num_host_pages == 0


@pytest.mark.parametrize("overlap", [True, False])
def test_retrieval_attention_exact_on_cuda(overlap):
    """Retrieval attention through the Triton shared-chunk kernel and merge: documents pushed to the
    host tier and attended there with top-k covering every key give a roomy engine's tokens."""
    rng = random.Random()
    kw = dict(load_format="dummy", device="cuda", dtype="float32", overlap_schedule=overlap)
    roomy = Engine("smollm2-135m", kv_cache_tokens=8192, **kw)
    tight = Engine("smollm2-135m", kv_cache_tokens=16 * 14, host_kv_cache_tokens=16 * 64,
                   retrieval_attention=True, retrieval_top_k=10**6, max_running_requests=1, **kw)  # fmt: skip
    vocab = roomy.model_config.vocab_size
    ids = lambda n: [rng.randrange(100, vocab) for _ in range(n)]  # noqa: E731
    prefix, docs = ids(20), [ids(rng.randint(30, 44)) for _ in range(6)]
    prompts = [RagPrompt(prefix, docs[:3], ids(4)), RagPrompt(prefix, docs[3:], ids(4))]
    prompts += [RagPrompt(prefix, rng.sample(docs, 6), ids(5)) for _ in range(2)]
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    for p in prompts:
        assert tight.generate(p, sp)[0]["token_ids"] == roomy.generate(p, sp)[0]["token_ids"]
    s = tight.cache_stats()
    assert s["chunk_host_attended"] >= 2 and s["held_pages"] == 0 and tight.runner.retrieval_steps > 0
    assert tight.runner.host_indexes.fill_graphs.replays > 0  # decode steps replayed the fill's graphs


def _approximate_engine(dtype: str, build_threads: int):
    """A CUDA engine whose device holds a few documents, retrieving top-8 keys from the rest; a token
    maker, a prefix and six documents of 60-90 tokens."""
    rng = random.Random()
    tight = Engine("smollm2-135m", load_format="dummy", device="cuda", dtype=dtype,
                   kv_cache_tokens=16 * 14, host_kv_cache_tokens=16 * 64, retrieval_attention=True,
                   retrieval_top_k=8, retrieval_sink=4, retrieval_build_threads=build_threads,
                   max_running_requests=1)  # fmt: skip
    vocab = tight.model_config.vocab_size
    ids = lambda n: [rng.randrange(100, vocab) for _ in range(n)]  # noqa: E731
    return tight, ids, ids(20), [ids(rng.randint(60, 90)) for _ in range(6)]


def test_retrieval_index_builds_cluster_on_cuda(monkeypatch):
    """A CUDA engine's host-chunk index builds run their k-means on the GPU (RetrievalOptions.build_device)
    and the search path then answers (approximate: top-k below the chunk's keys)."""
    import lazyrt.retrieval.key_index as key_index

    devices, kmeans = [], key_index.kmeans

    def spy(x, *a, **kw):
        devices.append(x.device.type)
        return kmeans(x, *a, **kw)

    monkeypatch.setattr(key_index, "kmeans", spy)
    tight, ids, prefix, docs = _approximate_engine("float32", build_threads=0)
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    prompts = [RagPrompt(prefix, docs[:3], ids(4)), RagPrompt(prefix, docs[3:], ids(4))]
    for p in prompts + [RagPrompt(prefix, docs, ids(5))]:
        assert len(tight.generate(p, sp)[0]["token_ids"]) == 4
    assert tight.runner.host_indexes.builds > 0 and devices and set(devices) == {"cuda"}
    assert tight.cache_stats()["held_pages"] == 0


def test_background_builds_put_index_data_on_the_device():
    """retrieval_build_threads=1 on CUDA: a builder thread copies each new index's data to the device
    (IndexEntry.on_device) and its turned keys into the pinned key tables, where the device fill reads
    them: equal to the entry's own, and the engine answers through them."""
    rng = random.Random()
    tight, ids, prefix, docs = _approximate_engine("bfloat16", build_threads=1)
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    for p in [RagPrompt(prefix, docs[:3], ids(4)), RagPrompt(prefix, docs[3:], ids(4))]:
        tight.generate(p, sp)
    cache = tight.runner.host_indexes
    assert cache.wait(60) and cache.builds > 0 and cache.key_tables.is_pinned()
    for p in [RagPrompt(prefix, docs, ids(5)), RagPrompt(prefix, rng.sample(docs, 6), ids(5))]:
        assert len(tight.generate(p, sp)[0]["token_ids"]) == 4
    dev = str(tight.runner.device)
    for (pages, n, layer, _), entry in cache._indexes.items():
        cent, sizes, starts, slot_of = entry._on_device[dev]
        assert cent.dtype == torch.bfloat16 and torch.equal(cent.cpu().float(), entry.index.centroids)
        assert torch.equal(slot_of.cpu(), entry.slot_of) and torch.equal(sizes.cpu(), entry.sizes)
        assert torch.equal(starts.cpu(), entry.starts)
        kvh, _, d = entry.table.shape
        laid = cache.key_tables[list(pages), layer].transpose(0, 1).reshape(kvh, -1, d)[:, :n]
        assert torch.equal(laid, entry.table)
    assert tight.cache_stats()["chunk_host_attended"] > 0 and tight.cache_stats()["held_pages"] == 0


def test_device_view_reads_pinned_host_memory_in_place():
    """device_view: a pinned host tensor as a CUDA tensor without a copy (writes on the host are seen)."""
    from lazyrt.retrieval.device_fill import device_view

    host = torch.randn(64, 8, dtype=torch.float32).to(torch.bfloat16).pin_memory()
    view = device_view(host, torch.device("cuda"))
    assert view.is_cuda and view.dtype == host.dtype and view.shape == host.shape
    idx = torch.randperm(64, device="cuda")[:20]
    assert torch.equal(view.index_select(0, idx).cpu(), host[idx.cpu()])
    host[3] = 7.0
    torch.cuda.synchronize()
    assert torch.equal(view[3].cpu(), host[3])
    with pytest.raises(ValueError, match="pinned"):
        device_view(torch.randn(4), torch.device("cuda"))


@pytest.mark.parametrize("exact", [False, True])
def test_device_fill_on_cuda_equals_the_cpu_fill(exact):
    """HostAttention.fill with q on CUDA (DeviceFill over the pinned host tier) vs the CPU fill."""
    from lazyrt.kernels.rope import RopeCache
    from lazyrt.retrieval.host_attention import HostAttention, HostIndexCache, HostPart, RetrievalOptions

    class _Rope:
        rope_theta, rope_scaling, rotary_dim = 500000.0, None, 64

    rng = random.Random()
    ps, layers, kvh, group, d = 16, 2, 2, 4, 64
    rope = RopeCache.build(_Rope(), 4096)
    host_kv = torch.randn(300, layers, 2, ps, kvh, d).pin_memory()
    free = rng.sample(range(300), 300)
    parts, row = [], 0
    for _ in range(6):
        n, m = rng.randint(300, 400), rng.choice([1, 1, 3])
        pages = tuple(free.pop() for _ in range(-(-n // ps)))
        parts.append(HostPart(range(row, row + m), pages, n, rng.randint(n, 3000), row))
        row += m
    opts = RetrievalOptions(top_k=10**6 if exact else 16, sink=4, scan=0.05, exact_prefill=False)
    cache = HostIndexCache()
    rope_cuda = rope.to("cuda")
    for step in range(4):  # the same parts each step (decode): the third and fourth replay CUDA graphs
        q = torch.randn(row, kvh * group, d)
        ha = HostAttention(parts, host_kv, rope, d**-0.5, opts, cache, device_rope=rope_cuda)
        for layer in range(layers):
            want_o, want_l = torch.zeros(row, kvh * group, d), torch.zeros(row, kvh * group)
            HostAttention(parts, host_kv, rope, d**-0.5, opts, cache).fill(layer, q, want_o, want_l)
            o = torch.zeros(row, kvh * group, d, device="cuda")
            lse = torch.zeros(row, kvh * group, device="cuda")
            ha.fill(layer, q.cuda(), o, lse)
            same = torch.isclose(o.cpu(), want_o, atol=1e-4, rtol=1e-4).all(-1)
            same &= torch.isclose(lse.cpu(), want_l, atol=1e-4, rtol=1e-4)
            bad = int((~same).sum())
            assert bad == 0, f"step {step}: {bad} of {same.numel()} differ"
    graphs = cache.fill_graphs
    assert graphs.captures == layers and graphs.replays == 2 * layers



def test_pool_sized_from_free_memory_leaves_room_for_the_index_data(monkeypatch):
    """No kv_cache_tokens on CUDA: with retrieval attention the KV pool is smaller than without it by
    reserved_device_bytes (what the device fill's index data, stacks and buffers can take); the free
    memory each engine sees is pinned to one figure, so the two pools differ by that alone."""
    from lazyrt.cache.page_pool import PagePool
    from lazyrt.retrieval.device_fill import reserved_device_bytes

    free = 32 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 80 << 30))
    kw = dict(load_format="dummy", device="cuda", dtype="bfloat16", host_kv_cache_tokens=16 * 4096,
              kv_cache_memory_fraction=0.3)  # fmt: skip
    pages = Engine("smollm2-135m", **kw).pool.num_pages
    eng = Engine("smollm2-135m", retrieval_attention=True, **kw)
    c = eng.model_config
    per_page = PagePool.bytes_per_page(c.num_layers, 16, c.num_kv_heads, c.head_dim, torch.bfloat16)
    reserve = reserved_device_bytes(16 * 4096, c.num_layers, c.num_kv_heads, c.head_dim)
    assert pages == int(free * 0.3) // per_page
    assert eng.pool.num_pages == (int(free * 0.3) - reserve) // per_page
    with pytest.raises(ValueError, match="host_kv_cache_tokens"):  # an index larger than half the budget
        Engine("smollm2-135m", retrieval_attention=True, **{**kw, "host_kv_cache_tokens": 16 * 200_000})
