"""One Llama-family decoder (Llama 2/3/3.1, Mistral, Qwen2/2.5, Qwen3) on lazyrt's attention backend.

Weights keep Hugging Face names so any HF checkpoint, GGUF conversion or dummy init loads as is. On
CUDA the model fuses q/k/v and gate/up into one matrix each (`qkv_proj`, `gate_up_proj`: one GEMM
instead of three / two, which matters for small decode batches); the CPU path keeps HF's separate
projections, so its results match HF transformers op for op.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from lazyrt.kernels.backend import AttentionBackend
from lazyrt.kernels.metadata import AttentionMetadata
from lazyrt.kernels.rope import RopeCache
from lazyrt.models.config import ModelConfig
from lazyrt.models.layer_ops import TorchLayerOps, layer_ops_for, rms_norm


class LlamaModel:
    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        ops: TorchLayerOps | None = None,
        fuse_projections: bool | None = None,
        all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
        all_gather: Callable[[torch.Tensor], torch.Tensor] | None = None,
        vocab_start: int = 0,
        reduce_add_norm: Callable[..., tuple[torch.Tensor, torch.Tensor] | None] | None = None,
    ):
        """Takes ownership of `weights` (fusing replaces entries in place). ops / fuse_projections:
        default by device and dtype (CUDA: fused projections, FlashInfer/Triton layer ops).
        all_reduce: tensor parallelism (models/tensor_parallel.py): config and weights are this rank's
        shard, and o_proj / down_proj outputs are partial sums that all_reduce adds up over the ranks.
        all_gather (vocab parallel): the embedding and lm_head hold vocabulary rows [vocab_start,
        vocab_start + config.vocab_size) only; all_gather(t) returns every rank's t stacked [ranks, ...].
        reduce_add_norm(partial, residual, weight, eps): all_reduce, the residual add and the RMSNorm
        after o_proj / down_proj in one kernel (worker/fused_all_reduce_norm.py), returning what
        ops.add_rms_norm does, or None for a step it does not take (then the three run apart)."""
        self.config = config
        self.all_reduce = all_reduce
        self.reduce_add_norm = reduce_add_norm
        self.all_gather, self.vocab_start = all_gather, vocab_start
        missing = [n for n in self._required_names() if n not in weights]
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} weights, e.g. {missing[:3]}")
        self.w = weights
        self.lm_head = weights.get("lm_head.weight", weights["model.embed_tokens.weight"])
        self.ops = ops if ops is not None else layer_ops_for(self.device, self.dtype)
        if fuse_projections if fuse_projections is not None else self.device.type == "cuda":
            self._fuse_projections()

    def _fuse_projections(self) -> None:
        """q/k/v -> qkv_proj and gate/up -> gate_up_proj, one layer at a time (peak: one layer extra)."""
        w = self.w
        for i in range(self.config.num_layers):
            a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
            w[a + "qkv_proj.weight"] = torch.cat([w.pop(a + f"{x}_proj.weight") for x in "qkv"])
            if self.config.attention_bias:
                w[a + "qkv_proj.bias"] = torch.cat([w.pop(a + f"{x}_proj.bias") for x in "qkv"])
            w[m + "gate_up_proj.weight"] = torch.cat([w.pop(m + f"{x}_proj.weight") for x in ("gate", "up")])

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

    def _qkv(self, i: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer i's q, k, v [T, heads, head_dim] of the normed input x, before RoPE."""
        c, w, p = self.config, self.w, f"model.layers.{i}.self_attn."
        n = x.shape[0]
        nq, nkv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        qkv_w = w.get(p + "qkv_proj.weight")
        if qkv_w is not None:  # strided views of one GEMM's output; the kernels take row strides
            q, k, v = F.linear(x, qkv_w, w.get(p + "qkv_proj.bias")).split([nq, nkv, nkv], dim=-1)
        else:
            q = F.linear(x, w[p + "q_proj.weight"], w.get(p + "q_proj.bias"))
            k = F.linear(x, w[p + "k_proj.weight"], w.get(p + "k_proj.bias"))
            v = F.linear(x, w[p + "v_proj.weight"], w.get(p + "v_proj.bias"))
        q = q.view(n, c.num_heads, c.head_dim)
        k = k.view(n, c.num_kv_heads, c.head_dim)
        v = v.view(n, c.num_kv_heads, c.head_dim)
        if c.qk_norm:
            q = rms_norm(q, w[p + "q_norm.weight"], c.rms_norm_eps)
            k = rms_norm(k, w[p + "k_norm.weight"], c.rms_norm_eps)
        return q, k, v

    def _attention(
        self, i: int, x: torch.Tensor, meta: AttentionMetadata, rope: RopeCache, backend: AttentionBackend
    ) -> torch.Tensor:
        c, w, p = self.config, self.w, f"model.layers.{i}.self_attn."
        n = x.shape[0]
        q, k, v = self._qkv(i, x)
        q = self.ops.rope(q, meta.positions, rope)
        o = backend.forward(i, q, k, v, meta)  # k goes in unrotated: the backend decides when to rotate
        return F.linear(o.reshape(n, c.num_heads * c.head_dim), w[p + "o_proj.weight"])  # a partial sum

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        table = self.w["model.embed_tokens.weight"]
        if self.all_gather is None:
            return F.embedding(input_ids, table)
        # vocab parallel: rows outside this rank's range are zeros here and come from their rank
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= table.shape[0])
        h = F.embedding(local.clamp(0, table.shape[0] - 1), table).masked_fill_(outside.unsqueeze(-1), 0)
        return self._reduce(h)

    def _reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.all_reduce is None else self.all_reduce(x)

    def _reduce_add_norm(
        self, partial: torch.Tensor, h: torch.Tensor, weight: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(h + sum of the ranks' partial), h + that sum): a block's output joins the residual."""
        if self.reduce_add_norm is not None:
            fused = self.reduce_add_norm(partial, h, weight, self.config.rms_norm_eps)
            if fused is not None:
                return fused
        return self.ops.add_rms_norm(self._reduce(partial), h, weight, self.config.rms_norm_eps)

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, meta: AttentionMetadata, rope: RopeCache, backend: AttentionBackend
    ) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm, for the T new tokens of a step."""
        c, w, ops = self.config, self.w, self.ops
        h = self._embed(input_ids)
        x = ops.rms_norm(h, w["model.layers.0.input_layernorm.weight"], c.rms_norm_eps)
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            a = self._attention(i, x, meta, rope, backend)
            x, h = self._reduce_add_norm(a, h, w[p + "post_attention_layernorm.weight"])
            last = i + 1 == c.num_layers
            nxt = "model.norm.weight" if last else f"model.layers.{i + 1}.input_layernorm.weight"
            x, h = self._reduce_add_norm(self._mlp(i, x), h, w[nxt])
        return x

    @torch.inference_mode()
    def layer_kv(
        self,
        input_ids: torch.Tensor,
        meta: AttentionMetadata,
        rope: RopeCache,
        backend: AttentionBackend,
        layer: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K (unrotated) and V [T, kv_heads, head_dim] at `layer` for the step's tokens: the layers
        before it run as in forward (their K/V stored where meta says), the rest not at all."""
        c, w, ops = self.config, self.w, self.ops
        if not 0 <= layer < c.num_layers:
            raise ValueError(f"layer={layer}: the model has {c.num_layers} layers")
        h = self._embed(input_ids)
        x = ops.rms_norm(h, w["model.layers.0.input_layernorm.weight"], c.rms_norm_eps)
        for i in range(layer):
            p = f"model.layers.{i}."
            a = self._attention(i, x, meta, rope, backend)
            x, h = self._reduce_add_norm(a, h, w[p + "post_attention_layernorm.weight"])
            nxt = f"model.layers.{i + 1}.input_layernorm.weight"
            x, h = self._reduce_add_norm(self._mlp(i, x), h, w[nxt])
        _, k, v = self._qkv(layer, x)
        return k, v

    def _mlp(self, i: int, x: torch.Tensor) -> torch.Tensor:
        w, p = self.w, f"model.layers.{i}.mlp."
        gate_up = w.get(p + "gate_up_proj.weight")
        if gate_up is not None:
            act = self.ops.silu_and_mul(F.linear(x, gate_up))
        else:
            act = F.silu(F.linear(x, w[p + "gate_proj.weight"])) * F.linear(x, w[p + "up_proj.weight"])
        return F.linear(act, w[p + "down_proj.weight"])  # a partial sum

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        out = F.linear(hidden, self.lm_head)
        if self.all_gather is not None:  # vocab parallel: [ranks, T, V / ranks] -> [T, V]
            out = self.all_gather(out.contiguous()).permute(1, 0, 2).reshape(out.shape[0], -1)
        return out.float()
