"""Documents by reference: the sqlite DocumentStore, the tokenizer process's resolution of {"id"}
documents, and the Engine / frontend API (add_document, {"id": ...} in rag and generate)."""

from __future__ import annotations

import hashlib
import json
import os
import random

import pytest

from lazyrt import Engine, RagPrompt, SamplingParams
from lazyrt.documents import (
    DocumentConflict,
    DocumentError,
    DocumentStore,
    UnknownDocument,
    check_doc_item,
    content_id,
    default_store_path,
    open_store,
)
from lazyrt.runtime.ipc.messages import DocumentReq, GenerateReq, decode, encode
from lazyrt.runtime.tokenizer.document_ops import handle_document_req
from lazyrt.runtime.tokenizer.request_tokenizer import InvalidRequest, RequestTokenizer

WORDS = ["river", "Quenta", "1822", "lumen", "tides", "é", "北京", "the", "of", "Arvania", ".", ","]


def _text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n)) + rng.choice([".", "!", "?", ""])


def wire(msg):
    return decode(encode(msg))


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(0, 50_000) for _ in range(n)]


# ---- the store --------------------------------------------------------------------------------
def test_store_roundtrip_pagination_delete_and_reopen(tmp_path):
    rng = random.Random()
    path = str(tmp_path / "docs.sqlite")
    store = DocumentStore(path, "model-a")
    with pytest.raises(UnknownDocument):
        store.get("doc-x")
    assert len(store) == 0 and os.path.exists(path)  # created on first use
    added = []  # (id, text, ids, metadata) in registration order
    for i in range(rng.randint(7, 15)):
        text, ids = f"{i} {_text(rng, rng.randint(3, 30))}", _ids(rng, rng.randint(1, 300))
        meta = {"source": _text(rng, 3), "n": rng.randint(0, 9)} if rng.random() < 0.5 else None
        doc_id = f"client-{i}.v1" if rng.random() < 0.5 else None
        doc, created = store.add(text, ids, doc_id, meta)
        assert created
        want_id = doc_id or "doc-" + hashlib.sha256(text.encode()).hexdigest()[:32]
        assert doc.id == want_id and doc.token_ids == ids and doc.metadata == (meta or {})
        added.append((doc.id, text, ids, meta or {}))
    # the same text under the same id again: the stored one (metadata replaced only when given)
    doc_id, text, ids, meta = added[0]
    again, created = store.add(text, ids, doc_id)
    assert not created and again.metadata == meta
    again, _ = store.add(text, ids, doc_id, {"replaced": True})
    assert again.metadata == {"replaced": True}
    added[0] = (doc_id, text, ids, {"replaced": True})
    with pytest.raises(DocumentConflict) as e:  # an id holding another text
        store.add(text + " changed", ids, doc_id)
    assert e.value.param == "id" and doc_id in str(e.value) and e.value.status == 409
    # pages of random sizes walk every document once, in registration order
    seen, after = [], None
    while True:
        page, more = store.list(rng.randint(1, 4), after)
        seen += page
        if not more:
            break
        after = page[-1].id
    assert [(d.id, d.text, d.token_ids, d.metadata) for d in seen] == added
    with pytest.raises(UnknownDocument) as e:
        store.list(3, "no-such-doc")
    assert e.value.param == "after"
    # delete: gone from get, token_ids and list; deleting again is a 404
    gone = rng.choice(added)[0]
    store.delete(gone)
    with pytest.raises(UnknownDocument):
        store.get(gone)
    with pytest.raises(UnknownDocument) as e:
        store.token_ids(gone, "documents[3].id")
    assert e.value.param == "documents[3].id" and e.value.status == 404
    with pytest.raises(UnknownDocument):
        store.delete(gone)
    left = [a for a in added if a[0] != gone]
    store.close()
    # a new process on the same file (a restarted server) sees the same registry
    reopened = DocumentStore(path, "model-a")
    docs, more = reopened.list(100)
    assert not more and [(d.id, d.text, d.token_ids, d.metadata) for d in docs] == left
    assert len(reopened) == len(left)
    other = DocumentStore(path, "model-b")
    with pytest.raises(ValueError, match="model-a"):  # its token ids belong to model-a's tokenizer
        other.open()
    with pytest.raises(ValueError, match="model-a"):
        other.list()


