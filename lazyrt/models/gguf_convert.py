"""Convert a llama GGUF file, once, into a cached Hugging Face model directory.

The directory holds config.json, the dequantized float32 weights as safetensors (sharded past
SHARD_BYTES) and the tokenizer written by save_pretrained, so every later load is a plain HF-dir load.
It is written under a temporary name and renamed into place: a killed conversion leaves no cache entry.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import time

import numpy as np
import torch

from lazyrt.models.config import UnsupportedModelError

logger = logging.getLogger(__name__)

# Bump when the output of the conversion changes: old cache entries are then ignored.
CONVERTER_VERSION = 1
SHARD_BYTES = 4 << 30
STALE_TMP_S = 6 * 3600

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_SKIPPED = {"rope_freqs.weight"}  # folded into config.json's rope_scaling instead
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")


def default_cache_root() -> str:
    return os.environ.get("LAZYRT_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "lazyrt")


def gguf_fingerprint(gguf_path: str) -> str:
    """Hash of the GGUF's absolute path, size and mtime."""
    path = os.path.abspath(gguf_path)
    st = os.stat(path)
    return hashlib.sha256(f"{path}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:16]


def cache_dir_for(gguf_path: str, cache_root: str | None = None) -> str:
    stem = os.path.splitext(os.path.basename(gguf_path))[0]
    key = f"{gguf_fingerprint(gguf_path)}-v{CONVERTER_VERSION}"
    return os.path.join(cache_root or default_cache_root(), "gguf", f"{stem}-{key}")


def ensure_converted(gguf_path: str, cache_root: str | None = None) -> str:
    """The HF directory converted from gguf_path, converting it first if the cache lacks it."""
    out = cache_dir_for(gguf_path, cache_root)
    if os.path.isfile(os.path.join(out, "config.json")):
        return out
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    _remove_stale_tmp(parent, os.path.basename(out))
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.tmp-", dir=parent)
    os.chmod(tmp, 0o755)  # mkdtemp makes it 0700; the cache may be shared
    try:
        t0 = time.perf_counter()
        convert_gguf(gguf_path, tmp)
        try:
            os.replace(tmp, out)
        except OSError:
            if not os.path.isfile(os.path.join(out, "config.json")):
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # a concurrent conversion won the race
        logger.info("converted %s -> %s in %.1f s", gguf_path, out, time.perf_counter() - t0)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _remove_stale_tmp(parent: str, name: str) -> None:
    now = time.time()
    for entry in os.listdir(parent):
        path = os.path.join(parent, entry)
        if entry.startswith(f".{name}.tmp-") and now - os.path.getmtime(path) > STALE_TMP_S:
            shutil.rmtree(path, ignore_errors=True)


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def hf_config_from_gguf(reader) -> dict:
    """An HF LlamaForCausalLM config.json dict from the GGUF metadata."""
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise UnsupportedModelError(
            f"unsupported GGUF architecture {arch!r}; lazyrt converts only 'llama' GGUFs"
        )
    a = lambda key, default=None: _field(reader, f"llama.{key}", default)
    tensors = {t.name: t for t in reader.tensors}
    hidden = int(a("embedding_length"))
    n_head = int(a("attention.head_count"))
    head_dim = int(a("attention.key_length", hidden // n_head))
    rot_dim = int(a("rope.dimension_count", head_dim))
    if rot_dim != head_dim:
        raise UnsupportedModelError(
            f"GGUF llama with partial rotary ({rot_dim} of {head_dim} dims) is unsupported"
        )
    vocab = int(tensors["token_embd.weight"].shape[-1])  # GGUF dims are [in, out]
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    eos_ids = [
        int(t)
        for t in (
            eos,
            _field(reader, "tokenizer.ggml.eot_token_id"),
            _field(reader, "tokenizer.ggml.eom_token_id"),
        )
        if t is not None
    ]
    eos_ids = list(dict.fromkeys(eos_ids))
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(a("feed_forward_length")),
        "num_hidden_layers": int(a("block_count")),
        "num_attention_heads": n_head,
        "num_key_value_heads": int(a("attention.head_count_kv", n_head)),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": _f32(a("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": _f32(a("rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(reader, head_dim),
        "max_position_embeddings": int(a("context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "mlp_bias": False,
        "bos_token_id": _opt_int(_field(reader, "tokenizer.ggml.bos_token_id")),
        "eos_token_id": eos_ids[0] if len(eos_ids) == 1 else (eos_ids or None),
        "pad_token_id": _opt_int(_field(reader, "tokenizer.ggml.padding_token_id")),
        "torch_dtype": "float32",
    }
    return cfg


def _f32(v) -> float:
    """A float32 metadata value as the shortest decimal that round-trips (9.9999997e-06 -> 1e-05)."""
    return float(str(np.float32(v)))


def _opt_int(v):
    return None if v is None else int(v)


def _rope_scaling(reader, head_dim: int) -> dict | None:
    kind = _field(reader, "llama.rope.scaling.type")
    if kind not in (None, "none"):
        if kind != "linear":
            raise UnsupportedModelError(f"unsupported GGUF rope scaling {kind!r} (supported: linear, llama3)")
        return {"rope_type": "linear", "factor": float(_field(reader, "llama.rope.scaling.factor"))}
    t = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if t is None:
        return None
    # llama.cpp stores llama3 scaling as per-frequency divisors; recover the HF parameters by matching
    # them against the published Llama 3.x settings.
    divisors = np.asarray(t.data, dtype=np.float64).reshape(-1)
    theta = float(_field(reader, "llama.rope.freq_base", 10000.0))
    factor = float(divisors.max())
    for low, high, orig in ((1.0, 4.0, 8192),):
        params = {
            "rope_type": "llama3",
            "factor": factor,
            "low_freq_factor": low,
            "high_freq_factor": high,
            "original_max_position_embeddings": orig,
        }
        if np.allclose(_llama3_divisors(theta, head_dim, params), divisors, rtol=1e-3):
            return params
    raise UnsupportedModelError("GGUF rope_freqs tensor does not match Llama 3 rope scaling")


def _llama3_divisors(theta: float, head_dim: int, p: dict) -> np.ndarray:
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * np.pi / freqs
    low_wl = p["original_max_position_embeddings"] / p["low_freq_factor"]
    high_wl = p["original_max_position_embeddings"] / p["high_freq_factor"]
    smooth = (p["original_max_position_embeddings"] / wavelen - p["low_freq_factor"]) / (
        p["high_freq_factor"] - p["low_freq_factor"]
    )
    mid = 1.0 / ((1 - smooth) / p["factor"] + smooth)
    return np.where(wavelen < high_wl, 1.0, np.where(wavelen > low_wl, p["factor"], mid))


def hf_name(gguf_name: str) -> str | None:
    """HF parameter name of a llama GGUF tensor (None: not a weight we keep)."""
    if gguf_name in _SKIPPED:
        return None
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK.fullmatch(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    raise UnsupportedModelError(f"unexpected tensor {gguf_name!r} in a llama GGUF")


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's convert_hf_to_gguf permutation of q/k rows (rotary halves -> interleaved pairs)."""
    out = w.shape[0]
    head_dim = out // n_head
    return w.reshape(n_head, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensor_to_hf(t, cfg: dict) -> tuple[str | None, torch.Tensor | None]:
    """(HF name, float32 tensor in HF [out, in] layout) of one GGUF tensor."""
    import gguf

    name = hf_name(t.name)
    if name is None:
        return None, None
    # numpy shapes of GGUFReader tensors are GGUF dims reversed, i.e. already HF's [out, in].
    w = np.asarray(gguf.dequantize(t.data, t.tensor_type), dtype=np.float32)
    w = w.reshape([int(d) for d in reversed(t.shape)])
    if ".attn_q." in t.name:
        w = unpermute_qk(w, cfg["num_attention_heads"])
    elif ".attn_k." in t.name:
        w = unpermute_qk(w, cfg["num_key_value_heads"])
    if not w.flags.writeable or not w.flags.c_contiguous:  # F32/F16 tensors may be views of the mmap
        w = np.array(w, copy=True, order="C")
    return name, torch.from_numpy(w)


def convert_gguf(gguf_path: str, out_dir: str) -> None:
    """Write config.json, safetensors weights and the tokenizer of a llama GGUF into out_dir."""
    import gguf
    from safetensors.torch import save_file
    from tqdm.auto import tqdm

    reader = gguf.GGUFReader(gguf_path)
    cfg = hf_config_from_gguf(reader)
    names = {t.name for t in reader.tensors}
    for t in reader.tensors:  # fail on unexpected tensors before the slow part
        hf_name(t.name)
    if "token_embd.weight" not in names or "output_norm.weight" not in names:
        raise UnsupportedModelError(f"{gguf_path!r} lacks token_embd/output_norm tensors")

    shards: list[dict[str, str]] = []  # per shard: tensor name -> file
    pending: dict[str, torch.Tensor] = {}
    pending_bytes = 0

    def flush() -> None:
        nonlocal pending, pending_bytes
        if pending:
            fname = f"shard-{len(shards):05d}.safetensors"
            save_file(pending, os.path.join(out_dir, fname), metadata={"format": "pt"})
            shards.append(dict.fromkeys(pending, fname))
            pending, pending_bytes = {}, 0

    bar = tqdm(
        total=len(reader.tensors) + 1, desc=f"lazyrt: converting {os.path.basename(gguf_path)}", unit="tensor"
    )
    try:
        for t in reader.tensors:
            name, w = gguf_tensor_to_hf(t, cfg)
            bar.update(1)
            if name is None:
                continue
            if pending_bytes and pending_bytes + w.numel() * 4 > SHARD_BYTES:
                flush()
            pending[name] = w
            pending_bytes += w.numel() * 4
        flush()
        _finish_shards(out_dir, shards)
        bar.set_postfix_str("tokenizer")
        _save_tokenizer(gguf_path, out_dir, cfg["max_position_embeddings"])
        bar.update(1)
    finally:
        bar.close()
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    with open(os.path.join(out_dir, "lazyrt_source.json"), "w") as f:
        json.dump({"gguf": os.path.abspath(gguf_path), "converter_version": CONVERTER_VERSION}, f, indent=2)


def _finish_shards(out_dir: str, shards: list[dict[str, str]]) -> None:
    """Rename shards to HF names; write model.safetensors.index.json when there is more than one."""
    n = len(shards)
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards):
        old = next(iter(shard.values()))
        new = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        os.replace(os.path.join(out_dir, old), os.path.join(out_dir, new))
        os.chmod(os.path.join(out_dir, new), 0o644)  # safetensors writes 0600
        weight_map.update(dict.fromkeys(shard, new))
    if n > 1:
        total = sum(os.path.getsize(os.path.join(out_dir, f)) for f in set(weight_map.values()))
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


def _save_tokenizer(gguf_path: str, out_dir: str, max_len: int) -> None:
    from transformers import AutoTokenizer

    path = os.path.abspath(gguf_path)
    tok = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    tok.model_max_length = max_len
    tok.save_pretrained(out_dir)
