"""One Llama-family decoder (Llama 2/3/3.1, Mistral, Qwen2/2.5, Qwen3) on lazyrt's attention backend.

Weights keep Hugging Face names so any HF checkpoint, GGUF conversion or dummy init loads as is.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lazyrt.kernels.backend import AttentionBackend
from lazyrt.kernels.metadata import AttentionMetadata
from lazyrt.kernels.rope import RopeCache, apply_rope_ref
from lazyrt.models.config import ModelConfig


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class LlamaModel:
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor]):
        self.config = config
        missing = [n for n in self._required_names() if n not in weights]
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} weights, e.g. {missing[:3]}")
        self.w = weights
        self.lm_head = weights.get("lm_head.weight", weights["model.embed_tokens.weight"])

    def _required_names(self) -> list[str]:
        c = self.config
        names = ["model.embed_tokens.weight", "model.norm.weight"]
        if not c.tie_word_embeddings:
            names.append("lm_head.weight")
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            names += [p + f"self_attn.{x}_proj.weight" for x in "qkvo"]
            names += [p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
            names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
            if c.attention_bias:
                names += [p + f"self_attn.{x}_proj.bias" for x in "qkv"]
            if c.qk_norm:
                names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
        return names

    @property
    def device(self) -> torch.device:
        return self.lm_head.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.dtype

    def _attention(
        self, i: int, x: torch.Tensor, meta: AttentionMetadata, rope: RopeCache, backend: AttentionBackend
    ) -> torch.Tensor:
        c, w, p = self.config, self.w, f"model.layers.{i}.self_attn."
        n = x.shape[0]
        q = F.linear(x, w[p + "q_proj.weight"], w.get(p + "q_proj.bias")).view(n, c.num_heads, c.head_dim)
        k = F.linear(x, w[p + "k_proj.weight"], w.get(p + "k_proj.bias")).view(n, c.num_kv_heads, c.head_dim)
        v = F.linear(x, w[p + "v_proj.weight"], w.get(p + "v_proj.bias")).view(n, c.num_kv_heads, c.head_dim)
        if c.qk_norm:
            q = rms_norm(q, w[p + "q_norm.weight"], c.rms_norm_eps)
            k = rms_norm(k, w[p + "k_norm.weight"], c.rms_norm_eps)
        q = apply_rope_ref(q, meta.positions, rope)
        o = backend.forward(i, q, k, v, meta)  # k goes in unrotated: the backend decides when to rotate
        return F.linear(o.reshape(n, c.num_heads * c.head_dim), w[p + "o_proj.weight"])

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, meta: AttentionMetadata, rope: RopeCache, backend: AttentionBackend
    ) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm, for the T new tokens of a step."""
        c, w = self.config, self.w
        h = F.embedding(input_ids, w["model.embed_tokens.weight"])
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            h = h + self._attention(
                i, rms_norm(h, w[p + "input_layernorm.weight"], c.rms_norm_eps), meta, rope, backend
            )
            x = rms_norm(h, w[p + "post_attention_layernorm.weight"], c.rms_norm_eps)
            gate = F.linear(x, w[p + "mlp.gate_proj.weight"])
            up = F.linear(x, w[p + "mlp.up_proj.weight"])
            h = h + F.linear(F.silu(gate) * up, w[p + "mlp.down_proj.weight"])
        return rms_norm(h, w["model.norm.weight"], c.rms_norm_eps)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.lm_head).float()
