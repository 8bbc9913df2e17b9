"""Host KV tier (host_kv_cache_tokens): chunks evicted from the device pool move to host memory and
come back by copy, not recompute. Outputs equal a roomy engine's, no page leaks in either pool,
failed steps leave no chunk resident where its copy did not happen, bad option values are named."""

from __future__ import annotations

import random

import pytest
import torch

from lazyrt import Engine, RagPrompt, SamplingParams
from lazyrt.cache.chunk_table import ChunkTable, Transfer
from lazyrt.cache.host_pool import HostKVPool
from lazyrt.cache.page_pool import PagePool
from lazyrt.runtime.scheduler.plan import StepPlan

VOCAB = 49152
SP = SamplingParams(max_tokens=4, ignore_eos=True)


def ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, VOCAB) for _ in range(n)]


# ---- the bytes: HostKVPool and the runner's copy ops ---------------------------------------------
def test_host_pool_round_trip_in_groups(monkeypatch):
    import lazyrt.cache.host_pool as hp

    dev = PagePool(3, 12, 4, 2, 8, torch.float32)
    dev.kv_all.normal_()
    before = dev.kv_all.clone()
    monkeypatch.setattr(hp, "_GROUP_BYTES", 2 * 3 * 2 * 4 * 2 * 8 * 4)  # two pages a group
    host = HostKVPool(dev, 7)
    src, hdst = [9, 2, 3, 4, 11], [5, 0, 1, 2, 6]  # runs and gaps on both sides
    host.offload(src, hdst)
    back = [7, 8, 0, 10, 1]
    host.load(hdst, back)
    for s, d in zip(src, back):
        assert torch.equal(dev.kv_all[:, d], before[:, s])
    with pytest.raises(ValueError, match="out of range"):
        host.offload([0], [7])


def test_runner_runs_offloads_then_loads_before_the_step(tiny_model_dir):
    eng = Engine(tiny_model_dir("llama"), device="cpu", kv_cache_tokens=16 * 16, host_kv_cache_tokens=16 * 8)
    assert eng.worker.ready_info().host_pages == 8
    kv = eng.pool.kv_all
    kv.normal_()
    before = kv.clone()
    # One step: device pages 3, 4 go to host pages 6, 7; host pages 6, 7 come back into 4, 9 (page 4
    # is both read by the offload and written by the load: the offload must run first).
    plan = StepPlan(offloads=[Transfer(None, [3, 4], [6, 7])], loads=[Transfer(None, [6, 7], [4, 9])])
    eng.runner.run_copies(plan)
    assert torch.equal(kv[:, 4], before[:, 3]) and torch.equal(kv[:, 9], before[:, 4])
    assert torch.equal(kv[:, 5], before[:, 5])


# ---- the bookkeeping: ChunkTable with a host tier -------------------------------------------------
def _table(host_pages: int, policy: str = "lru") -> ChunkTable:
    host = PagePool(1, host_pages, 4, 1, 1, torch.float32, "meta")
    return ChunkTable("m", 4, policy, host_pool=host)


def _ready(t: ChunkTable, tok: int, pages: list[int]):
    c = t.insert((), [tok] * (4 * len(pages)), pages)
    c.ready = True
    return c


def test_table_moves_chunks_between_tiers():
    t = _table(4)
    a, b, c = _ready(t, 1, [0, 1]), _ready(t, 2, [2, 3]), _ready(t, 3, [4])
    assert sorted(t.evict(3)) == [0, 1, 2, 3]  # a, b (oldest first) move to the host
    assert len(t) == 3 and a.pages == [] and b.pages == [] and a.host_pages and b.host_pages
    assert t.num_host_pages == 4
    offloads, loads = t.take_transfers()
    assert [(x.chunk, x.src) for x in offloads] == [(a, [0, 1]), (b, [2, 3])] and loads == []
    assert t.lookup((), [1] * 8) is a and t.stats.host_hits == 1 and t.stats.device_hits == 0
    t.load(a, [7, 8])
    assert a.ready and a.loading
    # the host is full: c's offload may only drop b (lower priority, not loading); a's copy stays
    assert t.evict(1) == [4]
    assert b not in list(t) and c.host_pages and a.host_pages and t.stats.host_evictions == 1
    offloads, loads = t.take_transfers()
    assert [x.chunk for x in offloads] == [c] and [(x.chunk, x.src, x.dst) for x in loads] == [
        (a, a.host_pages, [7, 8])
    ]
    assert not a.loading
    # a now has both copies: a device eviction needs no copy
    assert sorted(t.evict(2)) == [7, 8] and t.take_transfers() == ([], [])
    # a failed step's copies are forgotten: c's host copy (its only one) takes c out of the table
    t.drop_unfinished(offloads, [])
    assert c not in list(t) and a in list(t)
    assert sorted(t.clear_unreferenced()) == [] and len(t) == 0 and t.num_host_pages == 0


