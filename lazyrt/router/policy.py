"""Which replica a request goes to: the one that already holds most of its documents' KV.

The router keeps, per replica, what it believes that replica's chunk cache holds: the document keys
it sent there (a document's text, or its registry id), sized in tokens (characters per token learnt
from the answers), kept and evicted by the replica's own eviction policy within its KV capacity. A
request goes to the replica holding the most of its documents' tokens; documents nobody holds yet are
placed by rendezvous hashing (each key's owner among the healthy replicas, the highest hash of key +
replica), so a new document set lands in the same place whatever its order. A replica whose load
(requests in flight) is past the imbalance bound is skipped for the least-loaded one; so are requests
without documents.

When requests draw related documents (one topic's), requests follow their topic and two caches of C
hold about what one of 2C does. When each request's documents are drawn independently, a request's
other documents are computed wherever its majority lives and popular ones end up on every replica:
two caches of C then hold less than one of 2C (docs/benchmarks.md, router).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from lazyrt.cache.eviction import Access, EvictionPolicy, make_policy
from lazyrt.cache.placement import doc_key, owner

__all__ = ["POLICIES", "AffinityPolicy", "Choice", "ReplicaView", "doc_key", "doc_tokens", "owner"]

POLICIES = ("affinity", "hash", "owner", "least_loaded", "round_robin")
ID_DOC_TOKENS = 512  # a registered document's size, unknown to the router




def doc_tokens(doc: object, chars_per_token: float = 4.0, id_tokens: dict[str, int] | None = None) -> int:
    """About how many tokens a document is (the router has no tokenizer: the replicas' answers teach
    it chars_per_token, see AffinityPolicy.observe; id_tokens: documents registered through it)."""
    if isinstance(doc, dict):
        if "id" in doc:
            return (id_tokens or {}).get(str(doc["id"]), ID_DOC_TOKENS)
        return doc_tokens(doc.get("text", ""), chars_per_token)
    return max(1, round(len(str(doc)) / chars_per_token))


@dataclass
class Choice:
    replica: str
    # "affinity" (held most of it, or owns most of the new ones) | "hash" | "least_loaded" (no documents,
    # or that policy) | "imbalance" (the choice was too busy) | "round_robin"
    reason: str
    held: int = 0  # tokens of the request's documents the router believes the replica holds


@dataclass
class HeldDocument:
    """A document the router believes a replica holds, as that replica's eviction policy sees a chunk."""

    tokens: int
    pages: range
    priority: float = 0.0
    hits: int = 0
    seq: int = 0  # the last access that set its priority: ties go to the older one, as in the table