@pytest.mark.parametrize(
    "call, param",
    [
        (lambda s: s.add("", [1]), "text"),
        (lambda s: s.add("   ", [1]), "text"),
        (lambda s: s.add("x", [1], "has space"), "id"),
        (lambda s: s.add("x", [1], "a" * 129), "id"),
        (lambda s: s.add("x", [1], "-lead"), "id"),
        (lambda s: s.add("x", [1], None, ["not", "an", "object"]), "metadata"),
        (lambda s: s.add("x", [1], None, {"bad": float("nan")}), "metadata"),
        (lambda s: s.add("x", [1], None, {"big": "x" * 70_000}), "metadata"),
        (lambda s: s.list(0), "limit"),
        (lambda s: s.list(101), "limit"),
    ],
)
def test_store_rejects_bad_input_naming_the_field(call, param):
    store = DocumentStore(":memory:", "m")
    with pytest.raises(DocumentError) as e:
        call(store)
    assert e.value.param == param and str(e.value).startswith(param)
    assert len(store) == 0


@pytest.mark.parametrize(
    "item, param",
    [
        ({"id": "a", "text": "b"}, "documents[2]"),
        ({}, "documents[2]"),
        ({"id": "a", "title": "x"}, "documents[2].title"),
        ({"id": 7}, "documents[2].id"),
        ({"text": ""}, "documents[2].text"),
        (42, "documents[2]"),
        ("  ", "documents[2]"),
    ],
)
def test_request_document_items_are_checked(item, param):
    with pytest.raises(DocumentError) as e:
        check_doc_item(item, "documents[2]")
    assert e.value.param == param and str(e.value).startswith(param)
    assert check_doc_item({"text": "hi"}, "d") == "hi" and check_doc_item({"id": "x"}, "d") == {"id": "x"}


def test_default_path_is_per_model_under_the_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("LAZYRT_CACHE_DIR", str(tmp_path))
    a, b = default_store_path("m.gguf:abc"), default_store_path("other/model:1")
    assert a.startswith(str(tmp_path / "documents")) and a.endswith(".sqlite") and a != b
    store = open_store(None, "m.gguf:abc")
    assert store.path == a and not os.path.exists(a)  # nothing written until a document is used
    store.add("text", [1, 2])
    assert os.path.exists(a) and DocumentStore(a, "m.gguf:abc").get(content_id("text")).token_ids == [1, 2]
    assert open_store("none", "m") is None


