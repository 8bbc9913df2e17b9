"""lazyrt_frontend on both backends (a real server on loopback, an in-process Engine), default model."""

from __future__ import annotations

import httpx
import pytest
from lazyrt_frontend import (
    ProgramError,
    RuntimeEndpoint,
    doc,
    function,
    gen,
    rag,
    select,
    set_default_backend,
    system,
    user,
)
from server_util import DOCS

from lazyrt import Engine, SamplingParams
from lazyrt.runtime.tokenizer.rag_template import build_program_prompt

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(default_cpu_server):
    """conftest's default-model CPU server (shared with test_server), its cache flushed for this module."""
    assert httpx.post(default_cpu_server.url + "/flush_cache", timeout=30).status_code == 200
    return default_cpu_server


@pytest.fixture(scope="module")
def ref():
    """The reference: a plain Engine, used only through its own public calls."""
    return Engine(device="cpu", kv_cache_tokens=16384)


@pytest.fixture(scope="module")
def backends(server):
    local = Engine(device="cpu", kv_cache_tokens=16384)
    return {"http": RuntimeEndpoint(server.url), "engine": local}


@function
def qa_check(s, docs, question):
    s += system("Answer briefly.")
    for d in docs:
        s += doc(d)
    s += user(question)
    s += gen("answer", max_tokens=6)
    s += user("Is that answer correct? Reply yes or no.")
    s += select("verdict", choices=["yes", "no", "not sure"])


def test_rag_equals_engine_rag_on_both_backends(backends, ref):
    q = "What is the capital of Arvania?"
    for sys_msg in (None, "Answer in one word."):
        want = ref.rag(DOCS, q, system=sys_msg, sampling_params=SamplingParams(max_tokens=8))["text"]
        assert want
        for name, be in backends.items():
            assert rag(DOCS, q, system=sys_msg, max_tokens=8, backend=be) == want, name
    set_default_backend(backends["http"])
    assert (
        rag(DOCS[::-1], q, max_tokens=8) == ref.rag(DOCS[::-1], q, None, SamplingParams(max_tokens=8))["text"]
    )
    with pytest.raises(ValueError):
        rag([], q, backend=backends["engine"])


def test_program_with_docs_gen_select_same_state_on_both_backends(backends, ref):
    states = {
        name: qa_check.run(docs=DOCS, question="What is the capital of Arvania?", backend=be)
        for name, be in backends.items()
    }
    a, b = states["http"], states["engine"]
    assert a.messages == b.messages and a.variables == b.variables and a.docs == b.docs == DOCS
    assert a["verdict"] in ("yes", "no", "not sure") and a["answer"]
    # Independent check of gen: the reference engine on the same prompt (docs go in the first user turn).
    msgs = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": a.messages[1]["content"]},
    ]
    assert a.messages[1]["content"] == "What is the capital of Arvania?"
    gen_prompt = build_program_prompt(
        ref.tokenizer, msgs + [{"role": "assistant", "content": ""}], DOCS, 1, True
    )
    assert ref.generate(gen_prompt, SamplingParams(max_tokens=6))[0]["text"] == a["answer"]
    # select picks the argmax of the reference engine's length-normalized scores.
    sel_msgs = [dict(m) for m in a.messages]
    sel_msgs[-1]["content"] = ""
    scores = ref.score(
        build_program_prompt(ref.tokenizer, sel_msgs, DOCS, 1, True), ["yes", "no", "not sure"]
    )
    assert a["verdict"] == ["yes", "no", "not sure"][scores.index(max(scores))]
    assert a.metas["verdict"]["scores"] == pytest.approx(
        dict(zip(["yes", "no", "not sure"], scores)), abs=1e-3
    )
    assert b.metas["verdict"]["scores"] == pytest.approx(
        dict(zip(["yes", "no", "not sure"], scores)), abs=1e-3
    )
    # document options reach the engine: gen with them = the reference engine with the same params
    doc_opts = dict(doc_attention_scale=0.5, doc_attention_temperature=0.8, doc_positions="parallel")

    @function
    def qa_docs(s, docs, question):
        s += system("Answer briefly.")
        for d in docs:
            s += doc(d)
        s += user(question)
        s += gen("answer", max_tokens=6, **doc_opts)

    got = qa_docs.run(docs=DOCS, question="What is the capital of Arvania?", backend=backends["engine"])
    assert got["answer"] == ref.generate(gen_prompt, SamplingParams(max_tokens=6, **doc_opts))[0]["text"]
    assert got["answer"] != a["answer"]  # (the options change this answer: they were not dropped)
    # the same docs in another order: every doc is a chunk hit (the gen meta reports it)
    again = qa_check.run(docs=DOCS[::-1], question="How tall is Mount Feller?", backend=backends["http"])
    assert again.metas["answer"]["chunk_hits"] == 3


def _one_line(ref, topic: str, opts: dict):
    """A program that writes one line about topic with gen options opts, and its prompt as Engine
    takes it."""

    @function
    def story(s, topic):
        s += user(f"Write one sentence about {topic}.")
        s += gen("line", max_tokens=10, **opts)

    prompt = build_program_prompt(
        ref.tokenizer, [{"role": "user", "content": f"Write one sentence about {topic}."},
                        {"role": "assistant", "content": ""}], [], None, True)  # fmt: skip
    return story, prompt


