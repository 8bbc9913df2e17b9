"""Token sampling: greedy, temperature, top-k, top-p, min-p, per-request seeded generators.

Everything runs on the logits' device and nothing waits for the step: greedy rows take one argmax;
sampled rows draw their uniform number from their request's (host, seeded) generator, which needs no
logits, and pick their token on the device by inverse CDF over the filtered distribution. So a
step with sampled requests overlaps with the next one's host work like a greedy step does
(overlapped scheduling, scheduler/engine_core.py).
"""

from __future__ import annotations

import torch

from lazyrt.kernels.host_copy import to_device
from lazyrt.sampling_params import SamplingParams


def sampling_probs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The distribution each row samples from, in descending-logit order: (probs [n, V], not
    renormalized after top-p; order [n, V], the vocabulary index of each column). Logits are divided
    by temperature; top_k (<= 0 or >= V: off) keeps the k largest (ties with the k-th kept); top_p
    then keeps the smallest set of the renormalized probabilities whose mass reaches top_p; min_p
    (0: off) then keeps those at least min_p x as likely as the likeliest (HF's warpers in this order;
    a ratio to the likeliest is the same before or after renormalizing)."""
    x = logits.float() / temperature[:, None]
    sorted_x, order = torch.sort(x, dim=-1, descending=True)
    vocab = x.shape[-1]
    k = torch.where((top_k > 0) & (top_k < vocab), top_k, vocab)
    kth = sorted_x.gather(1, (k - 1)[:, None])
    probs = torch.softmax(sorted_x.masked_fill(sorted_x < kth, float("-inf")), dim=-1)
    before = probs.cumsum(-1) - probs  # mass of the more likely tokens
    probs = probs.masked_fill(before >= top_p[:, None], 0.0)
    if min_p is not None:
        probs = probs.masked_fill(probs < min_p[:, None] * probs[:, :1], 0.0)
    return probs, order


def pick(probs: torch.Tensor, order: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse CDF: row i takes the token whose probability interval holds u[i] (in [0, 1)) times
    its row's mass."""
    cdf = probs.cumsum(-1)
    col = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).clamp_(max=probs.shape[-1] - 1)
    return order.gather(1, col)[:, 0]


def sample_tokens_device(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> torch.Tensor:
    """One token per row of logits [n, vocab], left on logits' device; rows with temperature 0 are
    greedy, the others sample with their generator (None: torch's global one)."""
    tokens = torch.argmax(logits, dim=-1)
    rows = [i for i, p in enumerate(params) if p.temperature != 0]
    if not rows:
        return tokens
    dev = logits.device
    sp = [params[i] for i in rows]
    u = [float(torch.rand((), generator=generators[i])) for i in rows]
    temperature = to_device([p.temperature for p in sp], dev, torch.float32)
    top_k = to_device([p.top_k for p in sp], dev, torch.long)
    top_p = to_device([p.top_p for p in sp], dev, torch.float32)
    min_p = to_device([p.min_p for p in sp], dev, torch.float32) if any(p.min_p for p in sp) else None
    idx = to_device(rows, dev, torch.long)
    probs, order = sampling_probs(logits[idx], temperature, top_k, top_p, min_p)
    tokens[idx] = pick(probs, order, to_device(u, dev, torch.float32))
    return tokens
