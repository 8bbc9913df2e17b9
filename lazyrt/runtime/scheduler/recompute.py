"""Selective recompute (issue 6 quality fix): which pages of a RAG request's documents it recomputes.

Block attention computes each document's KV on its own (after the shared prefix), so it never sees
the documents before it. The scheduler can recompute any set of a document's pages in the request's
own pages, in context, and share the rest from the chunk (page-granular copy-on-write). This module
only decides *which* pages; it is pure (token ids in, page indices out) so it is cheap to test.

Policies (`recompute_policy`):
- `head`: the first pages of each document after the first (the attention-sink fix).
- `tail`: the last pages before the question, walking back over the documents after the first.
- `question`: pages that contain the question's tokens, each token weighted by its inverse page
  frequency within this prompt (a token in few pages counts more; one in more than half the pages
  counts nothing); the top-scoring pages up to the budget. No extra forward pass.
- `deviation` (CacheBlend-style): the pages whose KV moves most when computed in context. A probe
  step runs each document after the first through layers 0..PROBE_LAYER-1 in the request's context
  (layer 0's K/V do not depend on context: keys are stored unrotated, so the cached pages already
  hold them) and scores each page by the mean squared distance between its in-context K/V at
  PROBE_LAYER and the chunk's; the top-scoring pages over all those documents, up to the budget.
  Costs one extra step and about PROBE_LAYER layers' worth of forward over the later documents.

Budget: `pages` per document after the first (head: exactly that many of each; tail/question:
that many times the number of such documents, picked over all of them), or `ratio`, a fraction of
the pages of the documents after the first. The first document is never recomputed: its chunk KV
already is what full attention gives it (it sees the prefix only).
"""

from __future__ import annotations

import math
from collections import Counter

from lazyrt.config import RECOMPUTE_POLICIES

# A question token found in more than this share of the prompt's doc pages carries no weight.
COMMON_PAGE_SHARE = 0.5
# The deviation policy compares K/V at this layer (CacheBlend: the first layer whose K/V depend on
# the context; deeper layers deviate more but cost a deeper probe).
PROBE_LAYER = 1


def num_pages(n_tokens: int, page_size: int) -> int:
    return -(-n_tokens // page_size)


def page_budget(doc_lens: list[int], page_size: int, pages: int = 0, ratio: float = 0.0) -> int:
    """Pages the request may recompute in all: over the documents after the first."""
    later = [num_pages(n, page_size) for n in doc_lens[1:]]
    if pages:
        return min(pages * len(later), sum(later))
    if ratio > 0:
        return min(max(1, round(ratio * sum(later))), sum(later))
    return 0


def question_page_scores(docs: list[list[int]], question: list[int], page_size: int) -> list[list[float]]:
    """Score of every page of every document: the sum of the IDF weights (log(pages / pages
    containing the token), over this prompt's doc pages) of the distinct question tokens it holds."""
    pages = [set(d[i : i + page_size]) for d in docs for i in range(0, len(d), page_size)]
    q = set(question)
    df = Counter(t for p in pages for t in p if t in q)
    n = len(pages)
    weight = {t: math.log(n / c) for t, c in df.items() if c <= COMMON_PAGE_SHARE * n}
    return [
        [sum(weight.get(t, 0.0) for t in set(d[i : i + page_size])) for i in range(0, len(d), page_size)]
        for d in docs
    ]


def select_pages(
    policy: str,
    docs: list[list[int]],
    question: list[int],
    page_size: int,
    pages: int = 0,
    ratio: float = 0.0,
    page_scores: list[list[float]] | None = None,
) -> list[list[int]]:
    """Sorted indices of the pages of each document to recompute (the first document's list is
    always empty). `question` is the request's tokens after the documents (question + template).
    `page_scores`: the deviation policy's probe result, one score per page of each document (the
    first document's list is ignored)."""
    if policy not in RECOMPUTE_POLICIES:
        raise ValueError(f"recompute_policy={policy!r}: must be one of {', '.join(RECOMPUTE_POLICIES)}")
    sel: list[list[int]] = [[] for _ in docs]
    n_pages = [num_pages(len(d), page_size) for d in docs]
    budget = page_budget([len(d) for d in docs], page_size, pages, ratio)
    if budget == 0:
        return sel
    if policy == "head":
        for j in range(1, len(docs)):
            k = pages if pages else round(ratio * n_pages[j])
            sel[j] = list(range(min(k, n_pages[j])))
        return sel
    # Candidates over the documents after the first, in prompt order.
    cands = [(j, i) for j in range(1, len(docs)) for i in range(n_pages[j])]
    if policy == "tail":
        chosen = cands[len(cands) - budget :]
    elif policy == "deviation":
        if page_scores is None or [len(s) for s in page_scores[1:]] != n_pages[1:]:
            raise ValueError("the deviation policy needs one probe score per page of each document")
        # Largest deviation first; ties go to the page nearer the question.
        ranked = sorted(range(len(cands)), key=lambda r: (-page_scores[cands[r][0]][cands[r][1]], -r))
        chosen = [cands[r] for r in ranked[:budget]]
    else:
        scores = question_page_scores(docs, question, page_size)
        # Best score first; ties go to the page nearer the question. Pages without any weighted
        # question token are never picked: the budget is an upper bound.
        ranked = sorted(range(len(cands)), key=lambda r: (-scores[cands[r][0]][cands[r][1]], -r))
        chosen = [cands[r] for r in ranked[:budget] if scores[cands[r][0]][cands[r][1]] > 0]
    for j, i in chosen:
        sel[j].append(i)
    return [sorted(s) for s in sel]


def page_runs(n_tokens: int, page_size: int, selected: list[int]) -> list[tuple[bool, int, int]]:
    """A document as alternating runs: (recomputed?, first token, token count), in order. Runs start
    on page boundaries; only the last run may end in a partly filled page."""
    if not selected:  # nothing recomputed (the usual case): the whole document is one shared run
        return [(False, 0, n_tokens)] if n_tokens > 0 else []
    chosen = set(selected)
    runs: list[tuple[bool, int, int]] = []
    for i in range(num_pages(n_tokens, page_size)):
        lo, n = i * page_size, min(page_size, n_tokens - i * page_size)
        if runs and runs[-1][0] == (i in chosen):
            kind, start, m = runs[-1]
            runs[-1] = (kind, start, m + n)
        else:
            runs.append((i in chosen, lo, n))
    return runs