def test_gen_penalties_and_logprobs_on_both_backends(backends, ref):
    opts = dict(frequency_penalty=1.2, repetition_penalty=1.3, min_tokens=2, logprobs=2)
    story, prompt = _one_line(ref, "rivers", opts)
    want = ref.generate(prompt, SamplingParams(max_tokens=10, **opts))[0]
    plain = ref.generate(prompt, SamplingParams(max_tokens=10))[0]
    assert want["token_ids"] != plain["token_ids"]  # the penalties change this answer
    for name, be in backends.items():
        got = story.run(topic="rivers", backend=be)
        assert got["line"] == want["text"], name
        lps = got.metas["line"]["logprobs"]
        assert [e["token_id"] for e in lps] == want["token_ids"], name
        ref_lps = [e["logprob"] for e in want["logprobs"]]
        assert [e["logprob"] for e in lps] == pytest.approx(ref_lps, abs=1e-3)


def test_gen_min_p_on_both_backends(backends, ref):
    # a seeded sample with min_p answers as Engine with the same SamplingParams on both backends
    opts = dict(temperature=1.5, seed=3, min_p=0.05)
    story, prompt = _one_line(ref, "lakes", opts)
    want = ref.generate(prompt, SamplingParams(max_tokens=10, **opts))[0]
    plain = ref.generate(prompt, SamplingParams(max_tokens=10, temperature=1.5, seed=3))[0]
    assert want["token_ids"] != plain["token_ids"]  # min_p changes this sample: it was not dropped
    for name, be in backends.items():
        assert story.run(topic="lakes", backend=be)["line"] == want["text"], name


def test_gen_citations_on_both_backends(backends, ref):
    @function
    def cited(s, docs, question):
        for d in docs:
            s += doc(d)
        s += user(question)
        s += gen("answer", max_tokens=6, citations=True)

    q = "How tall is Mount Feller?"
    msgs = [{"role": "user", "content": q}, {"role": "assistant", "content": ""}]
    want = ref.generate(build_program_prompt(ref.tokenizer, msgs, DOCS, None, True),
                        SamplingParams(max_tokens=6, citations=True))[0]  # fmt: skip
    by_doc = lambda cs: {c["document"]: c["score"] for c in cs}  # noqa: E731
    for name, be in backends.items():
        got = cited.run(docs=DOCS, question=q, backend=be)
        assert got["answer"] == want["text"], name
        want_scores = by_doc(want["meta"]["citations"])
        assert by_doc(got.metas["answer"]["citations"]) == pytest.approx(want_scores, abs=1e-4), name
    with pytest.raises(ValueError, match="citations"):
        rag(DOCS, q, citations=True, backend=backends["engine"])


def test_run_batch_20_inputs_sharing_docs_reports_chunk_hits(backends, server):
    before = httpx.get(server.url + "/cache_stats", timeout=30).json()["chunk_hits"]
    kw = [{"docs": [DOCS[i % 3], DOCS[(i + 1) % 3]], "question": f"Question number {i}?"} for i in range(20)]

    @function
    def short(s, docs, question):
        for d in docs:
            s += doc(d)
        s += user(question)
        s += gen("answer", max_tokens=3)

    for name, be in backends.items():
        states = short.run_batch(kw, backend=be, progress_bar=True, max_concurrency=8)
        assert len(states) == 20 and all(s.error is None for s in states), name
        hits = sum(s.metas["answer"]["chunk_hits"] for s in states)
        # 3 distinct docs, 40 doc uses: at most 3 can miss (more may count as hits while computing)
        assert hits >= 37, (name, hits)
        assert [s.docs for s in states] == [k["docs"] for k in kw]
    after = httpx.get(server.url + "/cache_stats", timeout=30).json()["chunk_hits"]
    assert after - before >= 37
    # both backends answered each input identically (greedy)
    http_states = short.run_batch(kw[:4], backend=backends["http"])
    eng_states = short.run_batch(kw[:4], backend=backends["engine"])
    assert [s["answer"] for s in http_states] == [s["answer"] for s in eng_states]


def test_stream_yields_the_same_text(backends):
    for name, be in backends.items():
        plain = qa_check.run(docs=DOCS[:2], question="Where is Quenta?", backend=be)
        st = qa_check.run(docs=DOCS[:2], question="Where is Quenta?", backend=be, stream=True)
        pieces = list(st.text_iter())
        assert "".join(pieces) == plain["answer"] + plain["verdict"], name
        assert len(pieces) >= 2
        assert st.variables == plain.variables


def test_program_errors_are_reported(backends):
    @function
    def bad(s):
        s += doc("a lonely document")
        s += gen("x", max_tokens=2)  # docs need a user turn first

    for be in backends.values():
        with pytest.raises(ProgramError):
            bad.run(backend=be)
        states = bad.run_batch([{}], backend=be)
        assert isinstance(states[0].error, ProgramError)


def test_score_endpoint_and_program_generate_validation(server, ref):
    msgs = [
        {"role": "user", "content": "Is the sky blue? Answer yes or no."},
        {"role": "assistant", "content": ""},
    ]
    body = {"messages": msgs, "docs": DOCS[:1], "continue_final": True, "continuations": ["Yes", "No"]}
    r = httpx.post(server.url + "/score", json=body, timeout=120)
    assert r.status_code == 200
    want = ref.score(build_program_prompt(ref.tokenizer, msgs, DOCS[:1], None, True), ["Yes", "No"])
    assert r.json()["scores"] == pytest.approx(want, abs=1e-3)
    assert [len(x) for x in r.json()["logprobs"]] == [1, 1]
    for bad_body, param in [
        ({**body, "continuations": []}, "continuations"),
        ({**body, "continuations": [""]}, "continuations[0]"),
        ({**body, "doc_turn": 1}, "doc_turn"),
        ({**body, "messages": msgs[:1]}, "continue_final"),
        ({**body, "sampling_params": {"max_tokens": 5}}, "sampling_params"),  # (was taken and ignored)
    ]:
        r = httpx.post(server.url + "/score", json=bad_body, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (bad_body, r.text)
    r = httpx.post(server.url + "/generate", json={"text": "hi", "messages": msgs}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
