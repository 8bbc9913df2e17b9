"""The shared-chunk kernel's programs against a device's SMs: the host picks the kernel's launch
settings (triton_shared_chunk.launch_settings) by whether a launch fits one resident wave, and a
step's piece size (step_inputs.shared_arrays) by its documents' programs an SM. No Triton here: the
CPU engine asks too."""

from __future__ import annotations

import functools

import torch

# At the compiler's 255 registers a thread, two of the shared-chunk kernel's programs fit an SM
# (triton_shared_chunk has the measurements).
WAVE_PROGRAMS_PER_SM = 2
# Past one wave the kernel runs at 168 registers a thread (triton_shared_chunk.MANY_ITEMS_MAXNREG, 4
# warps): three programs fit an SM's 64K registers. A launch's work items then run in rounds of this
# many an SM.
CAPPED_PROGRAMS_PER_SM = 3


@functools.cache  # asked on every eager launch
def num_sms(device_index: int | None) -> int:
    """SMs of a CUDA device; off CUDA an H100's 132, so CPU runs make the same launch choices."""
    if device_index is None or not torch.cuda.is_available():
        return 132
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def device_sms(device: torch.device) -> int:
    return num_sms(device.index if device.type == "cuda" else None)


def within_one_wave(items: int, device: torch.device) -> bool:
    """Whether a launch of `items` (work items x kv heads) fits one wave of resident programs at the
    compiler's registers. 0: not known on the host (taken as more)."""
    return 0 < items <= device_sms(device) * WAVE_PROGRAMS_PER_SM


# A step whose documents, cut at the full piece size (step_inputs.SHARED_PIECE_TOKENS), give at most
# this many programs an SM (a program per full piece's worth of the keys their work items read, per
# kv head) takes half-size pieces: fewer long programs leave SMs idle while the last ones run. The
# measured crossover (step_inputs has the figures): up to 1.33 an SM went faster at half size, from
# 1.64 at full size.
HALF_PIECE_PROGRAMS_PER_SM = 1.5


def half_piece_items(num_kv_heads: int, device: torch.device) -> int:
    """Full pieces' worth of keys read by a step's documents' work items (each runs once per kv head)
    up to which it takes half-size pieces: a tensor-parallel rank holds fewer kv heads, so more."""
    return int(device_sms(device) * HALF_PIECE_PROGRAMS_PER_SM) // max(1, num_kv_heads)


def round_items(device: torch.device) -> int:
    """Work items (x kv heads) that run at once past one wave: a round of resident programs
    (shared_chunk.split_last_round)."""
    return device_sms(device) * CAPPED_PROGRAMS_PER_SM
