"""DocTokenCache: repeated document texts are tokenized once, with exactly the same ids."""

from __future__ import annotations

import random

import pytest

from lazyrt import Engine
from lazyrt.runtime.ipc.messages import GenerateReq, decode, encode
from lazyrt.runtime.tokenizer.doc_token_cache import DocTokenCache
from lazyrt.runtime.tokenizer.request_tokenizer import RequestTokenizer
from lazyrt.sampling_params import SamplingParams


def _text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(["river", "Quenta", "1822", "lumen", "tides", "é", "北京"]) for _ in range(n))


def test_requests_reuse_doc_tokens_exactly(tokenizer):
    rng = random.Random()
    rt = RequestTokenizer(tokenizer, 1 << 20, len(tokenizer))
    fresh = RequestTokenizer(tokenizer, 1 << 20, len(tokenizer), doc_cache_tokens=0)
    docs = [_text(rng, rng.randrange(5, 60)) for _ in range(6)]
    for i in range(12):
        req = GenerateReq(i, SamplingParams(max_tokens=4), text="Which river?", docs=rng.sample(docs, 3),
                          system="Be brief.", text_mode="rag")  # fmt: skip
        a, b = rt.tokenize(req), fresh.tokenize(req)
        assert decode(encode(a)) == decode(encode(b))  # as the scheduler receives them
        assert (a.prefix, a.docs, a.suffix) == (b.prefix, b.docs, b.suffix)
    seen = rt.doc_cache.misses
    assert seen <= len(docs) and rt.doc_cache.hits == 12 * 3 - seen  # each distinct text tokenized once
    assert len(fresh.doc_cache) == 0 and fresh.doc_cache.hits == 0  # 0 tokens: caching off
    assert len(fresh.prefix_cache) == 0 and rt.prefix_cache.misses == 1 and rt.prefix_cache.hits == 11


def test_placement_keys_only_for_peer_kv(tokenizer):
    """Each document's placement key (its text's, as the router hashes it) goes with the request only
    where the replica has peers; the ids are the same either way."""
    from lazyrt.cache.placement import doc_key

    rng = random.Random()
    docs = [_text(rng, rng.randrange(5, 60)) for _ in range(3)]
    req = GenerateReq(0, SamplingParams(max_tokens=4), text="Which river?", docs=docs, text_mode="rag",
                      doc_owners=["ipc:///p/a", None, "ipc:///p/b"])  # fmt: skip
    plain = RequestTokenizer(tokenizer, 1 << 20, len(tokenizer)).tokenize(req)
    keyed = RequestTokenizer(tokenizer, 1 << 20, len(tokenizer), placement_keys=True).tokenize(req)
    assert (plain.prefix, plain.docs, plain.suffix) == (keyed.prefix, keyed.docs, keyed.suffix)
    assert plain.doc_keys == [] and keyed.doc_keys == [doc_key(d) for d in docs]
    assert keyed.doc_owners == ["ipc:///p/a", None, "ipc:///p/b"]


def test_lru_eviction_by_token_budget():
    calls: list[str] = []

    def tokenize(text: str) -> list[int]:
        calls.append(text)
        return [len(w) for w in text.split()]

    cache = DocTokenCache(tokenize, max_tokens=10)
    assert cache.get("a bb ccc") == [1, 2, 3] and cache.num_tokens == 3
    cache.get("dddd e f g")  # 4 tokens -> 7
    cache.get("a bb ccc")  # a hit makes it most recent
    cache.get("x y z w v")  # 5 tokens -> 12 > 10: the least recent ("dddd e f g") goes
    assert cache.num_tokens == 8 and len(cache) == 2
    n = len(calls)
    assert cache.get("a bb ccc") == [1, 2, 3] and len(calls) == n  # still cached
    cache.get("dddd e f g")
    assert len(calls) == n + 1  # evicted: tokenized again
    big = " ".join(["w"] * 11)
    assert cache.get(big) == [1] * 11 and cache.num_tokens <= 10  # larger than the budget: not kept
    with pytest.raises(ValueError, match="max_tokens"):
        DocTokenCache(tokenize, max_tokens=-1)


