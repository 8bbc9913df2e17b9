"""ModelConfig: the architecture facts the runtime needs, read from a Hugging Face config dict."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# HF `architectures` / `model_type` values served by lazyrt.models.llama.LlamaModel.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
SUPPORTED_MODEL_TYPES = set(SUPPORTED_ARCHITECTURES.values())


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture is not one lazyrt implements."""


@dataclass(slots=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    partial_rotary_factor: float = 1.0
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3)
    sliding_window: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    torch_dtype: str = "float32"

    @property
    def max_context(self) -> int:
        if self.sliding_window:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        archs = cfg.get("architectures") or []
        model_type = cfg.get("model_type")
        known = [SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES]
        if known:
            model_type = known[0]
        if model_type not in SUPPORTED_MODEL_TYPES:
            name = ", ".join(archs) or str(model_type)
            raise UnsupportedModelError(
                f"unsupported model architecture {name!r}; lazyrt supports "
                f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
            )
        num_heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        head_dim = cfg.get("head_dim") or hidden // num_heads
        eos = cfg.get("eos_token_id")
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        rope_scaling = cfg.get("rope_scaling")
        rope_theta = cfg.get("rope_theta")
        # transformers >= 5 folds theta and scaling into `rope_parameters`.
        params = cfg.get("rope_parameters")
        if isinstance(params, dict):
            rope_theta = rope_theta or params.get("rope_theta")
            if params.get("rope_type", "default") != "default":
                rope_scaling = rope_scaling or params
        if rope_scaling is not None:
            rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
            if rope_type == "default":
                rope_scaling = None
            elif rope_type not in ("llama3", "linear"):
                raise UnsupportedModelError(
                    f"unsupported rope_scaling type {rope_type!r} (supported: llama3, linear)"
                )
        # Sliding windows are not implemented: the engine caps the context at the window instead,
        # which keeps attention exact.
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", model_type == "mistral") else None
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta or 10000.0),
            rope_scaling=rope_scaling,
            partial_rotary_factor=cfg.get("partial_rotary_factor", 1.0),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            qk_norm=model_type == "qwen3",
            sliding_window=window,
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
        )
