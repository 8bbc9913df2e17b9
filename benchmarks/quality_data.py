"""Synthetic RAG QA data for benchmarks/quality.py: made-up facts, one answer doc among distractors.

Every document describes one invented entity with a few facts (kind-specific templates). A
question asks for one fact of one entity; its retrieved set is that entity's document plus 2-4
distractors of the same kind (same template, other entities, other values), shuffled. Every value
in the pool is unique, so the answer string appears in exactly one retrieved document. No
downloads; everything follows from the seed.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field

_ONSETS = ["b", "c", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "tr", "dr"]
_VOWELS = ["a", "e", "i", "o", "u"]
_CODAS = ["", "", "n", "l", "r", "s", "m"]


def _name(rng: random.Random, syllables: int) -> str:
    s = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(syllables))
    return s.capitalize()


# kind -> (document template, {fact: (question template, value generator name)})
# Templates use {name} for the entity and one placeholder per fact.
KINDS: dict[str, tuple[str, dict[str, str]]] = {
    "bridge": (
        "The {name} Bridge in {town} was completed in {year} and is {length} metres long.",
        {
            "town": "In which town is the {name} Bridge?",
            "year": "In which year was the {name} Bridge completed?",
            "length": "How long is the {name} Bridge in metres?",
        },
    ),
    "chemist": (
        "{name} is a chemist born in {town} in {year}. {name} discovered the metal {metal}.",
        {
            "town": "In which town was the chemist {name} born?",
            "year": "In which year was the chemist {name} born?",
            "metal": "Which metal did the chemist {name} discover?",
        },
    ),
    "company": (
        "{name} Industries is based in {town}. It was founded in {year} and has {staff} employees.",
        {
            "town": "In which town is {name} Industries based?",
            "year": "In which year was {name} Industries founded?",
            "staff": "How many employees does {name} Industries have?",
        },
    ),
    "lake": (
        "Lake {name} lies near {town}. It is {depth} metres deep and is home to the {fish} fish.",
        {
            "town": "Near which town does Lake {name} lie?",
            "depth": "How deep is Lake {name} in metres?",
            "fish": "Which fish lives in Lake {name}?",
        },
    ),
    "ship": (
        "The ship {name} was launched in {year} from the port of {town}. Its captain is {captain}.",
        {
            "year": "In which year was the ship {name} launched?",
            "town": "From which port was the ship {name} launched?",
            "captain": "Who is the captain of the ship {name}?",
        },
    ),
}


@dataclass
class Doc:
    kind: str
    entity: str
    facts: dict[str, str]
    text: str


@dataclass
class Question:
    qid: int
    kind: str
    fact: str
    question: str
    answer: str
    docs: list[str]
    answer_doc: int  # index into docs
    distractor_values: list[str] = field(default_factory=list)  # the same fact of the distractors


class _Values:
    """Draws values that are unique across the whole pool (no answer can appear in two docs)."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.used: set[str] = set()

    def _unique(self, make) -> str:
        for _ in range(10_000):
            v = make()
            if normalize(v) not in self.used and all(normalize(v) not in u and u not in normalize(v)
                                                     for u in self.used if not v.isdigit()):
                self.used.add(normalize(v))
                return v
        raise RuntimeError("value space exhausted")

    def get(self, kind: str) -> str:
        r = self.rng
        makers = {
            "name": lambda: _name(r, r.choice([2, 3])),
            "town": lambda: _name(r, 2) + r.choice(["ton", "ford", "holm", "by", "mere", "stad"]),
            "year": lambda: str(r.randint(1700, 1999)),
            "length": lambda: str(r.randint(120, 2900)),
            "depth": lambda: str(r.randint(20, 990)),
            "staff": lambda: str(r.randint(1100, 9800)),
            "metal": lambda: _name(r, 2) + "ium",
            "fish": lambda: _name(r, 2) + r.choice(["fin", "gill", "scale"]),
            "captain": lambda: _name(r, 2) + " " + _name(r, 2),
        }
        return self._unique(makers[kind])


