"""The RAG serving workload of issue 6 (after LazyAttention, arXiv 2606.04302), server-independent.

A pool of `num_docs` documents of `doc_tokens` tokens each; every request takes `docs_per_request`
distinct documents, drawn by popularity (Zipf(alpha) over document rank, or uniform), plus a short
question; arrivals are a Poisson process. Everything is a pure function of the seed.

Documents are random *words*, not random token ids: /generate takes documents as text, and a decoded
random id sequence does not re-tokenize to the same ids. The words come from the tokenizer's own
vocabulary: every word is a vocabulary entry that encodes, with its leading space, to exactly one
token, so a document of L words is L tokens when tokenized on its own (checked by
`check_doc_tokens`; in the prompt, the template appends a blank-line separator: L + 1-2 tokens).
Without a tokenizer, `fallback_words` gives pronounceable pseudo-words (about 2-3 tokens each).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import numpy as np

SYSTEM_PROMPT = "You are a helpful assistant. Answer the question using only the documents."


@dataclass
class WorkloadConfig:
    num_docs: int = 100
    doc_tokens: int = 2048
    docs_per_request: int = 5
    question_tokens: int = 16
    num_requests: int = 120
    popularity: str = "zipf"  # zipf | uniform
    zipf_alpha: float = 2.1
    rate: float = 1.0  # requests/s; inf = all at t=0
    seed: int = 0
    # > 0: documents fall into this many topics; a request draws its topic by the popularity law,
    # then its documents within the topic uniformly (retrieval returns related documents together)
    topics: int = 0


@dataclass
class RagRequest:
    index: int
    arrival_s: float  # offset from the start of the point
    doc_ids: list[int]
    question: str


@dataclass
class Workload:
    config: WorkloadConfig
    docs: list[str]
    requests: list[RagRequest] = field(default_factory=list)

    def doc_counts(self) -> np.ndarray:
        c = np.zeros(len(self.docs), dtype=np.int64)
        for r in self.requests:
            c[r.doc_ids] += 1
        return c


def single_token_words(tokenizer, limit: int = 20000) -> list[str]:
    """Alphabetic vocabulary entries that encode (with a leading space) to exactly one token."""
    vocab = tokenizer.get_vocab()
    words = []
    for tok_id in sorted(vocab.values()):
        text = tokenizer.decode([tok_id])
        if len(text) < 4 or text[0] != " " or not text[1:].isalpha() or not text[1:].isascii():
            continue
        if tokenizer.encode(text, add_special_tokens=False) == [tok_id]:
            words.append(text[1:])
            if len(words) >= limit:
                break
    if len(words) < 100:
        raise ValueError(f"the tokenizer has only {len(words)} single-token words")
    return words


def fallback_words(n: int = 5000, seed: int = 1234) -> list[str]:
    rng = random.Random(seed)
    cons, vow = "bcdfghklmnprstvz", "aeiou"
    return ["".join(rng.choice(cons) + rng.choice(vow) for _ in range(rng.randint(1, 3))) for _ in range(n)]


def popularity_weights(n: int, popularity: str, alpha: float) -> np.ndarray:
    if popularity == "uniform":
        w = np.ones(n)
    elif popularity == "zipf":
        w = 1.0 / np.arange(1, n + 1, dtype=np.float64) ** alpha
    else:
        raise ValueError(f"popularity must be zipf or uniform, got {popularity!r}")
    return w / w.sum()


def arrival_times(num: int, rate: float, rng: np.random.Generator) -> np.ndarray:
    """Poisson process: exponential inter-arrival gaps of mean 1/rate (all zero for rate=inf)."""
    if math.isinf(rate):
        return np.zeros(num)
    if rate <= 0:
        raise ValueError("rate must be > 0")
    return np.cumsum(rng.exponential(1.0 / rate, size=num))


def make_docs(words: list[str], num_docs: int, doc_tokens: int, seed: int) -> list[str]:
    """Each document: doc_tokens random words (random enough that no two documents share a prefix)."""
    rng = random.Random(seed)
    # Leading space: every word, the first included, is then its own single token.
    return ["".join(" " + rng.choice(words) for _ in range(doc_tokens)) for _ in range(num_docs)]


def build_workload(cfg: WorkloadConfig, words: list[str]) -> Workload:
    # The document pool depends on (seed, sizes) only, so every mode, rate and popularity sees it.
    docs = make_docs(words, cfg.num_docs, cfg.doc_tokens, cfg.seed)
    # The request stream depends on the point too (but not on the mode): same seed -> same requests.
    point_seed = [
        cfg.seed,
        int(cfg.popularity == "zipf"),
        int(round(cfg.zipf_alpha * 1000)),
        cfg.num_requests,
    ]
    rng = np.random.default_rng(point_seed)
    p = popularity_weights(cfg.num_docs, cfg.popularity, cfg.zipf_alpha)
    # Popularity rank -> document: a fixed random permutation, so rank 0 is not always doc 0.
    perm = np.random.default_rng([cfg.seed, 7]).permutation(cfg.num_docs)
    arrivals = arrival_times(cfg.num_requests, cfg.rate, np.random.default_rng([*point_seed, 1]))
    k = min(cfg.docs_per_request, cfg.num_docs)
    reqs = []
    wrng = random.Random(cfg.seed * 1_000_003 + 17)
    if cfg.topics > 0:
        point_seed.append(cfg.topics)  # (topics = 0 keeps the earlier streams)
        rng = np.random.default_rng(point_seed)
        groups = np.array_split(np.arange(cfg.num_docs), cfg.topics)
        tp = popularity_weights(cfg.topics, cfg.popularity, cfg.zipf_alpha)
        if min(map(len, groups)) < k:
            raise ValueError(f"topics={cfg.topics}: a topic holds fewer than docs_per_request={k} documents")
    for i in range(cfg.num_requests):
        if cfg.topics > 0:
            ranks = rng.choice(groups[rng.choice(cfg.topics, p=tp)], size=k, replace=False)
        else:
            ranks = rng.choice(cfg.num_docs, size=k, replace=False, p=p)  # draw order = prompt order
        q = " ".join(wrng.choice(words) for _ in range(max(cfg.question_tokens - 4, 1)))
        reqs.append(RagRequest(i, float(arrivals[i]), [int(perm[r]) for r in ranks], f"Question {i}: {q}?"))
    return Workload(cfg, docs, reqs)


def check_doc_tokens(tokenizer, docs: list[str]) -> list[int]:
    return [len(tokenizer.encode(d, add_special_tokens=False)) for d in docs]
