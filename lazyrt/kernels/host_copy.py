"""Host -> device copies that never make the host wait for the device (overlapped scheduling).

A copy from pageable host memory may wait for the work already queued on the stream; while the
previous step runs, that would stall the host work that overlapped scheduling hides. On CUDA these
stage through pinned memory (PyTorch's caching host allocator keeps a buffer alive until its copy
is done) and copy asynchronously.
"""

from __future__ import annotations

import numpy as np
import torch


def _host(x, dtype: torch.dtype | None) -> torch.Tensor:
    t = x if isinstance(x, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(x))
    return t.to(dtype) if dtype is not None and t.dtype != dtype else t


def to_device(x, device: torch.device | str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """x (numpy array, list of numbers or CPU tensor) as a tensor on device, optionally cast."""
    t = _host(x, dtype)
    device = torch.device(device)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def copy_into(dst: torch.Tensor, x) -> None:
    """dst[: len(x)] = x, from the host."""
    t = _host(x, dst.dtype)
    if dst.device.type == "cuda":
        t = t.pin_memory()
    dst[: len(t)].copy_(t, non_blocking=True)
