"""The router's placement of a request's documents (peer KV): which replica owns each one, sent in
a header of the forwarded request. The replicas' schedulers follow it when that replica answers
(runtime/scheduler/peer_kv.py), so a document is cached where the router's view says it is."""

from __future__ import annotations

import json

from lazyrt.cache.placement import DOC_OWNERS_HEADER
from lazyrt.runtime.server.errors import ApiError

__all__ = ["DOC_OWNERS_HEADER", "doc_owners_header"]


def doc_owners_header(value: str | None) -> list[str] | None:
    """The header's JSON list: one peer address (or null, "": the replica decides) per document, in
    the request's order. None when absent; ApiError 400 naming the header when malformed."""
    if value is None:
        return None
    try:
        owners = json.loads(value)
    except json.JSONDecodeError:
        owners = None
    if not isinstance(owners, list) or not all(o is None or isinstance(o, str) for o in owners):
        raise ApiError(400, f"{DOC_OWNERS_HEADER}: must be a JSON list of peer addresses (or null), one per "
                       "document", DOC_OWNERS_HEADER)  # fmt: skip
    return [o or "" for o in owners]
