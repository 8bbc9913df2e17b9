"""Needle in a haystack with the default model (SmolLM2-135M) on CPU, retrieval attention against full
attention (issue 15): 8 reports of ~160 tokens, one of which holds a vault code; the device KV pool
holds about a third of the context, so most reports, the needle's among them, are attended from the
host tier through top-k retrieval (48 of each report's ~160 keys + 8 sink keys, per query head). The
answer must be full attention's, token for token. (With 16 keys it diverged once in about 20 runs: a
CI run answered "is:" where full attention gave the code; 48 keys still search, not attend to all.)"""

from __future__ import annotations

import random

import pytest

from lazyrt import Engine, SamplingParams

pytest.importorskip("faiss")

WORDS = "river stone garden market winter lantern copper meadow harbor violet engine signal orchard".split()


def test_needle_answer_equals_full_attention(default_model):
    rng = random.Random()
    filler = lambda n: " ".join(rng.choice(WORDS) for _ in range(n)) + "."  # noqa: E731
    code = rng.randrange(1000, 10000)
    docs = [f"Report {i}. " + filler(150) for i in range(8)]
    docs[0] = f"Report 0. {filler(70)} The secret code for the vault is {code}. {filler(70)}"
    question = "What is the secret code for the vault?"
    sp = SamplingParams(max_tokens=12, temperature=0.0)
    full = Engine(kv_cache_tokens=16384).rag(docs, question, sampling_params=sp)
    eng = Engine(
        kv_cache_tokens=16 * 26, host_kv_cache_tokens=16 * 400, max_running_requests=1,
        retrieval_attention=True, retrieval_top_k=48, retrieval_sink=8,
    )  # fmt: skip
    for d in docs:  # each report computed once; the device keeps the latest, the rest go to the host
        eng.rag([d], "Summarize.", sampling_params=SamplingParams(max_tokens=1))
    got = eng.rag(docs, question, sampling_params=sp)
    print(f"code {code}: full {full['text']!r}, retrieval {got['text']!r}, meta {got['meta']}")
    assert got["meta"]["prompt_tokens"] > 3 * eng.pool.num_pages * eng.pool.page_size // 2
    assert got["meta"]["host_attended_chunks"] >= 5 and got["meta"]["chunk_hits"] == 8
    assert eng.runner.host_indexes.builds > 0  # top-k below the reports' keys: searched, not exact
    assert got["token_ids"] == full["token_ids"]
    # the needle's report was attended in the host tier (only a host copy, no device pages)
    req = eng._make_request(eng.rag_prompt(docs, question), sp)
    needle = eng.scheduler.chunks.lookup(req.prefix, req.docs[0], record=False)
    assert needle is not None and not needle.pages and needle.host_pages
