"""CPU unit tests for lazyrt.cache: page pool, chunk table, radix prefix cache."""

from __future__ import annotations

import os
import random

import pytest
import torch

from lazyrt.cache.chunk_table import ChunkTable, PartKey
from lazyrt.cache.page_pool import OutOfPages, PagePool
from lazyrt.cache.radix_cache import RadixCache, RadixNode


def small_pool(num_pages: int = 8, num_layers: int = 2) -> PagePool:
    return PagePool(num_layers, num_pages, page_size=4, num_kv_heads=2, head_dim=3, dtype=torch.float32)


# ---------------------------------------------------------------- PagePool


def test_pool_layout_and_bytes():
    pool = small_pool()
    assert len(pool.kv) == 2
    for layer in pool.kv:
        assert layer.shape == (8, 2, 4, 2, 3)
        assert layer.dtype == torch.float32
        assert not layer.any()
    per_page = sum(layer[0].numel() * layer.element_size() for layer in pool.kv)
    assert PagePool.bytes_per_page(2, 4, 2, 3, torch.float32) == per_page
    assert PagePool.bytes_per_page(2, 4, 2, 3, torch.bfloat16) == per_page // 2


def test_pool_alloc_free_lowest_first():
    pool = small_pool()
    assert pool.alloc(0) == []
    assert pool.alloc(3) == [0, 1, 2]
    assert pool.num_free == 5
    pool.free([1])
    assert pool.num_free == 6
    assert pool.alloc(2) == [1, 3]
    assert not pool.is_free(3) and pool.is_free(4)


def test_pool_out_of_pages():
    pool = small_pool()
    pool.alloc(6)
    with pytest.raises(OutOfPages, match=r"3.*2"):
        pool.alloc(3)
    assert pool.num_free == 2  # a failed alloc takes nothing
    assert pool.alloc(2) == [6, 7]
    with pytest.raises(OutOfPages):
        pool.alloc(1)


def test_pool_double_free_and_range():
    pool = small_pool()
    pages = pool.alloc(3)
    pool.free([pages[0]])
    with pytest.raises(ValueError):
        pool.free([pages[0]])
    with pytest.raises(ValueError):
        pool.free([pages[1], pages[1]])
    assert pool.num_free == 6  # the rejected call freed nothing, not even the first copy
    for bad in (8, -1):
        with pytest.raises(ValueError):
            pool.free([bad])
    with pytest.raises(ValueError):
        pool.free([pages[2], 99])
    assert not pool.is_free(pages[2])


def test_pool_copy_pages_all_layers():
    pool = small_pool()
    gen = torch.Generator().manual_seed(0)
    for layer in pool.kv:
        layer.copy_(torch.randn(layer.shape, generator=gen))
    before = [layer.clone() for layer in pool.kv]
    pool.copy_pages([0, 1], [5, 3])
    for layer, old in zip(pool.kv, before, strict=True):
        assert torch.equal(layer[5], old[0])  # K and V together: dim 1 holds both
        assert torch.equal(layer[3], old[1])
        for p in (0, 1, 2, 4, 6, 7):
            assert torch.equal(layer[p], old[p])
    with pytest.raises(ValueError):
        pool.copy_pages([0], [1, 2])
    with pytest.raises(ValueError):
        pool.copy_pages([0, 1], [2, 2])


# ---------------------------------------------------------------- ChunkTable


def test_chunk_lookup_hit_miss_and_stats():
    t = ChunkTable("model-a", page_size=4)
    assert t.lookup((), [1, 2, 3]) is None
    c = t.insert([9], [1, 2, 3, 4, 5], [7, 3])
    assert c.num_tokens == 5 and c.pages == [7, 3] and not c.ready and c.ref_count == 0
    assert c.tokens == (1, 2, 3, 4, 5) and c.cond_tokens == (9,)
    assert t.lookup((9,), (1, 2, 3, 4, 5)) is c
    assert t.lookup([], [1, 2, 3, 4, 5]) is None  # cond_tokens are part of the identity
    assert t.lookup([9], [1, 2, 3, 4]) is None
    assert c.hits == 1
    assert (t.stats.hits, t.stats.misses) == (1, 3)
    assert len(t) == 1 and list(t) == [c] and t.num_pages == 2


