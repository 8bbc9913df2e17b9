"""The server in four processes: the tokenizer in a process of its own (--no-tokenizer-in-http) and the
model worker too (--no-worker-in-scheduler), not the default two. test_server's end-to-end tests run
here unchanged against that layout (outputs equal the Engine's, streaming, stop strings, disconnects that
free pages, logprobs and echo, bad input, 80 concurrent requests); what only this layout has is
checked below."""

from __future__ import annotations

import sys

import httpx
import pytest
import test_server as base
from server_util import child_names, serve_cpu

pytestmark = pytest.mark.slow

# test_server's fixtures and tests, collected again against this module's server, in test_server's
# order (pytest runs them in the order they are bound here; some expect a cache that the tests
# before them filled or left cold)
engine, oai = base.engine, base.oai
for _name in (
    "test_health_models_and_served_name",
    "test_openai_chat_with_documents_equals_engine_rag",
    "test_openai_completions_stream_and_not",
    "test_generate_endpoint_matches_engine_and_stop_strings",
    "test_client_disconnect_mid_stream_aborts_and_frees_pages",
    "test_logprobs_equal_engine_score",
    "test_completions_echo_with_prompt_logprobs",
    "test_bad_input_is_4xx_naming_the_field_and_server_keeps_serving",
    "test_80_concurrent_mixed_requests_complete_and_leak_nothing",
):
    globals()[_name] = getattr(base, _name)


@pytest.fixture(scope="module")
def server():
    yield from serve_cpu(32768, "--no-tokenizer-in-http", "--no-worker-in-scheduler")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_four_processes_and_the_split_has_every_hop(server):
    """Besides the HTTP process the tokenizer, the scheduler and the model worker run, and a request's
    time split has each of its parts."""
    assert child_names(server.proc.pid) == {"lazyrt-tokenize", "lazyrt-schedule", "lazyrt-worker"}
    body = {"text": "Hello there", "sampling_params": {"max_tokens": 3, "temperature": 0}}
    r = httpx.post(server.url + "/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    t = r.json()["meta"]["timings_ms"]
    assert t["to_tokenizer"] >= 0 and t["tokenizing"] > 0 and t["to_scheduler"] >= 0, t
    base._no_leaks(server)