# ---- the tokenizer process: registering and resolving ------------------------------------------
def test_tokenizer_by_id_equals_by_text(tokenizer):
    """Documents registered the way POST /v1/documents does resolve to the token ids the same
    texts get in every request shape (chat, completions, /generate, programs), and those are the
    tokenizer's own ids of text + blank line."""
    rng = random.Random()
    store = DocumentStore(":memory:", "m")
    rt = RequestTokenizer(tokenizer, 1 << 20, len(tokenizer), store=store)
    texts = [_text(rng, rng.randint(4, 40)) for _ in range(4)]
    ids = []
    for t in texts:
        resp = handle_document_req(DocumentReq(1, "add", text=t), store, rt.doc_cache.get, rt.max_context)
        assert resp.status == 200 and resp.created
        ids.append(resp.data["id"])
        ref = tokenizer(t + "\n\n", add_special_tokens=False).input_ids  # independent of lazyrt's code
        assert store.token_ids(resp.data["id"]) == ref and resp.data["tokens"] == len(ref)
    sp = SamplingParams(max_tokens=4)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Which river?"}]
    shapes = [
        dict(text="Which river?", system="Be brief.", text_mode="rag"),
        dict(messages=msgs),
        dict(text="Answer:", text_mode="raw"),
        dict(messages=[*msgs, {"role": "assistant", "content": "The"}], text_mode="program",
             continue_final=True),  # fmt: skip
    ]
    for shape in shapes:
        order = rng.sample(range(4), 3)
        by_text = [texts[i] for i in order]
        mixed = [rng.choice([texts[i], {"id": ids[i]}]) for i in order]
        # as the scheduler receives them (cached texts' ids travel as arrays, stored ids as lists)
        a = wire(rt.tokenize(GenerateReq(1, sp, docs=by_text, **shape)))
        b = wire(rt.tokenize(GenerateReq(2, sp, docs=[{"id": ids[i]} for i in order], **shape)))
        c = wire(rt.tokenize(GenerateReq(3, sp, docs=mixed, **shape)))
        assert (a.prefix, a.docs, a.suffix) == (b.prefix, b.docs, b.suffix) == (c.prefix, c.docs, c.suffix)
        assert b.docs == [store.token_ids(ids[i]) for i in order]
    # an unknown id is a 404 naming the item; documents by id need a store
    with pytest.raises(InvalidRequest) as e:
        rt.tokenize(GenerateReq(4, sp, messages=msgs, docs=[texts[0], {"id": "doc-nope"}]))
    assert e.value.status == 404 and e.value.param == "documents[1].id" and "doc-nope" in str(e.value)
    with pytest.raises(InvalidRequest) as e:
        rt.tokenize(GenerateReq(5, sp, text="q", text_mode="rag", docs=[{"id": "doc-nope"}]))
    assert e.value.param == "docs[0].id"
    no_store = RequestTokenizer(tokenizer, 1 << 20, len(tokenizer))
    with pytest.raises(InvalidRequest) as e:
        no_store.tokenize(GenerateReq(6, sp, messages=msgs, docs=[{"id": ids[0]}]))
    assert e.value.status == 400 and e.value.param == "documents[0].id" and "document store" in str(e.value)


def test_document_ops_answer_with_statuses_naming_the_field(tokenizer):
    store = DocumentStore(":memory:", "m")
    tok = lambda t: tokenizer(t, add_special_tokens=False).input_ids  # noqa: E731

    def op(**kw) -> object:
        return handle_document_req(DocumentReq(1, **kw), store, tok, 64)

    ok = op(op="add", text="A short document.", id="short", metadata={"k": [1, 2]})
    assert ok.status == 200 and ok.created and ok.data["id"] == "short" and "text" not in ok.data
    assert not op(op="add", text="A short document.", id="short").created
    r = op(op="add", text="Another text.", id="short")
    assert (r.status, r.param) == (409, "id") and "short" in r.message
    r = op(op="add", text="word " * 100)  # longer than the 64-token context: never usable
    assert (r.status, r.param) == (400, "text") and "context" in r.message
    assert op(op="get", id="short", include_text=True).data["text"] == "A short document."
    assert op(op="get", id="short").data == {"id": "short", "object": "document", "tokens": len(tok(
        "A short document.\n\n")), "metadata": {"k": [1, 2]}, "created": ok.data["created"]}  # fmt: skip
    assert op(op="list").data["data"][0]["id"] == "short"
    assert op(op="delete", id="short").data == {"id": "short", "object": "document.deleted", "deleted": True}
    r = op(op="get", id="short")
    assert (r.status, r.param) == (404, "id")
    off = handle_document_req(DocumentReq(1, "list"), None, tok, 64)
    assert off.status == 501 and "document store" in off.message


# ---- the Engine -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(tiny_model_dir, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("docstore") / "docs.sqlite")
    return Engine(tiny_model_dir("llama"), device="cpu", kv_cache_tokens=8192, document_store=path)


