"""Documents by reference on a real server (`python -m lazyrt.launch` on loopback, a tiny random
model): /v1/documents, requests with {"id": ...} documents (official openai client and /generate),
precompute, errors naming the field, pagination, and a restart on the same store."""

from __future__ import annotations

import random

import httpx
import openai
import pytest
from openai import OpenAI
from server_util import ServerProc, selected_params

from lazyrt.documents import DocumentStore

pytestmark = pytest.mark.slow

WORDS = ["river", "Quenta", "1822", "lumen", "tides", "é", "北京", "the", "of", "Arvania", ".", ","]


def _text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n)) + "."


def _launch(model: str, store: str, flags: tuple[str, ...]) -> ServerProc:
    """A server on the store, started (not yet healthy)."""
    return ServerProc("--model", model, "--device", "cpu", "--kv-cache-tokens", "8192",
                      "--document-store", store, "--log-level", "warning", *flags)  # fmt: skip


def _healthy(srv: ServerProc) -> ServerProc:
    try:
        srv.wait_healthy()
    except BaseException:
        srv.stop()
        raise
    return srv


class Served:
    """The module's server; restart() stops it and starts a new one on the same document store."""

    def __init__(self, model: str, store: str, flags: tuple[str, ...] = (), srv: ServerProc | None = None):
        self.model, self.store, self.flags = model, store, flags
        self.srv = _healthy(srv or _launch(model, store, flags))

    @property
    def url(self) -> str:
        return self.srv.url

    def restart(self, store: str | None = None) -> None:
        assert self.srv.stop() == 0
        self.store = store or self.store
        self.srv = _healthy(_launch(self.model, self.store, self.flags))


@pytest.fixture(scope="module")
def _ahead():
    """flags -> (store, server) started ahead: a start-up is ~10 s of one core, and the box has two, so
    the first `served` starts the server of every parametrization this session runs at once. Any not
    taken (a failure on the way) is stopped with the module."""
    ahead: dict[tuple[str, ...], tuple[str, ServerProc]] = {}
    yield ahead
    for _, srv in ahead.values():
        srv.stop()


@pytest.fixture(
    scope="module", params=[("--no-tokenizer-in-http",), ()], ids=["tokenizer-process", "in-http"]
)
def served(request, _ahead, tiny_model_dir, tmp_path_factory):
    """The store lives with the tokenizer: in its own process, or in the HTTP process. Each
    parametrization has a server and a store of its own."""
    model = tiny_model_dir("llama")
    if request.param not in _ahead:
        for flags in selected_params(request, "served") or [request.param]:
            store = str(tmp_path_factory.mktemp("docs") / "store.sqlite")
            _ahead.setdefault(flags, (store, _launch(model, store, flags)))
    store, srv = _ahead.pop(request.param)
    s = Served(model, store, request.param, srv)
    try:
        yield s
    finally:
        s.srv.stop()


@pytest.fixture()
def http(served):
    with httpx.Client(base_url=served.url, timeout=120) as c:
        yield c


@pytest.fixture()
def oai(served):
    client = OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    client.served_model = client.models.list().data[0].id
    return client