def test_a_chunk_larger_than_the_host_tier_is_dropped():
    t = _table(2)
    a = _ready(t, 1, [0, 1, 2])
    assert sorted(t.evict(1)) == [0, 1, 2] and a not in list(t)
    assert t.take_transfers() == ([], []) and t.stats.offloads == 0


# ---- end to end -----------------------------------------------------------------------------------
def _workload(rng: random.Random, rounds: int = 8):
    """Batches of RAG prompts over 6 documents in two groups that take turns (so each round evicts
    the last round's documents and reuses those of the round before), in a fresh order each time,
    sometimes with a second prompt over any of them."""
    prefix = ids(rng, 20)
    docs = [ids(rng, rng.randint(30, 45)) for _ in range(6)]
    batches = []
    for r in range(rounds):
        group = docs[:3] if r % 2 == 0 else docs[3:]
        batch = [RagPrompt(prefix, rng.sample(group, 3), ids(rng, rng.randint(2, 6)))]
        if rng.random() < 0.5:
            batch.append(RagPrompt(prefix, rng.sample(docs, rng.randint(2, 3)), ids(rng, rng.randint(2, 6))))
        batches.append(batch)
    return batches


def _run(engine: Engine, batches) -> list[list[int]]:
    return [o["token_ids"] for b in batches for o in engine.generate(b, SP)]


def _lookups(batches) -> int:
    """Chunk uses: the prefix and each distinct document of every request."""
    return sum(1 + len({tuple(d) for d in p.docs}) for b in batches for p in b)


def _check_consistent(engine: Engine) -> dict:
    s = engine.cache_stats()
    chunks = list(engine.scheduler.chunks)
    assert s["held_pages"] == 0
    assert s["free_pages"] + s["chunk_pages"] + s["radix_pages"] == s["total_pages"]
    assert s["host_chunk_pages"] == sum(len(c.host_pages) for c in chunks)
    assert s["host_free_pages"] + s["host_chunk_pages"] == s["host_total_pages"]
    assert s["chunk_device_hits"] + s["chunk_host_hits"] == s["chunk_hits"]
    assert s["chunk_loads"] == s["chunk_host_hits"]  # every host hit is copied back, once
    page = engine.worker.ready_info().page_bytes
    assert s["host_load_bytes"] == page * engine.scheduler.chunks.stats.load_pages
    assert all(c.pages or c.host_pages for c in chunks)
    return s


def _tight(path: str, host_tokens: int, overlap: bool, mode: str = "lazy") -> Engine:
    # a request needs prefix 2 + 3 docs of <= 3 pages + 1 own page: 12 of 14 pages, so documents of
    # the previous batch are evicted all the time
    return Engine(
        path, device="cpu", cache_mode=mode, kv_cache_tokens=16 * (14 if mode == "lazy" else 23),
        host_kv_cache_tokens=host_tokens, max_running_requests=2, overlap_schedule=overlap,
    )


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("mode", ["lazy", "block"])
def test_evicted_documents_come_back_from_the_host(mode, overlap, tiny_model_dir):
    path = tiny_model_dir("llama")
    batches = _workload(random.Random())
    want = _run(Engine(path, device="cpu", cache_mode=mode, kv_cache_tokens=8192), batches)
    with_host = _tight(path, 16 * 64, overlap, mode)
    with_host.worker.host_kv.kv.normal_(0, 50)  # a chunk loaded without its offload would show
    assert _run(with_host, batches) == want
    s = _check_consistent(with_host)
    assert s["chunk_hits"] + s["chunk_misses"] == _lookups(batches)
    assert s["chunk_evictions"] > 0 and s["chunk_host_hits"] > 0 and s["chunk_host_evictions"] == 0
    assert s["host_offload_bytes"] > 0 and s["host_load_bytes"] > 0
    without = _tight(path, 0, overlap, mode)
    assert _run(without, batches) == want
    off = without.cache_stats()
    assert s["chunk_misses"] < off["chunk_misses"] and off["chunk_host_hits"] == 0
    with_host.flush_cache()
    assert with_host.pool.num_free == with_host.pool.num_pages
    host = with_host.scheduler.chunks.host_pool
    assert host.num_free == host.num_pages and len(with_host.scheduler.chunks) == 0


