"""Log each Triton kernel variant a serving worker launches for the first time after start-up.

Such a launch compiles the variant (seconds on a fresh machine; a load from Triton's disk cache on a
warm one) while the engine waits, so every request in flight waits too. The worker's start-up
(ModelRunner.warm_up_attention, the CUDA graphs' capture) is meant to have launched every variant a
step can pick; a warning here names one it missed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

logger = logging.getLogger("lazyrt.worker")


def late_compile_hook(previous: Callable | None = None) -> Callable:
    """A Triton `jit_cache_hook` (called before a variant new to the process is compiled or loaded)
    that logs a warning naming it, then defers to `previous` (a hook already installed), if any."""

    def hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled):  # noqa: A002 (Triton's names)
        name = getattr(fn, "name", "kernel")
        logger.warning("Triton compiles a new variant of %s mid-serving (the engine waits for it; the "
                       "start-up warm-up did not launch it): %s", name, str(repr)[:400])  # fmt: skip
        if previous is None:
            return False
        return previous(key=key, repr=repr, fn=fn, compile=compile, is_manual_warmup=is_manual_warmup,
                        already_compiled=already_compiled)  # fmt: skip

    return hook


def watch_late_compiles(device: torch.device | None = None) -> bool:
    """From now on, log each Triton kernel variant this process launches for the first time (call
    it once start-up has launched what it will). False off CUDA (a device given that is not) or
    where this Triton has no such hook."""
    if device is not None and device.type != "cuda":
        return False
    try:
        from triton import knobs
    except ImportError:
        return False
    runtime = getattr(knobs, "runtime", None)
    if runtime is None or not hasattr(runtime, "jit_cache_hook"):
        return False
    runtime.jit_cache_hook = late_compile_hook(runtime.jit_cache_hook)
    return True
