"""Retrieval attention over position-free chunks (issue 15; RetrievalAttention, arXiv 2409.10516).

- key_index.py: KeyIndex: one chunk's keys (one layer, every KV head), rotated at chunk-local
  positions, in inverted lists (k-means in torch); search for each query's top-k keys. Attention-aware
  build from the chunk's own prefill queries: whitened two-level lists with least-squares probes.
- attention.py: attention of queries over a chunk's sink keys and retrieved keys, with the lse for
  merging with the exact parts of a step (torch reference).
- host_attention.py: the engine's use: a step's host-tier segments attended layer by layer
  (HostAttention, filled into the shared-chunk parts before the merge), indexes cached; on the CPU.
- device_fill.py: the same fill on the worker's GPU (DeviceFill), reading the pinned host tier in
  place through a zero-copy CUDA view; index data stacked on the device per group of chunks.

May import: lazyrt.kernels (RoPE).
"""

from lazyrt.retrieval.attention import retrieval_attention_ref
from lazyrt.retrieval.key_index import KeyIndex, build_key_index, search_key_index

__all__ = ["KeyIndex", "build_key_index", "retrieval_attention_ref", "search_key_index"]
