"""Penalties, logit bias, min_tokens, stop_token_ids and logprobs (issue 16's sampling parity), against
Hugging Face transformers: its logits processors on random logits, `generate` on tiny random models,
and its forward's log-softmax for the logprobs."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import DEVICES, load_hf
from transformers import (
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from lazyrt import Engine, SamplingParams
from lazyrt.runtime.worker.logits_processing import LogitsProcessing, logprob_entries, token_logprobs


def _feed(proc: LogitsProcessing, rids, params, prompts, outputs: list[list[int]]) -> None:
    """Replays sampling steps: each step's logits pass through apply, then the outputs are counted."""
    vocab = proc.vocab_size
    for t in range(max(map(len, outputs))):
        live = [i for i, o in enumerate(outputs) if t < len(o)]
        proc.apply(torch.randn(len(live), vocab), [rids[i] for i in live], [params[i] for i in live],
                   [prompts[i] for i in live])  # fmt: skip
        proc.advance([rids[i] for i in live], torch.tensor([outputs[i][t] for i in live]))


@pytest.mark.parametrize("trial", range(4))
def test_apply_matches_hf_processors_and_openai_formula(trial):
    rng = random.Random()
    vocab, eos = 53, {3, 7}
    ids = lambda n: [rng.randrange(vocab) for _ in range(n)]  # noqa: E731
    prompts = [ids(rng.randint(1, 30)) for _ in range(5)]
    outputs = [ids(rng.randint(1, 12)) for _ in range(5)]
    bias = {rng.randrange(vocab): rng.uniform(-5, 5) for _ in range(4)}
    bias0 = {t: rng.uniform(-5, 5) for t in outputs[0][:2] + ids(2)}  # on repeated tokens too
    params = [
        SamplingParams(repetition_penalty=rng.uniform(1.1, 2.0), logit_bias=bias0),
        SamplingParams(repetition_penalty=rng.uniform(0.5, 0.9)),  # < 1 favours repeats
        SamplingParams(presence_penalty=rng.uniform(-2, 2), frequency_penalty=rng.uniform(-2, 2)),
        SamplingParams(logit_bias=bias, min_tokens=len(outputs[3]) + 1, stop_token_ids=[11]),
        SamplingParams(),  # untouched
    ]
    rids = [10, 11, 12, 13, 14]
    proc = LogitsProcessing(vocab, "cpu", eos)
    _feed(proc, rids, params, prompts, outputs)
    logits = torch.randn(5, vocab) * 4
    got = proc.apply(logits, rids, params, prompts)

    ctx = lambda i: torch.tensor([prompts[i] + outputs[i]])  # noqa: E731
    # HF's order (vLLM's too): the bias, then the penalty
    want0 = SequenceBiasLogitsProcessor([[[t], b] for t, b in bias0.items()])(ctx(0), logits[:1].clone())
    want0 = RepetitionPenaltyLogitsProcessor(params[0].repetition_penalty)(ctx(0), want0)
    want1 = RepetitionPenaltyLogitsProcessor(params[1].repetition_penalty)(ctx(1), logits[1:2].clone())
    want2 = logits[2].clone()  # OpenAI: mu[j] - c[j] * alpha_frequency - (c[j] > 0) * alpha_presence
    for tok in range(vocab):
        c = outputs[2].count(tok)
        want2[tok] -= c * params[2].frequency_penalty + (c > 0) * params[2].presence_penalty
    want3 = SequenceBiasLogitsProcessor([[[t], b] for t, b in bias.items()])(ctx(3), logits[3:4].clone())
    want3 = MinNewTokensLengthLogitsProcessor(len(prompts[3]), params[3].min_tokens, sorted(eos) + [11])(
        ctx(3), want3
    )
    torch.testing.assert_close(got[0], want0[0])
    torch.testing.assert_close(got[1], want1[0])
    torch.testing.assert_close(got[2], want2)
    torch.testing.assert_close(got[3], want3[0])
    assert torch.equal(got[4], logits[4])
    assert not torch.equal(got[0], logits[0]) and not torch.equal(got[3], logits[3])
    # min_tokens reached: the ban lifts, the bias stays
    proc.advance([13], torch.tensor([0]))
    again = proc.apply(logits[3:4], [13], [params[3]], [prompts[3]])
    assert torch.isfinite(again).all()
    proc.release(13)
    assert len(proc) == 3  # rows that ask for nothing keep no state