def _add(http: httpx.Client, **body) -> dict:
    r = http.post("/v1/documents", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _err(r: httpx.Response, status: int, param: str) -> str:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"], err
    return err["message"]


def test_documents_by_id_equal_documents_by_text(http, oai, tokenizer):
    rng = random.Random()
    texts = [_text(rng, rng.randint(8, 40)) for _ in range(3)]
    docs = [_add(http, text=t, metadata={"i": i}) for i, t in enumerate(texts)]
    for d, t in zip(docs, texts):  # tokenized once, as a RAG document: text + blank line
        assert d["object"] == "document" and d["id"].startswith("doc-") and "text" not in d
        assert d["tokens"] == len(tokenizer(t + "\n\n", add_special_tokens=False).input_ids)
    ids = [{"id": d["id"]} for d in docs]
    question = [{"role": "user", "content": "Which river is it?"}]
    kw = dict(model=oai.served_model, messages=question, max_tokens=8, temperature=0)
    by_id = oai.chat.completions.create(**kw, extra_body={"documents": ids})
    # chunk keys hash the token ids: a hit for the texts proves the same tokens
    by_text = oai.chat.completions.create(**kw, extra_body={"documents": texts})
    assert by_text.choices[0].message.content == by_id.choices[0].message.content
    assert by_text.usage.prompt_tokens == by_id.usage.prompt_tokens
    doc_tokens = sum(d["tokens"] for d in docs)
    assert by_text.usage.prompt_tokens_details.cached_tokens >= doc_tokens
    # /generate: mixed items, another order; the same greedy tokens, every chunk a hit
    order = rng.sample(range(3), 3)
    body = {"text": "Which river?", "sampling_params": {"max_tokens": 8}}
    mixed = [rng.choice([texts[i], ids[i], {"text": texts[i]}]) for i in order]
    a = http.post("/generate", json={**body, "docs": mixed}).json()
    b = http.post("/generate", json={**body, "docs": [texts[i] for i in order]}).json()
    assert a["token_ids"] == b["token_ids"] and a["meta"]["prompt_tokens"] == b["meta"]["prompt_tokens"]
    assert (b["meta"]["chunk_hits"], b["meta"]["chunk_misses"]) == (3, 0)
    # completions: documents first, then the prompt
    kw = dict(model=oai.served_model, prompt="Answer:", max_tokens=6, temperature=0)
    c1 = oai.completions.create(**kw, extra_body={"documents": ids[:2]})
    c2 = oai.completions.create(**kw, extra_body={"documents": texts[:2]})
    assert c1.choices[0].text == c2.choices[0].text and c1.usage.prompt_tokens == c2.usage.prompt_tokens
    got = http.get(f"/v1/documents/{docs[1]['id']}", params={"include_text": "true"}).json()
    assert got == {**docs[1], "text": texts[1]}


def test_precompute_makes_the_first_request_a_hit(http, oai):
    rng = random.Random()
    cold, warm, warm_sys = (_text(rng, rng.randint(8, 30)) for _ in range(3))
    body = {"text": "Why?", "sampling_params": {"max_tokens": 2}}
    cold_id = _add(http, text=cold)["id"]
    meta = http.post("/generate", json={**body, "docs": [{"id": cold_id}]}).json()["meta"]
    assert (meta["chunk_hits"], meta["chunk_misses"]) == (0, 1)  # without precompute: computed now
    doc = _add(http, text=warm, precompute=True)
    assert doc["precompute"]["chunk_misses"] == 1  # the warm-up computed it
    before = http.get("/cache_stats").json()
    meta = http.post("/generate", json={**body, "docs": [{"id": doc["id"]}]}).json()["meta"]
    after = http.get("/cache_stats").json()
    assert (meta["chunk_hits"], meta["chunk_misses"]) == (1, 0)
    # the table's own counts: nothing computed; the document and the chat prefix (a chunk too) hit
    assert after["chunk_misses"] == before["chunk_misses"] and after["chunk_hits"] - before["chunk_hits"] == 2
    # under a system prompt: a chat request with that system message hits
    doc = _add(http, text=warm_sys, precompute={"system": "Be brief."})
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why?"}]
    out = oai.chat.completions.create(model=oai.served_model, messages=msgs, max_tokens=2,
                                      extra_body={"documents": [{"id": doc["id"]}]})  # fmt: skip
    assert out.usage.prompt_tokens_details.cached_tokens >= doc["tokens"]


def test_errors_name_the_field(http, oai):
    doc = _add(http, text="Mount Feller is 5,210 metres tall.", id="feller.v1")
    assert _add(http, text="Mount Feller is 5,210 metres tall.", id="feller.v1")["id"] == "feller.v1"
    msg = _err(http.post("/v1/documents", json={"text": "Another text.", "id": "feller.v1"}), 409, "id")
    assert "feller.v1" in msg
    _err(http.post("/v1/documents", json={"id": "x"}), 400, "text")
    _err(http.post("/v1/documents", json={"text": "  "}), 400, "text")
    _err(http.post("/v1/documents", json={"text": "t", "title": "x"}), 400, "title")
    _err(http.post("/v1/documents", json={"text": "t", "id": "no spaces"}), 400, "id")
    _err(http.post("/v1/documents", json={"text": "t", "metadata": [1]}), 400, "metadata")
    _err(http.post("/v1/documents", json={"text": "t", "precompute": "yes"}), 400, "precompute")
    _err(http.post("/v1/documents", json={"text": "t", "precompute": {"sys": "x"}}), 400, "precompute.sys")
    _err(http.get("/v1/documents/doc-none"), 404, "id")
    _err(http.get("/v1/documents/feller.v1", params={"with_text": "1"}), 400, "with_text")
    _err(http.get("/v1/documents", params={"limit": 0}), 400, "limit")
    _err(http.get("/v1/documents", params={"limit": "x"}), 400, "limit")
    assert "[1, 100]" in _err(http.get("/v1/documents", params={"limit": -1}), 400, "limit")
    _err(http.get("/v1/documents", params={"after": "doc-none"}), 404, "after")
    kw = dict(model=oai.served_model, messages=[{"role": "user", "content": "q?"}], max_tokens=2)
    cases = [
        (["some text", {"id": "doc-none"}], openai.NotFoundError, "documents[1].id"),
        ([{"id": doc["id"], "text": "both"}], openai.BadRequestError, "documents[0]"),
        ([{}], openai.BadRequestError, "documents[0]"),
        ([{"id": doc["id"], "title": "x"}], openai.BadRequestError, "documents[0].title"),
        ([{"id": 3}], openai.BadRequestError, "documents[0].id"),
    ]
    for docs, exc, param in cases:
        with pytest.raises(exc) as e:
            oai.chat.completions.create(**kw, extra_body={"documents": docs})
        assert e.value.body["param"] == param and param in e.value.body["message"], e.value.body
    body = {"text": "q?", "sampling_params": {"max_tokens": 2}}
    _err(http.post("/generate", json={**body, "docs": [{"id": "doc-none"}]}), 404, "docs[0].id")
    # delete, then use: 404 everywhere
    assert http.delete("/v1/documents/feller.v1").json() == {
        "id": "feller.v1", "object": "document.deleted", "deleted": True}  # fmt: skip
    _err(http.delete("/v1/documents/feller.v1"), 404, "id")
    _err(http.get("/v1/documents/feller.v1"), 404, "id")
    _err(http.post("/generate", json={**body, "docs": ["x", {"id": "feller.v1"}]}), 404, "docs[1].id")
    with pytest.raises(openai.NotFoundError):
        oai.chat.completions.create(**kw, extra_body={"documents": [{"id": "feller.v1"}]})
    assert http.get("/health").status_code == 200  # and the server serves on


def test_list_pagination(http):
    rng = random.Random()
    tag = f"p{rng.randrange(10**9)}"
    n = rng.randint(5, 9)
    mine = [_add(http, text=f"{tag} {i} {_text(rng, 5)}", id=f"{tag}-{i}")["id"] for i in range(n)]
    limit = rng.randint(1, 3)
    seen, after, pages = [], None, 0
    while True:
        params = {"limit": limit, **({"after": after} if after else {})}
        page = http.get("/v1/documents", params=params).json()
        assert page["object"] == "list" and len(page["data"]) <= limit
        ids = [d["id"] for d in page["data"]]
        assert (page["first_id"], page["last_id"]) == ((ids[0], ids[-1]) if ids else (None, None))
        seen += ids
        pages += 1
        if not page["has_more"]:
            break
        assert len(ids) == limit
        after = page["last_id"]
    assert len(seen) == len(set(seen)) and pages == -(-len(seen) // limit)
    assert [i for i in seen if i.startswith(tag)] == mine  # registration order
    texts = http.get("/v1/documents", params={"after": mine[0], "limit": 1, "include_text": "true"}).json()
    assert texts["data"][0]["id"] == mine[1] and texts["data"][0]["text"].startswith(f"{tag} 1 ")


def test_frontend_doc_by_id_on_the_http_backend(served):
    from lazyrt_frontend import RuntimeEndpoint, doc, function, gen, rag, user

    rng = random.Random()
    texts = [_text(rng, rng.randint(8, 25)) for _ in range(2)]
    backend = RuntimeEndpoint(served.url)
    ids = [backend.add_document(t, metadata={"i": i}, precompute=(i == 0)) for i, t in enumerate(texts)]

    @function
    def qa(s, docs):
        for d in docs:
            s += d
        s += user("Which river?")
        s += gen("answer", max_tokens=6)

    by_id = qa.run([doc(id=i) for i in ids], backend=backend)
    assert by_id.metas["answer"]["chunk_hits"] == 1  # the precomputed one (no system prompt either)
    by_text = qa.run([doc(t) for t in texts], backend=backend)
    assert by_id["answer"] == by_text["answer"] and by_text.metas["answer"]["chunk_hits"] == 2
    want = rag(texts[::-1], "Which?", max_tokens=4, backend=backend)
    assert rag([{"id": ids[1]}, texts[0]], "Which?", max_tokens=4, backend=backend) == want
    backend.close()


def test_restart_keeps_the_registry(served, http):
    """Last in the module: restarts the server on the same store file."""
    rng = random.Random()
    text = _text(rng, 25)
    doc = _add(http, text=text, id=f"restart-{rng.randrange(10**9)}", metadata={"src": "kb"})
    listing = http.get("/v1/documents", params={"limit": 100}).json()
    body = {"text": "Which?", "sampling_params": {"max_tokens": 6}}
    want = http.post("/generate", json={**body, "docs": [text]}).json()
    served.restart()
    with httpx.Client(base_url=served.url, timeout=120) as c:
        assert c.get("/v1/documents", params={"limit": 100}).json() == listing
        assert c.get(f"/v1/documents/{doc['id']}").json() == doc
        out = c.post("/generate", json={**body, "docs": [{"id": doc["id"]}]}).json()
        assert out["token_ids"] == want["token_ids"]
        assert (out["meta"]["chunk_hits"], out["meta"]["chunk_misses"]) == (0, 1)  # KV recomputed


def test_without_a_store_and_with_another_models_store(served, tmp_path):
    """After the restart test: --document-store none refuses ids by name; another model's file
    stops the server at startup, saying why (that server starts beside the restart: a start-up is
    ~10 s of one core, the box has two)."""
    other = str(tmp_path / "other.sqlite")
    DocumentStore(other, "another-model:1").open().close()
    srv = ServerProc("--model", served.model, "--device", "cpu", "--kv-cache-tokens", "1024",
                     "--document-store", other, *served.flags)  # fmt: skip
    try:
        served.restart("none")
        with httpx.Client(base_url=served.url, timeout=120) as c:
            msgs = [{"role": "user", "content": "q"}]
            body = {"messages": msgs, "documents": [{"id": "doc-x"}], "max_tokens": 2}
            r = c.post("/v1/chat/completions", json=body)
            msg = _err(r, 400, "documents[0].id")
            assert "document store" in msg
            assert c.get("/v1/documents").status_code == 501
            assert c.post("/generate", json={"text": "q", "docs": ["a text"]}).status_code == 200
        with pytest.raises(RuntimeError, match="exited") as e:
            srv.wait_healthy()
        assert "another-model:1" in str(e.value) and "document store" in str(e.value)
    finally:
        srv.stop()
