"""The host tier's KV bytes and the copies between it and the device PagePool.

Page ids are the scheduler's business (ChunkTable allocates them from an id-only PagePool); this
class only holds the memory and moves pages. A host page holds every layer of one device page,
contiguous (``[num_pages, num_layers, 2, page_size, num_kv_heads, head_dim]``), so a run of
consecutive host pages is one plain memcpy. On CUDA the memory is pinned and every copy is
``non_blocking`` on the current stream: the copies are ordered with the steps' kernels on that
stream and never make the host wait (overlapped scheduling keeps planning meanwhile). The host
memory is only ever written by those device copies, so stream order alone keeps it consistent.
"""

from __future__ import annotations

import torch

from lazyrt.cache.page_pool import PagePool

# Pages are gathered on the device in groups of at most this many bytes (a temporary buffer each).
_GROUP_BYTES = 64 << 20


class HostKVPool:
    def __init__(self, device_pool: PagePool, num_pages: int) -> None:
        if num_pages <= 0:
            raise ValueError(f"HostKVPool needs at least one page, got {num_pages}")
        self.device_pool = device_pool
        self.num_pages = num_pages
        kv = device_pool.kv_all  # [num_layers, pages, 2, page_size, kv_heads, head_dim]
        self.page_shape = (kv.shape[0], *kv.shape[2:])
        pin = device_pool.device.type == "cuda"
        self.kv = torch.empty((num_pages, *self.page_shape), dtype=kv.dtype, pin_memory=pin)
        self.page_bytes = self.kv[0].numel() * self.kv.element_size()
        self._group = max(1, _GROUP_BYTES // self.page_bytes)

    def offload(self, src: list[int], dst: list[int]) -> None:
        """Device pages src[i] -> host pages dst[i] (every layer)."""
        self._check(dst, src)
        dev = self.device_pool.kv_all
        for lo in range(0, len(src), self._group):
            s, d = src[lo : lo + self._group], dst[lo : lo + self._group]
            # [n, layers, ...]: a host page's layout (index_select allocates its output contiguous)
            staged = dev.transpose(0, 1).index_select(0, _index(s, dev.device)).contiguous()
            for i, h, n in _runs(d):
                self.kv[h : h + n].copy_(staged[i : i + n], non_blocking=True)

    def load(self, src: list[int], dst: list[int]) -> None:
        """Host pages src[i] -> device pages dst[i] (every layer)."""
        self._check(src, dst)
        dev = self.device_pool.kv_all
        for lo in range(0, len(src), self._group):
            s, d = src[lo : lo + self._group], dst[lo : lo + self._group]
            staged = torch.empty((len(s), *self.page_shape), dtype=dev.dtype, device=dev.device)
            for i, h, n in _runs(s):
                staged[i : i + n].copy_(self.kv[h : h + n], non_blocking=True)
            dev.index_copy_(1, _index(d, dev.device), staged.transpose(0, 1))

    def _check(self, host: list[int], device: list[int]) -> None:
        if len(host) != len(device):
            raise ValueError(f"host tier copy: {len(host)} host pages vs {len(device)} device pages")
        if host and not 0 <= min(host) <= max(host) < self.num_pages:
            raise ValueError(f"host tier copy: host page out of range [0, {self.num_pages})")
        if device and not 0 <= min(device) <= max(device) < self.device_pool.num_pages:
            raise ValueError(f"host tier copy: device page out of range [0, {self.device_pool.num_pages})")


def _index(pages: list[int], device: torch.device) -> torch.Tensor:
    t = torch.tensor(pages, dtype=torch.long)
    if device.type == "cuda":
        t = t.pin_memory()  # a pageable source would make the host wait for the stream
    return t.to(device, non_blocking=True)


def _runs(pages: list[int]) -> list[tuple[int, int, int]]:
    """(index in pages, first page, length) of each run of consecutive page ids."""
    runs: list[tuple[int, int, int]] = []
    for i, p in enumerate(pages):
        if runs and runs[-1][1] + runs[-1][2] == p:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((i, p, 1))
    return runs
