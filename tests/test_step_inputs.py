"""StepInputs.dense_pages: true exactly for the page tables plain paged attention can take."""

from __future__ import annotations

import random

import pytest

from lazyrt import Engine, RagPrompt, SamplingParams


def _record_dense(engine: Engine) -> list[tuple[int, bool]]:
    seen: list[tuple[int, bool]] = []
    build = engine.runner.build_metadata

    def wrapped(s):
        ids, meta = build(s)
        seen.append((meta.max_q_len, meta.dense_pages))
        return ids, meta

    engine.runner.build_metadata = wrapped
    return seen


@pytest.mark.parametrize("mode, dense", [("prefix", True), ("none", True), ("lazy", False), ("block", False)])
def test_dense_pages_flag_by_mode(mode, dense, tiny_model_dir):
    engine = Engine(tiny_model_dir("llama"), device="cpu", cache_mode=mode, kv_cache_tokens=4096)
    rng = random.Random()
    seen = _record_dense(engine)
    doc = lambda n: [rng.randrange(100, 40000) for _ in range(n)]  # noqa: E731
    prefix = doc(21)  # partial last page: a chunk tail in the middle of the table in lazy/block modes
    engine.generate(
        [RagPrompt(prefix, [doc(19), doc(30)], doc(5)) for _ in range(2)], SamplingParams(max_tokens=3)
    )
    plain = doc(40)
    engine.generate([plain, plain + doc(3)], SamplingParams(max_tokens=3))  # radix reuse in prefix mode
    rag_prefills = [d for q, d in seen[:-3] if q > 1]
    plain_prefills = [d for q, d in seen[-3:] if q > 1]
    if mode == "lazy":  # keys rotate in-kernel: never FlashInfer's, so never flagged
        assert not any(d for _, d in seen)
        return
    # prefix/none: every prefill; block: doc chunks after a partly filled prefix page and the suffix
    # over chunk tails are not dense (the prefix chunk computed on its own is)
    assert rag_prefills and (all(rag_prefills) if dense else not all(rag_prefills))
    assert plain_prefills and all(plain_prefills)  # plain prompts are dense in non-lazy modes
    assert not any(d for q, d in seen if q == 1)  # decode steps never go to FlashInfer prefill


def test_dense_pages_unit_cases():
    from lazyrt.runtime.step_inputs import StepInputs

    def inputs(pos_base, valid_len, indptr):
        return StepInputs(kv_indptr=indptr, pos_base=pos_base, valid_len=valid_len)

    assert inputs([0, 4, 8], [4, 4, 1], [0, 3]).dense_pages(4)
    assert inputs([0, 4, 0, 4], [4, 2, 4, 4], [0, 2, 4]).dense_pages(4)  # two sequences
    assert not inputs([0, 4, 8], [4, 3, 4], [0, 3]).dense_pages(4)  # partly filled page mid-table
    assert not inputs([0, 5, 9], [4, 4, 1], [0, 3]).dense_pages(4)  # chunk at a shifted offset
    assert not inputs([4, 8], [4, 1], [0, 2]).dense_pages(4)  # table not starting at position 0
