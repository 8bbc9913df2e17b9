"""Document attention (APE-style; issue 13): the question's and generated tokens' logits on document
tokens divided by a temperature, the attention mass on documents multiplied by a scale, in lazy and
block mode alike. The reference is Hugging Face transformers with an explicit mask and a pairwise
attention function that applies the same transform (tests/hf_reference.py; no lazyrt code)."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import cpu_engine as _engine
from conftest import load_hf
from conftest import random_rag_ids as _prompt
from hf_reference import hf_doc_attention_logits

from lazyrt import RagPrompt, SamplingParams
from lazyrt.config import EngineConfig
from lazyrt.runtime.ipc.messages import decode, encode
from lazyrt.runtime.scheduler.plan import ForwardItem, StepPlan
from lazyrt.runtime.scheduler.request import Request, Segment
from lazyrt.runtime.scheduler.step_wire import StepDecoder, StepEncoder
from lazyrt.runtime.server.protocol import ApiError, parse_generate
from lazyrt.runtime.worker.step_inputs import StepInputs

TEMP, SCALE = 0.6, 1.7




def _hf_greedy(hf, prefix, docs, suffix, n: int, temp: float, scale: float) -> list[int]:
    out: list[int] = []
    for _ in range(n):
        logits = hf_doc_attention_logits(hf, prefix, docs, suffix + out, temp, scale)
        out.append(int(logits[-1].argmax()))
    return out


@pytest.mark.parametrize("mode", ["lazy", "block"])
def test_greedy_tokens_match_reference(mode, tiny_model_dir):
    """Engine-level option: greedy tokens = the HF reference with the same transform; the transform
    changes the logits (so the check could fail)."""
    path = tiny_model_dir("llama")
    hf = load_hf(path)
    engine = _engine(path, mode, doc_attention_temperature=TEMP, doc_attention_scale=SCALE)
    rng = random.Random()
    vocab = engine.model_config.vocab_size
    prompts = [_prompt(rng, vocab) for _ in range(3)]
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    outs = engine.generate([RagPrompt(p, d, s) for p, d, s in prompts], sp)
    for (p, d, s), out in zip(prompts, outs):
        assert out["token_ids"] == _hf_greedy(hf, p, d, s, 6, TEMP, SCALE)
    p, d, s = prompts[0]
    plain = hf_doc_attention_logits(hf, p, d, s, 1.0, 1.0)
    changed = hf_doc_attention_logits(hf, p, d, s, TEMP, SCALE)
    assert (plain - changed).abs().max() > 1e-3


def test_logprobs_match_reference_and_per_request_override(tiny_model_dir):
    """Scored continuation logprobs (one prefill over cached chunks) = HF reference within fp32
    tolerance; a per-request override on a neutral engine gives the engine-level option's tokens."""
    path = tiny_model_dir("qwen3")
    hf = load_hf(path)
    rng = random.Random()
    configured = _engine(path, "lazy", doc_attention_temperature=TEMP, doc_attention_scale=SCALE)
    vocab = configured.model_config.vocab_size
    prefix, docs, suffix = _prompt(rng, vocab)
    cont = [rng.randrange(100, vocab) for _ in range(4)]
    req = configured.score_request(RagPrompt(prefix, docs, suffix), "x")
    req.suffix, req.score_len = suffix + cont, len(cont)  # score token ids directly
    configured._run([req])
    logits = hf_doc_attention_logits(hf, prefix, docs, suffix + cont, TEMP, SCALE)
    lp = torch.log_softmax(logits.double(), -1)
    expect = [float(lp[len(suffix) - 1 + i, t]) for i, t in enumerate(cont)]
    assert req.score_logprobs == pytest.approx(expect, abs=2e-4)

    neutral = _engine(path, "lazy")
    prompts = [RagPrompt(*_prompt(rng, vocab)) for _ in range(2)]
    sp = dict(max_tokens=5, ignore_eos=True)
    override = SamplingParams(**sp, doc_attention_temperature=TEMP, doc_attention_scale=SCALE)
    a = neutral.generate(prompts, override)
    b = configured.generate(prompts, SamplingParams(**sp))
    assert [o["token_ids"] for o in a] == [o["token_ids"] for o in b]


