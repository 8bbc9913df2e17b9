"""Needle in a haystack with the default model (SmolLM2-135M) on CPU, retrieval attention against full
attention (issue 15): 8 reports of ~160 tokens, one of which holds a vault code; the device KV pool
holds about a third of the context, so most reports, the needle's among them, are attended from the
host tier through top-k retrieval (48 of each report's ~160 keys + 8 sink keys, per query head). The
answer must be full attention's, token for token, up to the first place where full attention itself
is at a near-tie: there retrieval may take any token full attention rates within TIE_NATS of its best
(among its top 5), and what follows may differ. (Full attention is not always sure: codes starting
with 7 gave "7." vs "7888" with log-probabilities -0.864 / -0.872, and a CI run failed on such a tie;
another found it guessing a code's third digit, '2' at -1.80 and '3' at -1.97, where retrieval took a
third digit. With 16 keys retrieval diverged once in about 20 runs where full attention was sure: it
answered "is:" where full attention gave the code; 48 keys still search, not attend to all.)"""

from __future__ import annotations

import random

import pytest

from lazyrt import Engine, SamplingParams

# full attention's top-2 log-probabilities closer than this: a near-tie, either token is its answer (at the
# tie above, retrieval moved the two by +0.30 / -0.39: its top-k keeps the needle, drops the filler's tail)
TIE_NATS = 0.5
WORDS = "river stone garden market winter lantern copper meadow harbor violet engine signal orchard".split()


def test_needle_answer_equals_full_attention(default_model):
    rng = random.Random()
    filler = lambda n: " ".join(rng.choice(WORDS) for _ in range(n)) + "."  # noqa: E731
    code = rng.randrange(1000, 10000)
    docs = [f"Report {i}. " + filler(150) for i in range(8)]
    docs[0] = f"Report 0. {filler(70)} The secret code for the vault is {code}. {filler(70)}"
    question = "What is the secret code for the vault?"
    sp = SamplingParams(max_tokens=12, temperature=0.0, logprobs=5)
    full = Engine(kv_cache_tokens=16384).rag(docs, question, sampling_params=sp)
    eng = Engine(
        kv_cache_tokens=16 * 26, host_kv_cache_tokens=16 * 400, max_running_requests=1,
        retrieval_attention=True, retrieval_top_k=48, retrieval_sink=8, retrieval_build_threads=0,
    )  # fmt: skip
    for d in docs:  # each report computed once; the device keeps the latest, the rest go to the host
        eng.rag([d], "Summarize.", sampling_params=SamplingParams(max_tokens=1))
    got = eng.rag(docs, question, sampling_params=sp)
    print(f"code {code}: full {full['text']!r}, retrieval {got['text']!r}, meta {got['meta']}")
    assert got["meta"]["prompt_tokens"] > 3 * eng.pool.num_pages * eng.pool.page_size // 2
    assert got["meta"]["host_attended_chunks"] >= 5 and got["meta"]["chunk_hits"] == 8
    assert eng.runner.host_indexes.builds > 0  # top-k below the reports' keys: searched, not exact
    assert_same_answer(got["token_ids"], full)
    # the needle's report was attended in the host tier (only a host copy, no device pages)
    req = eng._make_request(eng.rag_prompt(docs, question), sp)
    needle = eng.scheduler.chunks.lookup(req.prefix, req.docs[0], record=False)
    assert needle is not None and not needle.pages and needle.host_pages


def assert_same_answer(got: list[int], full: dict) -> None:
    """got equals full's greedy tokens, or differs first where got took a token that full attention
    rated within TIE_NATS of its best (a near-tie; the token must be in full's top logprobs)."""
    want = full["token_ids"]
    assert len(got) == len(want)
    at = next((i for i in range(len(want)) if got[i] != want[i]), None)
    if at is None:
        return
    top = full["logprobs"][at]["top_logprobs"]
    lp = next((t["logprob"] for t in top if t["token_id"] == got[at]), None)
    gap = None if lp is None else top[0]["logprob"] - lp
    assert gap is not None and gap < TIE_NATS, (
        f"token {at}: retrieval {got[at]}, full attention {want[at]} with top {top} (gap {gap} nats)"
    )


def test_assert_same_answer_tells_ties_from_disagreements():
    lp = lambda a, b: {"top_logprobs": [{"token_id": 5, "logprob": a}, {"token_id": 6, "logprob": b}]}  # noqa: E731
    full = {"token_ids": [1, 5, 9], "logprobs": [lp(-0.1, -3.0), lp(-0.86, -0.87), lp(-0.2, -2.0)]}
    assert_same_answer([1, 5, 9], full)
    assert_same_answer([1, 6, 2], full)  # the runner-up at a tie, then anything
    with pytest.raises(AssertionError):
        assert_same_answer([1, 7, 9], full)  # not among full attention's top tokens
    full["logprobs"][1] = lp(-0.4, -1.5)
    with pytest.raises(AssertionError):
        assert_same_answer([1, 6, 9], full)  # full attention was sure
    # a flat distribution: any token within TIE_NATS of the best, not only the runner-up
    top = [{"token_id": t, "logprob": v} for t, v in ((5, -1.8), (6, -1.97), (7, -2.1), (8, -2.5))]
    full["logprobs"][1] = {"top_logprobs": top}
    assert_same_answer([1, 7, 0], full)
    with pytest.raises(AssertionError):
        assert_same_answer([1, 8, 9], full)  # 0.7 nats below the best
