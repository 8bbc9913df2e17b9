"""Synthetic RAG QA data for benchmarks/quality.py: made-up facts, the answer doc among distractors.

Every document describes one invented entity with a few facts (kind-specific templates). Three
question sets (`make_dataset(question_set=...)`), each over its own pool of documents:

- `single`: a question asks for one fact of one entity; its retrieved set is that entity's
  document plus 2-4 distractors of the same kind (same template, other entities, other values),
  shuffled. Every value in the pool is unique, so the answer string appears in exactly one
  retrieved document.
- `multihop`: the answer needs two documents linked by a town ("In which year was the bridge
  completed that stands in the town where the chemist X was born?": X's document gives the town
  T, the bridge in T gives the year; CHAINS lists the chains). In this pool every town is the
  town of exactly one document of each kind; all other values are unique. Retrieved: both hop
  documents, a decoy of the target's kind in another town T' (so "the only bridge" is no
  shortcut), from 4 docs on also the source's kind in T' (a complete decoy chain), then random
  documents of other towns; min_docs-max_docs (at least 3, default 3-5) in all, shuffled. The
  question names neither the town nor the answer; the answer is in exactly one retrieved document.
- `distractor`: single-fact questions whose retrieved set also holds 1-2 documents of other kinds
  with the same name ("the Foo Bridge" next to "Foo Industries", "Lake Foo"; the chemist X next to
  the ship X), which state their own years, towns and numbers; the rest are same-kind distractors
  as in `single`. In this pool bridge, company and lake i share one name, chemist and ship i a
  person's name; all fact values are unique, so the answer is still in exactly one retrieved
  document.

filler_sentences > 0 pads every document (the facts at a random place). No downloads;
everything follows from the seed.
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
    qtype: str = "single"  # the question set: single | multihop | distractor
    support_docs: list[int] = field(default_factory=list)  # docs needed, in hop order (answer_doc last)
    entity: str = ""  # the entity the question names (multihop: the source of the first hop)
    doc_kinds: list[str] = field(default_factory=list)  # the kind of each retrieved doc
    link: str = ""  # multihop: the fact that links the hops, e.g. "chemist.town"
    link_value: str = ""  # multihop: its value (in both support docs, never in the question)

    @property
    def key(self) -> str:
        """Report row: kind.fact, or source.town>kind.fact for a multihop chain."""
        return f"{self.link}>{self.kind}.{self.fact}" if self.link else f"{self.kind}.{self.fact}"


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


def make_docs(rng: random.Random, per_kind: int, share: str | None = None) -> list[Doc]:
    """per_kind documents of each kind. share=None: every value unique in the pool. share="town":
    per_kind towns, town i the town of document i of every kind (multihop links), other values
    unique. share="name": bridge, company and lake i share one name, chemist and ship i a person's
    name (namesake distractors), fact values unique."""
    vals = _Values(rng)
    towns = [vals.get("town") for _ in range(per_kind)] if share == "town" else None
    names = [(vals.get("name"), vals.get("captain")) for _ in range(per_kind)] if share == "name" else None
    docs = []
    for kind, (template, facts) in KINDS.items():
        for i in range(per_kind):
            if names is not None:
                name = names[i][kind in ("chemist", "ship")]
            else:
                name = vals.get("name") if kind != "chemist" else vals.get("captain")
            fv = {f: towns[i] if towns is not None and f == "town" else vals.get("year" if f == "year" else f)
                  for f in facts}
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


# Multihop chains. The first hop names an entity and leads to its town: (source kind) -> phrase.
HOP_SOURCES = {
    "chemist": "the town where the chemist {name} was born",
    "ship": "the port from which the ship {name} was launched",
    "company": "the town where {name} Industries is based",
    "lake": "the town near Lake {name}",
    "bridge": "the town of the {name} Bridge",
}
# The second hop: the one entity of a kind in that town, and the fact asked. {where} = a source phrase.
HOP_TARGETS = {
    ("bridge", "year"): "In which year was the bridge completed that stands in {where}?",
    ("bridge", "length"): "How long in metres is the bridge in {where}?",
    ("company", "year"): "In which year was the company founded that is based in {where}?",
    ("company", "staff"): "How many employees work for the company based in {where}?",
    ("lake", "depth"): "How deep in metres is the lake near {where}?",
    ("lake", "fish"): "Which fish lives in the lake near {where}?",
    ("chemist", "metal"): "Which metal was discovered by the chemist born in {where}?",
    ("ship", "captain"): "Who is the captain of the ship launched from {where}?",
}
# (source kind, target kind, target fact); every kind states its town, so any pair would do.
CHAINS = [
    ("chemist", "bridge", "year"),
    ("chemist", "company", "staff"),
    ("chemist", "lake", "fish"),
    ("ship", "bridge", "length"),
    ("ship", "lake", "depth"),
    ("ship", "company", "year"),
    ("company", "chemist", "metal"),
    ("bridge", "ship", "captain"),
    ("lake", "bridge", "year"),
]

QUESTION_SETS = ("single", "multihop", "distractor")
_SHARE = {"single": None, "multihop": "town", "distractor": "name"}


def make_dataset(n_questions: int = 200, seed: int = 0, per_kind: int = 16,
                 min_docs: int = 3, max_docs: int = 5, filler_sentences: int = 0,
                 question_set: str = "single") -> list[Question]:
    """n_questions questions over a pool of len(KINDS) * per_kind documents (docs repeat across
    questions, so a chunk cache gets reused). filler_sentences > 0 makes long documents (the facts
    somewhere inside); the questions, answers and retrieved sets are those of filler_sentences=0.
    question_set: single | multihop | distractor (module docstring); multihop and distractor
    retrieve at least 3 docs."""
    if question_set not in QUESTION_SETS:
        raise ValueError(f"question_set {question_set!r}: one of {', '.join(QUESTION_SETS)}")
    rng = random.Random(seed)
    docs = make_docs(rng, per_kind, share=_SHARE[question_set])
    if filler_sentences > 0:
        pad_rng = random.Random(seed + 7919)  # its own stream: the question draws below are unchanged
        for d in docs:
            d.text = pad_document(d.text, filler_sentences, pad_rng)
    by_kind: dict[str, list[Doc]] = {}
    for d in docs:
        by_kind.setdefault(d.kind, []).append(d)
    if question_set == "multihop":
        return [_multihop_question(qid, rng, docs, by_kind, min_docs, max_docs) for qid in range(n_questions)]
    if question_set == "distractor":
        return [_namesake_question(qid, rng, docs, by_kind, min_docs, max_docs) for qid in range(n_questions)]
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
            qtype="single",
            support_docs=[retrieved.index(target)],
            entity=target.entity,
            doc_kinds=[d.kind for d in retrieved],
        ))
    return out


def _multihop_question(qid: int, rng: random.Random, docs: list[Doc], by_kind: dict[str, list[Doc]],
                       min_docs: int, max_docs: int) -> Question:
    src_kind, kind, fact = rng.choice(CHAINS)
    source = rng.choice(by_kind[src_kind])
    town = source.facts["town"]
    (target,) = [d for d in by_kind[kind] if d.facts["town"] == town]
    n = rng.randint(max(min_docs, 3), max(max_docs, 3))
    decoy = rng.choice([d for d in by_kind[kind] if d.facts["town"] != town])  # same kind, other town
    distractors = [decoy]
    if n >= 4:  # the decoy's own chain: a source-kind entity in the decoy's town
        distractors += [d for d in by_kind[src_kind] if d.facts["town"] == decoy.facts["town"]]
    rest = [d for d in docs if d.facts["town"] not in (town, decoy.facts["town"])]
    distractors += rng.sample(rest, n - 2 - len(distractors))
    retrieved = distractors + [source, target]
    rng.shuffle(retrieved)
    where = HOP_SOURCES[src_kind].format(name=source.entity)
    return Question(
        qid=qid, kind=kind, fact=fact,
        question=HOP_TARGETS[(kind, fact)].format(where=where),
        answer=target.facts[fact],
        docs=[d.text for d in retrieved],
        answer_doc=retrieved.index(target),
        distractor_values=[d.facts[fact] for d in distractors if d.kind == kind],
        qtype="multihop",
        support_docs=[retrieved.index(source), retrieved.index(target)],
        entity=source.entity,
        doc_kinds=[d.kind for d in retrieved],
        link=f"{src_kind}.town",
        link_value=town,
    )


def _namesake_question(qid: int, rng: random.Random, docs: list[Doc], by_kind: dict[str, list[Doc]],
                       min_docs: int, max_docs: int) -> Question:
    kind = rng.choice(list(KINDS))
    target = rng.choice(by_kind[kind])
    fact = rng.choice(list(KINDS[kind][1]))
    n = rng.randint(max(min_docs, 3), max(max_docs, 3))
    namesakes = [d for d in docs if d.entity == target.entity and d is not target]
    k = rng.randint(1, min(len(namesakes), n - 2))
    same = rng.sample([d for d in by_kind[kind] if d is not target], n - 1 - k)
    distractors = rng.sample(namesakes, k) + same
    retrieved = distractors + [target]
    rng.shuffle(retrieved)
    return Question(
        qid=qid, kind=kind, fact=fact,
        question=KINDS[kind][1][fact].format(name=target.entity),
        answer=target.facts[fact],
        docs=[d.text for d in retrieved],
        answer_doc=retrieved.index(target),
        # the same fact of the same-kind distractors, and of the namesakes that state it (a year, a town)
        distractor_values=[d.facts[fact] for d in distractors if fact in d.facts],
        qtype="distractor",
        support_docs=[retrieved.index(target)],
        entity=target.entity,
        doc_kinds=[d.kind for d in retrieved],
    )


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
