"""Read a Hugging Face model directory: config.json, safetensors (sharded or not) or *.bin weights."""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os

import torch

from lazyrt.models.config import ModelConfig
from lazyrt.models.param_shapes import param_shapes

logger = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def read_config(model_dir: str) -> dict:
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{model_dir!r} is not a Hugging Face model directory: no config.json")
    with open(path) as f:
        return json.load(f)


def has_tokenizer(model_dir: str) -> bool:
    return any(os.path.isfile(os.path.join(model_dir, n)) for n in TOKENIZER_FILES)


def fingerprint(paths: list[str]) -> str:
    """Hash of (absolute path, size, mtime) of each file: changes whenever a file is replaced or edited."""
    h = hashlib.sha256()
    for p in sorted(os.path.abspath(p) for p in paths):
        st = os.stat(p)
        h.update(f"{p}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


def dir_model_id(model_dir: str) -> str:
    files = [p for p in glob.glob(os.path.join(model_dir, "*")) if os.path.isfile(p)]
    return f"{os.path.basename(os.path.abspath(model_dir))}:{fingerprint(files)}"


def _weight_files(model_dir: str) -> tuple[list[str], str]:
    """The weight files to read and their kind ("safetensors" or "bin")."""
    for index_name, kind in (
        ("model.safetensors.index.json", "safetensors"),
        ("pytorch_model.bin.index.json", "bin"),
    ):
        index = os.path.join(model_dir, index_name)
        if os.path.isfile(index):
            with open(index) as f:
                shards = sorted(set(json.load(f)["weight_map"].values()))
            return [os.path.join(model_dir, s) for s in shards], kind
    single = os.path.join(model_dir, "model.safetensors")
    if os.path.isfile(single):
        return [single], "safetensors"
    # Mistral repos ship consolidated.safetensors (original names) beside the HF shards: skip it.
    files = [
        p
        for p in sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
        if not os.path.basename(p).startswith("consolidated")
    ]
    if files:
        return files, "safetensors"
    files = sorted(glob.glob(os.path.join(model_dir, "*.bin")))
    files = [p for p in files if not os.path.basename(p).startswith(("training_args", "optimizer"))]
    if files:
        return files, "bin"
    raise FileNotFoundError(
        f"no weights in {model_dir!r}: expected *.safetensors (optionally with "
        "model.safetensors.index.json) or *.bin files"
    )


def load_weights(
    model_dir: str,
    cfg: ModelConfig,
    dtype: torch.dtype,
    shard: tuple[ModelConfig, dict[str, tuple]] | None = None,
) -> dict[str, torch.Tensor]:
    """The parameters named by param_shapes(cfg), cast tensor by tensor to dtype (peak memory: one shard).
    shard: (a tensor-parallel rank's config, the index of its slice of each split weight): only those
    slices are read (safetensors reads just their bytes), so a rank holds 1/N of the split weights."""
    local_cfg, index = shard if shard is not None else (cfg, {})
    expected = param_shapes(local_cfg)
    files, kind = _weight_files(model_dir)
    weights: dict[str, torch.Tensor] = {}
    ignored: list[str] = []

    def take(name: str, tensor: torch.Tensor) -> None:
        if name in expected:
            weights[name] = (tensor[index[name]] if name in index else tensor).to(dtype).contiguous()
        else:
            ignored.append(name)

    for path in files:
        if kind == "safetensors":
            from safetensors import safe_open

            with safe_open(path, framework="pt", device="cpu") as f:
                for name in f.keys():
                    if name in index:
                        weights[name] = f.get_slice(name)[index[name]].to(dtype).contiguous()
                    elif name in expected:
                        take(name, f.get_tensor(name))
                    else:
                        ignored.append(name)
        else:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            for name, tensor in state.items():
                take(name, tensor)
            del state
    if cfg.tie_word_embeddings and "lm_head.weight" in ignored:
        ignored.remove("lm_head.weight")  # tied checkpoints sometimes store the copy anyway
    if ignored:
        logger.info("ignored %d unused tensors in %s, e.g. %s", len(ignored), model_dir, ignored[:3])
    missing = [n for n in expected if n not in weights]
    if missing:
        raise ValueError(
            f"{model_dir!r} lacks {len(missing)} weights the {cfg.model_type} model needs, e.g. {missing[:3]}"
        )
    bad = [(n, tuple(w.shape), expected[n]) for n, w in weights.items() if tuple(w.shape) != expected[n]]
    if bad:
        raise ValueError(f"{model_dir!r}: weight shapes disagree with config.json, e.g. {bad[:3]}")
    return {n: weights[n] for n in expected}