def test_new_documents_are_tokenized_in_one_batch(tokenizer):
    """A request's documents not cached go to the tokenizer as one batch (a fast tokenizer encodes it on
    all cores), each distinct text once, with the ids one by one gives; a lone new one alone."""
    singles: list[str] = []
    batches: list[list[str]] = []

    def tokenize(text: str) -> list[int]:
        singles.append(text)
        return [len(w) for w in text.split()]

    def tokenize_batch(texts: list[str]) -> list[list[int]]:
        batches.append(list(texts))
        return [[len(w) for w in t.split()] for t in texts]

    cache = DocTokenCache(tokenize, max_tokens=10, tokenize_batch=tokenize_batch)
    texts = ["a bb", "ccc", "a bb", "dddd e f g"]
    got = cache.get_arrays(texts)
    assert [x.tolist() for x in got] == [[1, 2], [3], [1, 2], [4, 1, 1, 1]]
    assert batches == [["a bb", "ccc", "dddd e f g"]] and not singles
    assert (cache.misses, cache.hits) == (3, 1)  # the repeated text is a hit
    got = cache.get_arrays(["dddd e f g", "hh i"])  # one new text: tokenized alone
    assert [x.tolist() for x in got] == [[4, 1, 1, 1], [2, 1]] and singles == ["hh i"] and len(batches) == 1
    assert (cache.misses, cache.hits) == (4, 2) and cache.num_tokens <= 10
    off = DocTokenCache(tokenize, max_tokens=0, tokenize_batch=tokenize_batch)  # caching off
    assert [x.tolist() for x in off.get_arrays(["x yy", "z", "x yy"])] == [[1, 2], [1], [1, 2]]
    assert batches[-1] == ["x yy", "z"] and singles == ["hh i"] and len(off) == 0 and off.misses == 3
    # through RequestTokenizer with the real tokenizer: the ids each text gets alone
    rng = random.Random()
    rt = RequestTokenizer(tokenizer, 1 << 20, len(tokenizer))
    docs = [_text(rng, rng.randrange(5, 200)) for _ in range(5)]
    req = GenerateReq(0, SamplingParams(max_tokens=4), text="Which river?", docs=docs, text_mode="rag")
    alone = RequestTokenizer(tokenizer, 1 << 20, len(tokenizer))
    alone.doc_cache = DocTokenCache(lambda text: tokenizer(text, add_special_tokens=False).input_ids)
    calls: list[int] = []
    batch = rt.doc_cache._tokenize_batch
    rt.doc_cache._tokenize_batch = lambda texts: calls.append(len(texts)) or batch(texts)
    out, want = rt.tokenize(req), alone.tokenize(req)
    assert calls == [5]
    assert [list(d) for d in out.docs] == [list(d) for d in want.docs] and len(out.docs) == 5
    assert rt.doc_cache.misses == 5 and rt.doc_cache.hits == 0


def test_engine_reuses_document_tokens(tiny_model_dir):
    """Engine.rag tokenizes a repeated document once, with the ids a fresh tokenization gives."""
    engine = Engine(tiny_model_dir("llama"), device="cpu", kv_cache_tokens=4096)
    rng = random.Random()
    docs = [_text(rng, 12), _text(rng, 9)]
    cache = engine._doc_tokens
    hits, misses = cache.hits, cache.misses
    sp = SamplingParams(max_tokens=4)
    engine.rag(docs, "Which river?", sampling_params=sp)
    out = engine.rag(docs[::-1], "Which river?", sampling_params=sp)
    assert cache.misses - misses == 2 and cache.hits - hits == 2
    assert out["meta"]["chunk_hits"] == 2
    # a batch of prompts: their new documents tokenized in one call, each once
    calls: list[int] = []
    batch = cache._tokenize_batch
    cache._tokenize_batch = lambda texts: calls.append(len(texts)) or batch(texts)
    new = [_text(rng, 10 + i) for i in range(3)]
    engine.rag_batch([{"docs": new[:2], "question": "Which?", "sampling_params": {"max_tokens": 2}},
                      {"docs": new[1:] + docs[:1], "question": "Why?", "sampling_params": {"max_tokens": 2}}])
    assert calls == [3] and cache.misses - misses == 5
    tok = engine.tokenizer
    for text in list(cache._entries):
        assert cache.get(text) == tok(text, add_special_tokens=False).input_ids


def test_quick_requests_are_those_with_cached_documents_and_little_text(tokenizer):
    """RequestTokenizer.quick (what the HTTP process tokenizes on its event loop): every document
    given as text with its ids cached and at most QUICK_TEXT_CHARS of other text; a new document, a
    document by id, tools, message parts or a long question are not quick. Its answer never changes
    what tokenize returns."""
    from lazyrt.runtime.tokenizer.request_tokenizer import QUICK_TEXT_CHARS

    rng = random.Random()
    rt = RequestTokenizer(tokenizer, 1 << 20, len(tokenizer))
    fresh = RequestTokenizer(tokenizer, 1 << 20, len(tokenizer), doc_cache_tokens=0)
    docs = [_text(rng, rng.randrange(5, 60)) for _ in range(3)]
    sp = SamplingParams(max_tokens=4)

    def req(**kw) -> GenerateReq:
        return GenerateReq(0, sp, **{"text_mode": "rag", "text": "Which river?", **kw})

    first = req(docs=docs[:2])
    assert not rt.quick(first)  # new documents: tokenized first
    rt.tokenize(first)
    assert rt.quick(first) and rt.quick(req(docs=docs[1::-1])) and rt.quick(req(docs=[]))
    assert not rt.quick(req(docs=docs))  # docs[2] is new
    assert not rt.quick(req(docs=[docs[0], {"id": "d1"}]))  # read from the document store
    assert not rt.quick(req(docs=docs[:2], tools=[{"type": "function", "function": {"name": "f"}}]))
    assert rt.quick(req(docs=docs[:2], text="w" * QUICK_TEXT_CHARS))
    assert not rt.quick(req(docs=docs[:2], text="w" * (QUICK_TEXT_CHARS + 1)))
    assert not rt.quick(req(docs=docs[:2], system="s" * QUICK_TEXT_CHARS))
    chat = [{"role": "user", "content": "hi"}]
    assert rt.quick(GenerateReq(0, sp, messages=chat, docs=docs[:1]))
    assert not rt.quick(GenerateReq(0, sp, messages=[{"role": "user", "content": [{"type": "text"}]}]))
    assert rt.quick(GenerateReq(0, sp, input_ids=[1, 2, 3]))
    for r in (first, req(docs=docs[1::-1]), GenerateReq(0, sp, messages=chat, docs=docs[:1])):
        a, b = rt.tokenize(r), fresh.tokenize(r)
        assert (a.prefix, a.docs, a.suffix) == (b.prefix, b.docs, b.suffix)


