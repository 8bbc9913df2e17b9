"""Eviction policies of the ChunkTable: each sets ``chunk.priority``; the lowest priority goes first.

The table keeps a heap of (priority, seq, chunk) entries and asks the policy for a new priority on
every access; a policy never scans the table. Only ready chunks with ref_count 0 are ever evicted.

- ``lru``: priority = logical time of the last access (lookup hit, insert, acquire).
- ``lfu``: LFU with dynamic aging (LFU-DA): priority = L + frequency, where frequency counts the
  insert and every lookup hit, and the clock L is raised to the priority of each evicted chunk. A
  formerly hot chunk therefore ages out once chunks inserted later have climbed past its count.
  This is GDSF with cost = size: a miss recomputes the chunk's tokens, so frequency * cost / size
  is the number of recomputed tokens a page of the chunk saves.
- ``gdsf``: greedy-dual-size-frequency with a unit cost per miss: priority = L + frequency / pages.
  It maximizes chunk hits per page of KV, so with documents of mixed sizes it keeps small hot
  documents over large ones of equal popularity. With equal sizes it orders exactly like ``lfu``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sized
from typing import ClassVar, Literal, Protocol

Access = Literal["insert", "hit", "acquire"]


class Evictable(Protocol):
    """What a policy sees of a ChunkTable entry (lazyrt.cache.chunk_table.Chunk has these fields);
    a protocol so that the policies do not depend on the table that uses them."""

    priority: float
    hits: int
    pages: Sized


class EvictionPolicy(ABC):
    name: ClassVar[str]

    @abstractmethod
    def on_access(self, chunk: Evictable, kind: Access, tick: int) -> bool:
        """Update ``chunk.priority`` for an access at logical time ``tick``; True if it changed."""

    def on_evict(self, chunk: Evictable) -> None:
        """Called with each chunk chosen for eviction, before it leaves the table."""
        return None


class LruPolicy(EvictionPolicy):
    name = "lru"

    def on_access(self, chunk: Evictable, kind: Access, tick: int) -> bool:
        chunk.priority = float(tick)
        return True


class _AgingFrequencyPolicy(EvictionPolicy):
    """Greedy-dual with aging: priority = clock + frequency * value(chunk); clock = last evicted."""

    def __init__(self) -> None:
        self.clock = 0.0

    @abstractmethod
    def value(self, chunk: Evictable) -> float:
        """cost / size of one access to the chunk."""

    def on_access(self, chunk: Evictable, kind: Access, tick: int) -> bool:
        if kind == "acquire":
            return False  # a hit was counted by the lookup that found the chunk
        # chunk.hits counts lookup hits; the insert is the first use.
        chunk.priority = self.clock + (chunk.hits + 1) * self.value(chunk)
        return True

    def on_evict(self, chunk: Evictable) -> None:
        # max(): a chunk skipped while referenced may be evicted later with a stale, lower priority.
        self.clock = max(self.clock, chunk.priority)


class LfuPolicy(_AgingFrequencyPolicy):
    name = "lfu"

    def value(self, chunk: Evictable) -> float:
        return 1.0  # cost = size (tokens recomputed on a miss)


class GdsfPolicy(_AgingFrequencyPolicy):
    name = "gdsf"

    def value(self, chunk: Evictable) -> float:
        return 1.0 / max(len(chunk.pages), 1)  # cost = 1 per miss, size in pages


_POLICIES: dict[str, type[EvictionPolicy]] = {p.name: p for p in (LruPolicy, LfuPolicy, GdsfPolicy)}
EVICTION_POLICIES: tuple[str, ...] = tuple(_POLICIES)


def make_policy(name: str) -> EvictionPolicy:
    try:
        return _POLICIES[name]()
    except (KeyError, TypeError):
        raise ValueError(f"eviction_policy={name!r}: must be one of {', '.join(EVICTION_POLICIES)}") from None
