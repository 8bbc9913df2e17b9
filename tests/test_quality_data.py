"""The synthetic QA generator of benchmarks/quality.py: deterministic, one answer doc, a strict checker."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

from quality_data import is_correct, make_dataset, normalize  # noqa: E402


def _contains(doc: str, value: str) -> bool:
    return f" {normalize(value)} " in f" {normalize(doc)} "


def test_fixed_seed_is_deterministic():
    a, b = make_dataset(50, seed=3), make_dataset(50, seed=3)
    assert [(q.question, q.answer, q.docs) for q in a] == [(q.question, q.answer, q.docs) for q in b]
    c = make_dataset(50, seed=4)
    assert [q.docs for q in a] != [q.docs for q in c]


@pytest.mark.parametrize("filler", [0, 12])
def test_answer_in_exactly_one_retrieved_doc(filler):
    qs = make_dataset(300, seed=0, filler_sentences=filler)
    assert len(qs) == 300
    for q in qs:
        assert 3 <= len(q.docs) <= 5
        holders = [i for i, d in enumerate(q.docs) if _contains(d, q.answer)]
        assert holders == [q.answer_doc], (q.question, q.answer, q.docs)
        # Distractors are plausible: the same template, so they state the same fact, with other values.
        assert len(q.distractor_values) == len(q.docs) - 1
        assert q.answer not in q.distractor_values
        for v in q.distractor_values:
            assert sum(_contains(d, v) for d in q.docs) == 1


def test_long_documents_keep_the_questions():
    """Filler changes only the documents' length: same questions, answers and retrieved entities."""
    short, long = make_dataset(60, seed=2), make_dataset(60, seed=2, filler_sentences=20)
    for a, b in zip(short, long):
        assert (a.question, a.answer, a.answer_doc) == (b.question, b.answer, b.answer_doc)
        for x, y in zip(a.docs, b.docs):
            assert x in y and len(y) > 5 * len(x)
    positions = {b.docs[b.answer_doc].index(a.docs[a.answer_doc]) for a, b in zip(short, long)}
    assert len(positions) > 10  # the fact sits at different places in different documents


def test_docs_are_reused_across_questions():
    qs = make_dataset(200, seed=0)
    uses = [d for q in qs for d in q.docs]
    assert len(set(uses)) < len(uses) / 5  # a chunk cache gets hits


def test_checker_accepts_answer_and_rejects_distractor():
    for q in make_dataset(100, seed=1):
        assert is_correct(f"The answer is {q.answer}.", q.answer)
        assert is_correct(q.answer.upper() + "!", q.answer)
        for v in q.distractor_values:
            assert not is_correct(f"The answer is {v}.", q.answer)
    assert is_correct("It has 4,512 employees.", "4512")
    assert not is_correct("It is 14120 metres long.", "4120")  # whole words only
    assert not is_correct("I do not know.", "1873")


def test_quality_modes_parse_document_attention():
    from quality import parse_mode

    assert parse_mode("lazy/ape0.7,1.5") == ("lazy", {"doc_attention_temperature": 0.7,
                                                      "doc_attention_scale": 1.5})
    mode, opts = parse_mode("block+tail2/ape1,2")
    assert mode == "block" and opts == {"recompute_policy": "tail", "recompute_pages": 2,
                                        "doc_attention_temperature": 1.0, "doc_attention_scale": 2.0}
    ape = {"doc_attention_temperature": 0.5, "doc_attention_scale": 1.0}
    assert parse_mode("lazy/par/ape0.5,1") == ("lazy", {"doc_positions": "parallel", **ape})
    assert parse_mode("block/ape0.5,1/par") == ("block", {**ape, "doc_positions": "parallel"})
    for bad in ("none/ape0.5,1", "lazy/ape0,1", "lazy/ape0.5", "prefix/par", "lazy+tail10%/par"):
        with pytest.raises(Exception, match="mode"):
            parse_mode(bad)


# ---- question sets -------------------------------------------------------------------------------

# sha256 of json [(question, answer, docs, answer_doc)] of make_dataset(20, seed=0[, filler 12]),
# computed from the code before the multihop/distractor sets existed: `single` must not move.
SINGLE_FINGERPRINTS = {
    0: "cf7aae713fe93a2084589281e9f0bc02963903d048583efa1900040cf3be0d98",
    12: "98b2820dcd1a72e189878152b7df6ee7ff0d55c7fe8dcc23059c75456a1757b5",
}


@pytest.mark.parametrize("filler", [0, 12])
def test_single_set_unchanged(filler):
    import hashlib
    import json

    for qs in (make_dataset(20, seed=0, filler_sentences=filler),
               make_dataset(20, seed=0, filler_sentences=filler, question_set="single")):
        blob = json.dumps([(q.question, q.answer, q.docs, q.answer_doc) for q in qs])
        assert hashlib.sha256(blob.encode()).hexdigest() == SINGLE_FINGERPRINTS[filler]
        assert all(q.qtype == "single" and q.support_docs == [q.answer_doc] for q in qs)


