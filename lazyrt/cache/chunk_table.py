"""Content-addressed store of document-chunk KV, position-agnostic (keys are rotated in-kernel)."""

from __future__ import annotations

import hashlib
import heapq
import struct
from array import array
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from lazyrt.cache.eviction import Access, EvictionPolicy, make_policy
from lazyrt.cache.page_pool import OutOfPages, PagePool


class PartKey(tuple):
    """A (condition tokens, tokens) pair, equal to the plain tuple, whose hash is computed once: a
    document's key holds its whole token tuple, which Python hashes again on every dict or set
    access (~13 us for 2,048 tokens), and admission looks each one up in several."""

    def __new__(cls, cond: tuple[int, ...], tokens: tuple[int, ...]) -> PartKey:
        key = super().__new__(cls, (cond, tokens))
        key._hash = tuple.__hash__(key)
        return key

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self) -> tuple:
        return PartKey, (self[0], self[1])


@dataclass(slots=True, eq=False)
class Chunk:
    key: bytes  # content hash
    cond_tokens: tuple[int, ...]  # conditioning prefix the chunk's KV was computed after (may be empty)
    tokens: tuple[int, ...]  # the chunk's own tokens
    pages: list[int]  # device pages, ceil(len(tokens)/page_size); [] while only on the host tier
    ready: bool = False  # the device pages hold its KV (or will before any later-planned kernel)
    ref_count: int = 0  # requests currently using it
    last_used: int = 0  # logical clock tick
    hits: int = 0
    priority: float = 0.0  # eviction priority set by the table's policy: lowest is evicted first
    heap_seq: int = -1  # seq of the chunk's live eviction-heap entry; -1 once out of the table
    host_pages: list[int] = field(default_factory=list)  # its copy in the host tier; [] = none
    loading: bool = False  # a load from the host is queued and not yet taken into a step
    content: PartKey | None = None  # (cond_tokens, tokens): the table's index key (hash kept)
    # Peer KV: the peer replica this copy was read from (-1: computed or loaded here). Such a copy is
    # dropped once no request holds it (its owner keeps the document); fetching: its pages are asked
    # for and not yet answered.
    peer: int = -1
    fetching: bool = False
    ready_seq: int = 0  # the step whose kernels or copies filled its pages (0: before any step)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)


@dataclass(slots=True)
class ChunkTableStats:
    hits: int = 0  # device_hits + host_hits
    misses: int = 0
    evictions: int = 0  # chunks evicted from the device pool (moved to the host tier or dropped)
    device_hits: int = 0
    host_hits: int = 0  # found only in the host tier: copied back instead of recomputed
    offloads: int = 0  # chunks copied device -> host
    loads: int = 0  # chunks copied host -> device
    offload_pages: int = 0
    load_pages: int = 0
    host_evictions: int = 0  # host copies dropped to make room in the host tier
    peer_fetches: int = 0  # chunk uses read from the peer replica that owns them (not hits or misses here)
    peer_loads: int = 0  # chunks copied from a peer's pool
    peer_load_pages: int = 0


@dataclass(slots=True, eq=False)
class Transfer:
    """A chunk's pages copied between the tiers: src[i] -> dst[i], every layer. Offloads go device ->
    host, loads host -> device. `chunk` is None on the worker side (ids are all it needs)."""

    chunk: Chunk | None
    src: list[int]
    dst: list[int]
    num_tokens: int = 0  # the chunk's tokens (offloads: the worker may index its keys on the way out)
    peer: int = -1  # a peer load: the peer replica whose pool holds src


