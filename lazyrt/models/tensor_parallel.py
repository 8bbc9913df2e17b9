"""Megatron-style tensor-parallel shards of a Llama-family checkpoint (HF names, unfused).

Rank r of N keeps query heads [r*H/N, (r+1)*H/N) with their KV heads and the same slice of the MLP's
columns: q/k/v and gate/up are split by output rows (column parallel), o_proj and down_proj by input
columns (row parallel), so each rank's o_proj / down_proj output is a partial sum that one all-reduce
completes. When the vocabulary divides by the size, the embedding and lm_head are split by vocabulary
rows too (vocab parallel: a token's embedding comes from the rank that holds its row, through an
all-reduce; each rank's logits cover its rows and an all-gather assembles them); otherwise they stay
whole on every rank. Norms stay whole. With fewer KV heads than ranks each rank keeps the one KV head
its query heads read (replicated).
"""

from __future__ import annotations

import dataclasses

import torch

from lazyrt.models.config import ModelConfig


def check_tensor_parallel(config: ModelConfig, size: int) -> None:
    """ValueError naming tensor_parallel_size when the model cannot be split over `size` ranks."""
    h, kv, inter = config.num_heads, config.num_kv_heads, config.intermediate_size
    if h % size:
        raise ValueError(
            f"tensor_parallel_size={size}: the model's {h} attention heads are not divisible by it"
        )
    if kv >= size and kv % size:
        raise ValueError(
            f"tensor_parallel_size={size}: the model's {kv} KV heads are not divisible by it"
        )
    if kv < size and size % kv:
        raise ValueError(
            f"tensor_parallel_size={size}: with fewer KV heads ({kv}) than ranks it must be a multiple "
            "of the KV head count (each rank then keeps one replicated KV head)"
        )
    if inter % size:
        raise ValueError(
            f"tensor_parallel_size={size}: the model's intermediate_size {inter} is not divisible by it"
        )


def kv_replicas(config: ModelConfig, size: int) -> int:
    """How many ranks hold a copy of each KV head (1 unless there are fewer KV heads than ranks)."""
    return max(1, size // config.num_kv_heads)


def vocab_parallel(config: ModelConfig, size: int) -> bool:
    """Whether the embedding and lm_head are split by vocabulary rows over `size` ranks."""
    return size > 1 and config.vocab_size % size == 0


def shard_plan(config: ModelConfig, rank: int, size: int) -> tuple[ModelConfig, dict[str, tuple]]:
    """Rank's ModelConfig (its head counts and intermediate size) and, for each split weight, the index
    of rank's slice in the whole tensor (weights not named stay whole)."""
    check_tensor_parallel(config, size)
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is outside tensor_parallel_size={size}")
    d = config.head_dim
    nq = config.num_heads // size
    nkv = max(1, config.num_kv_heads // size)
    kv_first = rank // kv_replicas(config, size) * nkv  # the first KV head this rank keeps
    ni = config.intermediate_size // size
    rows = {
        "q": slice(rank * nq * d, (rank + 1) * nq * d),
        "k": slice(kv_first * d, (kv_first + nkv) * d),
        "v": slice(kv_first * d, (kv_first + nkv) * d),
    }
    cols = slice(rank * ni, (rank + 1) * ni)
    index: dict[str, tuple] = {}
    for i in range(config.num_layers):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        for x, sl in rows.items():
            index[a + f"{x}_proj.weight"] = (sl,)
            if config.attention_bias:
                index[a + f"{x}_proj.bias"] = (sl,)
        index[a + "o_proj.weight"] = (slice(None), rows["q"])
        index[m + "gate_proj.weight"] = (cols,)
        index[m + "up_proj.weight"] = (cols,)
        index[m + "down_proj.weight"] = (slice(None), cols)
    vocab = config.vocab_size
    if vocab_parallel(config, size):
        vocab //= size
        rows_v = slice(rank * vocab, (rank + 1) * vocab)
        index["model.embed_tokens.weight"] = (rows_v,)
        if not config.tie_word_embeddings:
            index["lm_head.weight"] = (rows_v,)
    local = dataclasses.replace(
        config, num_heads=nq, num_kv_heads=nkv, intermediate_size=ni, vocab_size=vocab
    )
    return local, index


def shard_weights(
    config: ModelConfig, weights: dict[str, torch.Tensor], rank: int, size: int
) -> ModelConfig:
    """Replaces the split weights in `weights` by rank's slices (copies, so the full tensors can be
    freed: a row slice is a view that .contiguous() would keep whole) and returns the rank's ModelConfig."""
    local, index = shard_plan(config, rank, size)
    for name, ix in index.items():
        weights[name] = weights[name][ix].clone()
    return local