def make_docs(rng: random.Random, per_kind: int) -> list[Doc]:
    vals = _Values(rng)
    docs = []
    for kind, (template, facts) in KINDS.items():
        for _ in range(per_kind):
            name = vals.get("name") if kind != "chemist" else vals.get("captain")
            fv = {f: vals.get("year" if f == "year" else f) for f in facts}
            docs.append(Doc(kind, name, fv, template.format(name=name, **fv)))
    return docs


# Filler for long documents: no digits and no invented words, so no answer value can appear in it.
FILLER = [
    "Visitors often remark on how quiet the surrounding streets are in the early morning.",
    "The local newspaper has written about it many times over the years.",
    "Several families in the area have lived there for generations.",
    "In spring the nearby fields turn green and the roads fill with cyclists.",
    "A small museum in the region keeps old photographs and letters.",
    "The winters there are long, and the summers are short but bright.",
    "Teachers from the nearby school bring their pupils on yearly visits.",
    "Most of the records from that time were kept in the town hall.",
    "People who grew up in the area describe it with a certain pride.",
    "The main road was widened later to make room for more traffic.",
    "Local guides tell stories about the place to anyone who will listen.",
    "A weekly market brings farmers and traders from the villages around.",
    "Some of the older buildings nearby were restored with great care.",
    "Travel writers have described the landscape as calm and open.",
    "During festivals the streets are decorated with lanterns and flags.",
    "The regional library holds a collection of maps of the area.",
    "Birds gather along the water in autumn before flying south.",
    "Many postcards sold in the shops show the same familiar view.",
    "The council meets every month to discuss roads, schools and parks.",
    "Evening walks along the old paths are popular with residents.",
]


def pad_document(text: str, n_sentences: int, rng: random.Random) -> str:
    """The fact sentence(s) at a random place among n_sentences filler sentences."""
    if n_sentences <= 0:
        return text
    filler = [rng.choice(FILLER) for _ in range(n_sentences)]
    at = rng.randint(0, n_sentences)
    return " ".join(filler[:at] + [text] + filler[at:])


def make_dataset(n_questions: int = 200, seed: int = 0, per_kind: int = 16,
                 min_docs: int = 3, max_docs: int = 5, filler_sentences: int = 0) -> list[Question]:
    """n_questions questions over a pool of len(KINDS) * per_kind documents (docs repeat across
    questions, so a chunk cache gets reused). filler_sentences > 0 makes long documents (the facts
    somewhere inside); the questions, answers and retrieved sets are those of filler_sentences=0."""
    rng = random.Random(seed)
    docs = make_docs(rng, per_kind)
    if filler_sentences > 0:
        pad_rng = random.Random(seed + 7919)  # its own stream: the question draws below are unchanged
        for d in docs:
            d.text = pad_document(d.text, filler_sentences, pad_rng)
    by_kind: dict[str, list[Doc]] = {}
    for d in docs:
        by_kind.setdefault(d.kind, []).append(d)
    out = []
    for qid in range(n_questions):
        kind = rng.choice(list(KINDS))
        target = rng.choice(by_kind[kind])
        fact = rng.choice(list(KINDS[kind][1]))
        n = rng.randint(min_docs, max_docs)
        distractors = rng.sample([d for d in by_kind[kind] if d is not target], n - 1)
        retrieved = distractors + [target]
        rng.shuffle(retrieved)
        out.append(Question(
            qid=qid, kind=kind, fact=fact,
            question=KINDS[kind][1][fact].format(name=target.entity),
            answer=target.facts[fact],
            docs=[d.text for d in retrieved],
            answer_doc=retrieved.index(target),
            distractor_values=[d.facts[fact] for d in distractors],
        ))
    return out


def normalize(text: str) -> str:
    """Lowercase, digits without thousands separators, punctuation to spaces, single spaces."""
    text = text.lower()
    text = re.sub(r"(?<=\d)[,_](?=\d{3}\b)", "", text)
    text = re.sub(r"[^a-z0-9]+", " ", text)
    return " ".join(text.split())


def is_correct(generated: str, answer: str) -> bool:
    """The normalized answer appears in the normalized output as whole words."""
    g, a = f" {normalize(generated)} ", f" {normalize(answer)} "
    return a in g
