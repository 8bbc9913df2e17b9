"""Shared fixtures: the default model's tokenizer and tiny random-weight models of each family."""

from __future__ import annotations

import os

import pytest
import torch

FAMILIES = ("llama", "llama3", "mistral", "qwen2", "qwen3", "llama_tied")
# parametrize("device", DEVICES): a CPU test that also runs on CUDA (Triton kernels, CUDA graphs) where
# there is one; the CUDA case carries the gpu marker and skips without it
_NEEDS_CUDA = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
DEVICES = ("cpu", pytest.param("cuda", marks=_NEEDS_CUDA))


@pytest.fixture(scope="session")
def default_model():
    from lazyrt.models.loader import load_model

    return load_model(None)


@pytest.fixture(scope="session")
def tokenizer(request):
    tok_dir = os.environ.get("LAZYRT_TOKENIZER_DIR")
    if tok_dir:  # a GPU box without the default GGUF: its tokenizer's files (benchmarks/gpu_run.sh)
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(tok_dir)
    return request.getfixturevalue("default_model").tokenizer


def _hf_config(family: str, vocab: int):
    import transformers as tf

    common = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    if family == "llama":
        return tf.LlamaConfig(**common, rope_theta=10000.0)
    if family == "llama_tied":
        return tf.LlamaConfig(**{**common, "tie_word_embeddings": True}, rope_theta=50000.0)
    if family == "llama3":
        scaling = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
        return tf.LlamaConfig(**common, rope_theta=500000.0, rope_scaling=scaling)
    if family == "mistral":
        return tf.MistralConfig(**common, sliding_window=None, rope_theta=1e6)
    if family == "qwen2":
        return tf.Qwen2Config(**common, rope_theta=1e6, use_sliding_window=False)
    if family == "qwen3":
        return tf.Qwen3Config(**common, head_dim=32, rope_theta=1e6, use_sliding_window=False)
    raise ValueError(family)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tokenizer):
    """Factory: family -> directory of a tiny random HF model (with the SmolLM2 tokenizer)."""
    import transformers as tf

    made: dict[str, str] = {}

    def make(family: str) -> str:
        if family not in made:
            d = tmp_path_factory.mktemp(f"tiny_{family}")
            seed = int.from_bytes(os.urandom(4), "little")
            print(f"tiny {family} model: torch seed {seed}")  # fresh weights each run; shown on failure
            torch.manual_seed(seed)
            cfg = _hf_config(family, len(tokenizer))
            model = tf.AutoModelForCausalLM.from_config(cfg)
            with torch.no_grad():  # larger random weights make logits less tied, greedy paths more distinct
                for p in model.parameters():
                    if p.dim() > 1:
                        p.normal_(0, 0.1)
                    else:
                        p.add_(torch.randn_like(p) * 0.1)
            model.save_pretrained(d)
            tokenizer.save_pretrained(d)
            made[family] = str(d)
        return made[family]

    return make


_SHARED_SERVERS: dict = {}  # fixture name -> ServerProc, while it runs


@pytest.fixture(scope="session")
def default_cpu_server():
    """A real CPU server with the default model (32768 KV tokens), shared by test_frontend and
    test_server (one startup, ~20 s, instead of two); each module takes it through its own `server`
    fixture, which flushes its cache first. Stopped after the last test that uses it (see
    pytest_runtest_teardown), not at the end of the session: it holds ~3 GB."""
    from server_util import serve_cpu

    for srv in serve_cpu(32768):
        _SHARED_SERVERS["default_cpu_server"] = srv
        yield srv


def pytest_runtest_teardown(item, nextitem):
    srv = _SHARED_SERVERS.get("default_cpu_server")
    if srv is None:
        return
    items = item.session.items
    rest = items[items.index(item) + 1 :] if item in items else []
    if not any("default_cpu_server" in getattr(it, "fixturenames", ()) for it in rest):
        del _SHARED_SERVERS["default_cpu_server"]
        srv.stop()  # its fixture's own stop at session end is then a no-op


@pytest.fixture(scope="session")
def tool_template_server(tiny_model_dir, tmp_path_factory, tokenizer):
    """(server, tokenizer): a real CPU server on a tiny random llama whose chat template
    (test_tool_calls.TEMPLATE) defines tools. One for the session: test_structured_output_server and
    test_tool_calls both use it (one server startup, ~15 s, instead of two)."""
    import shutil

    from server_util import ServerProc
    from test_tool_calls import TEMPLATE

    d = tmp_path_factory.mktemp("tiny_tools")
    shutil.copytree(tiny_model_dir("llama"), d, dirs_exist_ok=True)
    tok = tokenizer.__class__.from_pretrained(str(d))
    tok.chat_template = TEMPLATE
    tok.save_pretrained(str(d))
    srv = ServerProc("--model", str(d), "--device", "cpu", "--kv-cache-tokens", "8192",
                     "--log-level", "warning")  # fmt: skip
    try:
        srv.wait_healthy()
        yield srv, tok
    finally:
        srv.stop()


def load_hf(path: str):
    import transformers as tf

    m = tf.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    m.eval()
    return m


def random_rag_ids(rng, vocab: int) -> tuple[list[int], list[list[int]], list[int]]:
    """(prefix, 2-4 docs of 5-40 tokens, 5-token suffix) of random token ids."""
    ids = lambda n: [rng.randrange(100, vocab) for _ in range(n)]  # noqa: E731
    return ids(rng.randint(4, 20)), [ids(rng.randint(5, 40)) for _ in range(rng.randint(2, 4))], ids(5)


def cpu_engine(path: str, mode: str, **kw):
    from lazyrt import Engine

    return Engine(path, device="cpu", cache_mode=mode, kv_cache_tokens=8192, **kw)


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
