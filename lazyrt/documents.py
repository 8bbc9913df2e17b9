"""DocumentStore: documents registered once (text, token ids, metadata), used later by id.

RAG clients keep a document store; with this one they register each document once and send
`{"id": ...}` instead of its text. The registry is a sqlite file per model (token ids are the model's
tokenizer's), so a restarted server or Engine still knows every document; the KV is recomputed on
first use. Ids are content addressed ("doc-" + sha256 of the text) unless the client names one.

A stored document's token ids are those of its text tokenized as a RAG document (text + separator,
no special tokens): exactly what a request that sends the same text gets, so both share chunk KV.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sqlite3
import sys
import threading
import time
from array import array
from dataclasses import dataclass

MAX_ID_CHARS = 128
MAX_METADATA_BYTES = 64 << 10
MAX_LIST_LIMIT = 100
DEFAULT_LIST_LIMIT = 20
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]*")  # safe in a URL path segment
_CONTENT_ID = re.compile(r"doc-[0-9a-f]{32}")  # content_id's form: a client id may not take another text's


class DocumentError(ValueError):
    """A bad document operation; `param` names the field at fault, `status` the HTTP status."""

    status = 400

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class UnknownDocument(DocumentError, LookupError):
    status = 404


class DocumentConflict(DocumentError):
    status = 409


@dataclass
class Document:
    id: str
    text: str
    token_ids: list[int]
    metadata: dict
    created: int  # unix seconds

    def to_json(self, include_text: bool = False) -> dict:
        """The OpenAI-style object the API returns (text only when asked: documents can be long)."""
        out = {
            "id": self.id,
            "object": "document",
            "created": self.created,
            "tokens": len(self.token_ids),
            "metadata": self.metadata,
        }
        if include_text:
            out["text"] = self.text
        return out


def content_id(text: str) -> str:
    return "doc-" + hashlib.sha256(text.encode("utf-8")).hexdigest()[:32]


def default_store_path(model_id: str, cache_root: str | None = None) -> str:
    """$LAZYRT_CACHE_DIR/documents/<model id>.sqlite (~/.cache/lazyrt without the variable)."""
    root = cache_root or os.environ.get("LAZYRT_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "lazyrt"
    )
    name = re.sub(r"[^A-Za-z0-9._-]", "_", model_id)[:200]
    return os.path.join(root, "documents", f"{name}.sqlite")


def open_store(option: str | None, model_id: str) -> DocumentStore | None:
    """The store EngineConfig.document_store names: None = the default path, "none" = no store."""
    if option == "none":
        return None
    return DocumentStore(option or default_store_path(model_id), model_id)


def check_store_option(option: object) -> None:
    if option is not None and (not isinstance(option, str) or not option.strip()):
        raise ValueError(
            f"document_store={option!r}: must be a file path, 'none', or None (the default path)"
        )


def check_id(doc_id: object, param: str = "id") -> str:
    if not isinstance(doc_id, str):
        raise DocumentError(f"{param}: must be a string, got {type(doc_id).__name__}", param)
    if not 0 < len(doc_id) <= MAX_ID_CHARS or not _ID.fullmatch(doc_id):
        raise DocumentError(
            f"{param}: {doc_id[:MAX_ID_CHARS + 8]!r} is not a document id (1-{MAX_ID_CHARS} characters: "
            "letters, digits and . _ : -, starting with a letter or digit)",
            param,
        )
    return doc_id


def check_precompute(pre: object) -> tuple[bool, str | None]:
    """POST /v1/documents' `precompute` (true, false, null or {"system": str}) -> (precompute?, its system
    prompt); DocumentError naming precompute, precompute.system or an unknown precompute.<key>."""
    if pre is None or isinstance(pre, bool):
        return bool(pre), None
    if not isinstance(pre, dict):
        raise DocumentError(f"precompute: must be true, false or {{'system': str}}, got {pre!r}",
                            "precompute")  # fmt: skip
    extra = sorted(k for k in pre if k != "system")
    if extra:
        raise DocumentError(f"precompute.{extra[0]}: unknown field (precompute takes system)",
                            f"precompute.{extra[0]}")  # fmt: skip
    system = pre.get("system")
    if system is not None and not isinstance(system, str):
        raise DocumentError(f"precompute.system: must be a string, got {type(system).__name__}",
                            "precompute.system")  # fmt: skip
    return True, system


def check_text(text: object, param: str = "text") -> str:
    if not isinstance(text, str):
        raise DocumentError(f"{param}: must be a string, got {type(text).__name__}", param)
    if not text.strip():
        raise DocumentError(f"{param}: must not be empty", param)
    return text


def check_metadata(metadata: object, param: str = "metadata") -> dict:
    if not isinstance(metadata, dict):
        raise DocumentError(f"{param}: must be a JSON object, got {type(metadata).__name__}", param)
    try:
        raw = json.dumps(metadata, ensure_ascii=False, allow_nan=False)
        size = len(raw.encode("utf-8"))  # UnicodeEncodeError (a ValueError): a lone surrogate
    except (TypeError, ValueError, RecursionError) as e:
        raise DocumentError(f"{param}: is not JSON: {e}", param) from e
    if size > MAX_METADATA_BYTES:
        raise DocumentError(f"{param}: is over the {MAX_METADATA_BYTES} byte limit", param)
    return json.loads(raw)  # a plain copy: string keys, JSON values


def _pack(ids: list[int]) -> bytes:
    a = array("i", ids)
    if sys.byteorder == "big":  # the file is little-endian wherever it was written
        a.byteswap()
    return a.tobytes()


def _unpack(blob: bytes) -> list[int]:
    a = array("i")
    a.frombytes(blob)
    if sys.byteorder == "big":
        a.byteswap()
    return a.tolist()


_SCHEMA = """
CREATE TABLE IF NOT EXISTS documents (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,  -- insertion order: list pagination
    id TEXT NOT NULL UNIQUE,
    text TEXT NOT NULL,
    tokens BLOB NOT NULL,
    metadata TEXT NOT NULL,
    created INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS store_info (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""


class DocumentStore:
    """A sqlite registry of documents for one model. Thread-safe; several processes may share a file.

    `path` ":memory:" keeps it in memory (tests). `model_id` is recorded in the file, and a file
    written for another model is refused (its token ids would be wrong for this one)."""

    def __init__(self, path: str, model_id: str):
        self.path = path
        self.model_id = model_id
        self._lock = threading.Lock()
        self._conn: sqlite3.Connection | None = None  # opened on first use: most engines never need it

    @property
    def _db(self) -> sqlite3.Connection:
        """The connection (callers hold the lock); the first use creates the file and checks its model."""
        if self._conn is not None:
            return self._conn
        if self.path != ":memory:":
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        db = sqlite3.connect(self.path, timeout=30, check_same_thread=False, isolation_level=None)
        try:
            db.executescript(_SCHEMA)
            db.execute("INSERT OR IGNORE INTO store_info VALUES ('model_id', ?)", (self.model_id,))
            (owner,) = db.execute("SELECT value FROM store_info WHERE key = 'model_id'").fetchone()
        except BaseException:
            db.close()
            raise
        if owner != self.model_id:
            db.close()
            raise ValueError(
                f"document store {self.path}: its documents were tokenized for model {owner!r}, not "
                f"{self.model_id!r}; give another path (--document-store / document_store)"
            )
        self._conn = db
        return db

    def open(self) -> DocumentStore:
        """Open now (create the file, check its model) rather than on first use."""
        with self._lock:
            self._db  # noqa: B018
        return self

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def __len__(self) -> int:
        with self._lock:
            return self._db.execute("SELECT COUNT(*) FROM documents").fetchone()[0]

    def add(
        self, text: str, token_ids: list[int], doc_id: str | None = None, metadata: dict | None = None
    ) -> tuple[Document, bool]:
        """Register a document; returns it and whether it is new. Registering the same text under the
        same id again returns the stored one (with `metadata`, when given, replacing its metadata);
        an id already holding another text is a DocumentConflict."""
        check_text(text)
        own_id = content_id(text)
        doc_id = own_id if doc_id is None else check_id(doc_id)
        meta = None if metadata is None else check_metadata(metadata)
        if not token_ids:
            raise DocumentError("text: tokenizes to no tokens", "text")
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")  # read-then-write atomically across processes
            try:
                row = self._db.execute("SELECT text FROM documents WHERE id = ?", (doc_id,)).fetchone()
                if row is not None and row[0] != text:
                    raise DocumentConflict(
                        f"id: document {doc_id!r} already exists with a different text; "
                        "delete it first or use another id",
                        "id",
                    )
                if row is None and doc_id != own_id and _CONTENT_ID.fullmatch(doc_id):
                    raise DocumentError(  # else that other text could not be registered by content
                        f"id: {doc_id!r} has the form of a content-addressed id (doc- and 32 hex digits), "
                        f"but it is not this text's ({own_id}); leave id out, or choose one of another form",
                        "id",
                    )
                if row is None:
                    self._db.execute(
                        "INSERT INTO documents (id, text, tokens, metadata, created) VALUES (?, ?, ?, ?, ?)",
                        (doc_id, text, _pack(token_ids), json.dumps(meta or {}), int(time.time())),
                    )
                elif meta is not None:
                    self._db.execute(
                        "UPDATE documents SET metadata = ? WHERE id = ?", (json.dumps(meta), doc_id)
                    )
                # read back in the same transaction: a delete by another process sharing the file
                # cannot land between this registration and its answer
                doc = self._row(doc_id)
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return doc, row is None

    def _row(self, doc_id: str, param: str = "id") -> Document:
        """The document (callers hold the lock)."""
        row = self._db.execute(
            "SELECT id, text, tokens, metadata, created FROM documents WHERE id = ?", (doc_id,)
        ).fetchone()
        if row is None:
            raise UnknownDocument(f"{param}: no document {doc_id!r}", param)
        return Document(row[0], row[1], _unpack(row[2]), json.loads(row[3]), row[4])

    def get(self, doc_id: str, param: str = "id") -> Document:
        with self._lock:
            return self._row(doc_id, param)

    def token_ids(self, doc_id: str, param: str = "id") -> list[int]:
        """Just the tokens (what a request by id needs), without reading the text."""
        with self._lock:
            row = self._db.execute("SELECT tokens FROM documents WHERE id = ?", (doc_id,)).fetchone()
        if row is None:
            raise UnknownDocument(f"{param}: no document {doc_id!r}", param)
        return _unpack(row[0])

    def delete(self, doc_id: str) -> None:
        with self._lock:
            gone = self._db.execute("DELETE FROM documents WHERE id = ?", (doc_id,)).rowcount
        if not gone:
            raise UnknownDocument(f"id: no document {doc_id!r}", "id")

    def list(self, limit: int = DEFAULT_LIST_LIMIT, after: str | None = None) -> tuple[list[Document], bool]:
        """Up to `limit` documents in registration order, starting after the document `after`;
        returns them and whether more follow."""
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LIST_LIMIT:
            raise DocumentError(f"limit: must be an integer in [1, {MAX_LIST_LIMIT}], got {limit!r}", "limit")
        with self._lock:
            start = 0
            if after is not None:
                row = self._db.execute("SELECT seq FROM documents WHERE id = ?", (after,)).fetchone()
                if row is None:
                    raise UnknownDocument(f"after: no document {after!r}", "after")
                start = row[0]
            rows = self._db.execute(
                "SELECT id, text, tokens, metadata, created FROM documents "
                "WHERE seq > ? ORDER BY seq LIMIT ?",
                (start, limit + 1),
            ).fetchall()
        docs = [Document(r[0], r[1], _unpack(r[2]), json.loads(r[3]), r[4]) for r in rows[:limit]]
        return docs, len(rows) > limit


def list_json(docs: list[Document], has_more: bool, include_text: bool = False) -> dict:
    """A page of `DocumentStore.list` as the API's list object."""
    return {
        "object": "list",
        "data": [d.to_json(include_text) for d in docs],
        "first_id": docs[0].id if docs else None,
        "last_id": docs[-1].id if docs else None,
        "has_more": has_more,
    }


def check_doc_item(item: object, where: str) -> str | dict:
    """One item of a request's documents: a string, {"text": str} or {"id": str}. Returns the text
    (a string) or {"id": id}; anything else is a DocumentError naming `where` or its key."""
    if isinstance(item, str):
        return check_text(item, where)
    if not isinstance(item, dict):
        raise DocumentError(
            f"{where}: must be a string, {{'text': str}} or {{'id': str}}, got {type(item).__name__}", where
        )
    extra = sorted(str(k) for k in item if k not in ("id", "text"))
    if extra:
        raise DocumentError(f"{where}.{extra[0]}: unknown key (a document is {{'id'}} or {{'text'}})",
                            f"{where}.{extra[0]}")
    if ("id" in item) == ("text" in item):
        raise DocumentError(f"{where}: give exactly one of 'id' or 'text'", where)
    if "text" in item:
        return check_text(item["text"], f"{where}.text")
    return {"id": check_id(item["id"], f"{where}.id")}
