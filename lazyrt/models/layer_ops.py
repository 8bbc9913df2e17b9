"""The small per-layer ops of a decoder (RMSNorm, residual add + RMSNorm, SiLU-and-mul, query RoPE).

CPU: plain torch, in the same order of operations as Hugging Face (the reference the tests compare
against). CUDA: FlashInfer's fused norm and activation kernels for fp16/bf16 (one kernel each instead
of 4-6 elementwise ones: a decode step of a small batch is a few hundred such launches) and the
Triton RoPE kernel for queries; fp32 on CUDA keeps the torch math (FlashInfer has no fp32 norms).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lazyrt.kernels.rope import RopeCache, apply_rope_ref


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class TorchLayerOps:
    """Reference ops. `add_rms_norm` returns (norm(residual + x), residual + x)."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h = residual + x
        return rms_norm(h, weight, eps), h

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        n = gate_up.shape[-1] // 2
        return F.silu(gate_up[..., :n]) * gate_up[..., n:]

    def rope(self, x: torch.Tensor, positions: torch.Tensor, rope: RopeCache) -> torch.Tensor:
        return apply_rope_ref(x, positions, rope)


class CudaLayerOps(TorchLayerOps):
    """Triton query RoPE; FlashInfer RMSNorm / fused add+RMSNorm / SiLU-and-mul for 16-bit inputs."""

    def __init__(self, use_flashinfer: bool):
        from lazyrt.kernels.triton_kv import apply_rope_triton

        self._rope = apply_rope_triton
        self._fi = None
        if use_flashinfer:
            import flashinfer

            self._fi = flashinfer

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if self._fi is None or x.dim() != 2 or not x.is_contiguous():
            return rms_norm(x, weight, eps)
        return self._fi.rmsnorm(x, weight, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self._fi is None:
            return super().add_rms_norm(x, residual, weight, eps)
        # in place: residual += x, x = norm(residual); both are this step's fresh activations
        x, residual = x.contiguous(), residual.contiguous()
        self._fi.fused_add_rmsnorm(x, residual, weight, eps)
        return x, residual

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self._fi is None:
            return super().silu_and_mul(gate_up)
        return self._fi.silu_and_mul(gate_up.contiguous())

    def rope(self, x: torch.Tensor, positions: torch.Tensor, rope: RopeCache) -> torch.Tensor:
        return self._rope(x, positions, rope)


def layer_ops_for(device: torch.device, dtype: torch.dtype) -> TorchLayerOps:
    if device.type != "cuda":
        return TorchLayerOps()
    from lazyrt.kernels.flashinfer_backend import flashinfer_available

    return CudaLayerOps(use_flashinfer=dtype in (torch.float16, torch.bfloat16) and flashinfer_available())