def test_max_tokens_past_the_context_named_or_capped(tokenizer):
    """An explicit max_tokens (the field named in max_tokens_param) that the context cannot hold after
    the prompt is an error naming that field; the endpoint's default max_tokens is capped at what
    the context leaves."""
    from lazyrt.runtime.tokenizer.request_tokenizer import InvalidRequest

    rng = random.Random()
    ctx = rng.randint(60, 200)
    rt = RequestTokenizer(tokenizer, ctx, len(tokenizer))
    ids = [rng.randrange(100, 1000) for _ in range(rng.randint(5, ctx - 5))]
    room = ctx - len(ids)
    for m in (room, room + 1, room + rng.randint(2, 500)):
        for given in (None, "sampling_params.max_tokens"):
            req = GenerateReq(1, SamplingParams(max_tokens=m), input_ids=ids, param="input_ids",
                              max_tokens_param=given)  # fmt: skip
            if given is not None and m > room:
                with pytest.raises(InvalidRequest, match=f"at most {room}") as e:
                    rt.tokenize(req)
                assert e.value.param == given
            else:
                assert rt.tokenize(req).max_new_tokens == min(m, room)


def test_tokenizer_loop_takes_queued_requests_together(tokenizer):
    """TokenizerLoop.on_http_many (the tokenizer process's inbox, drained): the new documents of all
    the requests go to the tokenizer in one batch, at most PREFETCH_TEXTS texts, each distinct one
    once; every request is answered in order, a bad one with its error, the others with the ids a
    request tokenized alone gets."""
    from lazyrt.runtime.ipc.messages import ErrorOut, TokenizedReq, WorkerReady
    from lazyrt.runtime.tokenizer.process import TokenizerLoop

    rng = random.Random()
    docs = [_text(rng, rng.randrange(5, 60)) for _ in range(8)]
    sched, http = [], []
    loop = TokenizerLoop(tokenizer, WorkerReady("m", "", 8, 16, 1 << 20, len(tokenizer), [0], "cpu"),
                         sched.append, http.append)  # fmt: skip
    rt = loop.req_tokenizer
    batches: list[int] = []
    batch = rt.doc_cache._tokenize_batch
    rt.doc_cache._tokenize_batch = lambda texts: batches.append(len(texts)) or batch(texts)
    sp = SamplingParams(max_tokens=4)
    picks = [rng.sample(docs, 4) for _ in range(5)]
    msgs = [GenerateReq(i, sp, text="Which river?", docs=p, text_mode="rag") for i, p in enumerate(picks)]
    msgs.insert(2, GenerateReq(99, sp, text="Which river?", docs=[docs[0], 7], text_mode="rag"))  # bad
    loop.on_http_many(msgs)
    # one batch before any request's own: every distinct text document, the bad request's too
    assert batches == [len({d for m in msgs for d in m.docs if isinstance(d, str)})]
    assert [type(m).__name__ for m in sched] == ["TokenizedReq"] * 5
    assert [m.rid for m in sched] == [0, 1, 2, 3, 4]
    assert len(http) == 1 and isinstance(http[0], ErrorOut) and http[0].rid == 99
    alone = RequestTokenizer(tokenizer, 1 << 20, len(tokenizer))
    for m, req in zip(sched, [x for x in msgs if x.rid != 99]):
        want = alone.tokenize(req)
        assert isinstance(m, TokenizedReq) and [list(d) for d in m.docs] == [list(d) for d in want.docs]
    # the cap: a backlog with more new texts than PREFETCH_TEXTS takes that many in its batch
    many = [GenerateReq(i, sp, text="Which river?", docs=[_text(rng, 6) + f" {i}.{j}" for j in range(3)],
                        text_mode="rag") for i in range(10)]  # fmt: skip
    batches.clear()
    assert rt.prefetch_docs(many, max_texts=7) == 7 and batches == [7]
