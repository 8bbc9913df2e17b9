"""FusedAllReduceNorm: a tensor-parallel layer's all-reduce, residual add and RMSNorm in one kernel.

Each layer's o_proj and down_proj end in an all-reduce whose sum is added to the residual stream and
normalized for the next block: today two kernels a time (the peer all-reduce, FlashInfer's fused add
+ RMSNorm), 64 of each in a Llama-3.1-8B decode step, 11-12% of a TP=2 step on 2 H200s (issue 17).
FlashInfer's TensorRT-LLM fusion (`flashinfer.comm.trtllm_allreduce_fusion`, pattern
kARResidualRMSNorm) does the three in one launch: each rank writes its partial sums into the peers'
buffers (one-shot, Lamport flags; no NVLink multicast) and every rank sums them, adds the residual and
normalizes. Its workspace is allocated in torch's symmetric memory of the group PeerAllReduce set up
(so it is made right after it, on every rank, and counts as set-ups of the process the same way).

Decode-sized steps only (up to max_tokens rows); larger ones take the all-reduce then the add + norm.
Off by default (`tp_fused_all_reduce_norm`) until measured on GPUs. Its CUDA sources are not in the
slimmed FlashInfer wheel the GPU machine gets: benchmarks/fetch_fi_comm_sources.sh.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

# Rows a fused call takes (a decode step's batch; graphs capture up to 128): above this, unfused.
DEFAULT_MAX_TOKENS = 128


class FusedAllReduceNorm:
    RENDEZVOUS = 3  # symmetric-memory set-ups the workspace makes (data, flags, Lamport buffers)

    def __init__(self, workspace: torch.Tensor, metadata: dict, refs: object, rank: int, size: int,
                 max_tokens: int, hidden: int, dtype: torch.dtype):  # fmt: skip
        self.workspace, self.metadata, self._refs = workspace, metadata, refs
        self.rank, self.size, self.max_tokens, self.hidden, self.dtype = rank, size, max_tokens, hidden, dtype

    @staticmethod
    def available(device: torch.device) -> bool:
        """Whether this rank can run the kernel: CUDA, and FlashInfer's `trtllm_comm` module builds
        (its JIT compile happens here, before any collective; logged when it fails)."""
        if device.type != "cuda":
            return False
        try:
            from flashinfer.comm.trtllm_ar import get_trtllm_comm_module

            get_trtllm_comm_module()
        except Exception as e:
            why = f"{type(e).__name__}: {str(e)[:200]}"
            log.warning("tensor parallel: all-reduce and RMSNorm stay separate (FlashInfer's fused "
                        "all-reduce does not build: %s)", why)  # fmt: skip
            return False
        return True

    @classmethod
    def create(
        cls,
        group: torch.distributed.ProcessGroup,
        rank: int,
        size: int,
        dtype: torch.dtype,
        hidden: int,
        max_tokens: int = DEFAULT_MAX_TOKENS,
    ) -> FusedAllReduceNorm | None:
        """The group's workspace (a collective: every rank calls it, after PeerAllReduce.create on the
        same named group), or None where FlashInfer's kernel cannot be built or set up (logged; the
        caller keeps the unfused path and the ranks agree on it)."""
        try:
            from flashinfer.comm import trtllm_create_ipc_workspace_for_all_reduce_fusion

            ipc, workspace, metadata = trtllm_create_ipc_workspace_for_all_reduce_fusion(
                rank, size, max_tokens, hidden, use_fp32_lamport=dtype == torch.float32, group=group,
                create_metadata=True, use_symm_dev_mem=False,
            )  # fmt: skip
        except Exception as e:  # no FlashInfer comm sources, an unsupported GPU, no peer access, ...
            log.warning("tensor parallel: all-reduce and RMSNorm stay separate kernels (FlashInfer's fused "
                        "all-reduce unavailable: %s: %s)", type(e).__name__, str(e)[:200])  # fmt: skip
            return None
        return cls(workspace, metadata, ipc, rank, size, max_tokens, hidden, dtype)

    def fits(self, partial: torch.Tensor) -> bool:
        return (
            partial.dim() == 2
            and 0 < partial.shape[0] <= self.max_tokens
            and partial.shape[1] == self.hidden
            and partial.dtype == self.dtype
            and partial.is_contiguous()
        )

    def __call__(
        self, partial: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(RMSNorm(s) * weight, s) for s = residual + the sum of every rank's `partial` (fits must hold);
        new tensors, as TorchLayerOps.add_rms_norm returns them."""
        from flashinfer.comm import AllReduceFusionPattern, trtllm_allreduce_fusion

        norm_out, residual_out = torch.empty_like(partial), torch.empty_like(partial)
        trtllm_allreduce_fusion(
            allreduce_in=partial, world_size=self.size, world_rank=self.rank, token_num=partial.shape[0],
            hidden_dim=self.hidden, workspace_ptrs=self.workspace, launch_with_pdl=False,
            trigger_completion_at_end=True, fp32_acc=True,
            pattern_code=AllReduceFusionPattern.kARResidualRMSNorm, use_oneshot=None, allreduce_out=None,
            residual_in=residual.contiguous(), residual_out=residual_out, norm_out=norm_out, quant_out=None,
            scale_out=None, rms_gamma=weight, rms_eps=eps, scale_factor=None, layout_code=None,
            metadata=self.metadata,
        )  # fmt: skip
        return norm_out, residual_out
