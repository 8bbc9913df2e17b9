"""Attention and KV kernels. Each Triton kernel sits beside its plain-torch reference (same signature)
and is tested against it; the CPU path runs the references.

- attention_ref.py: the references: lazy paged attention, KV store, key re-rotation, page copy.
- triton_attention.py: lazy paged attention (keys rotated in-kernel by each page's pos_base).
- triton_kv.py: KV store, key re-rotation and the fused copy + re-rotate (block mode), query RoPE.
- flashinfer_backend.py: FlashInfer paged prefill where keys are stored rotated (prefix / none).
- backend.py: the per-layer backend the model calls: store this step's K/V, then attend.
- metadata.py: AttentionMetadata, the per-step CSR page tables with pos_base and valid_len.
- rope.py: the cos/sin cache and the torch RoPE.
- all_reduce_add_rms_norm.py (+ csrc/): a tensor-parallel all-reduce, residual add and RMSNorm in
  one CUDA kernel (FlashInfer's TensorRT-LLM fusion, JIT-built for that pattern) and its torch math.

May import: nothing from lazyrt (model configs are seen through the RopeConfig protocol).
"""
