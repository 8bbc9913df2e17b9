"""Peer KV: replicas on one host keep one copy of each document between them and read each other's.

Two replicas of C tokens of KV each hold less than one replica of 2C when each request's documents
are drawn independently: the popular ones end up in both caches and a request computes the ones its
replica lacks (docs/benchmarks.md, router). With --kv-peers each document has one owner among the
replicas (rendezvous hashing of its chunk key over the replicas that answer): only the owner caches
it, and a request anywhere reads it from there. Keys are stored unrotated and position-free, so the
owner's pages serve any request at any offset, the same as on the owner.

The protocol, between the schedulers (one-way ZMQ messages, each naming its sender):
- PeerHello / PeerWelcome at start-up: each replica learns the others' KV pool exports (mapped by its
  worker: cache/kv_share.py) and checks they run the same model, cache mode and page layout.
- A request admitted here with a document owned by peer P and not held here: the chunk is inserted
  with its own pages but not ready ("fetching"), and P is sent PeerEnsure. P holds the chunk (a hit
  there, or a miss it computes as for its own requests) and answers PeerPages once the step that
  wrote its KV has completed on P's device. The chunk is then loaded from P's pages into its own by
  the next step (a peer load, before that step's kernels) and P is sent PeerRelease once that step
  has completed here. Where P had no room, or does not answer within `timeout_s`, the chunk is
  computed here instead.
- A copy read from a peer is dropped once no request here holds it: the owner keeps the document,
  so no replica holds another's documents twice. Chunk hits and misses are counted by the owner;
  here such a use counts as a peer fetch.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from lazyrt.cache import placement
from lazyrt.cache.chunk_table import Chunk, PartKey
from lazyrt.runtime.ipc.messages import PeerEnsure, PeerHello, PeerPages, PeerRelease, PeerWelcome
from lazyrt.runtime.scheduler.plan import ChunkJob

logger = logging.getLogger("lazyrt.scheduler")

HELLO_EVERY_S = 2.0  # a peer that has not answered is asked again this often


@dataclass
class PeerFetch:
    """Chunks this replica asked a peer for (its side of one PeerEnsure)."""

    fetch_id: int
    peer: int
    chunks: list[Chunk]  # in the order of the PeerEnsure's docs
    cond: Chunk | None  # the prefix chunk they are computed after (to compute one here instead)
    sent_at: float
    answered: bool = False
    load_seq: int = -1  # the step that took its copies: released when that step has completed


@dataclass
class PeerPin:
    """Chunks this replica holds for a peer (the owner's side of one PeerEnsure)."""

    sender: int
    fetch_id: int
    chunks: list[Chunk | None]  # None: no room for it here (the sender computes it)
    answered_at: float = 0.0


@dataclass
class PeerStats:
    fetches_sent: int = 0
    fetch_timeouts: int = 0
    refused: int = 0  # documents a peer had no room for (computed here instead)
    pins: int = 0  # PeerEnsures served for peers
    pinned_chunks: int = 0
    lease_expired: int = 0
    stale_answers: int = 0  # answers to fetches given up on (released at once)


@dataclass
class PeerKV:
    """The scheduler's side of peer KV. `names`: every replica's peer address, this one's first.
    Messages to send collect in `outbox` as (peer index, message); the scheduler loop sends them."""

    sched: Any  # the Scheduler (its chunk table, pool and jobs; scheduler.py imports this module)
    names: list[str]
    model_id: str
    cache_mode: str
    page_size: int
    kv_export: list
    timeout_s: float = 10.0
    lease_s: float = 120.0
    outbox: list[tuple[int, object]] = field(default_factory=list)
    stats: PeerStats = field(default_factory=PeerStats)
    exports: dict[int, list] = field(default_factory=dict)  # peers that answered: their pool exports
    _pools_sent: set[int] = field(default_factory=set)  # peers whose export the worker has
    _down_since: dict[int, float] = field(default_factory=dict)  # peer -> when it was last asked
    _fetches: dict[int, PeerFetch] = field(default_factory=dict)
    _next_fetch: int = 1
    _pins: dict[tuple[int, int], PeerPin] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(set(self.names)) != len(self.names) or len(self.names) < 2:
            raise ValueError(f"kv_peers: needs this replica's address and at least one other, all distinct "
                             f"(got {self.names})")  # fmt: skip
        self._index = {n: i for i, n in enumerate(self.names)}
        now = time.monotonic()
        for i in range(1, len(self.names)):
            self._hello(i, now)

    # ---- ownership ----------------------------------------------------------------------------
    def owner(self, key: PartKey, doc_key: bytes | None = None, placed: str | None = None) -> int:
        """The replica that keeps this chunk (0 = this one): where the router placed it (`placed`, a
        replica's peer address: its affinity view of who holds the document) if that replica is this
        one or a peer that answers; else the rendezvous owner among this replica and the peers that
        answer, of the document's placement key (its text's: cache/placement.py, which the router's
        `owner` policy hashes the same way) or else of the chunk's key. Every replica with the same
        peers up picks the same one."""
        if not self.exports:
            return 0
        i = self._index.get(placed) if placed else None
        if i is not None and (i == 0 or i in self.exports):
            return i
        digest = doc_key if doc_key is not None else self.sched.chunks.make_key(key[0], key[1])
        name = placement.owner(digest, [self.names[i] for i in (0, *self.exports)])
        return self._index[name]

    # ---- this replica asks --------------------------------------------------------------------
    def fetch(self, peer: int, chunks: list[Chunk], prefix: tuple[int, ...], cond: Chunk | None) -> None:
        """Ask `peer` for the chunks (inserted here, held by the admitted request, not ready)."""
        for c in chunks:
            c.fetching, c.peer = True, peer
        fid = self._next_fetch
        self._next_fetch += 1
        self._fetches[fid] = PeerFetch(fid, peer, chunks, cond, time.monotonic())
        self.sched.chunks.stats.peer_fetches += len(chunks)
        self.stats.fetches_sent += 1
        docs = [list(c.tokens) for c in chunks]
        self.outbox.append((peer, PeerEnsure(self.names[0], fid, list(prefix), docs)))

    def _answered(self, msg: PeerPages) -> None:
        f = self._fetches.get(msg.fetch_id)
        peer = self._index.get(msg.sender)
        if f is None or f.answered or peer != f.peer:
            self.stats.stale_answers += 1
            if peer is not None:
                self.outbox.append((peer, PeerRelease(self.names[0], msg.fetch_id)))
            return
        f.answered = True
        pages = list(msg.pages) + [None] * (len(f.chunks) - len(msg.pages))
        loaded = False
        for c, src in zip(f.chunks, pages):
            if c.heap_seq < 0 or not c.fetching:  # every request using it is gone: dropped
                continue
            if src is not None and len(src) == len(c.pages) and c.ref_count:
                self.sched.chunks.peer_load(c, f.peer, src)
                loaded = True
            else:
                self.stats.refused += src is None
                self._compute_here(c, f.cond)
        if not loaded:
            self._release(f)

    def _compute_here(self, c: Chunk, cond: Chunk | None) -> None:
        """The owner could not give the chunk: compute it here (still dropped when unreferenced)."""
        c.fetching = False
        s = self.sched
        if not c.ref_count:
            s.pool.free(s.chunks.remove(c))
            return
        if cond is not None and cond.heap_seq < 0:
            cond = None  # cannot happen while a request holds both; never compute after a dropped prefix
        s.queue_job(ChunkJob(c, cond))

    def on_planned(self, seq: int) -> None:
        """Step `seq` took every peer copy owed so far (ChunkTable.take_peer_loads)."""
        for f in self._fetches.values():
            if f.answered and f.load_seq < 0:
                f.load_seq = seq

    def _release(self, f: PeerFetch) -> None:
        self._fetches.pop(f.fetch_id, None)
        self.outbox.append((f.peer, PeerRelease(self.names[0], f.fetch_id)))

    # ---- peers ask this replica ---------------------------------------------------------------
    def _ensure(self, sender: int, msg: PeerEnsure) -> None:
        s = self.sched
        chunks, cond = s.chunks, None
        prefix = tuple(msg.prefix)
        if prefix:
            cond = chunks.get(PartKey((), prefix))
        held_cond = cond
        if cond is not None:
            chunks.acquire(cond)  # held while the pin is set up (the jobs after it take their own refs)
            if not cond.pages and not self._to_device(cond):
                chunks.release(cond)
                for _ in msg.docs:
                    chunks.record_use(None)
                self._pins[(sender, msg.fetch_id)] = PeerPin(sender, msg.fetch_id, [None] * len(msg.docs))
                self._answer_ready()
                return
        held: list[Chunk | None] = []
        for d in msg.docs:
            c = chunks.get(PartKey(prefix, tuple(d)))
            if c is not None and not c.fetching and c.peer < 0:
                chunks.record_use(c)
                chunks.acquire(c)
                if not c.pages and not self._to_device(c):
                    chunks.release(c)
                    c = None
            else:
                c = self._compute(tuple(d), prefix, cond)
                if c is not None and prefix and cond is None:
                    cond = chunks.get(PartKey((), prefix))
            held.append(c)
        if held_cond is not None:
            chunks.release(held_cond)
        self.stats.pins += 1
        self.stats.pinned_chunks += sum(c is not None for c in held)
        self._pins[(sender, msg.fetch_id)] = PeerPin(sender, msg.fetch_id, held)
        self._answer_ready()

    def _to_device(self, c: Chunk) -> bool:
        """A held chunk found only in the host tier is loaded back (its copy runs before the next
        step's kernels); False when the pool has no room for it."""
        s = self.sched
        n = len(c.host_pages)
        s.make_room(n)
        if s.pool.num_free < n:
            return False
        s.chunks.load(c, s.pool.alloc(n))
        return True

    def _compute(self, doc: tuple[int, ...], prefix: tuple[int, ...], cond: Chunk | None) -> Chunk | None:
        """A document a peer asked for and nobody here has: computed as for a request of this
        replica (a miss), after its prefix chunk (computed too if missing); None without room."""
        s, chunks = self.sched, self.sched.chunks
        existing = chunks.get(PartKey(prefix, doc))
        if existing is not None:  # a copy read from a peer, or one being fetched: not this replica's
            return None
        need = s.pages_for(len(doc)) + (s.pages_for(len(prefix)) if prefix and cond is None else 0)
        s.make_room(need)
        if s.pool.num_free < need:
            chunks.record_use(None)
            return None
        if prefix and cond is None:
            cond = chunks.insert((), prefix, s.pool.alloc(s.pages_for(len(prefix))))
            s.queue_job(ChunkJob(cond, None))
        chunks.record_use(None)
        c = chunks.insert(prefix, doc, s.pool.alloc(s.pages_for(len(doc))))
        chunks.acquire(c)
        if cond is not None and not cond.ready and all(j.chunk is not cond for j in s.jobs):
            s.queue_job(ChunkJob(cond, None))
        s.queue_job(ChunkJob(c, cond))
        return c

    def _answer_ready(self) -> None:
        """Answers the pins whose chunks' KV is on the device: ready, and the step that wrote it has
        completed (the peer's copy runs on its own device stream, unordered with this one's)."""
        done = self.sched.complete_seq
        now = time.monotonic()
        for pin in self._pins.values():
            if pin.answered_at:
                continue
            for i, c in enumerate(pin.chunks):
                if c is not None and not c.ready and c.heap_seq >= 0 and not c.loading and not any(
                    j.chunk is c for j in self.sched.jobs
                ):  # its job was dropped (a failed step): give it up
                    self.sched.chunks.release(c)
                    pin.chunks[i] = None
            # (a load from the host tier: ready_seq is set when a step takes it, `loading` until then)
            if all(c is None or (c.ready and not c.loading and c.ready_seq <= done) for c in pin.chunks):
                pin.answered_at = now
                pages = [list(c.pages) if c is not None else None for c in pin.chunks]
                self.outbox.append((pin.sender, PeerPages(self.names[0], pin.fetch_id, pages)))

    def _unpin(self, key: tuple[int, int]) -> None:
        pin = self._pins.pop(key, None)
        if pin is None:
            return
        for c in pin.chunks:
            if c is not None and c.heap_seq >= 0:
                self.sched.chunks.release(c)

    # ---- both sides ---------------------------------------------------------------------------
    def on_complete(self, seq: int) -> None:
        """Step `seq` (and every one before it) has completed on this device."""
        for f in [f for f in self._fetches.values() if 0 <= f.load_seq <= seq]:
            self._release(f)
        self._answer_ready()

    def handle(self, msg: object) -> None:
        sender = self._index.get(getattr(msg, "sender", None))
        if sender is None or sender == 0:
            logger.warning("kv_peers: a %s from %r, which is not one of this replica's peers: ignored",
                           type(msg).__name__, getattr(msg, "sender", None))  # fmt: skip
            return
        if isinstance(msg, PeerHello):
            self.outbox.append((sender, PeerWelcome(self.names[0], self.model_id, self.cache_mode,
                                                    self.page_size, self.kv_export)))  # fmt: skip
            if sender not in self.exports:
                self._hello(sender, time.monotonic())  # it has (re)started: ask for its pool too
        elif isinstance(msg, PeerWelcome):
            self._welcome(sender, msg)
        elif isinstance(msg, PeerEnsure):
            self._ensure(sender, msg)
        elif isinstance(msg, PeerPages):
            self._answered(msg)
        elif isinstance(msg, PeerRelease):
            self._unpin((sender, msg.fetch_id))
        else:
            logger.error("kv_peers: unexpected message %s", type(msg).__name__)

    def _welcome(self, sender: int, msg: PeerWelcome) -> None:
        why = self._mismatch(msg)
        if why:
            logger.error("kv_peers: peer %s cannot share KV with this replica: %s", msg.sender, why)
            return
        if self.exports.get(sender) != msg.kv_export:
            self._pools_sent.discard(sender)  # a new pool (the peer restarted): map it again
            # its old pins are gone with it: fetches waiting on it are computed here
            for f in [f for f in self._fetches.values() if f.peer == sender and not f.answered]:
                self._give_up(f)
            for key in [k for k in self._pins if k[0] == sender]:
                self._unpin(key)
            logger.info("kv_peers: peer %s is up", msg.sender)
        self.exports[sender] = msg.kv_export
        self._down_since.pop(sender, None)

    def _mismatch(self, msg: PeerWelcome) -> str:
        mine = self.kv_export
        if msg.model_id != self.model_id:
            return f"model {msg.model_id!r} vs {self.model_id!r}"
        if msg.cache_mode != self.cache_mode:
            return f"cache_mode {msg.cache_mode!r} vs {self.cache_mode!r}"
        if msg.page_size != self.page_size:
            return f"page_size {msg.page_size} vs {self.page_size}"
        if msg.kv_export[0] != mine[0]:
            return f"its KV pool is {msg.kv_export[0]}, this one's {mine[0]} (both on GPUs or on the CPU)"
        shape, dtype = msg.kv_export[-2:]
        if [shape[0], *shape[2:]] != [mine[-2][0], *mine[-2][2:]] or dtype != mine[-1]:
            return f"KV page layout {shape} {dtype} vs {mine[-2]} {mine[-1]}"
        return ""

    def take_pools(self) -> list[list]:
        """[peer, export] for each peer whose pool the worker has not mapped yet: sent with a step."""
        new = [[i, e] for i, e in self.exports.items() if i not in self._pools_sent]
        self._pools_sent.update(i for i, _ in new)
        return new

    def on_failed(self) -> None:
        """A step failed and every running request with it (Scheduler.fail_running): the worker may
        not have mapped the pools it carried (sent again with the next step), and the copies taken
        into the failed steps will not complete: their fetches are released now (the chunks they
        filled are dropped with their requests)."""
        self._pools_sent.clear()
        for f in [f for f in self._fetches.values() if f.load_seq >= 0]:
            self._release(f)

    def tick(self, now: float | None = None) -> None:
        """Timeouts: fetches not answered in timeout_s are computed here (the peer is taken as down
        and asked again later); pins not released in lease_s are released (the reader is gone)."""
        now = time.monotonic() if now is None else now
        for f in [f for f in self._fetches.values() if not f.answered and now - f.sent_at > self.timeout_s]:
            logger.warning("kv_peers: peer %s did not answer in %.0f s: computing its documents here",
                           self.names[f.peer], self.timeout_s)  # fmt: skip
            self.stats.fetch_timeouts += 1
            self.exports.pop(f.peer, None)
            self._give_up(f)
        for key, pin in list(self._pins.items()):
            if pin.answered_at and now - pin.answered_at > self.lease_s:
                logger.warning("kv_peers: peer %s did not release its fetch in %.0f s: releasing it",
                               self.names[pin.sender], self.lease_s)  # fmt: skip
                self.stats.lease_expired += 1
                self._unpin(key)
        for i in range(1, len(self.names)):
            if i not in self.exports and now - self._down_since.get(i, 0.0) > HELLO_EVERY_S:
                self._hello(i, now)

    def _give_up(self, f: PeerFetch) -> None:
        """Stop waiting on f: its chunks are computed here; a late answer is released at once."""
        f.answered = True
        self._fetches.pop(f.fetch_id, None)
        for c in f.chunks:
            if c.heap_seq >= 0 and c.fetching:
                self._compute_here(c, f.cond)

    def _hello(self, peer: int, now: float) -> None:
        self._down_since[peer] = now
        self.outbox.append((peer, PeerHello(self.names[0], self.model_id)))

    def take_outbox(self) -> list[tuple[int, object]]:
        out, self.outbox = self.outbox, []
        return out

    @property
    def busy(self) -> bool:
        """Peers wait on this replica (pins to answer) or it waits on them (fetches)."""
        return any(not p.answered_at for p in self._pins.values()) or bool(self._fetches)

    def stats_dict(self) -> dict:
        st = self.stats
        return {
            "kv_peer_addr": self.names[0],
            "kv_peers_up": len(self.exports),
            "peer_fetches_sent": st.fetches_sent,
            "peer_fetch_timeouts": st.fetch_timeouts,
            "peer_refused_chunks": st.refused,
            "peer_pins": st.pins,
            "peer_pinned_chunks": st.pinned_chunks,
            "peer_pins_held": len(self._pins),
            "peer_lease_expired": st.lease_expired,
        }
