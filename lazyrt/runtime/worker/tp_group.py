"""TPGroup: one rank's handle on its tensor-parallel process group (torch.distributed; gloo on CPU,
NCCL on CUDA), built from its own store rather than the process-global default group, so several
engines (or tests) in one process each keep their own.

Only tensors travel here (the model's all-reduces, the page-count minimum, the sampled tokens); the
step plan reaches the other ranks over ZMQ (tp_ranks.py), which lets idle ranks wait without a
collective timing out.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from lazyrt.runtime.worker.tp_ranks import TPRendezvous

# Collectives and the start-up rendezvous wait this long for the other ranks (loading a large
# checkpoint on every rank comes first).
TIMEOUT_S = 600


class TPGroup:
    def __init__(self, rendezvous: TPRendezvous, rank: int, device: torch.device):
        self.rank, self.size, self.device = rank, rendezvous.size, device
        store = dist.FileStore(rendezvous.store_path, self.size)
        store.set_timeout(timedelta(seconds=TIMEOUT_S))
        if device.type == "cuda":
            os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # never rely on NVLink multicast
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timedelta(seconds=TIMEOUT_S)
            self.pg = dist.ProcessGroupNCCL(dist.PrefixStore("nccl", store), rank, self.size, opts)
        else:
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = timedelta(seconds=TIMEOUT_S)
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]  # one host
            self.pg = dist.ProcessGroupGloo(dist.PrefixStore("gloo", store), rank, self.size, opts)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks, in place (t must be contiguous); returns t."""
        self.pg.allreduce([t]).wait()
        return t

    def min_int(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        self.pg.allreduce([t], opts).wait()
        return int(t.item())

    def broadcast(self, t: torch.Tensor, root: int = 0) -> torch.Tensor:
        """Every rank's t becomes root's, in place; returns t."""
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        self.pg.broadcast([t], opts).wait()
        return t