def test_chunk_key_identity():
    t = ChunkTable("model-a", page_size=4)
    assert t.make_key([1, 2], [3]) != t.make_key([1], [2, 3])
    assert t.make_key([], [1]) == t.make_key((), (1,))
    assert t.make_key([], [1]) != ChunkTable("model-b", page_size=4).make_key([], [1])
    assert len(t.make_key([], [1])) == 16


def test_chunk_key_is_the_digest_of_the_int64_ids():
    """make_key packs ids with struct (faster than array("q")); the digest must be the one over the
    array bytes, on fresh random ids, and non-integers or ids past int64 must still be refused."""
    import hashlib
    import random
    from array import array

    rng = random.Random()
    cond = tuple(rng.randrange(-(2**62), 2**62) for _ in range(rng.randint(0, 40)))
    toks = [rng.randrange(0, 1 << 40) for _ in range(rng.randint(1, 3000))]
    t = ChunkTable("model-x", page_size=4)
    h = hashlib.blake2b(digest_size=16)
    h.update(array("q", [len(b"model-x"), len(cond), len(toks)]).tobytes())
    h.update(b"model-x" + array("q", cond).tobytes() + array("q", toks).tobytes())
    assert t.make_key(cond, toks) == h.digest()
    for bad in ([1.5], ["7"], [2**63]):
        with pytest.raises(TypeError, match="int64"):
            t.make_key((), bad)


def test_chunk_insert_validation():
    t = ChunkTable("m", page_size=4)
    with pytest.raises(ValueError):
        t.insert((), [1, 2, 3, 4, 5], [0])  # needs 2 pages
    with pytest.raises(ValueError):
        t.insert((), [1, 2, 3, 4], [0, 1])  # needs exactly 1
    with pytest.raises(ValueError):
        t.insert((), [], [])
    t.insert((), [1, 2, 3, 4], [0])
    with pytest.raises(ValueError):
        t.insert((), [1, 2, 3, 4], [1])  # equal chunk already present
    with pytest.raises(ValueError):
        t.insert((), [5], [0])  # page 0 belongs to another chunk
    assert len(t) == 1 and t.num_pages == 1


def test_chunk_hash_collision_never_serves_wrong_chunk(monkeypatch):
    t = ChunkTable("m", page_size=4)
    monkeypatch.setattr(t, "make_key", lambda cond, toks: b"\x00" * 16)
    a = t.insert((), [1, 2], [0])
    b = t.insert((5,), [1, 2], [1])
    c = t.insert((), [3], [2])
    assert a.key == b.key == c.key
    assert t.lookup((), [1, 2]) is a
    assert t.lookup((5,), [1, 2]) is b
    assert t.lookup((), [3]) is c
    assert t.lookup((), [4]) is None
    assert t.get(PartKey((5,), (1, 2))) is b and t.get(PartKey((), (4,))) is None  # the scheduler's way in
    assert t.remove(b) == [1]
    assert t.lookup((5,), [1, 2]) is None and t.get(PartKey((5,), (1, 2))) is None
    with pytest.raises(ValueError, match="not in this table"):
        t.acquire(b)
    assert t.lookup((), [1, 2]) is a and len(t) == 2