def test_engine_by_id_equals_by_text(engine):
    rng = random.Random()
    texts = [_text(rng, rng.randint(8, 30)) for _ in range(3)]
    ids = [engine.add_document(t, metadata={"i": i}) for i, t in enumerate(texts)]
    assert ids[0] == engine.add_document(texts[0])  # content addressed: the same id again
    sp = SamplingParams(max_tokens=6)
    by_id = engine.rag([{"id": i} for i in ids], "Which river?", sampling_params=sp)
    assert by_id["meta"]["chunk_misses"] == 3  # fresh random texts: computed now
    by_text = engine.rag(texts, "Which river?", sampling_params=sp)
    assert by_text["token_ids"] == by_id["token_ids"] and by_text["text"] == by_id["text"]
    assert by_text["meta"]["prompt_tokens"] == by_id["meta"]["prompt_tokens"]
    assert by_text["meta"]["chunk_hits"] == 3 and by_text["meta"]["chunk_misses"] == 0
    # the same prompt token ids, mixed items included; RagPrompt takes {"id"} too
    mixed = [{"text": texts[0]}, {"id": ids[1]}, texts[2]]
    reqs = [engine._make_request(engine.rag_prompt(d, "Which river?"), sp) for d in (texts, mixed)]
    a, b = ((r.prefix, r.docs, r.suffix) for r in reqs)
    assert a == b
    want = engine.tokenizer(texts[1] + "\n\n", add_special_tokens=False).input_ids
    assert list(reqs[1].docs[1]) == want
    raw = engine.generate(RagPrompt("Notes: ", [{"id": ids[1]}], " Answer:"), sp)[0]
    same = engine.generate(RagPrompt("Notes: ", [want], " Answer:"), sp)[0]
    assert raw["token_ids"] == same["token_ids"] and same["meta"]["chunk_hits"] == 1
    doc = engine.get_document(ids[2], include_text=True)
    assert doc["text"] == texts[2] and doc["metadata"] == {"i": 2} and doc["tokens"] == len(reqs[0].docs[2])


def test_precompute_makes_the_first_request_a_hit(engine):
    rng = random.Random()
    cold, warm, warm_sys = (_text(rng, rng.randint(8, 30)) for _ in range(3))
    sp = SamplingParams(max_tokens=2)
    cold_id = engine.add_document(cold)
    assert engine.rag([{"id": cold_id}], "Why?", sampling_params=sp)["meta"]["chunk_misses"] == 1
    warm_id = engine.add_document(warm, precompute=True)
    meta = engine.rag([{"id": warm_id}], "Why?", sampling_params=sp)["meta"]
    assert (meta["chunk_hits"], meta["chunk_misses"]) == (1, 0)
    sys_id = engine.add_document(warm_sys, precompute=True, system="Answer briefly.")
    meta = engine.rag([{"id": sys_id}], "Why?", system="Answer briefly.", sampling_params=sp)["meta"]
    assert (meta["chunk_hits"], meta["chunk_misses"]) == (1, 0)


def test_engine_document_errors_name_the_item(engine):
    doc_id = engine.add_document("Mount Feller is 5,210 metres tall.", id="feller")
    with pytest.raises(DocumentConflict, match="feller"):
        engine.add_document("Another text.", id="feller")
    with pytest.raises(UnknownDocument, match=r"docs\[1\]\.id"):
        engine.rag(["a doc", {"id": "doc-missing"}], "q?")
    with pytest.raises(DocumentError, match=r"docs\[0\]"):
        engine.rag([{"id": doc_id, "text": "both"}], "q?")
    with pytest.raises(UnknownDocument, match=r"RagPrompt\.docs\[0\]\.id"):
        engine.generate(RagPrompt("p", [{"id": "doc-missing"}], "s"))
    engine.delete_document(doc_id)
    with pytest.raises(UnknownDocument, match=r"docs\[0\]\.id"):  # deleted, then used
        engine.rag([{"id": doc_id}], "q?")
    with pytest.raises(UnknownDocument):
        engine.get_document(doc_id)
    with pytest.raises(ValueError, match="document_store"):
        Engine("unused", document_store="")


