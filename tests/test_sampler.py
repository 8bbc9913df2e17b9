"""The device sampler (runtime/worker/sampler.py): the distribution it samples from equals HF
transformers' temperature / top-k / top-p / min-p logits warpers on fresh random logits, its inverse-CDF pick
reproduces that distribution over a fine grid of uniforms, greedy rows take the argmax, and seeded
requests repeat."""

from __future__ import annotations

import random

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from lazyrt import SamplingParams
from lazyrt.runtime.worker.sampler import pick, sample_tokens_device, sampling_probs


def hf_probs(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float = 0.0
) -> torch.Tensor:
    scores = TemperatureLogitsWarper(temperature)(None, logits[None].clone())
    if 0 < top_k < logits.numel():
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    if min_p > 0:
        scores = MinPLogitsWarper(min_p)(None, scores)
    return torch.softmax(scores, dim=-1)[0]


def test_sampling_probs_match_hf_warpers():
    rng = random.Random()
    vocab = 500
    ks, ps = [-1, 0, 1, 7, 40, 499, 500, 600], [1.0, 0.9, 0.5, 0.05]
    configs = [(rng.uniform(0.3, 2.0), rng.choice(ks), rng.choice(ps)) for _ in range(12)]
    logits = torch.randn(len(configs), vocab) * rng.uniform(1, 4)
    t, k, p = (torch.tensor(c) for c in zip(*configs))
    probs, order = sampling_probs(logits, t.float(), k.long(), p.float())
    for i, (temperature, top_k, top_p) in enumerate(configs):
        got = torch.zeros(vocab).scatter_(0, order[i], probs[i])
        torch.testing.assert_close(got / got.sum(), hf_probs(logits[i], temperature, top_k, top_p),
                                   rtol=1e-5, atol=1e-6)  # fmt: skip


def test_min_p_matches_hf_warper_with_and_without_top_k_and_top_p():
    rng = random.Random()
    vocab = 400
    configs = [(rng.uniform(0.3, 2.0), rng.choice([-1, 5, 60]), rng.choice([1.0, 0.95, 0.6]),
                rng.choice([0.0, 0.01, 0.1, 0.5, 1.0])) for _ in range(16)]  # fmt: skip
    configs[0] = (1.0, -1, 1.0, 0.1)  # one row where min_p alone filters
    logits = torch.randn(len(configs), vocab) * rng.uniform(1, 4)
    t, k, p, m = (torch.tensor(c) for c in zip(*configs))
    probs, order = sampling_probs(logits, t.float(), k.long(), p.float(), m.float())
    filtered = 0
    for i, (temperature, top_k, top_p, min_p) in enumerate(configs):
        got = torch.zeros(vocab).scatter_(0, order[i], probs[i])
        want = hf_probs(logits[i], temperature, top_k, top_p, min_p)
        torch.testing.assert_close(got / got.sum(), want, rtol=1e-5, atol=1e-6)
        filtered += int((got > 0).sum() < (hf_probs(logits[i], temperature, top_k, top_p) > 0).sum())
    assert filtered  # min_p removed tokens that top-k / top-p alone keep, in some rows


def test_min_p_rows_sample_only_tokens_it_keeps():
    # a row with min_p samples only tokens at least min_p x as likely as the likeliest; a row beside
    # it without min_p is unaffected (its seeded draws equal a batch without the min_p row)
    logits = torch.tensor([[4.0, 3.5, 1.0, 0.0, -1.0], [4.0, 3.5, 1.0, 0.0, -1.0]])
    keep = {0, 1}  # exp(-0.5) = 0.61 >= 0.3; exp(-3) = 0.05 < 0.3
    for seed in range(40):
        params = [SamplingParams(temperature=1.0, min_p=0.3, seed=seed), SamplingParams(temperature=1.0)]
        gens = [torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed + 1000)]
        tok = sample_tokens_device(logits, params, gens)
        assert int(tok[0]) in keep
        alone = sample_tokens_device(logits[1:], params[1:], [torch.Generator().manual_seed(seed + 1000)])
        assert int(tok[1]) == int(alone[0])


def test_pick_reproduces_the_distribution_over_a_grid_of_uniforms():
    logits = torch.randn(3, 50) * 2
    probs, order = sampling_probs(logits, torch.tensor([1.0, 0.7, 1.3]), torch.tensor([-1, 10, 0]),
                                  torch.tensor([1.0, 1.0, 0.8]))  # fmt: skip
    n = 20000
    u = (torch.arange(n, dtype=torch.float64) + 0.5) / n
    for i in range(3):
        tokens = pick(probs[i : i + 1].expand(n, -1), order[i : i + 1].expand(n, -1), u.float())
        freq = torch.bincount(tokens, minlength=50).float() / n
        want = torch.zeros(50).scatter_(0, order[i], probs[i] / probs[i].sum())
        assert (freq - want).abs().max() < 2e-4  # grid resolution 1/n, plus fp32 rounding
        assert (freq[want == 0] == 0).all()  # filtered tokens are never picked


@pytest.mark.parametrize("seed", [None, 1234])
def test_batch_mixes_greedy_and_seeded_rows(seed):
    logits = torch.randn(5, 300)
    params = [SamplingParams(), SamplingParams(temperature=0.8, top_k=20, seed=seed), SamplingParams(),
              SamplingParams(temperature=1.5, top_p=0.5), SamplingParams(temperature=1.0)]  # fmt: skip

    def gens():
        return [torch.Generator().manual_seed(p.seed) if p.seed is not None else None for p in params]

    a = sample_tokens_device(logits, params, gens())
    assert a[0] == logits[0].argmax() and a[2] == logits[2].argmax()
    assert a[1] in torch.topk(logits[1], 20).indices  # top-k respected
    if seed is not None:
        assert sample_tokens_device(logits, params, gens())[1] == a[1]  # seeded rows repeat
    # a near-one-hot row samples its token whatever the uniform
    sharp = torch.full((1, 300), -50.0)
    sharp[0, 17] = 50.0
    assert sample_tokens_device(sharp, [SamplingParams(temperature=1.0)], [None]).item() == 17


@pytest.mark.parametrize(
    "kw, field",
    [({"seed": 2**63}, "seed"), ({"seed": -(2**63) - 1}, "seed"), ({"max_tokens": 2**31}, "max_tokens"),
     ({"top_k": 2**31}, "top_k"), ({"min_tokens": 2**31, "max_tokens": 2**31 - 1}, "min_tokens"),
     ({"retrieval_top_k": 2**31}, "retrieval_top_k")],
)  # fmt: skip
def test_sizes_past_what_the_processes_carry_are_refused_naming_the_field(kw, field):
    from lazyrt.sampling_params import SamplingParamError

    with pytest.raises(SamplingParamError, match=rf"SamplingParams\.{field}=") as e:
        SamplingParams(**kw)
    assert e.value.param == field


def test_n_seeds_stay_in_range_and_distinct():
    top = 2**63 - 1
    seeds = [p.seed for p in SamplingParams(seed=top - 1, n=4).expand_n()]
    assert seeds == [top - 1, top, -(2**63), -(2**63) + 1]
    low = random.randrange(-(2**40), 2**40)
    assert [p.seed for p in SamplingParams(seed=low, n=3).expand_n()] == [low, low + 1, low + 2]
