"""TPGroup: one rank's handle on its tensor-parallel process group (torch.distributed; gloo on CPU,
NCCL on CUDA), built from its own store rather than the process-global default group, so several
engines (or tests) in one process each keep their own.

Only tensors travel here (the model's all-reduces, the page-count minimum, the sampled tokens); the
step plan reaches the other ranks over ZMQ (tp_ranks.py), which lets idle ranks wait without a
collective timing out.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from lazyrt.runtime.worker.fused_all_reduce_norm import FusedAllReduceNorm
from lazyrt.runtime.worker.peer_all_reduce import DEFAULT_MAX_BYTES, PeerAllReduce

if TYPE_CHECKING:
    from lazyrt.runtime.worker.tp_ranks import TPRendezvous

log = logging.getLogger(__name__)

# Collectives and the start-up rendezvous wait this long for the other ranks (loading a large
# checkpoint on every rank comes first).
TIMEOUT_S = 600
CLOSE_TIMEOUT_S = 5


class TPGroupBroken(RuntimeError):
    """A step failed on a tensor-parallel rank, or a rank died: the ranks' collectives no longer pair up
    (one may wait in a collective the others left), so the group runs no further step."""


class TPGroup:
    def __init__(
        self,
        rendezvous: TPRendezvous,
        rank: int,
        device: torch.device,
        check: Callable[[], None] | None = None,
        peer_dtype: torch.dtype | None = None,
        peer_max_bytes: int = DEFAULT_MAX_BYTES,
        fused_norm_hidden: int | None = None,
    ):
        """Blocks until every rank has joined. check: called while waiting for the others; it raises
        to give up (e.g. when a rank's process has died instead of joining). peer_dtype (CUDA): small
        all-reduces of that dtype (up to peer_max_bytes) run torch's one-shot symmetric-memory kernel
        instead of NCCL (peer_all_reduce.py), where every rank can set it up; None: NCCL only (CPU:
        gloo whatever it is). fused_norm_hidden (with the peer path): the model's hidden size, for
        FlashInfer's all-reduce + residual add + RMSNorm kernel (fused_all_reduce_norm.py) where every
        rank can set it up."""
        self.rank, self.size, self.device = rank, rendezvous.size, device
        self.peer: PeerAllReduce | None = None
        self.fused: FusedAllReduceNorm | None = None
        store = dist.FileStore(rendezvous.store_path, self.size)
        store.set_timeout(timedelta(seconds=TIMEOUT_S))
        _wait_for_all(store, rank, self.size, check)
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
        if peer_dtype is not None:
            self.peer = self._peer_all_reduce(store, rendezvous.store_path, peer_dtype, peer_max_bytes)
        if self.peer is not None and fused_norm_hidden:
            self.fused = self._fused_all_reduce_norm(peer_dtype, fused_norm_hidden)

    def _peer_all_reduce(
        self, store: dist.Store, store_path: str, dtype: torch.dtype, max_bytes: int
    ) -> PeerAllReduce | None:
        # Every rank must take the same path (a rank on NCCL and one on peer memory would wait for each
        # other forever): the ranks agree before the collective set-up and on its outcome.
        if self.min_int(int(PeerAllReduce.available(self.device))) == 0:
            return None
        setups = PeerAllReduce.setups_in_process()
        if self.min_int(setups) != -self.min_int(-setups):
            log.warning("tensor parallel: NCCL for every all-reduce (a rank's process set up peer memory "
                        "for an earlier group, and torch's set-up cannot pair it with a fresh rank)")
            return None
        name = "lazyrt-tp-" + hashlib.sha1(store_path.encode()).hexdigest()[:16]  # unique per group
        peer = PeerAllReduce.create(self.pg, store, name, self.rank, self.size, self.device, dtype, max_bytes)
        return peer if self.min_int(int(peer is not None)) == 1 else None

    def _fused_all_reduce_norm(self, dtype: torch.dtype, hidden: int) -> FusedAllReduceNorm | None:
        # as the peer path: the ranks agree that each can build the kernel before the collective set-up,
        # then on its outcome (a rank left unfused would never meet the others' fused kernels)
        if not FusedAllReduceNorm.supports(self.size, dtype, hidden):  # the same on every rank
            log.info("tensor parallel: all-reduce and RMSNorm stay separate kernels (no fused kernel for "
                     "%d ranks of %d x %s)", self.size, hidden, dtype)  # fmt: skip
            return None
        if self.min_int(int(FusedAllReduceNorm.available(self.device))) == 0 or self.peer.group is None:
            return None
        before = PeerAllReduce.setups_in_process()
        PeerAllReduce.record_setups(before, None)  # unknown until it has gone through
        fused = FusedAllReduceNorm.create(self.peer.group, self.rank, self.size, dtype, hidden)
        PeerAllReduce.record_setups(before, FusedAllReduceNorm.RENDEZVOUS if fused is not None else None)
        return fused if self.min_int(int(fused is not None)) == 1 else None

    def reduce_add_norm(
        self, partial: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """LlamaModel's reduce_add_norm: the fused kernel for a step it takes, else None."""
        if self.fused is not None and self.fused.fits(partial):
            return self.fused(partial, residual, weight, eps)
        return None

    def close(self) -> None:
        """Gives up the NCCL communicator without waiting for the other ranks: left to the process
        group's destructor at exit, it waited for ranks that had already been stopped (seen on 2 H100s:
        the Engine's process hung at exit until killed)."""
        self.abort()

    def abort(self) -> None:
        """Aborts the NCCL communicator, which also ends this rank's collectives in flight (NCCL would
        wait for a dead peer until its timeout; gloo's collectives fail by themselves when a peer's
        connection closes, so on CPU there is nothing to do)."""
        self.fused = None
        if self.peer is not None:
            self.peer.close()
            self.peer = None
        if self.device.type != "cuda":
            return
        fn = getattr(self.pg, "abort", None) or getattr(self.pg, "shutdown", None)
        if fn is not None:  # on a thread, bounded: closing must not hang whatever NCCL does
            t = threading.Thread(target=fn, name="tp-abort", daemon=True)
            t.start()
            t.join(CLOSE_TIMEOUT_S)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks of t (contiguous): t itself, summed in place by NCCL, or, for a small
        tensor on the peer path, a new tensor (t is then left as it was). Use the returned tensor."""
        if self.peer is not None and self.peer.fits(t):
            return self.peer(t)
        self.pg.allreduce([t]).wait()
        return t

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's t (contiguous, the same shape on all), stacked: [size, *t.shape]."""
        out = torch.empty((self.size, *t.shape), dtype=t.dtype, device=t.device)
        if self.device.type == "cuda":
            self.pg._allgather_base(out, t).wait()  # one NCCL all-gather into out, capturable in graphs
        else:
            self.pg.allgather([list(out.unbind(0))], [t]).wait()
        return out

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


OnDead = Callable[[Exception], None]


class RankWatch:
    """Calls check() every interval_s on a daemon thread; the first time it raises (another rank's
    process has died), calls on_dead(that error) once and stops. Rank 0 of an offline Engine uses it
    to break out of a collective whose peer is gone (the server's own watch stops every process)."""

    def __init__(self, check: Callable[[], None], on_dead: OnDead, interval_s: float = 0.5):
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(check, on_dead, interval_s), name="tp-rank-watch", daemon=True
        )
        self._thread.start()

    def _run(self, check: Callable[[], None], on_dead: OnDead, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            try:
                check()
            except Exception as e:
                on_dead(e)
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _wait_for_all(store: dist.Store, rank: int, size: int, check: Callable[[], None] | None) -> None:
    """A barrier in Python before the process group's own (which blocks in C++ until its timeout):
    a rank that died while loading is noticed at once by a caller whose check() can see it."""
    store.set(f"joined/{rank}", b"1")
    keys = [f"joined/{r}" for r in range(size)]
    deadline = time.monotonic() + TIMEOUT_S
    while not store.check(keys):
        if check is not None:
            check()
        if time.monotonic() > deadline:
            raise TimeoutError(f"tensor_parallel_size={size}: not every rank joined within {TIMEOUT_S} s")
        time.sleep(0.05)
