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
    for bad in ("none/ape0.5,1", "lazy/ape0,1", "lazy/ape0.5"):
        with pytest.raises(Exception, match="mode"):
            parse_mode(bad)
