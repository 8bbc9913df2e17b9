"""The server in two processes: the tokenizer inside the HTTP process (--tokenizer-in-http) and the
model worker inside the scheduler's (--worker-in-scheduler). test_server's end-to-end tests run here
unchanged against that layout (outputs equal the Engine's, streaming, stop strings, disconnects that
free pages, logprobs and echo, bad input, 80 concurrent requests); what only this layout has is
checked below."""

from __future__ import annotations

import sys

import httpx
import pytest
import test_server as base
from server_util import serve_cpu
from test_server_step_failure import _child_names

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
    yield from serve_cpu(32768, "--tokenizer-in-http", "--worker-in-scheduler")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_two_processes_and_the_split_has_no_tokenizer_hop(server):
    """Besides the HTTP process only the scheduler runs (no tokenizer, no worker process), and a
    request's time split shows the hop to the tokenizer as (nearly) nothing: it is a call."""
    assert "lazyrt-schedule" in _child_names(server.proc.pid)
    assert not {"lazyrt-tokenize", "lazyrt-worker"} & _child_names(server.proc.pid)
    body = {"text": "Hello there", "sampling_params": {"max_tokens": 3, "temperature": 0}}
    r = httpx.post(server.url + "/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    t = r.json()["meta"]["timings_ms"]
    assert 0 <= t["to_tokenizer"] < 5, t
    base._no_leaks(server)