def test_token_logprobs_match_log_softmax():
    logits = torch.randn(4, 40)
    tokens = torch.randint(0, 40, (4,))
    params = [SamplingParams(logprobs=k) for k in (3, None, 0, 5)]
    entries = logprob_entries(4, params, token_logprobs(logits, tokens, params))
    ref = torch.log_softmax(logits, -1)
    assert entries[1] is None
    for i in (0, 2, 3):
        lp, top_ids, top_lps = entries[i]
        assert lp == pytest.approx(float(ref[i, tokens[i]]), abs=1e-5)
        k = params[i].logprobs
        assert top_ids == ref[i].topk(k).indices.tolist() if k else top_ids == []
        assert top_lps == pytest.approx(ref[i].topk(k).values.tolist(), abs=1e-5)


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    path = tiny_model_dir("llama3")
    return load_hf(path), path


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("overlap", [True, False])
def test_penalties_bias_min_tokens_match_hf_generate(tiny, overlap, device):
    hf, path = tiny
    hf = hf.to(device)
    engine = Engine(path, device=device, dtype="float32", kv_cache_tokens=4096, overlap_schedule=overlap)
    rng = random.Random()
    vocab = engine.model_config.vocab_size
    for _ in range(3):
        prompt = [rng.randrange(100, vocab) for _ in range(rng.randint(3, 25))]
        plain = engine.generate([prompt], SamplingParams(max_tokens=12))[0]["token_ids"]
        stop_tok = plain[0]  # banned until min_tokens: the first token must change
        bias = {plain[1]: -7.5, rng.randrange(vocab): 6.0}
        sp = SamplingParams(
            max_tokens=12, repetition_penalty=1.35, logit_bias=bias, min_tokens=4, stop_token_ids=[stop_tok]
        )
        got = engine.generate([prompt], sp)[0]
        eos = sorted(engine.eos_ids) + [stop_tok]
        want = hf.generate(
            torch.tensor([prompt], device=device), max_new_tokens=12, do_sample=False,
            repetition_penalty=1.35, min_new_tokens=4, sequence_bias=[[[t], b] for t, b in bias.items()],
            eos_token_id=eos, pad_token_id=0,
        )[0, len(prompt):].tolist()  # fmt: skip
        if want[-1] in eos and len(want) < 12:
            assert got["meta"]["finish_reason"] == "stop"
        assert got["token_ids"] == want
        assert got["token_ids"][0] != stop_tok


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("overlap", [True, False])
def test_logprobs_equal_hf_forward(tiny, overlap, device):
    hf, path = tiny
    hf = hf.to(device)
    engine = Engine(path, device=device, dtype="float32", kv_cache_tokens=4096, overlap_schedule=overlap)
    rng = random.Random()
    vocab = engine.model_config.vocab_size
    prompts = [[rng.randrange(100, vocab) for _ in range(rng.randint(3, 25))] for _ in range(3)]
    sps = [
        SamplingParams(max_tokens=8, temperature=0.9, seed=rng.randrange(1 << 30), logprobs=4,
                       presence_penalty=1.0),  # fmt: skip
        SamplingParams(max_tokens=8, logprobs=0),
        SamplingParams(max_tokens=8),
    ]
    outs = engine.generate(prompts, sps)
    assert "logprobs" not in outs[2]
    for prompt, sp, out in zip(prompts[:2], sps, outs):
        ids = out["token_ids"]
        with torch.inference_mode():
            logits = hf(torch.tensor([prompt + ids], device=device)).logits[0].float().cpu()
            ref = torch.log_softmax(logits, -1)
        assert len(out["logprobs"]) == len(ids)
        for i, (tok, e) in enumerate(zip(ids, out["logprobs"])):
            row = ref[len(prompt) + i - 1]  # logprobs are the model's, before penalties/temperature
            assert e["token_id"] == tok and e["logprob"] == pytest.approx(float(row[tok]), abs=2e-4)
            assert e["token"] == bytes(e["bytes"]).decode(errors="replace")
            top = [t["token_id"] for t in e["top_logprobs"]]
            assert len(top) == sp.logprobs
            if top:
                assert top[0] == int(row.argmax())
                assert [t["logprob"] for t in e["top_logprobs"]] == pytest.approx(
                    row.topk(sp.logprobs).values.tolist(), abs=2e-4
                )
        # each token's bytes, joined, are the output's text
        joined = b"".join(bytes(e["bytes"]) for e in out["logprobs"]).decode(errors="replace")
        assert joined == engine.tokenizer.decode(ids)