def test_chunk_refcount_blocks_eviction():
    t = ChunkTable("m", page_size=4)
    a = t.insert((), [1], [0])
    b = t.insert((), [2], [1])
    a.ready = b.ready = True
    t.acquire(a)
    assert t.evictable_pages() == 1
    assert t.evict(10) == [1]
    assert t.lookup((), [1]) is a
    with pytest.raises(ValueError):
        t.remove(a)
    assert t.clear_unreferenced() == []
    t.release(a)
    with pytest.raises(ValueError):
        t.release(a)
    assert t.evict(10) == [0]
    assert len(t) == 0 and t.num_pages == 0 and t.stats.evictions == 2
    with pytest.raises(ValueError):
        t.acquire(a)  # evicted chunks are no longer members


def test_chunk_lru_eviction_order():
    t = ChunkTable("m", page_size=2)
    a = t.insert((), [1, 1, 1], [0, 1])
    b = t.insert((), [2], [2])
    c = t.insert((), [3], [3])
    for ch in (a, b, c):
        ch.ready = True
    assert t.lookup((), [1, 1, 1]) is a  # a becomes most recent: order b, c, a
    assert t.evict(1) == [2]
    t.acquire(c)
    t.release(c)  # acquire touches: order a, c
    assert t.evict(1) == [0, 1]  # a whole chunk is evicted even if it overshoots
    assert t.evict(0) == []
    assert t.evictable_pages() == 1


def test_chunk_not_ready_only_flushed():
    t = ChunkTable("m", page_size=2)
    pending = t.insert((), [1], [0])
    done = t.insert((), [2], [1])
    done.ready = True
    assert t.evictable_pages() == 1
    assert t.evict(5) == [1]
    assert t.lookup((), [1]) is pending
    assert t.clear_unreferenced() == [0]
    assert len(t) == 0


# ---------------------------------------------------------------- RadixCache


def test_radix_never_matches_partial_page():
    r = RadixCache(page_size=4)
    toks = list(range(10))
    assert r.insert(toks, [5, 6, 7]) == []  # third page is partial: ignored, caller keeps it
    assert r.num_pages == 2
    assert r.match_prefix(toks)[0] == [5, 6]
    assert r.match_prefix(toks[:7])[0] == [5]
    assert r.match_prefix(toks[:3])[0] == []
    pages, node = r.match_prefix([9, 9, 9, 9])
    assert pages == [] and node is r.root
    assert r.stats.queries == 4 and r.stats.hit_tokens == 12
    with pytest.raises(ValueError):
        r.insert(list(range(8)), [1])  # two full pages need two page ids


def test_radix_insert_returns_duplicates():
    r = RadixCache(page_size=2)
    assert r.insert([1, 2, 3, 4], [0, 1]) == []
    # same first page, new second page: caller's page 5 is a duplicate of cached page 0
    assert r.insert([1, 2, 9, 9, 7], [5, 6, 8]) == [5]
    assert r.match_prefix([1, 2, 9, 9])[0] == [0, 6]
    # caller re-inserting pages it matched earlier gets nothing back
    assert r.insert([1, 2, 3, 4, 5, 6], [0, 1, 7]) == []
    assert r.match_prefix([1, 2, 3, 4, 5, 6])[0] == [0, 1, 7]
    assert r.num_pages == 4
    with pytest.raises(ValueError):
        r.insert([8, 8], [1])  # page 1 already cached elsewhere
    with pytest.raises(ValueError):
        r.insert([1, 2, 8, 8], [3, 3])  # 3 would be freed by the caller and adopted
    assert r.num_pages == 4


def test_radix_locked_path_not_evicted():
    r = RadixCache(page_size=2)
    r.insert([1, 1, 2, 2], [0, 1])
    r.insert([3, 3], [2])
    _, node = r.match_prefix([1, 1, 2, 2])
    r.lock(node)
    assert node.lock_ref == 1 and node.parent.lock_ref == 1
    assert r.evictable_pages() == 1
    assert r.evict(10) == [2]
    assert r.evictable_pages() == 0 and r.evict(10) == []
    with pytest.raises(RuntimeError):
        r.reset()
    r.unlock(node)
    assert r.evictable_pages() == 2
    with pytest.raises(ValueError):
        r.unlock(node)
    assert sorted(r.reset()) == [0, 1] and r.num_pages == 0
    with pytest.raises(ValueError):
        r.lock(node)  # node was dropped
    r.lock(r.root)  # locking the root is a harmless no-op
    r.unlock(r.root)


