from lazyrt.cache.chunk_table import Chunk, ChunkTable, ChunkTableStats
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
]