def test_stop_token_ids_end_text_without_the_token(default_model):
    engine = Engine(kv_cache_tokens=4096)
    prompt = "Once upon a time, in a small village,"
    plain = engine.generate([prompt], SamplingParams(max_tokens=16))[0]
    ids = plain["token_ids"]
    k = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i])  # first occurrence
    got = engine.generate([prompt], SamplingParams(max_tokens=16, stop_token_ids=[ids[k]], logprobs=1))[0]
    assert got["token_ids"] == ids[: k + 1]
    assert got["meta"]["finish_reason"] == "stop"
    assert got["text"] == engine.tokenizer.decode(ids[:k], skip_special_tokens=True)
    assert len(got["logprobs"]) == k + 1


@pytest.mark.parametrize(
    "kw, field",
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": "x"}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"logit_bias": {"a": 1}}, "logit_bias"),
        ({"logit_bias": {5: 101}}, "logit_bias"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"stop_token_ids": [-3]}, "stop_token_ids"),
        ({"logprobs": 21}, "logprobs"),
        ({"n": 0}, "n"),
    ],
)
def test_bad_values_name_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kw)


def test_token_ids_outside_vocab_are_refused(default_model):
    engine = Engine(kv_cache_tokens=1024)
    for kw in ({"logit_bias": {10**6: 1.0}}, {"stop_token_ids": [10**6]}):
        with pytest.raises(ValueError, match=next(iter(kw))):
            engine.generate(["hi"], SamplingParams(**kw))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_processing_and_sampling_never_wait_for_the_device():
    """Penalties, bias, min_tokens, seeded sampling and logprobs on CUDA: no call blocks the host on
    the device (a blocking upload would wait for the step's forward and end the overlap), and the
    results equal the CPU's."""
    from lazyrt.runtime.worker.sampler import sample_tokens_device

    rng = random.Random()
    vocab = 1000
    params = [SamplingParams(repetition_penalty=1.3, presence_penalty=0.5, logit_bias={5: 3.0}, min_tokens=3,
                             stop_token_ids=[9], logprobs=3),
              SamplingParams(temperature=0.8, seed=rng.randrange(1 << 30), frequency_penalty=0.4),
              SamplingParams()]  # fmt: skip
    rids, prompts = [1, 2, 3], [[rng.randrange(vocab) for _ in range(8)] for _ in range(3)]
    procs = {d: LogitsProcessing(vocab, d, {2}) for d in ("cpu", "cuda")}
    for _ in range(4):
        logits = torch.randn(3, vocab)
        got = {}
        for d, proc in procs.items():
            gens = [None, torch.Generator().manual_seed(params[1].seed), None]
            x = logits.to(d)
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error" if d == "cuda" else "default")
            try:
                processed = proc.apply(x, rids, params, prompts)
                tokens = sample_tokens_device(processed, params, gens)
                proc.advance(rids, tokens)
                found = token_logprobs(x, tokens, params)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            got[d] = (processed.cpu(), tokens.cpu(), found[1].cpu())
        assert torch.allclose(got["cuda"][0], got["cpu"][0], atol=1e-5)
        assert torch.equal(got["cuda"][1], got["cpu"][1])
        assert torch.allclose(got["cuda"][2], got["cpu"][2], atol=1e-5)
