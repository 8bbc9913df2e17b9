"""The synthetic QA generator of benchmarks/quality.py: deterministic, one answer doc, a strict checker."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

from quality_data import is_correct, make_dataset, normalize  # noqa: E402


def _contains(doc: str, value: str) -> bool:
    return f" {normalize(value)} " in f" {normalize(doc)} "


def test_fixed_seed_is_deterministic():
    a, b = make_dataset(50, seed=3), make_dataset(50, seed=3)
    assert [(q.question, q.answer, q.docs) for q in a] == [(q.question, q.answer, q.docs) for q in b]
    c = make_dataset(50, seed=4)
    assert [q.docs for q in a] != [q.docs for q in c]


def test_answer_in_exactly_one_retrieved_doc():
    qs = make_dataset(300, seed=0)
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