def test_restart_keeps_the_registry(engine, tiny_model_dir):
    rng = random.Random()
    text = _text(rng, 20)
    doc_id = engine.add_document(text, id=f"r{rng.randrange(10**6)}", metadata={"src": "x"})
    listed = engine.list_documents(limit=100)
    sp = SamplingParams(max_tokens=5)
    want = engine.rag([text], "Which?", sampling_params=sp)
    again = Engine(tiny_model_dir("llama"), device="cpu", kv_cache_tokens=4096,
                   document_store=engine.documents.path)  # fmt: skip
    assert again.list_documents(limit=100) == listed
    assert again.get_document(doc_id)["metadata"] == {"src": "x"}
    out = again.rag([{"id": doc_id}], "Which?", sampling_params=sp)  # new KV cache: recomputed
    assert out["token_ids"] == want["token_ids"] and out["meta"]["chunk_misses"] == 1
    none = Engine(tiny_model_dir("llama"), device="cpu", kv_cache_tokens=4096, document_store="none")
    with pytest.raises(DocumentError, match=r"docs\[0\]\.id: documents by id need a document store"):
        none.rag([{"id": doc_id}], "q?")
    with pytest.raises(ValueError, match="no document store"):
        none.add_document("text")


def test_frontend_doc_by_id_equals_doc_by_text(engine):
    from lazyrt_frontend import LocalEngine, doc, function, gen, rag, user

    rng = random.Random()
    texts = [_text(rng, rng.randint(8, 25)) for _ in range(2)]
    backend = LocalEngine(engine)
    ids = [backend.add_document(t, precompute=(i == 0)) for i, t in enumerate(texts)]

    @function
    def qa(s, docs):
        for d in docs:
            s += d
        s += user("Which river?")
        s += gen("answer", max_tokens=6)

    by_id = qa.run([doc(id=i) for i in ids], backend=backend)
    by_text = qa.run([doc(t) for t in texts], backend=backend)
    assert by_id["answer"] == by_text["answer"]
    assert by_text.metas["answer"]["chunk_hits"] == 2
    assert rag([{"id": ids[0]}, texts[1]], "Which?", max_tokens=4, backend=backend) == rag(
        texts, "Which?", max_tokens=4, backend=backend
    )
    with pytest.raises(ValueError, match="exactly one"):
        doc("text", id="x")


def test_batch_lines_take_documents_by_id(engine):
    from lazyrt.batch_input import parse_line
    from lazyrt.batch_runners import LocalRunner

    rng = random.Random()
    text = _text(rng, 15)
    doc_id = engine.add_document(text)
    lines = [
        {"id": "a", "docs": [{"id": doc_id}], "question": "Which?"},
        {"id": "b", "docs": [{"text": text}], "question": "Which?"},
        {"id": "c", "docs": [text, {"id": "doc-missing"}], "question": "Which?"},
        {"id": "d", "docs": [{"id": doc_id, "text": text}], "question": "Which?"},
    ]
    jobs = [parse_line(json.dumps(x), i + 1, {"max_tokens": 4}) for i, x in enumerate(lines)]
    assert jobs[0].docs == [{"id": doc_id}] and jobs[1].docs == [text]
    assert jobs[3].error is not None and "docs[0]" in jobs[3].error and "exactly one" in jobs[3].error
    out = [res for _, res in LocalRunner(engine, 4).run(jobs[:3])]
    assert out[0]["text"] == out[1]["text"] and out[1]["meta"]["chunk_hits"] == 1
    assert "docs[1].id" in out[2]["error"]["message"]
