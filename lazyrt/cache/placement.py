"""Which replica owns a document: rendezvous hashing of a key of the document over the replicas'
names. The router (routing a request where its documents live) and the replicas' schedulers (peer
KV: which replica caches a document) compute the same owner from the same text, so both live here.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

# The router's placement of a request's documents travels to the replica in this header (a JSON list
# of owners' peer addresses, one per document; runtime/server/doc_owners.py reads it)
DOC_OWNERS_HEADER = "x-lazyrt-doc-owners"


def doc_key(doc: object) -> bytes:
    """A document's placement key: its text (a plain string or {"text"}), or {"id"} for a registered one."""
    if isinstance(doc, dict):
        doc = f"id:{doc['id']}" if "id" in doc else doc.get("text", "")
    return hashlib.blake2b(str(doc).encode(), digest_size=16).digest()


def weight(key: bytes, name: str) -> int:
    return int.from_bytes(hashlib.blake2b(key + b"\x00" + name.encode(), digest_size=8).digest(), "big")


def owner(key: bytes, names: Sequence[str]) -> str:
    """The rendezvous-hashing owner of a key among names (at least one): the highest weight of key +
    name, so removing a name moves only the keys it owned."""
    return max(names, key=lambda n: weight(key, n))
