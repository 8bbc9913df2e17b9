"""Peer KV on the worker: the peer replicas' KV pools mapped into this process, and the copies of
chunk pages out of them (the scheduler's peer loads: runtime/scheduler/peer_kv.py)."""

from __future__ import annotations

import torch

from lazyrt.cache.chunk_table import Transfer
from lazyrt.cache.kv_share import import_shared
from lazyrt.cache.page_pool import PagePool


class PeerPools:
    def __init__(self, pool: PagePool) -> None:
        self.pool = pool
        self.pools: dict[int, torch.Tensor] = {}  # peer index -> its kv_all, mapped here

    def map(self, exports: list[list]) -> None:
        """[peer, export] pairs: (re)map each peer's pool; its page layout must be this pool's."""
        own = self.pool.kv_all
        for peer, export in exports:
            kv = import_shared(export, own.device)
            if kv.dtype != own.dtype or kv.shape[0] != own.shape[0] or kv.shape[2:] != own.shape[2:]:
                raise ValueError(f"kv_peers: peer {peer}'s KV pool {tuple(kv.shape)} {kv.dtype} does not "
                                 f"match this one's pages {tuple(own.shape)} {own.dtype}")  # fmt: skip
            self.pools[int(peer)] = kv

    def load(self, transfers: list[Transfer]) -> None:
        """Each transfer's peer pages src[i] -> this pool's pages dst[i], every layer, on this device's
        stream (the reader's kernels gather over NVLink / PCIe; the owner holds the pages meanwhile)."""
        own = self.pool.kv_all
        for t in transfers:
            kv = self.pools.get(t.peer)
            if kv is None:
                raise RuntimeError(f"kv_peers: a step copies from peer {t.peer}, whose KV pool is not mapped")
            if len(t.src) != len(t.dst) or max(t.src, default=0) >= kv.shape[1]:
                raise ValueError(f"kv_peers: a peer load of {len(t.src)} pages into {len(t.dst)}, or past "
                                 f"the peer's {kv.shape[1]} pages")  # fmt: skip
            if t.dst and max(t.dst) >= self.pool.num_pages:
                raise ValueError(f"kv_peers: a peer load into page {max(t.dst)} of {self.pool.num_pages}")
            src = torch.tensor(t.src, dtype=torch.long).to(own.device, non_blocking=True)
            dst = torch.tensor(t.dst, dtype=torch.long).to(own.device, non_blocking=True)
            own.index_copy_(1, dst, kv.index_select(1, src))
