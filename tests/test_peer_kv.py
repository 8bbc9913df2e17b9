"""Peer KV (--kv-peers): replicas on one host keep each document once and read each other's pages.

The protocol tests run two replicas' scheduler + worker in this process (the same objects the
scheduler process builds), passing their PeerKV messages by hand, against a third replica without
peers on the same random-weight model: greedy tokens must be equal, each document must be cached
by one replica only, and the pages a replica read from its peer must equal the peer's.
"""

from __future__ import annotations

import random
import subprocess
import sys
import textwrap

import pytest
import torch

from lazyrt.cache.chunk_table import PartKey
from lazyrt.cache.kv_share import import_shared, shared_zeros
from lazyrt.cache.page_pool import PagePool
from lazyrt.config import EngineConfig
from lazyrt.runtime.ipc.messages import PeerPages, decode, encode
from lazyrt.runtime.scheduler.engine_core import EngineCore
from lazyrt.runtime.scheduler.peer_kv import PeerKV
from lazyrt.runtime.scheduler.request import Request
from lazyrt.runtime.scheduler.scheduler import Scheduler
from lazyrt.runtime.worker.model_worker import ModelWorker
from lazyrt.sampling_params import SamplingParams

NAMES = ["ipc:///tmp/lazyrt-test-peer-a", "ipc:///tmp/lazyrt-test-peer-b"]