def _holders(q, value):
    return [i for i, d in enumerate(q.docs) if _contains(d, value)]


@pytest.mark.parametrize("seed", [0, 1, 5])
@pytest.mark.parametrize("filler", [0, 12])
def test_multihop_answerable_from_two_docs(seed, filler):
    from quality_data import CHAINS

    qs = make_dataset(150, seed=seed, filler_sentences=filler, question_set="multihop")
    keys = set()
    for q in qs:
        ctx = (q.question, q.answer, q.docs)
        assert q.qtype == "multihop" and 3 <= len(q.docs) <= 5
        assert len(q.doc_kinds) == len(q.docs)
        src, tgt = q.support_docs
        assert src != tgt and tgt == q.answer_doc
        assert _holders(q, q.answer) == [q.answer_doc], ctx
        # the bridging town: in both hop docs, in no other retrieved doc, never in the question
        assert q.link.endswith(".town") and _holders(q, q.link_value) == sorted(q.support_docs), ctx
        assert not is_correct(q.question, q.link_value) and not is_correct(q.question, q.answer), ctx
        # the question names the source entity, which only the first hop doc mentions
        assert _contains(q.question, q.entity) and _holders(q, q.entity) == [src], ctx
        assert q.doc_kinds[src] == q.link.split(".")[0] and q.doc_kinds[tgt] == q.kind
        # no shortcut: another doc of the answer's kind (in another town) is retrieved too
        assert q.doc_kinds.count(q.kind) >= 2, ctx
        assert len(q.distractor_values) == q.doc_kinds.count(q.kind) - 1
        for v in q.distractor_values:
            assert not is_correct(f"The answer is {v}.", q.answer)
            assert len(_holders(q, v)) == 1
        keys.add(q.key)
    assert keys == {f"{s}.town>{k}.{f}" for s, k, f in CHAINS}


@pytest.mark.parametrize("seed", [0, 1, 5])
@pytest.mark.parametrize("filler", [0, 12])
def test_distractor_set_has_namesakes_of_other_kinds(seed, filler):
    qs = make_dataset(150, seed=seed, filler_sentences=filler, question_set="distractor")
    for q in qs:
        ctx = (q.question, q.answer, q.docs)
        assert q.qtype == "distractor" and 3 <= len(q.docs) <= 5 and q.support_docs == [q.answer_doc]
        assert _holders(q, q.answer) == [q.answer_doc], ctx
        assert q.doc_kinds[q.answer_doc] == q.kind and _contains(q.question, q.entity)
        namesakes = [i for i in _holders(q, q.entity) if i != q.answer_doc]
        assert namesakes and all(q.doc_kinds[i] != q.kind for i in namesakes), ctx
        # and same-kind distractors as in `single`
        assert q.doc_kinds.count(q.kind) >= 2, ctx
        for v in q.distractor_values:
            assert not is_correct(f"The answer is {v}.", q.answer)
            assert len(_holders(q, v)) == 1
    # namesakes state the asked fact with another value (a year, a town) in a good share of questions
    clash = sum(any(q.doc_kinds[i] != q.kind for i in _holders(q, q.entity)) and
                len(q.distractor_values) > q.doc_kinds.count(q.kind) - 1 for q in qs)
    assert clash > len(qs) / 4


@pytest.mark.parametrize("qset", ["multihop", "distractor"])
def test_question_sets_deterministic_reused_and_padded(qset):
    a, b = make_dataset(60, seed=2, question_set=qset), make_dataset(60, seed=2, question_set=qset)
    assert [(q.question, q.answer, q.docs) for q in a] == [(q.question, q.answer, q.docs) for q in b]
    uses = [d for q in make_dataset(200, seed=0, question_set=qset) for d in q.docs]
    assert len(set(uses)) < len(uses) / 5
    long = make_dataset(60, seed=2, filler_sentences=20, question_set=qset)
    for x, y in zip(a, long):
        assert (x.question, x.answer, x.support_docs) == (y.question, y.answer, y.support_docs)
        for s, t in zip(x.docs, y.docs):
            assert s in t and len(t) > 5 * len(s)
    with pytest.raises(ValueError, match="question_set"):
        make_dataset(5, question_set="hard")


def test_quality_modes_parse_deviation_and_wilson():
    from quality import accuracy_cell, parse_mode, wilson

    dev = {"recompute_policy": "deviation"}
    assert parse_mode("lazy+deviation10%") == ("lazy", {**dev, "recompute_ratio": 0.1})
    assert parse_mode("block+deviation2") == ("block", {**dev, "recompute_pages": 2})
    with pytest.raises(Exception, match="mode"):
        parse_mode("lazy+deviation0")
    assert accuracy_cell([True] * 87 + [False] * 113) == "43.5% (87/200, 36.8-50.4)"
    lo, hi = wilson(0, 10)
    assert lo == 0.0 and 0.25 < hi < 0.35
    lo, hi = wilson(10, 10)
    assert 0.65 < lo < 0.75 and hi == 1.0