def test_radix_lock_child_pins_parent_only_on_its_branch():
    r = RadixCache(page_size=1)
    r.insert([1, 2], [0, 1])
    r.insert([1, 3], [9, 2])  # [9] returned: page for token 1 already cached
    _, leaf = r.match_prefix([1, 2])
    r.lock(leaf)
    assert r.evict(10) == [2]  # sibling leaf goes, shared parent and locked leaf stay
    r.unlock(leaf)
    assert r.evict(10) == [1, 0]


def test_radix_lru_leaf_order_and_parent_becomes_leaf():
    r = RadixCache(page_size=2)
    r.insert([1, 1, 2, 2], [0, 1])  # chain 0 -> 1, oldest
    r.insert([3, 3], [2])
    r.insert([4, 4], [3])
    r.match_prefix([3, 3])  # order now: chain(0,1), 3, 2
    assert r.evict(1) == [1]  # leaf of the oldest chain
    # page 0 became a leaf and is still the oldest, so it goes before the newer leaves
    assert r.evict(2) == [0, 3]
    assert r.evict(1) == [2]
    assert r.num_pages == 0 and r.evictable_pages() == 0


def test_radix_evict_in_one_call_pushes_parents():
    r = RadixCache(page_size=2)
    r.insert([1, 1, 2, 2], [0, 1])
    r.insert([3, 3], [2])  # newer than the whole chain
    assert r.evict(2) == [1, 0]


# ---------------------------------------------------------------- randomized model check


def _tree(r: RadixCache) -> dict[tuple, int]:
    """Path of page keys -> page id, for every node."""
    out: dict[tuple, int] = {}
    stack: list[tuple[tuple, RadixNode]] = [((), r.root)]
    while stack:
        path, node = stack.pop()
        for key, child in node.children.items():
            assert child.parent is node and child.key == key
            out[path + (key,)] = child.page
            stack.append((path + (key,), child))
    return out


def _node_at(r: RadixCache, path: tuple) -> RadixNode:
    node = r.root
    for key in path:
        node = node.children[key]
    return node