def test_shared_pool_is_mapped_by_another_process():
    t, export = shared_zeros((3, 4, 2), torch.float16, torch.device("cpu"))
    vals = torch.randn(3, 4, 2).half()
    t.copy_(vals)
    code = textwrap.dedent(f"""
        import torch
        from lazyrt.cache.kv_share import import_shared
        from lazyrt.runtime.ipc.messages import decode
        kv = import_shared(decode(bytes.fromhex("{encode(export).hex()}")), torch.device("cpu"))
        print(float(kv.float().sum()))
        kv[0, 0, 0] = 7.0
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert float(out.stdout) == pytest.approx(float(vals.float().sum()), rel=1e-3)
    assert t[0, 0, 0].item() == 7.0  # the other process wrote this process's memory
    with pytest.raises(ValueError, match="unknown KV pool export"):
        import_shared(["nope"], torch.device("cpu"))


class Replica:
    """One replica's scheduler and worker, wired as the scheduler process wires them."""

    def __init__(self, kv_tokens: int, names: list[str] | None, overlap: bool, seed: int = 5, host: int = 0,
                 cache_mode: str = "lazy"):  # fmt: skip
        cfg = EngineConfig(model="tiny-llama", load_format="dummy", device="cpu", dtype="float32",
                           kv_cache_tokens=kv_tokens, seed=seed, overlap_schedule=overlap,
                           kv_peers=tuple(names or ()), host_kv_cache_tokens=host,
                           cache_mode=cache_mode)  # fmt: skip
        cfg.validate()
        self.worker = ModelWorker(cfg)
        ready = self.worker.ready_info()
        pool = PagePool(1, ready.num_pages, ready.page_size, 1, 1, torch.float32, "meta")
        self.sched = Scheduler.from_config(pool, cfg, ready.model_id, ready.host_pages, ready.page_bytes)
        self.core = EngineCore(self.sched, self.worker, set(), overlap=overlap)
        if names:
            self.sched.peers = PeerKV(self.sched, names, ready.model_id, cfg.cache_mode, ready.page_size,
                                      ready.kv_export, timeout_s=30)  # fmt: skip
        self.out: dict[int, list[int]] = {}

    def add(self, rid: int, prefix: list[int], docs: list[list[int]], suffix: list[int], n: int,
            doc_keys: list[bytes] | None = None) -> None:  # fmt: skip
        params = SamplingParams(max_tokens=n, ignore_eos=True)
        req = Request(rid, params, prefix=prefix, docs=docs, suffix=suffix)
        req.max_new_tokens = n
        req.doc_keys = list(doc_keys or [])
        self.core.add(req)
        self.out[rid] = []

    def step(self) -> None:
        if self.core.has_work:
            for t in self.core.step():
                self.out[t.rid] += t.token_ids


def pump(a: Replica, b: Replica) -> int:
    """Delivers each replica's outbox to the other (2 replicas: peer 1 is the other); returns how many."""
    n = 0
    for src, dst in ((a, b), (b, a)):
        for peer, msg in src.sched.peers.take_outbox():
            assert peer == 1
            dst.sched.peers.handle(decode(encode(msg)))  # as it travels
            n += 1
    return n


def run(a: Replica, b: Replica, max_rounds: int = 500) -> None:
    for _ in range(max_rounds):
        moved = pump(a, b)
        a.step()
        b.step()
        if not (a.core.has_work or b.core.has_work or moved or a.sched.peers.busy or b.sched.peers.busy):
            return
    raise AssertionError("the replicas did not finish")


def peers(a_tokens: int, b_tokens: int, b_host: int = 0) -> tuple[Replica, Replica]:
    """Replicas a and b (overlapped scheduling) after their hello: each has mapped the other's pool."""
    a, b = Replica(a_tokens, NAMES, True), Replica(b_tokens, NAMES[::-1], True, host=b_host)
    pump(a, b)
    pump(a, b)
    return a, b


def peers_with_requests(seed: int, n_docs: int, n_req: int) -> tuple[Replica, Replica, list]:
    """Replicas a and b (as `peers`) with a workload's requests added to a (not run yet)."""
    a, b = peers(4096, 4096)
    _, reqs = workload(random.Random(seed), 200, n_docs, n_req)
    for r in reqs:
        a.add(*r)
    return a, b, reqs


def on_a_and_reference(a: Replica, reqs: list) -> Replica:
    """Every request added to a, and run to the end on a replica without peers (the reference)."""
    ref = Replica(4096, None, True)
    for r in reqs:
        a.add(*r)
        ref.add(*r)
    while ref.core.has_work:
        ref.step()
    return ref


def workload(rng: random.Random, vocab: int, n_docs: int, n_req: int) -> tuple[list, list]:
    docs = [[rng.randrange(3, vocab) for _ in range(rng.randrange(20, 70))] for _ in range(n_docs)]
    prefix = [rng.randrange(3, vocab) for _ in range(9)]
    reqs = []
    for rid in range(n_req):
        chosen = rng.sample(range(n_docs), rng.randrange(1, 4))
        reqs.append((rid, prefix, [docs[i] for i in chosen], [rng.randrange(3, vocab) for _ in range(5)], 6))
    return docs, reqs


@pytest.mark.parametrize("overlap,mode", [(False, "lazy"), (True, "lazy"), (True, "block")])
def test_two_replicas_read_each_others_documents_with_the_same_tokens(overlap, mode):
    """In block mode too: a document read from the peer is copied (rotated) into the request's own
    pages like one of its own chunks."""
    rng = random.Random()
    a = Replica(4096, NAMES, overlap, cache_mode=mode)
    b = Replica(4096, NAMES[::-1], overlap, cache_mode=mode)
    ref = Replica(4096, None, overlap, cache_mode=mode)
    pump(a, b)  # hello -> welcome: each maps the other's pool
    pump(a, b)
    assert a.sched.peers.exports and b.sched.peers.exports
    docs, reqs = workload(rng, 200, 8, 12)
    for i, r in enumerate(reqs):  # every request on its own, on either replica, and on the reference
        (a if i % 2 else b).add(*r)
        ref.add(*r)
        run(a, b)
        while ref.core.has_work:
            ref.step()
        mine = (a if i % 2 else b).out[r[0]]
        assert mine == ref.out[r[0]], f"request {i}"
    # each document is cached by its owner only; copies read from a peer were dropped after use
    for rep in (a, b):
        assert all(c.peer < 0 and not c.fetching for c in rep.sched.chunks)
        assert rep.sched.pool.num_free + rep.sched.chunks.num_pages == rep.sched.pool.num_pages
        assert not rep.sched.peers._pins and not rep.sched.peers._fetches  # every pin released
    held = {c.tokens for rep in (a, b) for c in rep.sched.chunks if c.cond_tokens}
    held_twice = {c.tokens for c in a.sched.chunks if c.cond_tokens} & {c.tokens for c in b.sched.chunks}
    assert not held_twice and held <= {tuple(d) for d in docs}
    fetched = a.sched.chunks.stats.peer_fetches + b.sched.chunks.stats.peer_fetches
    assert fetched > 0 and a.sched.chunks.stats.peer_loads + b.sched.chunks.stats.peer_loads > 0
    # hits and misses are counted by the owners: the sum is what one cache holding all would count
    total = sum(rep.sched.chunks.stats.hits + rep.sched.chunks.stats.misses for rep in (a, b))
    assert total == ref.sched.chunks.stats.hits + ref.sched.chunks.stats.misses


def test_concurrent_requests_a_full_owner_and_pages_equal_the_owners():
    rng = random.Random(3)
    # b's pool is small: documents it owns but cannot hold are computed by the replica asking
    a, b = peers(4096, 96)
    docs, reqs = workload(rng, 200, 10, 16)
    ref = on_a_and_reference(a, reqs)
    # watch the copies: after each step, a peer copy's pages equal the owner's
    checked = 0
    for _ in range(800):
        moved = pump(a, b)
        a.step()
        b.step()
        for c in a.sched.chunks:
            if c.peer >= 0 and c.ready and c.ready_seq <= a.sched.complete_seq:
                owner = b.sched.chunks.get(PartKey(c.cond_tokens, c.tokens))
                if owner is not None and owner.ready and owner.ref_count:  # held for a
                    mine = a.worker.pool.kv_all[:, c.pages]
                    theirs = b.worker.pool.kv_all[:, owner.pages]
                    torch.testing.assert_close(mine, theirs, rtol=0, atol=0)
                    checked += 1
        if not (a.core.has_work or b.core.has_work or moved or a.sched.peers.busy or b.sched.peers.busy):
            break
    assert checked > 0
    assert {rid: a.out[rid] for rid, *_ in reqs} == {rid: ref.out[rid] for rid, *_ in reqs}
    assert a.sched.peers.stats.refused > 0  # b had no room for some: a computed those itself
    assert not b.sched.peers._pins and not a.sched.peers._fetches
    assert a.sched.pool.num_free + a.sched.chunks.num_pages == a.sched.pool.num_pages


def test_a_peer_that_never_answers_is_computed_here():
    rng = random.Random(5)
    a, b = peers(4096, 4096)
    docs, reqs = workload(rng, 200, 6, 4)
    ref = on_a_and_reference(a, reqs)
    a.step()  # admitted: asks b, which never hears of it
    lost = a.sched.peers.take_outbox()
    assert any(type(m).__name__ == "PeerEnsure" for _, m in lost)
    a.sched.peers.tick(now=1e12)  # long past the timeout
    assert a.sched.peers.stats.fetch_timeouts > 0 and not a.sched.peers.exports  # b is taken as down
    for _ in range(300):
        a.step()
        if not a.core.has_work:
            break
    assert {rid: a.out[rid] for rid, *_ in reqs} == {rid: ref.out[rid] for rid, *_ in reqs}
    # b's late answer is released at once; nothing is held
    a.sched.peers.handle(PeerPages(NAMES[1], 1, [[0]]))
    assert [type(m).__name__ for _, m in a.sched.peers.take_outbox()][-1] == "PeerRelease"


def test_bad_peer_configuration_is_refused():
    def cfg(**kw) -> EngineConfig:
        base = dict(model="tiny-llama", load_format="dummy", device="cpu", kv_peers=tuple(NAMES))
        return EngineConfig(**{**base, **kw})

    for kw, match in [
        (dict(kv_peers=(NAMES[0],)), "at least one other"),
        (dict(kv_peers=(NAMES[0], NAMES[0])), "distinct"),
        (dict(kv_peers=(NAMES[0], "localhost:5")), "not a ZMQ address"),
        (dict(kv_peers=(NAMES[0], "tcp://*:5000")), "name a host and a port"),
        (dict(cache_mode="prefix"), "cache_mode lazy or block"),
        (dict(kv_peer_timeout_s=0), "kv_peer_timeout_s"),
    ]:
        with pytest.raises(ValueError, match=match):
            cfg(**kw).validate()
    from lazyrt import Engine

    with pytest.raises(ValueError, match="server option"):
        Engine(model="tiny-llama", load_format="dummy", device="cpu", kv_peers=tuple(NAMES))


def test_pins_of_a_reader_that_never_releases_expire():
    a, b, _ = peers_with_requests(8, 6, 3)
    for _ in range(200):  # until b has answered a's fetches; a's releases are never delivered
        for _, msg in a.sched.peers.take_outbox():
            if type(msg).__name__ != "PeerRelease":
                b.sched.peers.handle(decode(encode(msg)))
        for _, msg in b.sched.peers.take_outbox():
            a.sched.peers.handle(decode(encode(msg)))
        a.step()
        b.step()
        if not (a.core.has_work or b.core.has_work):
            break
    pins = b.sched.peers._pins
    assert pins and all(p.answered_at for p in pins.values())
    held = [c for p in pins.values() for c in p.chunks if c is not None]
    assert held and all(c.ref_count > 0 for c in held)
    b.sched.peers.tick(now=1e12)  # long past the lease
    assert not pins and b.sched.peers.stats.lease_expired > 0
    assert all(c.ref_count == 0 for c in b.sched.chunks)  # evictable again


def test_an_owner_loads_a_document_back_from_its_host_tier_before_answering():
    rng = random.Random(13)
    # b's device pool holds ~2 documents: the rest of what it owns moves to its host tier and is
    # loaded back when a asks for it again (answered once the load has run)
    a, b = peers(4096, 160, b_host=4096)
    ref = Replica(4096, None, True)
    docs, reqs = workload(rng, 200, 8, 14)
    for r in reqs:
        a.add(*r)
        ref.add(*r)
        run(a, b)
        while ref.core.has_work:
            ref.step()
        assert a.out[r[0]] == ref.out[r[0]]
    assert b.sched.chunks.stats.loads > 0 and b.sched.peers.stats.pins > 0


def test_owners_follow_the_documents_placement_keys_as_the_router_hashes_them():
    from lazyrt.cache.placement import doc_key, owner

    rng = random.Random(21)
    a, b = peers(4096, 4096)
    docs, reqs = workload(rng, 200, 10, 10)
    key = {tuple(d): doc_key(f"text of document {i}") for i, d in enumerate(docs)}
    for i, (rid, prefix, ds, suffix, n) in enumerate(reqs):
        (a if i % 2 else b).add(rid, prefix, ds, suffix, n, [key[tuple(d)] for d in ds])
        run(a, b)
    home = {NAMES[0]: a, NAMES[1]: b}
    used = {tuple(d) for _, _, ds, _, _ in reqs for d in ds}
    for d in used:
        held = [rep for rep in (a, b) if any(c.tokens == d for c in rep.sched.chunks)]
        assert held == [home[owner(key[d], NAMES)]]


def test_a_failed_step_releases_the_fetches_it_copied():
    a, b, _ = peers_with_requests(18, 8, 6)
    for _ in range(100):  # until a step has taken a peer copy (overlapped: it is still in flight)
        pump(a, b)
        a.step()
        b.step()
        if any(f.load_seq >= 0 for f in a.sched.peers._fetches.values()):
            break
    taken = [f.fetch_id for f in a.sched.peers._fetches.values() if f.load_seq >= 0]
    assert taken
    a.core._fail_running()  # what EngineCore does when a step raises
    released = [m.fetch_id for _, m in a.sched.peers.take_outbox() if type(m).__name__ == "PeerRelease"]
    assert set(taken) <= set(released)
    assert all(c.peer < 0 for c in a.sched.chunks)  # the copies went with their requests
    assert a.sched.pool.num_free + a.sched.chunks.num_pages == a.sched.pool.num_pages
