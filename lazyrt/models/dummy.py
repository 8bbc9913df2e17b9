"""Dummy checkpoints: real architectures, random weights (for benchmarks and tests without downloads)."""

from __future__ import annotations

import torch

from lazyrt.models.config import ModelConfig
from lazyrt.models.param_shapes import is_norm, param_shapes

_LLAMA3_EOS = [128001, 128008, 128009]
_QWEN_EOS = 151645


def _llama(hidden, layers, heads, kv_heads, inter, vocab, **extra) -> dict:
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "intermediate_size": inter,
        "vocab_size": vocab,
        "head_dim": hidden // heads,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    cfg.update(extra)
    return cfg


def _llama3_scaling(factor: float) -> dict:
    return {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }


def _llama31(hidden, layers, heads, inter) -> dict:
    """A Llama 3.1 size: 8 KV heads, the 128k vocabulary, llama3 RoPE scaling to 128k positions."""
    return _llama(
        hidden,
        layers,
        heads,
        8,
        inter,
        128256,
        rope_theta=500000.0,
        rope_scaling=_llama3_scaling(8.0),
        max_position_embeddings=131072,
        bos_token_id=128000,
        eos_token_id=_LLAMA3_EOS,
    )


# Hugging Face config.json dicts. Vocab sizes of the tiny presets fit the default (SmolLM2) tokenizer.
PRESETS: dict[str, dict] = {
    "llama-3.1-8b": _llama31(4096, 32, 32, 14336),
    # too big for one 80 GB GPU (~141 GB of bf16 weights): for tensor-parallel benchmarks
    "llama-3.1-70b": _llama31(8192, 80, 64, 28672),
    "llama-3.2-1b": _llama(
        2048,
        16,
        32,
        8,
        8192,
        128256,
        rope_theta=500000.0,
        rope_scaling=_llama3_scaling(32.0),
        max_position_embeddings=131072,
        tie_word_embeddings=True,
        bos_token_id=128000,
        eos_token_id=_LLAMA3_EOS,
    ),
    "smollm2-135m": _llama(
        576,
        30,
        9,
        3,
        1536,
        49152,
        rope_theta=100000.0,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    ),
    "qwen2.5-7b": _llama(
        3584,
        28,
        28,
        4,
        18944,
        152064,
        architectures=["Qwen2ForCausalLM"],
        model_type="qwen2",
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=32768,
        bos_token_id=151643,
        eos_token_id=_QWEN_EOS,
    ),
    "qwen3-8b": _llama(
        4096,
        36,
        32,
        8,
        12288,
        151936,
        architectures=["Qwen3ForCausalLM"],
        model_type="qwen3",
        head_dim=128,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=40960,
        bos_token_id=151643,
        eos_token_id=_QWEN_EOS,
    ),
    "tiny-llama": _llama(
        64, 2, 4, 2, 128, 49152, max_position_embeddings=2048, bos_token_id=1, eos_token_id=2
    ),
    "tiny-qwen3": _llama(
        64,
        2,
        4,
        2,
        128,
        49152,
        architectures=["Qwen3ForCausalLM"],
        model_type="qwen3",
        head_dim=32,
        rms_norm_eps=1e-6,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    ),
}


def preset_config(name: str) -> dict:
    if name not in PRESETS:
        raise KeyError(f"unknown dummy preset {name!r}; presets: {', '.join(sorted(PRESETS))}")
    return dict(PRESETS[name])


def dummy_weights(
    cfg: ModelConfig,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    device: str | torch.device = "cpu",
    shard: dict[str, tuple] | None = None,
) -> dict[str, torch.Tensor]:
    """normal(0, 0.02) weights (norm scales: ones), made directly in dtype and on device: no float32 or
    host copy of a big model. shard: a tensor-parallel rank's slice index per split weight
    (tensor_parallel.shard_plan); each such weight is made whole, one at a time, and only the rank's
    slice is kept, so every tensor-parallel size holds the same model."""
    gen = torch.Generator(device=device).manual_seed(seed)
    weights: dict[str, torch.Tensor] = {}
    for name, shape in param_shapes(cfg).items():
        if is_norm(name):
            w = torch.ones(shape, dtype=dtype, device=device)
        else:
            w = torch.empty(shape, dtype=dtype, device=device).normal_(0.0, 0.02, generator=gen)
        if shard is not None and name in shard:
            w = w[shard[name]].clone()  # a copy (a row slice is a view), so the whole tensor is freed
        weights[name] = w
    return weights
