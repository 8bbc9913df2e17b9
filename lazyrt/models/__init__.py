"""Llama-family models on lazyrt's attention backend, and their loaders.

- llama.py: the decoder (Llama 2/3/3.1, Mistral, Qwen2/2.5, Qwen3), HF parameter names.
- layer_ops.py: norms, SiLU-and-mul and query RoPE: torch on CPU, FlashInfer / Triton on CUDA.
- config.py: ModelConfig from an HF config dict.
- tensor_parallel.py: a rank's Megatron-style shard of the weights and its ModelConfig.
- loader.py: load_model for HF directories, GGUF files and dummy weights; the default model.
- hf_dir.py, gguf_convert.py, dummy.py, param_shapes.py: the formats behind it.

May import: lazyrt.kernels
"""
