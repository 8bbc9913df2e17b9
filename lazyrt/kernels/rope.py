"""RoPE: a cos/sin cache built from the model's rope config, and its application (torch reference).

Layout follows Hugging Face Llama ("rotate half", non-interleaved): the rotated part of a head is
split in two halves (x1, x2) and becomes (x1*cos - x2*sin, x2*cos + x1*sin).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

import torch


class RopeConfig(Protocol):
    """The rope fields of a model config (lazyrt.models.config.ModelConfig has them); a protocol so
    that the kernels do not depend on the model package."""

    rope_theta: float
    rope_scaling: dict[str, Any] | None

    @property
    def rotary_dim(self) -> int: ...


def rope_inv_freq(config: RopeConfig) -> torch.Tensor:
    """Inverse frequencies [rotary_dim // 2] in fp32, with llama3 / linear scaling applied."""
    dim = config.rotary_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv_freq / factor
    # llama3: long wavelengths slowed by `factor`, short ones kept, a smooth blend in between.
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_ctx = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
    return torch.where(medium, smoothed, scaled)


@dataclass
class RopeCache:
    """cos/sin per position: [max_positions, rotary_dim], fp32 (halves duplicated, like HF)."""

    cos: torch.Tensor
    sin: torch.Tensor

    @property
    def rotary_dim(self) -> int:
        return self.cos.shape[-1]

    @classmethod
    def build(cls, config: RopeConfig, max_positions: int, device: str | torch.device = "cpu") -> RopeCache:
        inv_freq = rope_inv_freq(config)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        return cls(cos=emb.cos().to(device), sin=emb.sin().to(device))

    def to(self, device: str | torch.device) -> RopeCache:
        return RopeCache(self.cos.to(device), self.sin.to(device))


def apply_rope_ref(x: torch.Tensor, positions: torch.Tensor, rope: RopeCache) -> torch.Tensor:
    """Rotate x [n, heads, head_dim] by positions [n]; returns a new tensor in x's dtype."""
    rd = rope.rotary_dim
    cos = rope.cos[positions].unsqueeze(1).to(x.dtype)
    sin = rope.sin[positions].unsqueeze(1).to(x.dtype)
    rot, rest = x[..., :rd], x[..., rd:]
    x1, x2 = rot[..., : rd // 2], rot[..., rd // 2 :]
    rotated = rot * cos + torch.cat([-x2, x1], dim=-1) * sin
    return torch.cat([rotated, rest], dim=-1) if rest.shape[-1] else rotated
