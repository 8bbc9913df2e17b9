"""A KV pool that other processes on the same host can map: replicas read each other's chunk pages.

Peer KV (--kv-peers): a replica copies a document's pages straight out of the replica that owns it
instead of recomputing them. For that the owner's pool must be mapped into the reader's address
space once, at start-up:

- on CUDA the pool's memory is exported with a CUDA IPC handle (what torch.multiprocessing sends for
  a CUDA tensor); the reader opens it in its own device's context, with peer access enabled, so its
  own kernels read the owner's pages over NVLink / PCIe (the owner's GPU must be visible to it:
  start both replicas with every GPU visible and pick each one's with --device cuda:N);
- on the CPU the pool lives in a file under /dev/shm that the reader maps too.

An export is plain values (lists, ints, bytes, strings): it travels in the msgpack messages, no
pickle. Only the owner ever writes its pages; readers copy whole pages the owner holds pinned for
them (lazyrt/runtime/scheduler/peer_kv.py).
"""

from __future__ import annotations

import atexit
import os
import secrets

import torch

_SHM_DIR = "/dev/shm"


def shared_zeros(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, list]:
    """A zeroed tensor other processes can map, and its export (`import_shared` opens it there)."""
    if device.type == "cuda":
        t = torch.zeros(shape, dtype=dtype, device=device)
        return t, export_cuda(t)
    if device.type != "cpu":
        raise ValueError(f"kv_peers: a shared KV pool needs a CUDA or CPU device, not {device}")
    if not os.path.isdir(_SHM_DIR):
        raise ValueError(f"kv_peers: a shared KV pool on the CPU needs {_SHM_DIR} (Linux shared memory)")
    path = os.path.join(_SHM_DIR, f"lazyrt-kv-{os.getpid()}-{secrets.token_hex(4)}")
    numel = 1
    for n in shape:
        numel *= n
    t = torch.from_file(path, shared=True, size=numel, dtype=dtype).view(shape)  # zero-filled
    atexit.register(_unlink, path)
    return t, ["shm", path, list(shape), _dtype_name(dtype)]


def export_cuda(t: torch.Tensor) -> list:
    """A contiguous CUDA tensor's IPC export: its storage's handle (torch's own sharing, as
    torch.multiprocessing does) with the view's shape and dtype."""
    if not t.is_contiguous() or t.storage_offset():
        raise ValueError("export_cuda: needs a contiguous tensor at the start of its storage")
    (_, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync) = (
        t.untyped_storage()._share_cuda_()
    )
    return ["cuda", handle, size, offset, ref_handle, ref_offset, event_handle, bool(event_sync),
            list(t.shape), _dtype_name(t.dtype)]  # fmt: skip


def import_shared(export: list, device: torch.device) -> torch.Tensor:
    """Maps another process's shared tensor (shared_zeros' export) into this one. CUDA memory is
    opened in `device`'s context (peer access enabled), so kernels on `device` read it directly."""
    kind = export[0]
    if kind == "shm":
        _, path, shape, dtype = export
        if device.type != "cpu":
            raise ValueError(f"kv_peers: a peer's KV pool is in host memory; this replica runs on {device}")
        numel = 1
        for n in shape:
            numel *= n
        if not os.path.exists(path):
            raise ValueError(f"kv_peers: the peer's KV pool {path} is gone (has that replica stopped?)")
        return torch.from_file(path, shared=True, size=numel, dtype=_dtype(dtype)).view(shape)
    if kind == "cuda":
        _, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync, shape, dtype = export
        if device.type != "cuda":
            raise ValueError(f"kv_peers: a peer's KV pool is on a GPU but this replica runs on {device}")
        torch.cuda._lazy_init()  # (as torch.multiprocessing's rebuild does before opening a handle)
        index = device.index if device.index is not None else torch.cuda.current_device()
        storage = torch.UntypedStorage._new_shared_cuda(
            index, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync
        )
        return torch.empty(0, dtype=_dtype(dtype), device=torch.device("cuda", index)).set_(
            storage, 0, tuple(shape)
        )
    raise ValueError(f"kv_peers: unknown KV pool export {kind!r}")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"kv_peers: unknown dtype {name!r} in a peer's KV pool export")
    return dtype


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
