"""How many CPU threads a model worker's torch uses.

torch sizes its intra-op pool to every core. A worker that drives a GPU does little CPU math (step
inputs, small copies), yet after each small parallel op the pool's threads spin-wait: two replicas of
a 2-GPU machine's workers were seen at 500-700% CPU each, and limiting each to 4 threads raised one
replica's saturated throughput 10% and the router's over two 12% (docs/benchmarks.md, router). So a
CUDA worker keeps 4 threads by default, unless its CPU does real work (retrieval attention attends
host-tier chunks on the CPU) or the user set OMP_NUM_THREADS. CPU tensor-parallel ranks share the
machine's cores.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from lazyrt.config import EngineConfig

CUDA_WORKER_THREADS = 4


def worker_cpu_threads(
    cfg: EngineConfig, cuda: bool, cores: int, env: Mapping[str, str] | None = None
) -> int | None:
    """The thread count a worker process should set, or None to keep torch's. cuda: the worker drives
    a GPU; cores: torch's current count (all cores, or OMP_NUM_THREADS)."""
    if cfg.worker_cpu_threads is not None:
        return cfg.worker_cpu_threads
    env = os.environ if env is None else env
    if not cuda:
        return max(1, cores // cfg.tensor_parallel_size) if cfg.tensor_parallel_size > 1 else None
    if cfg.retrieval_attention or "OMP_NUM_THREADS" in env:
        return None
    return min(CUDA_WORKER_THREADS, cores)


def set_worker_cpu_threads(cfg: EngineConfig, in_process: bool = False) -> int:
    """Applies worker_cpu_threads in this process; returns torch's thread count after. in_process: the
    offline Engine's worker lives in the user's process, so only an explicit setting is applied."""
    import torch

    cuda = cfg.device.startswith("cuda") or (cfg.device == "auto" and torch.cuda.is_available())
    n = worker_cpu_threads(cfg, cuda, torch.get_num_threads())
    if n is not None and (cfg.worker_cpu_threads is not None or not in_process):
        torch.set_num_threads(n)
    return torch.get_num_threads()
