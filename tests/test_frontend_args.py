"""lazyrt_frontend's arguments on a tiny random model: gen(ignore_eos=, stop=""), rag()'s None
defaults, and a run_batch item that is not a dict failing alone."""

from __future__ import annotations

import random

import pytest
from lazyrt_frontend import ProgramError, doc, function, gen, rag, user

from lazyrt import Engine, SamplingParams
from lazyrt.runtime.server.protocol import parse_generate

DOCS = ["Quenta is the capital of Arvania.", "Mount Feller is 5,210 metres tall."]


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return Engine(tiny_model_dir("llama"), device="cpu", kv_cache_tokens=4096)


def _program(**gen_opts):
    @function
    def one(s, question):
        s += user(question)
        s += gen("answer", **gen_opts)

    return one


def test_gen_ignore_eos_reaches_the_engine_and_the_endpoint_body(engine):
    eos = min(engine.eos_ids)
    q = f"Say {random.randrange(1000)}"
    forced = dict(max_tokens=4, logit_bias={eos: 100.0})  # EOS every step: the answer ends at once
    assert _program(**forced).run(question=q, backend=engine).metas["answer"]["completion_tokens"] == 1
    out = _program(**forced, ignore_eos=True).run(question=q, backend=engine)
    assert out.metas["answer"]["completion_tokens"] == 4
    # RuntimeEndpoint sends gen's sampling dict as /generate's sampling_params: the server takes it
    body = {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": ""}],
            "continue_final": True, "sampling_params": gen("a", ignore_eos=True).sampling}  # fmt: skip
    assert parse_generate(body).req.sampling.ignore_eos is True


def test_gen_empty_stop_is_refused_not_dropped(engine):
    with pytest.raises(ProgramError) as e:
        _program(max_tokens=2, stop="").run(question="Hi", backend=engine)
    assert "stop" in str(e.value)
    assert _program(max_tokens=2, stop=None).run(question="Hi", backend=engine)["answer"] is not None


def test_rag_none_means_the_default(engine):
    q = f"What is {random.randrange(1000)}?"
    want = engine.rag(DOCS, q, sampling_params=SamplingParams(max_tokens=3))["text"]
    nones = dict(citations=None, n=None, logprobs=None, seed=None)
    assert rag(DOCS, q, max_tokens=3, backend=engine, **nones) == want
    for name, value in (("citations", True), ("n", 2), ("logprobs", 0)):
        with pytest.raises(ValueError, match=name):
            rag(DOCS, q, backend=engine, **{name: value})


def test_run_batch_item_that_is_not_a_dict_fails_alone(engine):
    @function
    def qa(s, question):
        s += doc(DOCS[0])
        s += user(question)
        s += gen("answer", max_tokens=2)

    states = qa.run_batch([{"question": "Where?"}, 5, {"question": "Why?"}], backend=engine)
    assert [s.error is None for s in states] == [True, False, True]
    assert isinstance(states[1].error, TypeError) and "run_batch item 1" in str(states[1].error)
    with pytest.raises(ProgramError, match="item 1"):
        states[1].wait()
    for s, q in ((states[0], "Where?"), (states[2], "Why?")):
        assert s.messages[0]["content"] == q and s.docs == DOCS[:1]
        assert s.metas["answer"]["completion_tokens"] >= 1
