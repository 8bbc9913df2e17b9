"""Units behind the server: the wire format and incremental detokenization (no processes)."""

from __future__ import annotations

import pickle
import random
from array import array

import msgpack
import pytest

from lazyrt.runtime.ipc.messages import (
    GenerateReq,
    StepItem,
    StepMsg,
    TokenBatch,
    TokenizedReq,
    TokenOut,
    decode,
    encode,
)
from lazyrt.runtime.tokenizer.detokenizer import IncrementalDetokenizer
from lazyrt.sampling_params import SamplingParams


def test_messages_round_trip_with_type_tags_and_no_pickle():
    msgs = [
        GenerateReq(3, SamplingParams(max_tokens=5, stop=["x"]), messages=[{"role": "user", "content": "é"}]),
        StepMsg([StepItem([1, 2], 7, [[[4, 5], 0, 20]], 0, 3, SamplingParams())], [[[1], [2], 3]], [9]),
        TokenBatch([TokenOut(1, [42], "length", {"prompt_tokens": 3})]),
    ]
    for m in msgs:
        assert decode(encode(m)) == m
        assert type(decode(encode(m))) is type(m)
    try:  # a pickle payload never turns back into an object
        out = decode(pickle.dumps(msgs[0]))
    except ValueError:  # msgpack's format errors are ValueErrors
        out = None
    assert not isinstance(out, GenerateReq)
    forged = msgpack.ExtType(1, msgpack.packb(["os.system", "echo hi"]))
    with pytest.raises(ValueError, match="unknown message type"):
        decode(msgpack.packb(forged))
    with pytest.raises(TypeError):
        encode(object())


def test_token_arrays_travel_as_bytes_and_arrive_as_lists():
    """The tokenizer process sends cached document ids as array('q'); the scheduler gets plain lists,
    equal to what the lists would have given, and the payload is the packed bytes (not one msgpack
    int each)."""
    rng = random.Random()
    docs = [[rng.randrange(1 << 40) for _ in range(rng.randrange(3000))] for _ in range(rng.randint(1, 6))]
    sp = SamplingParams(max_tokens=2)
    as_lists = TokenizedReq(1, sp, 2, prefix=[1, 2], docs=docs, suffix=[3])
    as_arrays = TokenizedReq(1, sp, 2, prefix=[1, 2], docs=[array("q", d) for d in docs], suffix=[3])
    got = decode(encode(as_arrays))
    assert got == decode(encode(as_lists)) == as_lists
    assert all(type(d) is list for d in got.docs)
    assert len(encode(as_arrays)) < 8 * sum(map(len, docs)) + 200
    assert decode(encode([array("i", [5, -7]), array("q")])) == [[5, -7], []]
    for forged in (b"d" + bytes(8), b"", b"q" + bytes(5)):  # floats, no typecode, a torn item
        with pytest.raises(ValueError):
            decode(msgpack.packb(msgpack.ExtType(2, forged)))


def _stream(tokenizer, ids, stop=None):
    d = IncrementalDetokenizer(tokenizer, stop)
    pieces = []
    for t in ids:
        d.add([t])
        pieces.append(d.take())
        if d.stopped:
            break
    pieces.append(d.take(final=True))
    return d, pieces


def test_detokenizer_never_emits_half_a_character(tokenizer):
    text = "Grüße aus 東京 🙂🚀 and ünïcödé ok"
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids)  # some tokens are partial characters
    d, pieces = _stream(tokenizer, ids)
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == tokenizer.decode(ids) == text


def test_detokenizer_holds_back_and_cuts_stop_strings(tokenizer):
    text = "The quick brown fox jumps over the lazy dog."
    ids = tokenizer(text, add_special_tokens=False).input_ids
    d, pieces = _stream(tokenizer, ids, stop=["fox jumps", "zzz"])
    assert "".join(pieces) == "The quick brown "
    assert d.stopped and all("fox" not in p for p in pieces)
    assert len(d.ids) < len(ids)  # tokens after the stop are not consumed
    d, pieces = _stream(tokenizer, ids, stop=["absent"])
    assert "".join(pieces) == text and not d.stopped


class _ReadLog(dict):
    """A request body that records every field the parser looks at."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.read: set[str] = set()

    def get(self, key, default=None):
        self.read.add(key)
        return super().get(key, default)

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        self.read.add(key)
        return super().__contains__(key)


@pytest.mark.parametrize("chat", [True, False])
def test_openai_bodies_take_only_the_fields_their_parser_reads(chat):
    # every field the parser reads is on the endpoint's list (else a field it honours would be
    # refused), and a field off the list is a 400 naming it (else it would be accepted and ignored);
    # fields without an effect (user, store false, ...) pass, asking for what they cannot do does not;
    # a bad value of a field it takes (min_p 2) is refused by its name too
    from lazyrt.runtime.server import protocol
    from lazyrt.runtime.server.errors import ApiError

    fields = protocol.CHAT_FIELDS if chat else protocol.COMPLETION_FIELDS
    parse = protocol.parse_chat if chat else protocol.parse_completion
    body = {"model": "m", "max_tokens": 5, "temperature": 0.5, "top_p": 0.9, "top_k": 4, "min_p": 0.05,
            "stop": ["."], "seed": 1, "presence_penalty": 0.1, "frequency_penalty": 0.1,
            "repetition_penalty": 1.1, "logit_bias": {"3": 1}, "min_tokens": 1, "stop_token_ids": [2],
            "citations": False, "n": 2,
            "doc_attention_temperature": 1.0, "doc_attention_scale": 1.0, "doc_positions": "sequential",
            "retrieval_top_k": 4, "response_format": {"type": "text"}, "stream": True,
            "stream_options": {"include_usage": True}, "documents": ["a doc"]}  # fmt: skip
    if chat:
        body |= {"messages": [{"role": "user", "content": "q"}], "logprobs": True, "top_logprobs": 2,
                 "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
                 "tool_choice": "auto", "parallel_tool_calls": True}  # fmt: skip
    else:
        body |= {"prompt": "p", "logprobs": 2, "echo": False}
    logged = _ReadLog(body)
    parse(logged, "m")
    assert logged.read <= set(fields), sorted(logged.read - set(fields))
    assert set(body) <= logged.read  # the body above exercises the fields it sends
    for extra in ({"user": "u"}, {"store": False}, {"service_tier": "auto"}, {"modalities": ["text"]},
                  {"metadata": {"k": "v"}}, {"prompt_cache_key": "k"}, {"verbosity": None}):  # fmt: skip
        parse({**body, **extra}, "m")
    refused = (("min_p", 2), ("reasoning_effort", "low"), ("audio", {"voice": "x"}), ("store", True),
               ("service_tier", "flex"), ("modalities", ["text", "audio"]), ("topk", 3),
               ("top_logprobs" if not chat else "echo", 1), ("best_of", 2))  # fmt: skip
    for name, value in refused:
        with pytest.raises(ApiError) as e:
            parse({**body, name: value}, "m")
        assert e.value.param == name, (name, e.value.param)
