"""A request's documents (texts, {"text": ...} or {"id": ...}) -> texts and stored token ids.

Shared by the tokenizer process and the in-process Engine, so a document by id gives the same
prompt on both; a registered document's token ids come from the store, not from re-tokenizing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from lazyrt.documents import DocumentError, DocumentStore, check_doc_item, check_text
from lazyrt.runtime.tokenizer.rag_template import DocPart, doc_part


def resolve_docs(items: Sequence[object], store: DocumentStore | None, field: str) -> list[DocPart]:
    """Each item checked (errors name `field[i]...`); texts stay texts, ids become their token ids."""
    return [resolve_doc(item, store, f"{field}[{i}]") for i, item in enumerate(items)]


def resolve_doc(item: object, store: DocumentStore | None, where: str) -> DocPart:
    ref = check_doc_item(item, where)
    if isinstance(ref, str):
        return ref
    if store is None:
        raise DocumentError(
            f"{where}.id: documents by id need a document store, and this one runs without "
            "(document_store='none')",
            f"{where}.id",
        )
    return store.token_ids(ref["id"], f"{where}.id")


def register(
    store: DocumentStore | None,
    tokenize: Callable[[str], list[int]],
    text: object,
    doc_id: str | None = None,
    metadata: dict | None = None,
    max_tokens: int | None = None,
) -> tuple[dict, bool]:
    """Tokenize `text` as a RAG document (doc_part, as requests by text do) and register it.
    Returns the document's API object (without its text) and whether it is new."""
    if store is None:
        raise DocumentError("there is no document store (document_store='none')", None)
    text = check_text(text)
    ids = tokenize(doc_part(text))
    if max_tokens is not None and len(ids) >= max_tokens:
        raise DocumentError(
            f"text: the document is {len(ids)} tokens but the model's context length is {max_tokens}", "text"
        )
    doc, created = store.add(text, ids, doc_id, metadata)
    return doc.to_json(), created
