"""The model worker's torch CPU threads (lazyrt/runtime/worker/cpu_threads.py): 4 in a CUDA worker by
default, torch's own where the CPU does real work or the user chose, a share per CPU tensor-parallel
rank; an explicit worker_cpu_threads always wins; bad values are refused naming the option."""

from __future__ import annotations

import random

import pytest
import torch

from lazyrt.config import EngineConfig
from lazyrt.launch import build_parser
from lazyrt.runtime.worker.cpu_threads import CUDA_WORKER_THREADS, set_worker_cpu_threads, worker_cpu_threads


def test_auto_and_explicit_thread_counts():
    rng = random.Random()
    cores = rng.randint(5, 128)
    lazy = EngineConfig(cache_mode="lazy", host_kv_cache_tokens=4096)
    assert worker_cpu_threads(lazy, cuda=True, cores=cores, env={}) == CUDA_WORKER_THREADS
    assert worker_cpu_threads(lazy, cuda=True, cores=2, env={}) == 2  # never more than there are
    assert worker_cpu_threads(lazy, cuda=True, cores=cores, env={"OMP_NUM_THREADS": "7"}) is None
    retrieval = EngineConfig(cache_mode="lazy", host_kv_cache_tokens=4096, retrieval_attention=True)
    assert worker_cpu_threads(retrieval, cuda=True, cores=cores, env={}) is None  # CPU attention
    assert worker_cpu_threads(EngineConfig(), cuda=False, cores=cores, env={}) is None  # the model's math
    tp = rng.randint(2, 4)
    cfg = EngineConfig(tensor_parallel_size=tp)
    assert worker_cpu_threads(cfg, cuda=False, cores=cores, env={}) == cores // tp
    n = rng.randint(1, 64)
    for c in (lazy, retrieval, cfg):
        c.worker_cpu_threads = n
        for cuda in (True, False):
            assert worker_cpu_threads(c, cuda=cuda, cores=cores, env={"OMP_NUM_THREADS": "3"}) == n


def test_the_offline_engine_applies_only_an_explicit_count():
    before = torch.get_num_threads()
    try:
        auto = EngineConfig(device="cpu", tensor_parallel_size=1)
        assert set_worker_cpu_threads(auto, in_process=True) == before  # the user's process: untouched
        n = random.Random().randint(1, max(1, before))
        assert set_worker_cpu_threads(EngineConfig(device="cpu", worker_cpu_threads=n), in_process=True) == n
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("bad", [0, -2, 1.5, True, "4"])
def test_bad_values_name_the_option(bad):
    with pytest.raises(ValueError, match="worker_cpu_threads"):
        EngineConfig(worker_cpu_threads=bad).validate()


def test_launch_passes_the_flag():
    args = build_parser().parse_args(["--worker-cpu-threads", "3"])
    assert args.worker_cpu_threads == 3
    assert build_parser().parse_args([]).worker_cpu_threads is None
