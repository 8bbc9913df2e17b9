"""PeerAllReduce: small all-reduces of a CUDA tensor-parallel group through torch's symmetric memory.

A decode step all-reduces 2 x layers small tensors (batch x hidden: 8 KB at batch 1, 512 KB at batch
64). NCCL's ring pays a fixed latency for each that is a large share of a TP step (issue 17). Torch's
one-shot kernel instead has every rank copy its input into its slot of a buffer all ranks map (NVLink
peer memory), meet at a barrier, and sum every peer's slot straight into its output: one launch, no
NVLink multicast (we keep NVLS off). The kernel ends with a second barrier, so the next call may
overwrite a slot that a slower peer was still reading. Tensors larger than the buffer, or of
another dtype, go to NCCL.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

# Bytes of the buffer: decode steps up to batch 64 at hidden 4,096 (bf16); larger all-reduces (prefill
# steps) are bandwidth-bound and NCCL's ring is the better kernel for them.
DEFAULT_MAX_BYTES = 1 << 20


class PeerAllReduce:
    # torch numbers the store exchanges of its symmetric-memory set-up per process, across groups (a
    # static sequence id in each key), so a rank that set up an earlier group and a fresh rank write
    # and wait for different keys and never meet (a second TP engine in one process hung on 2 H200s).
    # Ranks therefore set up together only when each has done as many set-ups in its process; after
    # an attempt that failed part-way the count is unknown: -pid, equal to no other process's.
    _setups_in_process = 0

    def __init__(self, buf: torch.Tensor, group_name: str, group: dist.ProcessGroup | None = None):
        """group: the named group the buffer was set up on (FusedAllReduceNorm sets up on it too)."""
        self.buf, self.group_name, self.group = buf, group_name, group

    @classmethod
    def record_setups(cls, before: int, added: int | None) -> None:
        """A set-up on this process's symmetric memory (this one's, FusedAllReduceNorm's): `added`
        rendezvous after the count was `before`; None while it runs or when it failed part-way
        (unknown from then on)."""
        cls._setups_in_process = before + added if added is not None and before >= 0 else -os.getpid()

    @classmethod
    def setups_in_process(cls) -> int:
        """How many symmetric-memory set-ups this process has made (-pid: unknown). Ranks may set up
        a group together only when they all give the same number."""
        return cls._setups_in_process

    @staticmethod
    def available(device: torch.device) -> bool:
        """Whether this rank could try: a CUDA device and a torch with the one-shot copy kernel."""
        return device.type == "cuda" and hasattr(torch.ops.symm_mem, "one_shot_all_reduce_copy_out")

    @classmethod
    def create(
        cls,
        pg: dist.Backend,
        store: dist.Store,
        name: str,
        rank: int,
        size: int,
        device: torch.device,
        dtype: torch.dtype,
        max_bytes: int = DEFAULT_MAX_BYTES,
    ) -> PeerAllReduce | None:
        """The group's buffer under the group name `name` (a collective: every rank calls it), or None
        where this torch, driver or machine cannot map peer memory (the caller keeps NCCL; the reason
        is logged)."""
        if not PeerAllReduce.available(device) or max_bytes <= 0:
            return None
        setups = cls._setups_in_process
        try:
            import torch.distributed._symmetric_memory as symm_mem
            from torch._C._distributed_c10d import _register_process_group, _SymmetricMemory

            # The symmetric-memory ops look the group up by name: TPGroup's NCCL backend is not in
            # torch's registry (several engines share a process), so wrap it in a named group here.
            group = dist.ProcessGroup(store, rank, size)
            group._register_backend(device, dist.ProcessGroup.BackendType.NCCL, pg)
            group._set_default_backend(dist.ProcessGroup.BackendType.NCCL)
            group._set_group_name(name)
            _register_process_group(name, group)
            cls.record_setups(setups, None)  # unknown until it has gone through
            _SymmetricMemory.set_group_info(name, rank, size, dist.PrefixStore("symm", store))
            buf = symm_mem.empty(max_bytes // dtype.itemsize, dtype=dtype, device=device)
            symm_mem.rendezvous(buf, name)
            cls.record_setups(setups, 1)
        except Exception as e:  # an older torch, no peer access between the GPUs, ...
            log.warning("tensor parallel: NCCL for every all-reduce (symmetric memory unavailable: %s: %s)",
                        type(e).__name__, str(e)[:200])  # fmt: skip
            return None
        return cls(buf, name, group)

    def close(self) -> None:
        """Takes the group's name out of torch's registry (it holds the NCCL backend), so a process
        that starts and stops engines does not keep each one's communicator; the buffer goes with
        this object."""
        try:
            from torch._C._distributed_c10d import _unregister_process_group

            _unregister_process_group(self.group_name)
        except Exception as e:  # an older torch: the entry stays until the process exits
            log.debug("tensor parallel: group %s not unregistered: %s", self.group_name, e)

    def fits(self, t: torch.Tensor) -> bool:
        # whole 16-byte vectors (the kernel's widest loads; a model's hidden size always gives them)
        return (t.dtype == self.buf.dtype and t.numel() <= self.buf.numel() and t.is_contiguous()
                and t.numel() * t.element_size() % 16 == 0)  # fmt: skip

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's t (fits(t) must hold), in a new tensor."""
        flat = t.view(-1)
        out = torch.empty_like(flat)
        buf = self.buf[: flat.numel()]
        torch.ops.symm_mem.one_shot_all_reduce_copy_out(buf, flat, "sum", self.group_name, out)
        return out.view(t.shape)