class ChunkTable:
    """Content-addressed store of chunk KV. key = hash(model_id, cond_tokens, tokens).

    The table owns the device page ids of its chunks but never allocates or frees them: ``evict``/
    ``remove`` return page ids and the caller gives them back to the PagePool (shared with the radix
    cache and requests). Which chunks ``evict`` drops is up to the eviction policy
    (lazyrt/cache/eviction.py): lru, lfu or gdsf.

    Host tier (``host_pool``, page ids only): a chunk evicted from the device keeps its identity and
    moves to the host when its pages fit there (host chunks of lower priority make room; otherwise it
    is dropped). Only chunks live in the host tier, so the table allocates and frees host page ids
    itself. A chunk found only on the host is copied back by ``load``. The copies the worker owes are
    handed out by ``take_transfers``; the caller puts them at the start of the next step it sends.
    """

    def __init__(
        self, model_id: str, page_size: int, eviction_policy: str = "lru", host_pool: PagePool | None = None
    ) -> None:
        if page_size <= 0:
            raise ValueError("page_size must be positive")
        if host_pool is not None and host_pool.page_size != page_size:
            raise ValueError("the host pool's page size differs from the table's")
        self.host_pool = host_pool
        # copies not yet taken into a step: device -> host for evicted chunks, host -> device for hits
        self._offloads: list[Transfer] = []
        self._loads: list[Transfer] = []
        self._peer_loads: list[Transfer] = []
        self.policy: EvictionPolicy = make_policy(eviction_policy)
        self.eviction_policy = eviction_policy
        # Min-heap of (priority, seq, chunk) over every chunk (evictable or not). An entry is live
        # while chunk.heap_seq == seq; a priority change pushes a new entry and the old one goes stale.
        self._heap: list[tuple[float, int, Chunk]] = []
        self._seq = 0
        self.model_id = model_id
        self.page_size = page_size
        self.stats = ChunkTableStats()
        # Chunks by exact contents (cond_tokens, tokens): a lookup is one dict access, no digest of
        # the tokens (blake2b of a 2,048-token document's packed ids: ~30 us, 5 of them an admission);
        # two chunks whose digests collide are still two entries.
        self._by_content: dict[PartKey, Chunk] = {}
        self._owned: set[int] = set()
        self._count = 0
        self._clock = 0
        self._model_bytes = model_id.encode()

    def make_key(self, cond_tokens: Sequence[int], tokens: Sequence[int]) -> bytes:
        h = hashlib.blake2b(digest_size=16)
        # Lengths are hashed so (a, b | c) and (a | b, c) differ.
        h.update(array("q", [len(self._model_bytes), len(cond_tokens), len(tokens)]).tobytes())
        h.update(self._model_bytes)
        h.update(_int64_bytes(cond_tokens))
        h.update(_int64_bytes(tokens))
        return h.digest()

    def pages_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def lookup(self, cond_tokens: Sequence[int], tokens: Sequence[int], record: bool = True) -> Chunk | None:
        """Find the chunk with exactly these contents (ready or not); a hit touches it.
        record=False only finds it: the caller reports the use later with `record_use` (a request
        that waits for memory looks its docs up again every step and must count once)."""
        chunk = self.get(PartKey(_as_tuple(cond_tokens), _as_tuple(tokens)))
        if record:
            self.record_use(chunk)
        return chunk

    def get(self, key: PartKey) -> Chunk | None:
        """The chunk with exactly these (cond_tokens, tokens), or None; counts nothing (lookup
        with record=False, for a caller that holds its PartKeys)."""
        return self._by_content.get(key)

    def record_use(self, chunk: Chunk | None) -> None:
        """Count one use: a hit on `chunk` (in the tier it is in now), or a miss when it is None."""
        if chunk is None:
            self.stats.misses += 1
            return
        self._check_member(chunk)
        self.stats.hits += 1
        if chunk.pages:
            self.stats.device_hits += 1
        else:
            self.stats.host_hits += 1
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
        key = self.make_key(cond, toks)  # also checks the ids are int64s
        content = PartKey(cond, toks)
        if content in self._by_content:
            raise ValueError("an equal chunk is already in the table")
        chunk = Chunk(key=key, cond_tokens=cond, tokens=toks, pages=list(pages), content=content)
        self._by_content[content] = chunk
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
        """Evict unreferenced ready chunks from the device, lowest policy priority first, until >=
        num_pages device pages are freed or none remain; returns those pages. A chunk is evicted whole,
        so more than num_pages may come back. With a host tier it moves there (an offload is queued
        unless it already has a host copy, which is never stale: a chunk's KV never changes)."""
        if num_pages <= 0:
            return []
        freed: list[int] = []
        victims = self._lowest(num_pages, lambda c: bool(c.pages) and c.ready and not c.ref_count, _device)
        for chunk in victims:
            self.policy.on_evict(chunk)
            self.stats.evictions += 1
            if not chunk.host_pages and not self._to_host(chunk):
                freed += self._drop(chunk)
                continue
            freed += self._leave_device(chunk)
        return freed

    def offload(self, chunk: Chunk) -> list[int] | None:
        """Move an unreferenced ready chunk to the host tier now, whatever its priority: a request
        waiting for its documents in rounds (retrieval attention) needs it kept there, not dropped
        and recomputed. Host copies no one holds or loads make room. Returns its device pages for
        the caller to free, or None when the host has no room (it stays on the device)."""
        self._check_member(chunk)
        if chunk.ref_count or not chunk.ready or not chunk.pages:
            raise ValueError("offload: the chunk is in use, not ready or not on the device")
        if not chunk.host_pages and not self._to_host(chunk, upto=float("inf")):
            return None
        self.policy.on_evict(chunk)
        self.stats.evictions += 1
        return self._leave_device(chunk)

    def _leave_device(self, chunk: Chunk) -> list[int]:
        """The chunk keeps only its host copy; returns its device pages for the caller to free."""
        freed = chunk.pages
        self._owned.difference_update(freed)
        chunk.pages, chunk.ready = [], False
        return freed

    def load(self, chunk: Chunk, pages: list[int]) -> None:
        """A chunk found only on the host goes back to the device `pages` (allocated by the caller):
        the load is queued, and the chunk is ready for any kernel of the step that takes it or later
        (take_transfers: copies run before the step's kernels). Its host copy stays."""
        self._check_member(chunk)
        if chunk.pages or not chunk.host_pages:
            raise ValueError("load: the chunk is not (only) in the host tier")
        if len(pages) != len(chunk.host_pages) or not self._owned.isdisjoint(pages):
            raise ValueError(f"load: pages {pages} do not fit the chunk or are held by another chunk")
        chunk.pages, chunk.ready, chunk.loading = pages, True, True
        self._owned.update(pages)
        self._loads.append(Transfer(chunk, chunk.host_pages, pages))
        self.stats.loads += 1
        self.stats.load_pages += len(pages)

    def peer_load(self, chunk: Chunk, peer: int, src: list[int]) -> None:
        """A chunk being fetched gets its KV from peer `peer`'s pages `src` (held there for this
        replica): the copy is queued and the chunk is ready for any kernel of the step that takes it
        (take_peer_loads: copies run before the step's kernels) or later."""
        self._check_member(chunk)
        if not chunk.fetching or chunk.ready:
            raise ValueError("peer_load: the chunk is not being fetched")
        if len(src) != len(chunk.pages):
            raise ValueError(f"peer_load: {len(src)} peer pages for a chunk of {len(chunk.pages)}")
        chunk.fetching, chunk.ready, chunk.peer = False, True, peer
        self._peer_loads.append(Transfer(chunk, list(src), chunk.pages, len(chunk.tokens), peer))
        self.stats.peer_loads += 1
        self.stats.peer_load_pages += len(src)

    @property
    def owes_copies(self) -> bool:
        """Copies between the tiers or from peers are queued and no step has taken them yet."""
        return bool(self._offloads or self._loads or self._peer_loads)

    def take_peer_loads(self) -> list[Transfer]:
        """Peer copies owed since the last call, for the step about to be sent (after its host loads,
        before its kernels); those whose chunk has left the table since are dropped."""
        loads = [t for t in self._peer_loads if t.chunk.pages is t.dst and t.chunk.heap_seq >= 0]
        self._peer_loads = []
        return loads

    def take_transfers(self) -> tuple[list[Transfer], list[Transfer]]:
        """(offloads, loads) owed since the last call, for the step about to be sent: the worker
        runs offloads before loads (a load may land in device pages an offload of the same step
        reads, or read host pages one fills), both before the step's kernels. Copies whose chunk has
        since left that tier are dropped (their pages may belong to another copy by now)."""
        # identity, not equality: a page list is replaced whenever a chunk's copy in a tier changes
        offloads = [t for t in self._offloads if t.chunk.host_pages is t.dst and t.chunk.heap_seq >= 0]
        loads = [t for t in self._loads if t.chunk.pages is t.dst and t.chunk.heap_seq >= 0]
        for t in self._loads:
            t.chunk.loading = False
        self._offloads, self._loads = [], []
        return offloads, loads

    def drop_unfinished(self, offloads: list[Transfer], loads: list[Transfer]) -> list[int]:
        """Copies that a failed step was to make may not have happened: forget the copy each made
        (a chunk left in neither tier leaves the table). Returns device pages for the caller to
        free. Every chunk involved must be unreferenced."""
        freed: list[int] = []
        for t in offloads:
            c = t.chunk
            if c.host_pages is t.dst and c.heap_seq >= 0:
                self._free_host(c)
                if not c.pages:
                    self._drop(c)
        for t in loads:
            c = t.chunk
            if c.pages is t.dst and c.heap_seq >= 0:
                freed += c.pages
                if c.host_pages:
                    self._owned.difference_update(c.pages)
                    c.pages, c.ready = [], False
                else:
                    self._drop(c)
        return freed

    def _to_host(self, chunk: Chunk, upto: float | None = None) -> bool:
        """Give the evicted chunk a host copy (queueing its offload) if it fits, making room by
        dropping host copies of priority up to `upto` (default: the chunk's own); False if it does
        not fit."""
        host = self.host_pool
        n = len(chunk.pages)
        if host is None or n > host.num_pages:
            return False
        short = n - host.num_free
        if short > 0:
            # Host copies of no higher priority make room (the same policy across both tiers); never
            # one a queued load reads, nor one of a chunk in use (an admission holds a host-only chunk
            # before it loads it).
            victims = self._lowest(
                short,
                lambda c: bool(c.host_pages) and not c.loading and not c.ref_count,
                _host,
                upto=chunk.priority if upto is None else upto,
            )
            if sum(map(_host, victims)) < short:
                return False
            for c in victims:
                self.policy.on_evict(c)
                self.stats.host_evictions += 1
                self._free_host(c)
                if not c.pages:
                    self._drop(c)
        try:
            chunk.host_pages = host.alloc(n)
        except OutOfPages:
            return False
        self._offloads.append(Transfer(chunk, chunk.pages, chunk.host_pages, len(chunk.tokens)))
        self.stats.offloads += 1
        self.stats.offload_pages += n
        return True

    def _free_host(self, chunk: Chunk) -> None:
        if chunk.host_pages:
            self.host_pool.free(chunk.host_pages)
            chunk.host_pages = []

    def _lowest(
        self,
        num_pages: int,
        eligible: Callable[[Chunk], bool],
        size: Callable[[Chunk], int],
        upto: float = float("inf"),
    ) -> list[Chunk]:
        """Eligible chunks, lowest priority first (none above `upto`), until their sizes reach
        num_pages or none remain. The heap is left as it was: the caller drops or moves them."""
        picked: list[Chunk] = []
        popped: list[tuple[float, int, Chunk]] = []
        heap, total = self._heap, 0
        while total < num_pages and heap and heap[0][0] <= upto:
            entry = heapq.heappop(heap)
            chunk = entry[2]
            if chunk.heap_seq != entry[1]:
                continue  # stale: the chunk was re-prioritized or has left the table
            popped.append(entry)
            if eligible(chunk):
                picked.append(chunk)
                total += size(chunk)
        for entry in popped:
            heapq.heappush(heap, entry)  # dropped chunks' entries go stale (heap_seq = -1)
        return picked

    def clear_unreferenced(self) -> list[int]:
        """Flush: evict every unreferenced chunk, ready or not."""
        freed: list[int] = []
        for chunk in [c for c in self if c.ref_count == 0]:
            freed += self._drop(chunk)
            self.stats.evictions += 1
        return freed

    @property
    def num_pages(self) -> int:
        """Device pages held by chunks."""
        return len(self._owned)

    @property
    def num_host_pages(self) -> int:
        return self.host_pool.num_pages - self.host_pool.num_free if self.host_pool is not None else 0

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[Chunk]:
        yield from self._by_content.values()

    def _check_member(self, chunk: Chunk) -> None:
        # chunk.content is the dict's own key object: its hash is kept and identity settles equality
        if chunk.content is None or self._by_content.get(chunk.content) is not chunk:
            raise ValueError("chunk is not in this table (already removed or evicted?)")

    def _drop(self, chunk: Chunk) -> list[int]:
        del self._by_content[chunk.content]
        self._owned.difference_update(chunk.pages)
        self._free_host(chunk)
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


def _device(chunk: Chunk) -> int:
    return len(chunk.pages)


def _host(chunk: Chunk) -> int:
    return len(chunk.host_pages)


def _int64_bytes(tokens: Sequence[int]) -> bytes:
    """The ids as native int64s (array("q")'s bytes): struct packs a 2,048-token tuple ~4x faster
    than building an array from it, and admission keys every document of a request."""
    try:
        return struct.pack(f"{len(tokens)}q", *tokens)
    except struct.error as e:
        raise TypeError(f"token ids must be integers in the int64 range ({e})") from None


def _as_tuple(tokens: Sequence[int]) -> tuple[int, ...]:
    # Tuples pass through: the scheduler looks up every doc of a waiting request on each admission
    # attempt, and copying 2k-token documents dominated that. An insert's make_key still rejects
    # non-integers (int64 packing); a lookup only compares values, and equal values are equal ids.
    if type(tokens) is tuple:
        return tokens
    return tuple(int(t) for t in tokens)
