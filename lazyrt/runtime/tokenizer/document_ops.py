"""The tokenizer process's side of /v1/documents: DocumentReq -> DocumentResp against its store.

The store lives here, beside the tokenizer: registering needs the tokenizer, and requests by id
look their tokens up here, so the HTTP process's event loop never waits on sqlite.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from lazyrt.documents import DocumentError, DocumentStore, list_json
from lazyrt.runtime.ipc.messages import DocumentReq, DocumentResp
from lazyrt.runtime.tokenizer.doc_refs import register

logger = logging.getLogger("lazyrt.tokenizer")


def handle_document_req(
    msg: DocumentReq, store: DocumentStore | None, tokenize: Callable[[str], list[int]], max_context: int
) -> DocumentResp:
    try:
        if store is None:
            raise DocumentError(
                "this server runs without a document store (--document-store none)", None
            )
        if msg.op == "add":
            data, created = register(store, tokenize, msg.text, msg.id, msg.metadata, max_context)
            return DocumentResp(msg.rid, data, created=created)
        if msg.op == "get":
            return DocumentResp(msg.rid, store.get(msg.id).to_json(msg.include_text))
        if msg.op == "list":
            docs, more = store.list(msg.limit, msg.after)
            return DocumentResp(msg.rid, list_json(docs, more, msg.include_text))
        if msg.op == "delete":
            store.delete(msg.id)
            return DocumentResp(msg.rid, {"id": msg.id, "object": "document.deleted", "deleted": True})
        raise DocumentError(f"unknown document operation {msg.op!r}", None)
    except DocumentError as e:
        status = 501 if store is None else e.status
        return DocumentResp(msg.rid, status=status, message=str(e), param=e.param)
    except Exception as e:  # a store failure (disk full, say) fails this call, not the process
        logger.exception("document operation %s failed", msg.op)
        return DocumentResp(msg.rid, status=500, message=f"document store error: {e}")
