"""KV memory and what is cached in it; no tensors move here except inside PagePool.

- page_pool.py: PagePool: the KV pages of all layers (FlashInfer NHD layout) and their allocator.
- chunk_table.py: ChunkTable: document chunks' KV by content hash, position-free, ref-counted, in
  the device pool and (optionally) the host tier.
- host_pool.py: HostKVPool: the host tier's KV bytes (pinned on CUDA) and the copies to and from it.
- radix_cache.py: RadixCache: page-granular prefix cache for plain prompts and prefix mode.
- eviction.py: the chunk eviction policies (lru, lfu, gdsf).
- kv_share.py: a KV pool other processes of the host can map (peer KV: CUDA IPC, /dev/shm).
- placement.py: which replica owns a document (rendezvous hashing; the router and peer KV agree).

May import: nothing from lazyrt (the scheduler and the worker build on it).
"""

from lazyrt.cache.chunk_table import Chunk, ChunkTable, ChunkTableStats, Transfer
from lazyrt.cache.eviction import EVICTION_POLICIES, EvictionPolicy, make_policy
from lazyrt.cache.page_pool import OutOfPages, PagePool
from lazyrt.cache.radix_cache import RadixCache, RadixNode, RadixStats

__all__ = [
    "Chunk",
    "ChunkTable",
    "ChunkTableStats",
    "EVICTION_POLICIES",
    "EvictionPolicy",
    "make_policy",
    "OutOfPages",
    "PagePool",
    "RadixCache",
    "RadixNode",
    "RadixStats",
    "Transfer",
]
