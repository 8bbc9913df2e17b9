"""A tensor-parallel layer's all-reduce, residual add and RMSNorm in one CUDA kernel.

The kernel is FlashInfer's TensorRT-LLM fusion (pattern kARResidualRMSNorm, one-shot Lamport), built
from csrc/all_reduce_add_rms_norm.cu for that pattern alone: FlashInfer's own `trtllm_comm` module
instantiates every pattern, dtype and rank count and took over 8 minutes of nvcc on the GPU machine
(2026-11-27); this one compiles in ~20 s. The workspace it reads (peer buffers and flags) is set up by
worker/fused_all_reduce_norm.py; `all_reduce_add_rms_norm_ref` is the math in torch.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

SOURCE = Path(__file__).resolve().parent / "csrc" / "all_reduce_add_rms_norm.cu"
RANKS = (2, 4, 8)  # the rank counts the module is built for
BARRIER_FLAGS = 256  # the header's kBarrierFlagCount: int32 flags a rank keeps for the two-shot barrier


def all_reduce_add_rms_norm_ref(
    partials: list[torch.Tensor], residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(s) * weight, s) for s = residual + sum(partials), in fp32 (the reference)."""
    s = residual.float() + sum(p.float() for p in partials)
    norm = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return norm, s


@functools.cache
def load_module() -> object:
    """The built module (JIT-compiled by FlashInfer's toolchain on first use, then cached on disk);
    raises where FlashInfer or nvcc is missing."""
    from flashinfer.jit.core import current_compilation_context, gen_jit_spec

    flags = current_compilation_context.get_nvcc_flags_list(supported_major_versions=[9, 10, 12])
    return gen_jit_spec("lazyrt_all_reduce_add_rms_norm", [SOURCE], extra_cuda_cflags=flags).build_and_load()