@dataclass
class ReplicaView:
    """What the router believes one replica's chunk cache holds: its documents, kept and evicted the
    way the replica's ChunkTable does (its eviction policy, lru / lfu / gdsf, learnt from /cache_stats;
    whole pages; a document evicted only when a new one needs its room, never one of the request being
    placed). An LRU view of an LFU cache forgets the popular documents the replica keeps and remembers
    one-off ones it dropped."""

    capacity: int | None = None  # tokens; None = not known yet (nothing is dropped)
    eviction_policy: str = "lfu"  # the replicas' default
    page_size: int = 16
    held: dict[bytes, HeldDocument] = field(default_factory=dict)
    tokens: int = 0
    pages: int = 0
    _policy: EvictionPolicy | None = None
    _tick: int = 0

    def holds(self, key: bytes) -> int:
        d = self.held.get(key)
        return d.tokens if d is not None else 0

    def add(self, keys: Sequence[bytes], sizes: Sequence[int]) -> None:
        """The documents of one request sent to the replica, admitted as its scheduler does: the held
        ones are pinned (an access: lru refreshes them), room is made for the new ones at once (never by
        evicting this request's), then each is used in order: a hit, or an insert."""
        if self._policy is None:
            self._policy = make_policy(self.eviction_policy)
        order = list(dict.fromkeys(zip(keys, sizes)))
        for k, _ in order:
            if k in self.held:
                self._access(self.held[k], "acquire")
        new = [(k, HeldDocument(n, range(-(-n // self.page_size)))) for k, n in order if k not in self.held]
        if self.capacity is not None:
            self.make_room(sum(len(d.pages) for _, d in new), {k for k, _ in order})
        fresh = dict(new)
        for k, _ in order:
            d = fresh.get(k)
            if d is None:
                d = self.held[k]
                d.hits += 1
                self._access(d, "hit")
            else:
                self.held[k] = d
                self.tokens += d.tokens
                self.pages += len(d.pages)
                self._access(d, "insert")

    def _access(self, d: HeldDocument, kind: Access) -> None:
        assert self._policy is not None
        self._tick += 1
        if self._policy.on_access(d, kind, self._tick):
            d.seq = self._tick

    def make_room(self, need: int, keep: set[bytes]) -> None:
        assert self._policy is not None and self.capacity is not None
        limit = self.capacity // self.page_size
        while self.pages + need > limit:
            victims = [(d.priority, d.seq, k) for k, d in self.held.items() if k not in keep]
            if not victims:
                return
            k = min(victims)[2]
            self._policy.on_evict(self.held[k])
            d = self.held.pop(k)
            self.tokens -= d.tokens
            self.pages -= len(d.pages)

    def reset(self, capacity: int | None, eviction_policy: str = "lfu", page_size: int = 16) -> None:
        """Forget everything (the replica (re)joined or was flushed), with its cache's size and policy."""
        self.clear()
        self.capacity, self.eviction_policy, self.page_size = capacity, eviction_policy, page_size

    def clear(self) -> None:
        self.held.clear()
        self.tokens = self.pages = 0
        self._policy = None


@dataclass
class AffinityPolicy:
    """imbalance: a replica is skipped when its load exceeds (1 + imbalance) x the least load + slack.
    mode: "affinity" (the above), "hash" (rendezvous owners only, no view of the caches), "owner" (peer
    KV replicas: where most of the request's document tokens are owned, by the owners the replicas
    compute from their peer addresses, `peer_names`), or the baselines "least_loaded" and
    "round_robin", which ignore documents.

    A request moved off its documents computes them where it goes, and at a few requests in flight
    such moves are most of what separates two caches of C from one of 2C; a replica batches its
    requests, so a few more in flight on one than on another cost little. Hence a slack of 16
    (`benchmarks/router_affinity.py --slack 4 16`, CPU, 8 in flight: 24 topics, C = 8,192 tokens,
    123 of 2,000 requests moved and 7.0 points below one 2C at a slack of 4, none and 1.8 at 16; 12
    topics, C = 3,072: 16.1 and 8.0). The relative bound decides under heavy load."""

    imbalance: float = 0.5
    slack: int = 16
    mode: str = "affinity"
    views: dict[str, ReplicaView] = field(default_factory=dict)
    # characters per prompt token, learnt from answers (the views are sized in tokens, like the
    # replicas' caches; 4 is English prose, synthetic or code-heavy text is far from it)
    chars_per_token: float = 4.0
    id_tokens: dict[str, int] = field(default_factory=dict)  # documents registered through the router
    peer_names: dict[str, str] = field(default_factory=dict)  # replica URL -> its peer KV address
    _turn: int = 0  # round_robin: requests routed so far
    _observed: int = 0

    def __post_init__(self) -> None:
        if self.mode not in POLICIES:
            raise ValueError(f"policy {self.mode!r}: must be one of {', '.join(POLICIES)}")

    def observe(self, chars: int, prompt_tokens: int) -> None:
        """An answer's prompt held prompt_tokens for `chars` characters of request text: update the
        ratio (a running mean over the first answers, then an exponential one that follows drift)."""
        if chars <= 0 or prompt_tokens <= 0:
            return
        self._observed += 1
        w = max(1.0 / self._observed, 0.05)
        self.chars_per_token += w * (chars / prompt_tokens - self.chars_per_token)

    def view(self, replica: str) -> ReplicaView:
        return self.views.setdefault(replica, ReplicaView())

    def choose(
        self, keys: Sequence[bytes], load: dict[str, int], sizes: Sequence[int] | None = None
    ) -> Choice:
        """load: requests in flight per healthy replica (at least one); sizes: each key's tokens."""
        if not load:
            raise ValueError("no healthy replica")
        replicas = sorted(load)
        least = min(replicas, key=lambda r: (load[r], r))
        if self.mode == "round_robin":
            self._turn += 1
            return Choice(replicas[(self._turn - 1) % len(replicas)], "round_robin")
        named = {r: self.peer_names[r] for r in replicas if r in self.peer_names}
        if not keys or self.mode == "least_loaded" or (self.mode == "owner" and not named):
            return Choice(least, "least_loaded")
        sizes = list(sizes) if sizes is not None else [1] * len(keys)
        if self.mode == "owner":  # where peer KV caches them: the replicas hash each text the same way
            by_name = {n: r for r, n in named.items()}
            owns = {r: 0 for r in replicas}
            for k, n in zip(keys, sizes):
                owns[by_name[owner(k, list(named.values()))]] += n
            best = max(replicas, key=lambda r: (owns[r], -load[r], r))
            if load[best] > (1 + self.imbalance) * load[least] + self.slack:
                return Choice(least, "imbalance", owns[least])
            return Choice(best, "owner", owns[best])
        held = {r: 0 for r in replicas}
        if self.mode == "affinity":
            for r in replicas:
                v = self.views.get(r)
                held[r] = sum(n for k, n in zip(keys, sizes) if v is not None and v.holds(k))
        owned = {r: 0 for r in replicas}  # of the documents no replica holds: their owners
        for k, n in zip(keys, sizes):
            if self.mode == "hash" or not any(self.views.get(r) and self.views[r].holds(k) for r in replicas):
                owned[owner(k, replicas)] += n
        best = max(replicas, key=lambda r: (held[r], owned[r], -load[r], r))
        if load[best] > (1 + self.imbalance) * load[least] + self.slack:
            return Choice(least, "imbalance", held[least])
        return Choice(best, "affinity" if self.mode == "affinity" else "hash", held[best])

    def record(self, replica: str, keys: Sequence[bytes], sizes: Sequence[int]) -> None:
        """The request went to `replica`: its documents are (about to be) in that cache. With peer KV
        replicas (peer_names known) a document another replica holds stays there (the request reads
        it from that one: a use of its copy) and only the others go into `replica`'s cache."""
        if self.mode != "affinity" or not keys:
            return
        if not self._places(replica):
            self.view(replica).add(keys, sizes)
            return
        mine: dict[bytes, int] = {}
        for k, n in zip(keys, sizes):
            holder = self._holder(k, replica)
            if holder == replica:
                mine[k] = n
            else:
                self.views[holder].add([k], [n])
        self.view(replica).add(list(mine), list(mine.values()))

    def placement(self, keys: Sequence[bytes], replica: str) -> list[str | None] | None:
        """Peer KV, affinity: each document's owner for a request sent to `replica` (the peer address
        of the replica whose view holds it, else `replica`'s own, which will compute it), for the
        replicas to follow (header x-lazyrt-doc-owners); None when there is nothing to place."""
        if self.mode != "affinity" or not keys or not self._places(replica):
            return None
        return [self.peer_names.get(self._holder(k, replica)) for k in keys]

    def _places(self, replica: str) -> bool:
        return replica in self.peer_names

    def _holder(self, key: bytes, replica: str) -> str:
        """The replica whose view holds key (`replica` first), else `replica`; only replicas with a
        peer address count (the others cannot lend their pages)."""
        if self.view(replica).holds(key):
            return replica
        for r in sorted(self.views):
            if r != replica and r in self.peer_names and self.views[r].holds(key):
                return r
        return replica

    def ranked(
        self, keys: Sequence[bytes], load: dict[str, int], sizes: Sequence[int] | None = None
    ) -> tuple[Choice, list[str]]:
        """The choice, and every replica in the order to try: the chosen one, then by least load."""
        c = self.choose(keys, load, sizes)
        return c, [c.replica] + sorted((r for r in load if r != c.replica), key=lambda r: (load[r], r))
