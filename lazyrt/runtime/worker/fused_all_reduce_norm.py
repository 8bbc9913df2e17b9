"""FusedAllReduceNorm: a tensor-parallel layer's all-reduce, residual add and RMSNorm in one kernel.

Each layer's o_proj and down_proj end in an all-reduce whose sum is added to the residual stream and
normalized for the next block: otherwise three kernels each time (the partial into the peer buffer,
the peer all-reduce, FlashInfer's fused add + RMSNorm), 64 of each in a Llama-3.1-8B decode step,
11-12% of a TP=2 step on 2 H200s (issue 17). The fused kernel (kernels/all_reduce_add_rms_norm.py:
FlashInfer's TensorRT-LLM fusion, one-shot Lamport, no NVLink multicast) has every rank write its
partial sums into the peers' buffers and sum, add the residual and normalize in one launch.

Its workspace is this module's: three buffers in torch's symmetric memory of the group PeerAllReduce
set up (so it is made right after it, on every rank, and counts as set-ups of the process the same
way), laid out as the kernel reads them: every rank's pointer to each buffer (two-shot data, barrier
flags, the Lamport triple buffer), then one pointer to five int32 counters.

Decode-sized steps only (up to max_tokens rows); larger ones take the all-reduce then the add + norm.
On wherever the peer path is (`tp_fused_all_reduce_norm`): a Llama-3.1-8B-shape TP=2 decode step on 2
H200s went 4.09 -> 3.69 ms at batch 1, 7.54 -> 7.06 at batch 64 (docs/benchmarks.md).
"""

from __future__ import annotations

import logging

import torch

from lazyrt.kernels.all_reduce_add_rms_norm import BARRIER_FLAGS, RANKS, load_module

log = logging.getLogger(__name__)

# Rows a fused call takes (a decode step's batch; graphs capture up to 128): above this, unfused.
DEFAULT_MAX_TOKENS = 128


class FusedAllReduceNorm:
    RENDEZVOUS = 3  # symmetric-memory set-ups the workspace makes (data, flags, Lamport buffers)

    def __init__(self, module: object, workspace: torch.Tensor, keep: list, rank: int, size: int,
                 max_tokens: int, hidden: int, dtype: torch.dtype):  # fmt: skip
        self.module, self.workspace, self._keep = module, workspace, keep
        self.rank, self.size, self.max_tokens, self.hidden, self.dtype = rank, size, max_tokens, hidden, dtype

    @staticmethod
    def supports(size: int, dtype: torch.dtype, hidden: int) -> bool:
        """Whether the built module has a kernel for this group (checked before building it): 2, 4 or
        8 ranks, 16/32-bit floats, rows of whole 16-byte vectors."""
        floats = (torch.bfloat16, torch.float16, torch.float32)
        return size in RANKS and dtype in floats and hidden * dtype.itemsize % 16 == 0

    @staticmethod
    def available(device: torch.device) -> bool:
        """Whether this rank can run the kernel: CUDA, and its module builds (the JIT compile happens
        here, before any collective; logged when it fails)."""
        if device.type != "cuda":
            return False
        try:
            load_module()
        except Exception as e:
            why = f"{type(e).__name__}: {str(e)[:200]}"
            log.warning("tensor parallel: all-reduce and RMSNorm stay separate (the fused all-reduce "
                        "does not build: %s)", why)  # fmt: skip
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
        same named group), or None where it cannot be set up (logged; the caller keeps the unfused
        path). No rank may call the kernel before every rank has returned from here: the caller's
        agreement on the outcome (a collective after these buffers are initialized) is that barrier.
        The caller has checked `supports` (TPGroup, before it builds the module)."""
        try:
            import torch.distributed._symmetric_memory as symm_mem

            module = load_module()
            device = torch.device("cuda", torch.cuda.current_device())
            comm = size * max_tokens * hidden * dtype.itemsize  # one copy of every rank's rows
            keep, ptrs = [], []
            for nbytes in (comm, size * BARRIER_FLAGS * 4, 3 * comm):  # two-shot data, flags, Lamport
                buf = symm_mem.empty(-(-nbytes // 16) * 4, dtype=torch.int32, device=device)
                handle = symm_mem.rendezvous(buf, group.group_name)
                ptrs += [handle.get_buffer(r, tuple(buf.shape), torch.int32).data_ptr() for r in range(size)]
                keep.append((buf, handle))
            keep[1][0].zero_()
            lamport = keep[2][0]  # "not written yet" is negative zero in the data's dtype
            if dtype.itemsize == 2:
                lamport.view(torch.int16).fill_(-(1 << 15))
            else:
                lamport.fill_(-(1 << 31))
            # read counter, non-Lamport flag, Lamport flag, the Lamport buffer's stride, clear size
            counters = torch.tensor([0, 0, 0, comm, 0], dtype=torch.int32, device=device)
            keep.append(counters)
            workspace = torch.tensor(ptrs + [counters.data_ptr()], dtype=torch.int64, device=device)
            torch.cuda.synchronize(device)
        except Exception as e:  # no module, no peer access, out of memory, ...
            log.warning("tensor parallel: all-reduce and RMSNorm stay separate kernels (the fused "
                        "all-reduce could not be set up: %s: %s)", type(e).__name__, str(e)[:200])
            return None
        return cls(module, workspace, keep, rank, size, max_tokens, hidden, dtype)

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
        norm_out, residual_out = torch.empty_like(partial), torch.empty_like(partial)
        self.module.all_reduce_add_rms_norm(
            partial, self.workspace, self.size, self.rank, residual.contiguous(), residual_out, norm_out,
            weight, eps,
        )  # fmt: skip
        return norm_out, residual_out
