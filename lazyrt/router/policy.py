"""Which replica a request goes to: the one that already holds most of its documents' KV.

Each document (its text, or its registry id) is a key; rendezvous hashing gives every key one owner
replica among the healthy ones (highest hash of key + replica), so a document's chunks are computed
on one replica and found there again, whatever the other documents of the request or their order,
and only the keys of a replica that leaves move. A request goes to the replica owning most of its
keys, unless that replica's load (requests in flight) is past the imbalance bound: then, and for
requests without documents, to the least-loaded replica.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass


def _weight(key: bytes, replica: str) -> int:
    return int.from_bytes(hashlib.blake2b(key + b"\x00" + replica.encode(), digest_size=8).digest(), "big")


def doc_key(doc: object) -> bytes:
    """A document's routing key: its text (a plain string or {"text"}), or {"id"} for a registered one."""
    if isinstance(doc, dict):
        doc = f"id:{doc['id']}" if "id" in doc else doc.get("text", "")
    return hashlib.blake2b(str(doc).encode(), digest_size=16).digest()


def owner(key: bytes, replicas: Sequence[str]) -> str:
    """The rendezvous-hashing owner of a key among replicas."""
    return max(replicas, key=lambda r: _weight(key, r))


@dataclass
class Choice:
    replica: str
    reason: str  # "affinity" | "least_loaded" (no documents) | "imbalance" (the owner was too busy)
    owned: int = 0  # of the request's documents, how many the chosen replica owns


POLICIES = ("affinity", "least_loaded", "round_robin")


@dataclass
class AffinityPolicy:
    """imbalance: the owner is skipped when its load exceeds (1 + imbalance) x the least load + slack.
    mode: "affinity" (the above), or the baselines "least_loaded" and "round_robin" (documents ignored)."""

    imbalance: float = 0.5
    slack: int = 4
    mode: str = "affinity"
    _turn: int = 0  # round_robin: requests routed so far

    def __post_init__(self) -> None:
        if self.mode not in POLICIES:
            raise ValueError(f"policy {self.mode!r}: must be one of {', '.join(POLICIES)}")

    def choose(self, keys: Sequence[bytes], load: dict[str, int]) -> Choice:
        """load: requests in flight per healthy replica (at least one)."""
        if not load:
            raise ValueError("no healthy replica")
        replicas = sorted(load)
        least = min(replicas, key=lambda r: (load[r], r))
        if self.mode == "round_robin":
            self._turn += 1
            return Choice(replicas[(self._turn - 1) % len(replicas)], "round_robin")
        if not keys or self.mode == "least_loaded":
            return Choice(least, "least_loaded")
        owned: dict[str, int] = {}
        for k in keys:
            o = owner(k, replicas)
            owned[o] = owned.get(o, 0) + 1
        best = max(owned, key=lambda r: (owned[r], -load[r], r))
        if load[best] > (1 + self.imbalance) * load[least] + self.slack:
            return Choice(least, "imbalance", owned.get(least, 0))
        return Choice(best, "affinity", owned[best])

    def ranked(self, keys: Sequence[bytes], load: dict[str, int]) -> tuple[Choice, list[str]]:
        """The choice, and every replica in the order to try: the chosen one, then by least load."""
        c = self.choose(keys, load)
        return c, [c.replica] + sorted((r for r in load if r != c.replica), key=lambda r: (load[r], r))