def test_neutral_values_change_nothing(tiny_model_dir):
    """Temperature 1 and scale 1 (explicit) give the default engine's logprobs bit for bit."""
    path = tiny_model_dir("llama")
    rng = random.Random()
    default, explicit = _engine(path, "lazy"), _engine(path, "lazy", doc_attention_temperature=1.0,
                                                        doc_attention_scale=1)
    prefix, docs, suffix = _prompt(rng, default.model_config.vocab_size)
    scores = [e.score(RagPrompt(prefix, docs, suffix), [" yes", " no"], normalize=False)
              for e in (default, explicit)]
    assert scores[0] == scores[1]


def test_lazy_equals_block_with_recompute(tiny_model_dir):
    """Document attention and selective recompute together: lazy and block give the same tokens."""
    path = tiny_model_dir("llama")
    kw = dict(doc_attention_temperature=0.8, doc_attention_scale=0.5, recompute_policy="tail",
              recompute_ratio=0.5)
    lazy, block = _engine(path, "lazy", **kw), _engine(path, "block", **kw)
    rng = random.Random()
    prompts = [RagPrompt(*_prompt(rng, lazy.model_config.vocab_size)) for _ in range(3)]
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    assert [o["token_ids"] for o in lazy.generate(prompts, sp)] == [
        o["token_ids"] for o in block.generate(prompts, sp)
    ]


def test_bad_values_name_the_option(tiny_model_dir):
    for kw in ({"doc_attention_temperature": 0}, {"doc_attention_scale": -1.0},
               {"doc_attention_temperature": float("inf")}, {"doc_attention_scale": True}):
        name = next(iter(kw))
        with pytest.raises(ValueError, match=name):
            EngineConfig(**kw).validate()
        with pytest.raises(ValueError, match=name):
            SamplingParams(**kw)
    with pytest.raises(ValueError, match="doc_attention_scale.*needs cache_mode lazy or block"):
        EngineConfig(cache_mode="prefix", doc_attention_scale=2.0).validate()
    engine = _engine(tiny_model_dir("llama"), "none")
    with pytest.raises(ValueError, match="sampling_params.doc_attention_temperature"):
        sp = SamplingParams(max_tokens=2, doc_attention_temperature=0.5)
        engine.rag(["a doc"], "q?", sampling_params=sp)
    with pytest.raises(ApiError) as e:
        parse_generate({"text": "hi", "sampling_params": {"doc_attention_scale": 0}})
    assert e.value.param == "sampling_params.doc_attention_scale"
    ok = parse_generate({"text": "hi", "sampling_params": {"doc_attention_temperature": 0.5}})
    assert ok.req.sampling.doc_attention_temperature == 0.5


def test_wire_and_step_inputs_carry_document_attention():
    """The plan -> StepMsg -> plan round trip keeps is_doc and doc_logits (decode items too, which
    travel without segments), and StepInputs gives document entries of such items the transform."""
    page = 4
    prefix = Segment([0], 0, 3)
    doc = Segment([1, 2], 3, 6, is_doc=True)
    own = Segment([3, 4], 9, 2)
    req = Request(7, SamplingParams(max_tokens=4))
    dl = (1 / TEMP, 0.5)
    enc, dec = StepEncoder(), StepDecoder()
    first = StepPlan([ForwardItem([5, 6], 9, [prefix, doc, own], own, request=req, doc_logits=dl)])
    back = dec.decode(decode(encode(enc.encode(first, []))))
    assert [s.is_doc for s in back.items[0].segments] == [False, True, False]
    assert back.items[0].doc_logits == pytest.approx(dl)
    own.num_tokens = 3
    step = StepPlan([ForwardItem([8], 11, [prefix, doc, own], own, request=req, doc_logits=dl)])
    msg = enc.encode(step, [])
    assert msg.items[0].segments is None  # the compact decode form
    back = dec.decode(decode(encode(msg)))
    assert back.items[0].doc_logits == pytest.approx(dl)
    s = StepInputs.from_plan(back, page)
    assert s.entry_logit_scale.tolist() == pytest.approx([1, dl[0], dl[0], 1])
    assert s.entry_log_mass.tolist() == pytest.approx([0, dl[1], dl[1], 0])
    plain = StepInputs.from_plan(StepPlan([ForwardItem([8], 11, [prefix, doc, own], own)]), page)
    assert plain.entry_logit_scale is None and plain.entry_log_mass is None
