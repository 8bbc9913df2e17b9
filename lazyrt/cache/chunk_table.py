"""Content-addressed store of document-chunk KV, position-agnostic (keys are rotated in-kernel)."""

from __future__ import annotations

import hashlib
import heapq
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from lazyrt.cache.eviction import Access, EvictionPolicy, make_policy


@dataclass(slots=True, eq=False)
class Chunk:
    key: bytes  # content hash
    cond_tokens: tuple[int, ...]  # conditioning prefix the chunk's KV was computed after (may be empty)
    tokens: tuple[int, ...]  # the chunk's own tokens
    pages: list[int]  # ceil(len(tokens)/page_size) pages; chunk starts at slot 0 of pages[0]
    ready: bool = False  # KV has been computed into pages
    ref_count: int = 0  # requests currently using it
    last_used: int = 0  # logical clock tick
    hits: int = 0
    priority: float = 0.0  # eviction priority set by the table's policy: lowest is evicted first
    heap_seq: int = -1  # seq of the chunk's live eviction-heap entry; -1 once out of the table

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)


@dataclass(slots=True)
class ChunkTableStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0


class ChunkTable:
    """Content-addressed store of chunk KV. key = hash(model_id, cond_tokens, tokens).

    The table owns the page ids of its chunks but never allocates or frees them: ``evict``/``remove``
    return page ids and the caller gives them back to the PagePool. Which chunks ``evict`` drops is
    up to the eviction policy (lazyrt/cache/eviction.py): lru, lfu or gdsf.
    """

    def __init__(self, model_id: str, page_size: int, eviction_policy: str = "lru") -> None:
        if page_size <= 0:
            raise ValueError("page_size must be positive")
        self.policy: EvictionPolicy = make_policy(eviction_policy)
        self.eviction_policy = eviction_policy
        # Min-heap of (priority, seq, chunk) over every chunk (evictable or not). An entry is live
        # while chunk.heap_seq == seq; a priority change pushes a new entry and the old one goes stale.
        self._heap: list[tuple[float, int, Chunk]] = []
        self._seq = 0
        self.model_id = model_id
        self.page_size = page_size
        self.stats = ChunkTableStats()
        # Colliding keys with different contents coexist in one bucket.
        self._buckets: dict[bytes, list[Chunk]] = {}
        self._owned: set[int] = set()
        self._count = 0
        self._clock = 0
        self._model_bytes = model_id.encode()

    def make_key(self, cond_tokens: Sequence[int], tokens: Sequence[int]) -> bytes:
        h = hashlib.blake2b(digest_size=16)
        # Lengths are hashed so (a, b | c) and (a | b, c) differ.
        h.update(array("q", [len(self._model_bytes), len(cond_tokens), len(tokens)]).tobytes())
        h.update(self._model_bytes)
        h.update(array("q", cond_tokens).tobytes())
        h.update(array("q", tokens).tobytes())
        return h.digest()

    def pages_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def lookup(self, cond_tokens: Sequence[int], tokens: Sequence[int], record: bool = True) -> Chunk | None:
        """Find the chunk with exactly these contents (ready or not); a hit touches it.
        record=False only finds it: the caller reports the use later with `record_use` (a request
        that waits for memory looks its docs up again every step and must count once)."""
        cond, toks = _as_tuple(cond_tokens), _as_tuple(tokens)
        chunk = self._find(self.make_key(cond, toks), cond, toks)
        if record:
            self.record_use(chunk)
        return chunk

    def record_use(self, chunk: Chunk | None) -> None:
        """Count one use: a hit on `chunk`, or a miss when it is None."""
        if chunk is None:
            self.stats.misses += 1
            return
        self._check_member(chunk)
        self.stats.hits += 1
        chunk.hits += 1
        self._touch(chunk, "hit")

    def insert(self, cond_tokens: Sequence[int], tokens: Sequence[int], pages: list[int]) -> Chunk:
        cond, toks = _as_tuple(cond_tokens), _as_tuple(tokens)
        if not toks:
            raise ValueError("cannot insert an empty chunk")
        need = self.pages_needed(len(toks))
        if len(pages) != need:
            raise ValueError(f"chunk of {len(toks)} tokens needs {need} pages, got {len(pages)}")
        if len(set(pages)) != len(pages) or not self._owned.isdisjoint(pages):
            raise ValueError(f"pages {pages} repeat or are already held by another chunk")
        key = self.make_key(cond, toks)
        if self._find(key, cond, toks) is not None:
            raise ValueError("an equal chunk is already in the table")
        chunk = Chunk(key=key, cond_tokens=cond, tokens=toks, pages=list(pages))
        self._buckets.setdefault(key, []).append(chunk)
        self._owned.update(pages)
        self._count += 1
        self._touch(chunk, "insert")
        return chunk

    def acquire(self, chunk: Chunk) -> None:
        self._check_member(chunk)
        chunk.ref_count += 1
        self._touch(chunk, "acquire")

    def release(self, chunk: Chunk) -> None:
        self._check_member(chunk)
        if chunk.ref_count <= 0:
            raise ValueError("release of a chunk with ref_count 0")
        chunk.ref_count -= 1

    def remove(self, chunk: Chunk) -> list[int]:
        """Drop an unreferenced chunk (e.g. failed computation); returns its pages for the caller to free."""
        self._check_member(chunk)
        if chunk.ref_count:
            raise ValueError(f"cannot remove a chunk with ref_count {chunk.ref_count}")
        return self._drop(chunk)

    def evictable_pages(self) -> int:
        return sum(len(c.pages) for c in self if c.ready and c.ref_count == 0)

    def evict(self, num_pages: int) -> list[int]:
        """Evict unreferenced ready chunks, lowest policy priority first, until >= num_pages pages are
        freed or none remain. A chunk is evicted whole, so more than num_pages may come back."""
        if num_pages <= 0:
            return []
        freed: list[int] = []
        skipped: list[tuple[float, int, Chunk]] = []  # live entries of chunks in use or not ready
        heap = self._heap
        while len(freed) < num_pages and heap:
            entry = heapq.heappop(heap)
            chunk = entry[2]
            if chunk.heap_seq != entry[1]:
                continue  # stale: the chunk was re-prioritized or has left the table
            if not chunk.ready or chunk.ref_count:
                skipped.append(entry)
                continue
            self.policy.on_evict(chunk)
            freed += self._drop(chunk)
            self.stats.evictions += 1
        for entry in skipped:
            heapq.heappush(heap, entry)
        return freed

    def clear_unreferenced(self) -> list[int]:
        """Flush: evict every unreferenced chunk, ready or not."""
        freed: list[int] = []
        for chunk in [c for c in self if c.ref_count == 0]:
            freed += self._drop(chunk)
            self.stats.evictions += 1
        return freed

    @property
    def num_pages(self) -> int:
        return len(self._owned)

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[Chunk]:
        for bucket in self._buckets.values():
            yield from bucket

    def _find(self, key: bytes, cond: tuple[int, ...], toks: tuple[int, ...]) -> Chunk | None:
        # Compare contents, not just the hash: a collision must never serve another chunk's KV.
        for chunk in self._buckets.get(key, ()):
            if chunk.tokens == toks and chunk.cond_tokens == cond:
                return chunk
        return None

    def _check_member(self, chunk: Chunk) -> None:
        if not any(c is chunk for c in self._buckets.get(chunk.key, ())):
            raise ValueError("chunk is not in this table (already removed or evicted?)")

    def _drop(self, chunk: Chunk) -> list[int]:
        bucket = self._buckets[chunk.key]
        bucket[:] = [c for c in bucket if c is not chunk]
        if not bucket:
            del self._buckets[chunk.key]
        self._owned.difference_update(chunk.pages)
        self._count -= 1
        chunk.heap_seq = -1  # its heap entries are stale from now on
        return list(chunk.pages)

    def _touch(self, chunk: Chunk, kind: Access) -> None:
        self._clock += 1
        chunk.last_used = self._clock
        if self.policy.on_access(chunk, kind, self._clock) or chunk.heap_seq < 0:
            self._seq += 1
            chunk.heap_seq = self._seq
            heapq.heappush(self._heap, (chunk.priority, self._seq, chunk))
            if len(self._heap) > 2 * self._count + 64:
                # Drop stale entries; live ones keep their seq, so they stay valid.
                self._heap = [(c.priority, c.heap_seq, c) for c in self]
                heapq.heapify(self._heap)


def _as_tuple(tokens: Sequence[int]) -> tuple[int, ...]:
    # Tuples pass through: the scheduler looks up every doc of a waiting request on each admission
    # attempt, and copying 2k-token documents dominated that. make_key's array("q") still rejects
    # non-integers, and equal integer values compare equal whatever their type.
    if type(tokens) is tuple:
        return tokens
    return tuple(int(t) for t in tokens)