def test_randomized_ownership_against_model():
    seed = int(os.environ.get("LAZYRT_TEST_SEED", random.SystemRandom().randrange(2**32)))
    print(f"seed={seed}  (reproduce with LAZYRT_TEST_SEED={seed})")
    rng = random.Random(seed)
    ps, num_pages = 2, 40
    pool = PagePool(1, num_pages, ps, 1, 1, torch.float32)
    radix = RadixCache(ps)
    table = ChunkTable("m", ps)
    held: set[int] = set()  # pages allocated to in-flight requests, not yet handed to a cache
    model: dict[tuple, int] = {}  # radix model: path of page keys -> page
    requests: list[dict] = []  # in-flight radix requests
    chunks: dict[tuple, dict] = {}  # chunk model: (cond, tokens) -> {pages, ref, ready}
    refs: list[tuple] = []  # one entry per acquire not yet released

    def keys_of(tokens):
        return [tuple(tokens[i : i + ps]) for i in range(0, len(tokens) - ps + 1, ps)]

    def locked_paths():
        out: dict[tuple, int] = {}
        for req in requests:
            for i in range(1, req["depth"] + 1):
                out[req["keys"][:i]] = out.get(req["keys"][:i], 0) + 1
        return out

    def check():
        tree = _tree(radix)
        assert tree == model
        locks = locked_paths()
        for path in tree:
            assert _node_at(radix, path).lock_ref == locks.get(path, 0), path
        assert radix.evictable_pages() == sum(1 for p in model if p not in locks)
        assert radix.num_pages == len(model)
        chunk_pages: list[int] = []
        for c in table:
            m = chunks[(c.cond_tokens, c.tokens)]
            assert c.pages == m["pages"] and c.ref_count == m["ref"] and c.ready == m["ready"]
            chunk_pages += c.pages
        assert len(table) == len(chunks) and table.num_pages == len(chunk_pages)
        assert table.evictable_pages() == sum(
            len(m["pages"]) for m in chunks.values() if m["ready"] and m["ref"] == 0
        )
        owners = [0] * num_pages
        for p in range(num_pages):
            owners[p] += pool.is_free(p) + (p in held)
        for p in list(tree.values()) + chunk_pages:
            owners[p] += 1
        assert owners == [1] * num_pages, "page leaked or owned twice"
        assert pool.num_free == sum(pool.is_free(p) for p in range(num_pages))

    def radix_evict(n):
        freed = radix.evict(n)
        assert len(set(freed)) == len(freed)
        locks = locked_paths()
        gone = {path for path, page in model.items() if page in set(freed)}
        assert len(gone) == len(freed) and not gone & locks.keys()
        for path in gone:
            del model[path]
        assert all(path[:-1] in model for path in model if len(path) > 1), "evicted a non-leaf"
        assert len(freed) >= n or radix.evictable_pages() == 0
        pool.free(freed)

    def chunk_evict(n):
        freed = table.evict(n)
        gone = [k for k, m in chunks.items() if set(m["pages"]) <= set(freed)]
        assert sorted(p for k in gone for p in chunks[k]["pages"]) == sorted(freed)
        for k in gone:
            assert chunks[k]["ready"] and chunks[k]["ref"] == 0
            del chunks[k]
        assert len(freed) >= n or table.evictable_pages() == 0
        pool.free(freed)

    def alloc(n):
        if pool.num_free < n and rng.random() < 0.7:
            radix_evict(n - pool.num_free)
            if pool.num_free < n:
                chunk_evict(n - pool.num_free)
        if n > pool.num_free:
            with pytest.raises(OutOfPages):
                pool.alloc(n)
            return None
        pages = pool.alloc(n)
        held.update(pages)
        return pages

    def start_request():
        tokens = [rng.randrange(3) for _ in range(rng.randrange(11))]
        keys = keys_of(tokens)
        matched, node = radix.match_prefix(tokens)
        depth = 0
        while depth < len(keys) and tuple(keys[: depth + 1]) in model:
            depth += 1
        assert matched == [model[tuple(keys[:i])] for i in range(1, depth + 1)]
        radix.lock(node)
        new = alloc(-(-len(tokens) // ps) - len(matched))
        req = {"tokens": tokens, "keys": tuple(keys), "depth": depth, "node": node, "matched": matched}
        if new is None:
            radix.unlock(node)
            return
        req["new"] = new
        requests.append(req)

    def finish_request(req, commit):
        requests.remove(req)
        if commit:
            pages = req["matched"] + req["new"]
            rejected = radix.insert(req["tokens"], pages)
            expect = []
            for i in range(len(req["keys"])):
                path = req["keys"][: i + 1]
                if path in model:
                    if model[path] != pages[i]:
                        expect.append(pages[i])
                else:
                    model[path] = pages[i]
            assert rejected == expect
            to_free = rejected + pages[len(req["keys"]) :]
        else:
            to_free = req["new"]
        held.difference_update(req["new"])
        pool.free(to_free)
        radix.unlock(req["node"])

    def chunk_op():
        cond = rng.choice([(), (7,), (7, 8)])
        toks = tuple(rng.randrange(2) for _ in range(rng.randrange(1, 6)))
        c = table.lookup(cond, toks)
        if c is not None:
            assert (c.cond_tokens, c.tokens) == (cond, toks) and c.pages == chunks[(cond, toks)]["pages"]
        else:
            assert (cond, toks) not in chunks
            pages = alloc(table.pages_needed(len(toks)))
            if pages is None:
                return
            c = table.insert(cond, toks, pages)
            held.difference_update(pages)
            chunks[(cond, toks)] = {"pages": pages, "ref": 0, "ready": False}
        if rng.random() < 0.5:
            table.acquire(c)
            chunks[(cond, toks)]["ref"] += 1
            refs.append((cond, toks))

    for _ in range(3000):
        op = rng.random()
        if op < 0.25:
            start_request()
        elif op < 0.45 and requests:
            finish_request(rng.choice(requests), commit=rng.random() < 0.85)
        elif op < 0.6:
            chunk_op()
        elif op < 0.68 and refs:
            key = refs.pop(rng.randrange(len(refs)))
            table.release(table.lookup(*key))
            chunks[key]["ref"] -= 1
        elif op < 0.75:
            pending = [c for c in table if not c.ready]
            if pending:
                c = rng.choice(pending)
                c.ready = True
                chunks[(c.cond_tokens, c.tokens)]["ready"] = True
        elif op < 0.78:
            orphans = [c for c in table if not c.ready and c.ref_count == 0]
            if orphans:
                c = rng.choice(orphans)
                pool.free(table.remove(c))
                del chunks[(c.cond_tokens, c.tokens)]
        elif op < 0.86:
            radix_evict(rng.randrange(6))
        elif op < 0.94:
            chunk_evict(rng.randrange(6))
        elif op < 0.97:
            if any(req["depth"] for req in requests):
                with pytest.raises(RuntimeError):
                    radix.reset()
            else:
                assert sorted(radix.reset()) == sorted(model.values())
                pool.free(list(model.values()))
                model.clear()
        else:
            freed = table.clear_unreferenced()
            gone = [k for k, m in chunks.items() if m["ref"] == 0]
            assert sorted(freed) == sorted(p for k in gone for p in chunks[k]["pages"])
            for k in gone:
                del chunks[k]
            pool.free(freed)
        check()

    # drain: everything must come back to the pool
    while requests:
        finish_request(requests[0], commit=True)
    for key in refs:
        table.release(table.lookup(*key))
        chunks[key]["ref"] -= 1
    pool.free(table.clear_unreferenced() + radix.reset())
    assert pool.num_free == num_pages and len(table) == 0 and radix.num_pages == 0


def test_scratch_pages_are_never_allocated():
    pool = PagePool(1, 4, page_size=4, num_kv_heads=1, head_dim=2, dtype=torch.float32, scratch_pages=1)
    assert pool.kv[0].shape[0] == 5 and pool.scratch_pages == [4]
    assert sorted(pool.alloc(4)) == [0, 1, 2, 3]
    with pytest.raises(OutOfPages):
        pool.alloc(1)
    with pytest.raises(ValueError):
        pool.free([4])


def test_radix_drop_removes_the_pages_and_everything_below_them():
    rng = random.Random()
    ps = 4
    rc = RadixCache(ps)
    base = [rng.randrange(1000) for _ in range(3 * ps)]
    a, b = base + [1] * ps, base[: 2 * ps] + [2] * (2 * ps)  # b branches off after base's 2nd page
    assert rc.insert(a, [10, 11, 12, 13]) == []
    assert rc.insert(b, [10, 11, 20, 21]) == []
    node = rc.node_of(a)
    rc.lock(node)
    with pytest.raises(RuntimeError):
        rc.drop({12})  # 13 below it is locked
    rc.unlock(node)
    assert sorted(rc.drop({12, 21})) == [12, 13, 21]  # 12's subtree; 21 (a leaf) alone
    assert rc.match_prefix(a)[0] == [10, 11] and rc.match_prefix(b)[0] == [10, 11, 20]
    assert rc.num_pages == 3 and rc.evictable_pages() == 3
    assert sorted(rc.evict(10)) == [10, 11, 20]
