"""What happens to a request's logits between the model and the sampler, and what it reports back.

`LogitsProcessing` keeps, per request, the counts of the tokens it generated (on the device, updated
with the sampled tokens without a host sync, so overlapped steps keep overlapping), the tokens of its
prompt (repetition penalty) and its dense logit bias. Before sampling it applies, to the rows that
ask for them, in this order: repetition penalty (HF semantics, prompt + output tokens), presence and
frequency penalties (OpenAI semantics, output tokens), logit bias, and the min_tokens ban on EOS and
stop_token_ids. Rows that ask for nothing are not touched (and cost nothing).

`token_logprobs` reports log-probabilities from the model's own logits (before any of the above and
before temperature), the numbers `Engine.score` gives for the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lazyrt.kernels.host_copy import to_device
from lazyrt.sampling_params import SamplingParams


@dataclass
class _RequestLogits:
    params: SamplingParams
    generated: int = 0  # tokens sampled for it so far (host count: min_tokens)
    counts: torch.Tensor | None = None  # [vocab] float32, its output tokens (penalties)
    prompt: torch.Tensor | None = None  # [vocab] bool, tokens in its prompt (repetition penalty)
    bias: torch.Tensor | None = None  # [vocab] float32


class LogitsProcessing:
    def __init__(self, vocab_size: int, device: torch.device | str, eos_ids: set[int]):
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.eos_ids = sorted(eos_ids)
        self._state: dict[int, _RequestLogits] = {}

    def __len__(self) -> int:
        return len(self._state)

    def release(self, rid: int) -> None:
        self._state.pop(rid, None)

    def _get(self, rid: int, params: SamplingParams, prompt_ids: list[int]) -> _RequestLogits:
        st = self._state.get(rid)
        if st is not None:
            return st
        st = _RequestLogits(params)
        p, v, dev = params, self.vocab_size, self.device
        if p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1:
            st.counts = torch.zeros(v, dtype=torch.float32, device=dev)
        if p.repetition_penalty != 1:
            st.prompt = torch.zeros(v, dtype=torch.bool, device=dev)
            if prompt_ids:
                # index_fill_ takes the value as a kernel argument (x[i] = True may upload it, blocking)
                st.prompt.index_fill_(0, to_device(prompt_ids, dev, torch.long), True)
        if p.logit_bias:
            st.bias = torch.zeros(v, dtype=torch.float32, device=dev)
            ids = to_device(list(p.logit_bias), dev, torch.long)
            st.bias[ids] = to_device(list(p.logit_bias.values()), dev, torch.float32)
        self._state[rid] = st
        return st

    def apply(
        self, logits: torch.Tensor, rids: list[int], params: list[SamplingParams], prompts: list[list[int]]
    ) -> torch.Tensor:
        """logits [n, vocab] of the rows to sample, one per (rid, params, prompt ids); returns the
        logits with each row's processing applied (the input itself when no row asks for any)."""
        rows = [i for i, p in enumerate(params) if p.needs_logits_processing]
        if not rows:
            return logits
        states = [self._get(rids[i], params[i], prompts[i]) for i in rows]
        out = logits.float().clone()
        idx = to_device(rows, logits.device, torch.long)
        x = out[idx]
        dev = x.device
        # bias first, then penalties (the order of HF's processors and vLLM's sampler): a biased
        # token that repeats is penalized with its bias included
        for j, st in enumerate(states):
            if st.bias is not None:
                x[j] += st.bias
        counted = [j for j, st in enumerate(states) if st.counts is not None]
        if counted:
            j = to_device(counted, dev, torch.long)
            counts = torch.stack([states[k].counts for k in counted])
            xs = x[j]
            cp = [states[k].params for k in counted]
            rep = to_device([q.repetition_penalty for q in cp], dev, torch.float32)[:, None]
            seen = counts > 0
            prompt = [states[k].prompt for k in counted]
            if any(m is not None for m in prompt):
                zeros = torch.zeros(x.shape[-1], dtype=torch.bool, device=dev)
                seen = seen | torch.stack([m if m is not None else zeros for m in prompt])
            xs = torch.where(seen, torch.where(xs > 0, xs / rep, xs * rep), xs)
            pres = to_device([q.presence_penalty for q in cp], dev, torch.float32)[:, None]
            freq = to_device([q.frequency_penalty for q in cp], dev, torch.float32)[:, None]
            x[j] = xs - freq * counts - pres * (counts > 0).float()
        for j, st in enumerate(states):
            if st.generated < st.params.min_tokens:
                banned = self.eos_ids + [t for t in st.params.stop_token_ids if t < x.shape[-1]]
                x[j].index_fill_(0, to_device(banned, dev, torch.long), float("-inf"))
        out[idx] = x
        return out

    def advance(self, rids: list[int], tokens: torch.Tensor) -> None:
        """Count the tokens just sampled (tokens[i] for rids[i]; left on the device)."""
        one = None
        for i, rid in enumerate(rids):
            st = self._state.get(rid)
            if st is None:
                continue
            st.generated += 1
            if st.counts is not None:
                one = torch.ones(1, dtype=torch.float32, device=st.counts.device) if one is None else one
                st.counts.index_add_(0, tokens[i : i + 1].to(st.counts.device), one)


def token_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, params: list[SamplingParams]
) -> tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """For the rows whose params ask for logprobs: (row indices, the sampled token's logprob [k],
    the top-N token ids [k, N] and their logprobs [k, N]) with N the largest number asked (rows asking
    for fewer are cut on the host); None when no row asks. Tensors stay on the logits' device."""
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not rows:
        return None
    idx = to_device(rows, logits.device, torch.long)
    lp = torch.log_softmax(logits[idx].float(), dim=-1)
    chosen = lp.gather(1, tokens[idx][:, None].long())[:, 0]
    top = max(params[i].logprobs for i in rows)
    top_lp, top_ids = torch.topk(lp, top, dim=-1) if top else (lp[:, :0], lp[:, :0].long())
    return rows, chosen, top_ids, top_lp


def logprob_entries(
    n_rows: int, params: list[SamplingParams], found: tuple | None
) -> list[list | None] | None:
    """token_logprobs' tensors (now on the host) as one entry per row: None, or [logprob of the
    sampled token, [top ids], [top logprobs]] with that row's number of top entries."""
    if found is None:
        return None
    rows, chosen, top_ids, top_lp = found
    chosen, top_ids, top_lp = chosen.tolist(), top_ids.tolist(), top_lp.tolist()
    out: list[list | None] = [None] * n_rows
    for j, i in enumerate(rows):
        k = params[i].logprobs
        out[i] = [chosen[j], top_ids[j][:k], top_lp[j][:k]]
    return out
