"""Paged KV storage for all layers (FlashInfer NHD layout) with a free-list page allocator."""

from __future__ import annotations

import heapq

import torch

from lazyrt.cache.kv_share import shared_zeros


class OutOfPages(RuntimeError):
    """Raised when an allocation asks for more pages than are free."""


class PagePool:
    """KV pages for all layers, FlashInfer NHD layout, plus a free-list allocator.

    ``kv[layer]`` has shape ``[num_pages, 2, page_size, num_kv_heads, head_dim]``; ``[:, 0]`` is K and
    ``[:, 1]`` is V; ``kv_all`` is all layers, ``[num_layers, ...]``. Pages are handed out lowest free
    index first, so allocation is deterministic.
    """

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
        scratch_pages: int = 0,
        shared: bool = False,
    ) -> None:
        if min(num_layers, num_pages, page_size, num_kv_heads, head_dim) <= 0:
            raise ValueError("PagePool dimensions must all be positive")
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        # Scratch pages sit past num_pages, outside the allocator: CUDA-graph padding rows write
        # there, so no allocator (the worker's or the scheduler process's copy) can ever hand them out.
        self.scratch_pages = list(range(num_pages, num_pages + scratch_pages))
        shape = (num_pages + scratch_pages, 2, page_size, num_kv_heads, head_dim)
        # One allocation for all layers (block-mode copies touch every layer in one kernel launch);
        # kv[layer] is a contiguous view of it.
        # shared: other processes of this host can map it (peer KV; `export` says how: kv_share.py)
        self.export: list | None = None
        if shared:
            self.kv_all, self.export = shared_zeros((num_layers, *shape), dtype, self.device)
        else:
            self.kv_all = torch.zeros((num_layers, *shape), dtype=dtype, device=self.device)
        self.kv: list[torch.Tensor] = list(self.kv_all.unbind(0))
        # A sorted list is a valid min-heap; _is_free makes double-free detection O(1).
        self._free_heap: list[int] = list(range(num_pages))
        self._is_free: list[bool] = [True] * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free_heap)

    def is_free(self, page: int) -> bool:
        self._check_range(page)
        return self._is_free[page]

    def alloc(self, n: int) -> list[int]:
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of pages ({n})")
        if n > len(self._free_heap):
            raise OutOfPages(f"asked for {n} pages, only {len(self._free_heap)} of {self.num_pages} free")
        pages = [heapq.heappop(self._free_heap) for _ in range(n)]
        for p in pages:
            self._is_free[p] = False
        return pages

    def free(self, pages: list[int]) -> None:
        # Validate everything before mutating, so a bad call leaves the pool untouched.
        seen: set[int] = set()
        for p in pages:
            self._check_range(p)
            if self._is_free[p] or p in seen:
                raise ValueError(f"double free of page {p}")
            seen.add(p)
        for p in pages:
            self._is_free[p] = True
            heapq.heappush(self._free_heap, p)

    def copy_pages(self, src: list[int], dst: list[int]) -> None:
        """Copy K and V of ``src[i]`` into ``dst[i]`` for every layer."""
        if len(src) != len(dst):
            raise ValueError(f"copy_pages: {len(src)} src pages vs {len(dst)} dst pages")
        if not src:
            return
        for p in (*src, *dst):
            self._check_range(p)
        if len(set(dst)) != len(dst):
            raise ValueError("copy_pages: duplicate destination pages")
        src_t = torch.tensor(src, dtype=torch.long, device=self.device)
        dst_t = torch.tensor(dst, dtype=torch.long, device=self.device)
        # every layer at once; index_select materializes the source first, so overlapping src/dst is safe
        self.kv_all.index_copy_(1, dst_t, self.kv_all.index_select(1, src_t))

    @staticmethod
    def bytes_per_page(
        num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        return num_layers * 2 * page_size * num_kv_heads * head_dim * dtype.itemsize

    def _check_range(self, page: int) -> None:
        if not 0 <= page < self.num_pages:
            raise ValueError(f"page index {page} out of range [0, {self.num_pages})")
