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
