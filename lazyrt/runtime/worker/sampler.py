"""Token sampling: greedy, temperature, top-k, top-p, per-request seeded generators."""

from __future__ import annotations

import torch

from lazyrt.sampling_params import SamplingParams


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Pick one token from logits [vocab] (fp32)."""
    if params.temperature == 0:
        return int(torch.argmax(logits))
    logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.numel():
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # keep the smallest set whose mass reaches top_p (always at least the top token)
        drop = (torch.cumsum(sorted_probs, 0) - sorted_probs) >= params.top_p
        sorted_probs[drop] = 0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


def sample_tokens_device(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> torch.Tensor:
    """One token per row of logits [n, vocab], left on logits' device: greedy rows share one argmax
    and wait for nothing (overlapped scheduling); a row with temperature > 0 samples on the host
    (its seeded generator), which waits for the step."""
    tokens = torch.argmax(logits, dim=-1)
    for i, (p, g) in enumerate(zip(params, generators)):
        if p.temperature != 0:
            tokens[i] = sample_token(logits[i], p, g)
    return tokens