@pytest.mark.parametrize("overlap", [True, False])
def test_a_small_host_tier_evicts_and_stays_consistent(overlap, tiny_model_dir):
    """Outputs and accounting stay right with a host tier of one or two documents. A random workload
    rarely leaves one document in the host tier that outranks every later one (nothing is evicted
    from it: seen once in CI); up to 4 fresh workloads run until one evicts from the host tier."""
    path = tiny_model_dir("llama")
    ref = Engine(path, device="cpu", kv_cache_tokens=8192)
    for _ in range(4):
        batches = _workload(random.Random(), rounds=10)
        eng = _tight(path, 16 * 5, overlap)  # room for one or two documents
        assert _run(eng, batches) == _run(ref, batches)
        s = _check_consistent(eng)
        assert s["chunk_hits"] + s["chunk_misses"] == _lookups(batches)
        eng.flush_cache()
        assert eng.pool.num_free == eng.pool.num_pages and eng.scheduler.chunks.num_host_pages == 0
        if s["chunk_host_evictions"] > 0 and s["chunk_offloads"] > 0:
            return
        ref.flush_cache()
    pytest.fail("no workload of 4 evicted from the host tier")


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("fail_on", ["offloads", "loads"])
def test_a_failed_step_keeps_no_copy_it_did_not_make(fail_on, overlap, tiny_model_dir):
    """The first step that moves pages of the kind `fail_on` raises before any of its work, after
    scribbling over every page it (and, with overlap, the step in flight with it) would write.
    Later requests still get the roomy engine's tokens, and no page leaks from either pool."""
    path = tiny_model_dir("llama")
    batches = _workload(random.Random())
    ref = Engine(path, device="cpu", kv_cache_tokens=8192)
    want = _run(ref, batches)
    eng = _tight(path, 16 * 64, overlap)
    host_kv, kv = eng.worker.host_kv.kv, eng.pool.kv_all
    execute, recent, failed = eng.runner.execute, [], []

    def flaky(plan):
        recent.append(plan)
        if failed or not getattr(plan, fail_on):
            return execute(plan)
        failed.append(plan)
        for p in recent[-2:] if overlap else recent[-1:]:
            for t in p.offloads:
                host_kv[t.dst].normal_(0, 50)
            for t in p.loads:
                kv[:, t.dst].normal_(0, 50)
            for it in p.items:
                kv[:, it.target.pages].normal_(0, 50)
        raise RuntimeError("injected")

    eng.runner.execute = flaky
    got = []
    for b in batches:
        try:
            got += [o["token_ids"] for o in eng.generate(b, SP)]
        except RuntimeError as e:
            assert "injected" in str(e)
            got += [None] * len(b)
    assert failed, f"no step had {fail_on}"
    _check_consistent(eng)
    # everything again: cached chunks (in either tier) must hold the right KV
    assert _run(eng, batches) == want
    assert [g for g in got if g is not None] == [w for g, w in zip(got, want) if g is not None]
    eng.flush_cache()
    assert eng.pool.num_free == eng.pool.num_pages and eng.scheduler.chunks.num_host_pages == 0


# ---- options and stats ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kw", [dict(host_kv_cache_tokens=-16), dict(host_kv_cache_tokens=8), dict(host_kv_cache_tokens="64"),
           dict(host_kv_cache_tokens=64, cache_mode="prefix")]
)
def test_bad_host_tier_values_name_the_option(kw):
    with pytest.raises(ValueError, match="host_kv_cache_tokens"):
        Engine(device="cpu", **kw)


@pytest.mark.parametrize("cli", ["launch", "batch"])
def test_bad_host_tier_flag_names_the_flag(cli, capsys, tmp_path):
    if cli == "launch":
        from lazyrt.launch import build_parser, main

        assert "--host-kv-cache-tokens" in build_parser().format_help()
        argv = ["--host-kv-cache-tokens", "-5"]
    else:
        from lazyrt.batch import main

        argv = ["--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl")]
        argv += ["--cache-mode", "none", "--host-kv-cache-tokens", "64"]
    with pytest.raises(SystemExit):
        main(argv)
    assert "--host-kv-cache-tokens" in capsys.readouterr().err


def test_metrics_report_both_tiers(tiny_model_dir):
    from lazyrt.runtime.server.metrics import ServerMetrics

    eng = Engine(tiny_model_dir("llama"), device="cpu", kv_cache_tokens=1024, host_kv_cache_tokens=512)
    text = ServerMetrics().render(eng.cache_stats()).decode()
    for name in ("lazyrt_host_kv_pages_total 32.0", "lazyrt_chunk_host_hits_total",
                 "lazyrt_chunk_loads_total", "lazyrt_chunk_host_attended_total",
                 "lazyrt_host_load_bytes_total", "lazyrt_chunk_device_hits_total"):
        assert name in text
