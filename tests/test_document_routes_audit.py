"""The documents API with odd input: a client id shaped like another text's content id, a delete
landing from another process sharing the store, repeated query parameters; and a server that still
answers a chat request with documents after all of it."""

from __future__ import annotations

import httpx
import pytest
from server_util import ServerProc

from lazyrt.documents import DocumentError, DocumentStore, content_id


# ---- the store ------------------------------------------------------------------------------------
def test_a_client_id_cannot_take_another_texts_content_id():
    """Before: {"text": A, "id": content_id(B)} registered, and then B itself could not be registered
    without an id: a 409 naming `id`, a field that request never sent."""
    store = DocumentStore(":memory:", "m")
    with pytest.raises(DocumentError) as e:
        store.add("text A", [1, 2], content_id("text B"))
    assert e.value.param == "id" and e.value.status == 400 and content_id("text B") in str(e.value)
    doc, created = store.add("text B", [3])
    assert created and doc.id == content_id("text B") and doc.text == "text B"
    # a text's own content id, or an id of another form, is still the client's to give
    assert store.add("text A", [1, 2], content_id("text A"))[0].id == content_id("text A")
    assert store.add("text C", [4], "doc-notahash")[0].id == "doc-notahash"
    assert store.add("text D", [5], "DOC-" + "0" * 32)[0].text == "text D"
    assert len(store) == 4


class _DeleteAfterCommit:
    """A sqlite connection that, right after each COMMIT, lets another process's store delete `doc_id`:
    the interleaving of a registration and a concurrent delete on a shared store file."""

    def __init__(self, conn, other: DocumentStore, doc_id: str):
        self._conn, self._other, self._doc_id = conn, other, doc_id

    def execute(self, sql, *args):
        out = self._conn.execute(sql, *args)
        if sql == "COMMIT":
            self._other.delete(self._doc_id)
        return out

    def __getattr__(self, name):
        return getattr(self._conn, name)


def test_a_registration_answers_what_it_registered_when_a_delete_follows_at_once(tmp_path):
    """Before: add() read its document back after committing, so a delete from another process (two
    servers share the default store of a model) in between made a successful registration raise
    UnknownDocument (POST /v1/documents answered 404 'no document')."""
    path = str(tmp_path / "shared.sqlite")
    mine, theirs = DocumentStore(path, "m").open(), DocumentStore(path, "m").open()
    mine._conn = _DeleteAfterCommit(mine._conn, theirs, "shared-doc")
    doc, created = mine.add("some text", [7, 8, 9], "shared-doc", {"k": 1})
    assert created and (doc.id, doc.text, doc.token_ids, doc.metadata) == ("shared-doc", "some text",
                                                                          [7, 8, 9], {"k": 1})  # fmt: skip
    assert len(theirs) == 0  # and the delete did go through after it


# ---- a real server --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    store = tmp_path_factory.mktemp("docs_audit") / "store.sqlite"
    srv = ServerProc("--device", "cpu", "--kv-cache-tokens", "4096", "--max-model-len", "1024",
                     "--document-store", str(store), "--log-level", "warning")  # fmt: skip
    try:
        srv.wait_healthy()
        yield srv
    finally:
        srv.stop()


@pytest.fixture()
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def _err(r: httpx.Response, status: int, param: str) -> str:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"], err
    return err["message"]


@pytest.mark.slow
def test_repeated_query_parameters_are_refused_not_dropped(http):
    """Before: ?limit=5&limit=1 listed 1 document, ?include_text=true&include_text=false no text: the
    first value dropped without a word."""
    for i in range(3):
        assert http.post("/v1/documents", json={"text": f"repeat {i}", "id": f"rep-{i}"}).status_code == 200
    _err(http.get("/v1/documents?limit=5&limit=1"), 400, "limit")
    _err(http.get("/v1/documents?after=rep-0&after=rep-1"), 400, "after")
    _err(http.get("/v1/documents/rep-0?include_text=true&include_text=false"), 400, "include_text")
    page = http.get("/v1/documents?limit=2&after=rep-0").json()  # one of each: as before
    assert [d["id"] for d in page["data"]] == ["rep-1", "rep-2"]
    assert http.get("/v1/documents/rep-0?include_text=1").json()["text"] == "repeat 0"


@pytest.mark.slow
def test_content_id_squatting_is_a_400_and_the_server_serves_on(http):
    squat = content_id("Quenta is the capital of Arvania.")
    msg = _err(http.post("/v1/documents", json={"text": "Another text.", "id": squat}), 400, "id")
    assert squat in msg
    doc = http.post("/v1/documents", json={"text": "Quenta is the capital of Arvania."}).json()
    assert doc["id"] == squat and doc["tokens"] > 0
    body = {"messages": [{"role": "user", "content": "What is the capital of Arvania?"}], "max_tokens": 4,
            "documents": [{"id": squat}, "Mount Feller is 5,210 metres tall."]}  # fmt: skip
    out = http.post("/v1/chat/completions", json=body)
    assert out.status_code == 200, out.text
    assert out.json()["usage"]["prompt_tokens"] > doc["tokens"] and out.json()["choices"][0]["message"]
