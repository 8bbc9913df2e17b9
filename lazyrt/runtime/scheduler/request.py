"""Request state inside the scheduler, and the KV segments a request sees."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from lazyrt.cache.chunk_table import Chunk
from lazyrt.sampling_params import SamplingParams


@dataclass(slots=True)
class Segment:
    """A run of tokens in pages: token i of the run sits at position start_pos + i of the request."""

    pages: list[int]
    start_pos: int
    num_tokens: int
    is_doc: bool = False  # a document's tokens (chunk pages, their block copies, recomputed pages)
    # pages are HOST tier page ids: a chunk attended where it lies (retrieval attention)
    host: bool = False
    doc: int = -1  # which of the request's documents these tokens belong to (-1: not a document)
    # (key, arrays) of its page table, built by step_inputs.segment_table; valid while key holds
    table: tuple | None = field(default=None, repr=False, compare=False)
    # (key, pieces) for shared-chunk grouping, built by step_inputs.segment_run; valid while key holds
    pieces: tuple | None = field(default=None, repr=False, compare=False)


class RequestState(enum.Enum):
    WAITING = "waiting"  # not admitted: no pages held
    CHUNKS = "chunks"  # admitted, waiting for its chunks' KV
    PROBE = "probe"  # deviation recompute: waiting for the probe step that picks its pages
    PREFILL = "prefill"  # its own tokens (suffix / uncached prompt) are next
    DECODE = "decode"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    rid: int
    params: SamplingParams
    prefix: list[int] = field(default_factory=list)
    docs: list[tuple[int, ...]] = field(default_factory=list)  # tuples: see __post_init__
    suffix: list[int] = field(default_factory=list)  # for a plain prompt: the whole prompt
    max_new_tokens: int = 0
    state: RequestState = RequestState.WAITING
    output_ids: list[int] = field(default_factory=list)
    # tokens sampled for it by steps launched but not yet applied (overlapped scheduling: at most 1)
    pending_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None
    # KV the request sees, in position order, and the segment its own tokens go to.
    segments: list[Segment] = field(default_factory=list)
    own: Segment | None = None
    chunks: list[Chunk] = field(default_factory=list)  # chunk refs held (released at finish)
    # retrieval attention: host-only chunks it counted on when added (held until admitted, so the
    # host tier keeps them); host_chunks: how many of its chunks it attends in the host tier
    host_pins: list[Chunk] = field(default_factory=list)
    host_chunks: int = 0
    # retrieval attention, documents that do not fit the device together: rounds of them computed
    # while it waits (Scheduler._chunk_round), and the chunks those rounds computed: (cond, tokens)
    chunk_rounds: int = 0
    staged: set[tuple[tuple[int, ...], tuple[int, ...]]] = field(default_factory=set)
    copied_pages: list[int] = field(default_factory=list)  # block mode: per-use copies of doc pages
    # pending block copies: (chunk pages to copy, destination pages, position delta to re-rotate by)
    copies: list[tuple[list[int], list[int], int]] = field(default_factory=list)
    # Selective recompute (runtime/scheduler/recompute.py): the page indices of each doc it recomputes (chosen
    # once), the pages it owns for them, and the runs still to compute: (index of the run's Segment
    # in `segments`, offset of the first token left in the run, tokens left). They are prefilled in
    # context before (or in the step of) the suffix.
    recompute_sel: list[list[int]] | None = None
    recomputed_pages: list[int] = field(default_factory=list)
    pending_recompute: list[tuple[int, int, list[int]]] = field(default_factory=list)
    recomputed_tokens: int = 0
    # Deviation policy, until its probe step picks the pages: each doc's one segment (an index into
    # `segments`), whether it hit the cache, and the pages reserved for the recompute (lazy mode).
    probe_docs: list[tuple[int, bool]] | None = None
    recompute_reserve: list[int] = field(default_factory=list)
    probe_next: int = 1  # the next doc to probe (docs go in step-budget-sized groups)
    probe_scores: list[list[float]] = field(default_factory=list)  # per doc, filled as probes return
    radix_node: object | None = None
    radix_pages: list[int] = field(default_factory=list)
    # own pages handed to the radix once the prompt's prefill was done (they are the radix's now)
    radix_given: list[int] = field(default_factory=list)
    prompt_cached: bool = False
    # accounting for `meta`
    cached_tokens: int = 0
    chunk_hits: int = 0
    chunk_misses: int = 0
    peer_chunks: int = 0  # documents read from the peer replica that owns them (peer KV)
    # peer KV: each document's placement key (cache/placement.py, of its text or registry id), to find
    # its owner as the router does; empty: owners by the chunks' keys
    doc_keys: list[bytes] = field(default_factory=list)
    doc_owners: list[str] = field(default_factory=list)  # peer KV: owners the router placed ("" = none)
    arrival: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    # Server path only (wall clock, shared by the processes): HTTP received it, the tokenizer process
    # got it and finished it, the scheduler process got it and admitted it; 0 = not known. Reported
    # as meta["timings_ms"].
    received_at: float = 0.0
    tokenizing_at: float = 0.0
    tokenized_at: float = 0.0
    queued_at: float = 0.0
    admitted_at: float = 0.0
    # Scoring: the last `score_len` prompt tokens get their log-probabilities reported (given all
    # before them) in `score_logprobs`, from the prefill step that computes them.
    score_len: int = 0
    score_logprobs: list[float] | None = None
    score_top: list | None = None  # [top ids, top logprobs] per scored token (asked with logprobs)
    # Document attention of its own tokens: (logit scale, log mass) on document keys; None = plain.
    doc_logits: tuple[float, float] | None = None
    # Documents all placed right after the prefix (doc_positions="parallel"), set by Scheduler.add.
    parallel_docs: bool = False

    # citations: each document's attention share summed over the generated tokens, and their count
    citation_mass: list[float] = field(default_factory=list)
    citation_tokens: int = 0

    def __post_init__(self) -> None:
        # Once here: admission keys, lookups and page counts each wanted a tuple of every document
        # (10k ids a request), and tuple() of a tuple is the same object.
        self.docs = [d if type(d) is tuple else tuple(d) for d in self.docs]

    def add_citation_mass(self, mass: list[float]) -> None:
        if len(self.citation_mass) < len(mass):
            self.citation_mass += [0.0] * (len(mass) - len(self.citation_mass))
        for i, m in enumerate(mass):
            self.citation_mass[i] += m
        self.citation_tokens += 1

    def citations(self) -> list[dict]:
        """Documents by the mean share of attention the generated tokens paid them, largest first."""
        n = max(self.citation_tokens, 1)
        scores = [m / n for m in self.citation_mass] + [0.0] * (len(self.docs) - len(self.citation_mass))
        return sorted(({"document": i, "score": s} for i, s in enumerate(scores)), key=lambda c: -c["score"])

    @property
    def is_rag(self) -> bool:
        return bool(self.docs)

    @property
    def prompt_ids(self) -> list[int]:
        return self.prefix + [t for d in self.docs for t in d] + self.suffix

    @property
    def prompt_len(self) -> int:
        return len(self.prefix) + sum(len(d) for d in self.docs) + len(self.suffix)
