"""Scheduler: admits requests when their pages fit, resolves chunks, and plans each forward step.

A step mixes chunk prefills (a document's KV, computed once), prefills of request-owned tokens
(question suffix or uncached prompt, plus recomputed document pages: recompute.py) and
decodes. Pages a request may still need (its suffix and max_new_tokens, recomputed pages, block
copies) are reserved at admission, so a running request never waits for memory and a full pool only
makes new requests wait.
"""

from __future__ import annotations

import math
import time
from collections import deque
from typing import TYPE_CHECKING

import torch

from lazyrt.cache.chunk_table import Chunk, ChunkTable, PartKey
from lazyrt.cache.page_pool import PagePool
from lazyrt.cache.radix_cache import RadixCache
from lazyrt.config import (
    CACHE_MODES,
    EngineConfig,
    check_doc_attention,
    check_doc_positions,
    check_host_kv_cache_tokens,
    check_recompute_options,
)
from lazyrt.runtime.scheduler.plan import PENDING_TOKEN, ChunkJob, ForwardItem, PageCopy, StepPlan
from lazyrt.runtime.scheduler.recompute import page_budget, page_runs, select_pages
from lazyrt.runtime.scheduler.request import Request, RequestState, Segment

if TYPE_CHECKING:
    from lazyrt.runtime.scheduler.peer_kv import PeerKV


class RequestRejected(ValueError):
    """A request the scheduler cannot take; `param` names the request field at fault."""

    param = "sampling_params"

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        if param is not None:
            self.param = param


class RequestTooLarge(RequestRejected):
    param = "max_tokens"


class Scheduler:
    def __init__(
        self,
        pool: PagePool,
        cache_mode: str,
        model_id: str,
        max_running_requests: int = 64,
        max_step_tokens: int = 8192,
        eviction_policy: str = "lru",
        recompute_head_pages: int = 0,
        recompute_policy: str = "head",
        recompute_pages: int = 0,
        recompute_ratio: float = 0.0,
        doc_attention_temperature: float = 1.0,
        doc_attention_scale: float = 1.0,
        doc_positions: str = "sequential",
        host_kv_pages: int = 0,
        page_bytes: int = 0,
        retrieval_attention: bool = False,
    ):
        if cache_mode not in CACHE_MODES:
            raise ValueError(f"cache_mode={cache_mode!r}: must be one of {', '.join(CACHE_MODES)}")
        self.pool = pool
        self.page_size = pool.page_size
        self.cache_mode = cache_mode
        check_host_kv_cache_tokens(cache_mode, host_kv_pages * pool.page_size, pool.page_size)
        # Host KV tier: page ids only (the worker holds the bytes), handed out by the chunk table.
        host = None
        if host_kv_pages:
            host = PagePool(1, host_kv_pages, pool.page_size, 1, 1, torch.float32, "meta")
        self.page_bytes = page_bytes  # one KV page, all layers: host tier traffic in cache_stats
        if retrieval_attention and (cache_mode != "lazy" or host is None):
            raise ValueError("retrieval_attention: needs cache_mode lazy and a host KV tier")
        # Retrieval attention: a chunk found only on the host is attended there (host segments)
        # when the pool has no free pages to load it; host_attended counts those chunk uses.
        self.retrieval = retrieval_attention
        self.host_attended = 0
        self.chunks = ChunkTable(model_id, pool.page_size, eviction_policy, host_pool=host)
        self.radix = RadixCache(pool.page_size)
        self.max_running = max_running_requests
        self.max_step_tokens = max_step_tokens
        # Selective recompute (block/lazy): pages of the docs after the first recomputed in context.
        self.recompute_policy, self.recompute_pages, self.recompute_ratio = check_recompute_options(
            recompute_policy, recompute_pages, recompute_ratio, recompute_head_pages
        )
        check_doc_attention(cache_mode, doc_attention_temperature, doc_attention_scale)
        self.doc_attention = (float(doc_attention_temperature), float(doc_attention_scale))
        check_doc_positions(cache_mode, doc_positions, self.recomputes)
        self.doc_positions = doc_positions
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.jobs: list[ChunkJob] = []
        # Peer KV (runtime/scheduler/peer_kv.py): set by the scheduler process when kv_peers is on.
        self.peers: PeerKV | None = None
        self._seq = 0  # steps planned so far (StepPlan.seq)
        # the waiting request the last schedule() stopped admitting at (it did not fit, and its
        # documents' rounds, if any, could not go on): when nothing else runs, the one that is stuck
        self.blocked: Request | None = None
        self.complete_seq = 0  # the last step whose results came back: its device work is done

    # ---- intake -------------------------------------------------------------------------------

    @classmethod
    def from_config(
        cls, pool: PagePool, cfg: EngineConfig, model_id: str, host_kv_pages: int = 0, page_bytes: int = 0
    ) -> Scheduler:
        """host_kv_pages and page_bytes: as the worker reports them (WorkerReady)."""
        return cls(
            pool,
            cfg.cache_mode,
            model_id,
            cfg.max_running_requests,
            cfg.max_step_tokens,
            eviction_policy=cfg.eviction_policy,
            recompute_head_pages=cfg.recompute_head_pages,
            recompute_policy=cfg.recompute_policy,
            recompute_pages=cfg.recompute_pages,
            recompute_ratio=cfg.recompute_ratio,
            doc_attention_temperature=cfg.doc_attention_temperature,
            doc_attention_scale=cfg.doc_attention_scale,
            doc_positions=cfg.doc_positions,
            host_kv_pages=host_kv_pages,
            page_bytes=page_bytes,
            retrieval_attention=cfg.retrieval_attention,
        )

    @property
    def recomputes(self) -> bool:
        """Selective recompute is on (some pages of the later docs are recomputed in context)."""
        return bool(self.recompute_pages or self.recompute_ratio)

    def pages_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.page_size)

    def worst_case_pages(self, req: Request, on_host: set[tuple[int, ...]] | None = None) -> int:
        """Pages the request needs with nothing cached: more than the pool means it can never run
        (unless its documents are computed in rounds: _chunk_round). on_host: the documents found
        only in the host tier (default: those it holds there)."""
        own = self.pages_for(len(req.suffix) + req.max_new_tokens)
        if not (req.is_rag and self.uses_chunks):
            return self.pages_for(req.prompt_len + req.max_new_tokens)
        # attended in the host tier: no device pages
        pinned = self._host_only_docs(req) if on_host is None else on_host
        doc_pages = sum(self.pages_for(len(d)) for d in req.docs if not pinned or d not in pinned)
        return self.pages_for(len(req.prefix)) + doc_pages + self._per_use_pages(req) + own

    def recompute_selection(self, req: Request) -> list[list[int]]:
        """Indices of each doc's pages the request recomputes in context (its own pages); the rest
        is served from the chunk. Chosen once per request (recompute.py); the deviation policy
        chooses after its probe step (_apply_probe), from the K/V the probe measured."""
        if req.recompute_sel is None:
            if self._probe_budget(req):
                raise ValueError("the deviation policy picks a request's pages in its probe step")
            if not (self.recompute_pages or self.recompute_ratio) or self.recompute_policy == "deviation":
                req.recompute_sel = [[] for _ in req.docs]
            else:
                req.recompute_sel = select_pages(
                    self.recompute_policy, req.docs, req.suffix, self.page_size,
                    self.recompute_pages, self.recompute_ratio,
                )
        return req.recompute_sel

    def head_lens(self, req: Request) -> list[int]:
        """Tokens each doc recomputes in context (all policies; head runs first in each doc)."""
        return [
            sum(min(self.page_size, len(d) - i * self.page_size) for i in sel)
            for d, sel in zip(req.docs, self.recompute_selection(req))
        ]

    def _per_use_pages(self, req: Request) -> int:
        """Pages a RAG request owns besides its suffix: recomputed pages, and in block mode the
        re-rotated copies of the rest of each doc."""
        if self.cache_mode == "block":
            return sum(self.pages_for(len(d)) for d in req.docs)
        reserved = self._probe_budget(req)  # deviation: reserved now, picked by the probe
        return reserved or sum(len(s) for s in self.recompute_selection(req))

    def _probe_budget(self, req: Request) -> int:
        """Pages the deviation policy will recompute for the request (0: no probe needed)."""
        if self.recompute_policy != "deviation":
            return 0
        lens = [len(d) for d in req.docs]
        return page_budget(lens, self.page_size, self.recompute_pages, self.recompute_ratio)

    @property
    def uses_chunks(self) -> bool:
        return self.cache_mode in ("lazy", "block")

    def check_fits(self, req: Request) -> None:
        need = self.worst_case_pages(req)
        if need <= self.pool.num_pages:
            return
        if not self._computes_in_rounds(req):
            raise RequestTooLarge(
                f"request needs {need} KV pages ({need * self.page_size} tokens incl. max_tokens) but the "
                f"KV cache holds {self.pool.num_pages} pages; raise kv_cache_tokens or shorten the prompt"
            )
        # Retrieval attention: its documents are computed a round at a time and moved to the host
        # tier (_chunk_round), so the device needs room for one document beside the rest of the
        # request, and the host for the documents the device does not hold at admission.
        fixed = self.pages_for(len(req.prefix)) + self._own_and_per_use_pages(req)
        on_host = self._host_only_docs(req)
        docs = set(req.docs)
        largest = max((self.pages_for(len(d)) for d in docs if d not in on_host), default=0)
        if fixed + largest > self.pool.num_pages:
            raise RequestTooLarge(
                f"request needs {fixed + largest} KV pages on the device (prefix, suffix, max_tokens and its "
                f"largest document not yet computed) but the KV cache holds {self.pool.num_pages} pages; "
                "raise kv_cache_tokens or shorten the prompt (with retrieval attention, documents are "
                "computed a few at a time and moved to the host KV tier: only the largest must fit with "
                "the rest of the request)"
            )
        total = sum(self.pages_for(len(d)) for d in docs)
        host = self.chunks.host_pool.num_pages
        if total > host + self.pool.num_pages - fixed:
            raise RequestTooLarge(
                f"request's documents need {total} KV pages but the host KV tier holds {host} pages and the "
                f"KV cache {self.pool.num_pages - fixed} more beside the rest of the request; raise "
                "host_kv_cache_tokens (or kv_cache_tokens) or send fewer documents"
            )

    def _computes_in_rounds(self, req: Request) -> bool:
        """Retrieval attention: documents that do not fit the device together may be computed in
        rounds while the request waits (scored prompts attend nothing in the host tier)."""
        return self.retrieval and req.is_rag and not req.score_len

    def _own_and_per_use_pages(self, req: Request) -> int:
        return self.pages_for(len(req.suffix) + req.max_new_tokens) + self._per_use_pages(req)

    def add(self, req: Request) -> None:
        req.doc_logits = self.doc_logits_for(req)
        req.parallel_docs = self.parallel_docs_for(req)
        if req.params.retrieval_top_k is not None and not self.retrieval:
            raise RequestRejected(
                f"sampling_params.retrieval_top_k={req.params.retrieval_top_k}: needs a server started with "
                "retrieval attention (--retrieval-attention)",
                "sampling_params.retrieval_top_k",
            )
        self._pin_host_docs(req)
        try:
            self.check_fits(req)
        except RequestRejected:
            self._unpin(req)
            raise
        self.waiting.append(req)

    def _host_only(self, req: Request) -> list[Chunk]:
        """Retrieval attention: the request's document chunks found only in the host tier now."""
        if not (self.retrieval and req.is_rag) or req.score_len:
            return []
        prefix = tuple(req.prefix)
        found = (self.chunks.lookup(prefix, d, record=False) for d in set(req.docs))
        return [c for c in found if c is not None and not c.pages and c.host_pages]

    def _host_only_docs(self, req: Request) -> set[tuple[int, ...]]:
        chunks = req.host_pins if req.host_pins else self._host_only(req)
        return {c.tokens for c in chunks}

    def _pin_host_docs(self, req: Request) -> None:
        """Retrieval attention: hold the request's documents found only in the host tier until it is
        admitted (they need no device pages, so it may be larger than the device pool). Those held
        already are not held twice."""
        held = {id(c) for c in req.host_pins}
        for c in self._host_only(req):
            if id(c) not in held:
                self.chunks.acquire(c)
                req.host_pins.append(c)

    def _unpin(self, req: Request) -> None:
        for c in req.host_pins:
            self.chunks.release(c)
        req.host_pins = []

    def parallel_docs_for(self, req: Request) -> bool:
        """Whether the request's documents all start right after the prefix (doc_positions).
        Raises RequestRejected when the request asks for a layout the server cannot give."""
        mode = req.params.doc_positions or self.doc_positions
        if req.params.doc_positions is not None:
            try:
                check_doc_positions(self.cache_mode, mode, self.recomputes)
            except ValueError as e:
                raise RequestRejected(f"sampling_params.{e}", "sampling_params.doc_positions") from None
        return mode == "parallel"

    def doc_logits_for(self, req: Request) -> tuple[float, float] | None:
        """(logit scale, log mass) on document keys for the request's own tokens, None if neutral.
        Raises RequestRejected when the request asks for document attention the mode cannot give."""
        p = req.params  # SamplingParams validated the values themselves
        temp = self.doc_attention[0] if p.doc_attention_temperature is None else p.doc_attention_temperature
        scale = self.doc_attention[1] if p.doc_attention_scale is None else p.doc_attention_scale
        for name, v in (("doc_attention_temperature", temp), ("doc_attention_scale", scale)):
            if v != 1 and not self.uses_chunks:
                raise RequestRejected(
                    f"sampling_params.{name}={v!r}: needs cache_mode lazy or block (documents attended "
                    f"as chunks); this server runs cache_mode {self.cache_mode!r}",
                    f"sampling_params.{name}",
                )
        if temp == 1 and scale == 1:
            return None
        if self.retrieval:
            raise RequestRejected(
                "sampling_params.doc_attention_temperature / doc_attention_scale: not supported with "
                "retrieval_attention (the retrieved keys are attended plainly)",
                "sampling_params.doc_attention_temperature",
            )
        return (1.0 / temp, math.log(scale))

    @property
    def has_work(self) -> bool:
        # (chunk jobs, or copies, alone: documents a peer replica asked this one to compute or load back)
        owed = self.peers is not None and self.chunks.owes_copies
        return bool(self.waiting or self.running or self.jobs or owed)

    # ---- admission ----------------------------------------------------------------------------
    def room_pages(self) -> int:
        """Free pages plus the cached pages nobody holds (radix pages no request locks, ready chunks
        nobody references): the most make_room can give."""
        return self.pool.num_free + self.radix.evictable_pages() + self.chunks.evictable_pages()

    def make_room(self, n_pages: int) -> bool:
        """Evicts cached pages (radix first, then chunks) until n_pages are free; returns whether they
        are. Evicts nothing when even every evictable page would not make them free: the caller waits
        anyway, and the cache keeps documents and prompts a later request may hit."""
        short = n_pages - self.pool.num_free
        if short <= 0:
            return True
        if self.room_pages() < n_pages:
            return False
        freed = self.radix.evict(short)
        self.pool.free(freed)
        short -= len(freed)
        if short > 0:
            self.pool.free(self.chunks.evict(short))
        return self.pool.num_free >= n_pages

    def _host_attended(self, req: Request, found: dict) -> set:
        """Retrieval attention: the keys of `found` chunks (documents found only in the host tier)
        the request attends where they lie: those the pool cannot also load (free pages plus pages
        of chunks nobody holds), after the pages it needs anyway (the shared prefix is always
        loaded: new chunks are computed over it)."""
        if not self.retrieval or req.score_len:
            return set()
        prefix_key = ((), tuple(req.prefix))
        host_only = [k for k, c in found.items()
                     if k != prefix_key and c is not None and not c.pages and c.host_pages]  # fmt: skip
        if not host_only:
            return set()
        other = sum(self.pages_for(len(k[1])) for k, c in found.items() if k not in host_only and
                    (c is None or not c.pages))  # fmt: skip
        # pages it could have by evicting what nobody holds (the popularity policy picks) count too:
        # host attention is for contexts the device cannot hold, not a substitute for a load
        room = self.pool.num_free + self.chunks.evictable_pages()
        free = room - other - self.pages_for(len(req.suffix) + req.max_new_tokens)
        free -= self._per_use_pages(req)
        at_host = set()
        for k in host_only:
            n = self.pages_for(len(k[1]))
            if n <= free:
                free -= n
            else:
                at_host.add(k)
        return at_host

    def _needs_rounds(self, req: Request) -> bool:
        """The request's documents not in the host tier now do not fit the device together."""
        if not self._computes_in_rounds(req):
            return False
        on_host = {c.tokens for c in self._host_only(req)}  # now: a held one may have been loaded since
        return self.worst_case_pages(req, on_host) > self.pool.num_pages

    def _max_rounds(self, req: Request) -> int:
        # each round computes at least one document and keeps every earlier one (held in the host
        # tier), so more rounds than documents means its documents were lost (e.g. a failed step)
        return 2 * len(set(req.docs)) + 2

    def _chunk_round(self, req: Request) -> bool:
        """Retrieval attention, a waiting request whose documents do not fit the device together:
        moves the ones computed so far to the host tier (held there for it, so none is dropped and
        computed again), then admits it if the rest fit with it as today, else queues ChunkJobs for
        as many of its missing documents as the device holds beside what the request needs (the
        request keeps waiting). Returns whether it was admitted."""
        prefix = tuple(req.prefix)
        found = {d: self.chunks.lookup(prefix, d, record=False) for d in dict.fromkeys(req.docs)}
        if any(c is not None and c.pages and not c.ready for c in found.values()):
            return False  # the last round's chunks (or another request's) are still being written
        for c in found.values():
            if c is None or not c.pages:
                continue
            if any(p is c for p in req.host_pins):  # held on the host; another request loaded it since
                req.host_pins = [p for p in req.host_pins if p is not c]
                self.chunks.release(c)
            if not c.ref_count:  # in use by a running request: it stays until that one ends
                freed = self.chunks.offload(c)
                self.pool.free(freed or [])  # None: no host room, it stays on the device
        self._pin_host_docs(req)
        if self.worst_case_pages(req) <= self.pool.num_pages:
            return self._try_admit(req)  # the rest fit together: admitted as today
        if req.chunk_rounds >= self._max_rounds(req):
            req.error = (
                f"its documents were computed in {req.chunk_rounds} rounds and some were lost before it "
                "could run; raise host_kv_cache_tokens or kv_cache_tokens"
            )
            return False
        fixed = self.pages_for(len(prefix)) + self._own_and_per_use_pages(req)
        on_device = sum(len(c.pages) for c in found.values() if c is not None)
        cap = self.pool.num_pages - fixed - on_device
        take, used = [], 0
        for d, c in found.items():  # first fit, in prompt order
            n = self.pages_for(len(d))
            if c is None and used + n <= cap:
                take.append(d)
                used += n
        cond = self.chunks.lookup((), prefix, record=False) if prefix else None
        if cond is not None:
            self.chunks.acquire(cond)  # kept through the eviction below
        load = self.pages_for(len(prefix)) if prefix and (cond is None or not cond.pages) else 0
        # running requests hold the rest for now: fewer documents this round, and only evicting for
        # those that then fit (cond is held: not evictable)
        room = self.room_pages()
        while take and load + used > room:
            used -= self.pages_for(len(take.pop()))
        if take:
            self.make_room(load + used)
        while take and load + used > self.pool.num_free:
            used -= self.pages_for(len(take.pop()))
        if not take:
            if cond is not None:
                self.chunks.release(cond)
            return False
        if prefix and cond is None:
            self.chunks.record_use(None)
            cond = self.chunks.insert((), prefix, self.pool.alloc(load))
            self.chunks.acquire(cond)
            self.queue_job(ChunkJob(cond, None))
            req.staged.add(((), prefix))
        elif load:
            self.chunks.load(cond, self.pool.alloc(load))
        for d in take:
            self.chunks.record_use(None)  # a miss: computed for this request
            c = self.chunks.insert(prefix, d, self.pool.alloc(self.pages_for(len(d))))
            self.queue_job(ChunkJob(c, cond))
        if cond is not None:
            self.chunks.release(cond)
        req.staged.update((prefix, d) for d in take)
        req.chunk_rounds += 1
        return False

    def stuck(self) -> list[Request]:
        """When a step has nothing to run (nothing running or computing): the waiting requests that
        cannot go on, to fail alone. Those whose documents' rounds gave up (req.error), and the one
        admission stopped at (it blocks the queue: nothing running will free pages for it). The
        requests behind them are served once they are gone."""
        out = [r for r in self.waiting if r.error]
        b = self.blocked
        if b is not None and b.state is RequestState.WAITING and all(r is not b for r in out):
            out.append(b)
        return out

    def queue_job(self, job: ChunkJob) -> None:
        """Each job holds its own refs until its KV is written."""
        for x in (job.chunk, job.cond):
            if x is not None:
                self.chunks.acquire(x)
        self.jobs.append(job)

    def _try_admit(self, req: Request) -> bool:
        if req.is_rag and self.uses_chunks:
            return self._admit_rag(req)
        return self._admit_plain(req)

    def _admit_plain(self, req: Request) -> bool:
        tokens = req.prompt_ids
        pages, node = [], None
        if self.cache_mode != "none":
            # Keep at least one token to compute: its logits give the first output token.
            # A scored tail must be computed in this request's prefill, so never take it from the cache.
            usable = max(len(tokens) - 1 - req.score_len, 0) // self.page_size * self.page_size
            pages, node = self.radix.match_prefix(tokens[:usable])
            self.radix.lock(node)
        matched = len(pages) * self.page_size
        need = self.pages_for(len(tokens) - matched + req.max_new_tokens)
        self.make_room(need)
        if self.pool.num_free < need:
            if node is not None:
                self.radix.unlock(node)
            return False
        req.radix_node, req.radix_pages = node, pages
        req.cached_tokens = matched
        req.segments = [Segment(pages, 0, matched)] if pages else []
        req.own = Segment(self.pool.alloc(need), matched, 0)
        req.segments.append(req.own)
        req.state = RequestState.PREFILL
        return True

    def _admit_rag(self, req: Request) -> bool:
        parts: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
        prefix = tuple(req.prefix)
        if prefix:
            parts.append(PartKey((), prefix))
        doc_keys = [PartKey(prefix, d) for d in req.docs]
        parts += doc_keys
        found: dict[tuple, Chunk | None] = {}
        for key in parts:
            if key not in found:
                found[key] = self.chunks.get(key)
        existed = {key: c is not None for key, c in found.items()}
        held = [c for c in found.values() if c is not None]
        for c in held:
            self.chunks.acquire(c)  # protect hits from the eviction below
        # new chunks, and chunks found only in the host tier (copied back, not recomputed)
        at_host = self._host_attended(req, found)
        new_pages = sum(
            self.pages_for(len(key[1]))
            for key, c in found.items()
            if c is None or (not c.pages and key not in at_host)
        )
        own_pages = self.pages_for(len(req.suffix) + req.max_new_tokens)
        need = new_pages + own_pages + self._per_use_pages(req)
        self.make_room(need)
        if self.pool.num_free < need:
            for c in held:
                self.chunks.release(c)
            return False
        self._unpin(req)  # its admission holds its own refs now
        req.host_chunks = len(at_host)
        self.host_attended += len(at_host)
        fetched: dict[int, list[Chunk]] = {}  # peer KV: owner -> the documents it is asked for
        placement = dict(zip(doc_keys, req.doc_keys)) if self.peers is not None else {}
        placed = dict(zip(doc_keys, req.doc_owners)) if self.peers is not None else {}
        for key, c in found.items():
            # (a document's key: its cond is the prefix, the prefix chunk's is empty)
            owner = 0
            if c is None and self.peers is not None and key[0] == prefix:
                owner = self.peers.owner(key, placement.get(key), placed.get(key))
            if key not in req.staged and not owner:  # its rounds counted those (misses)
                self.chunks.record_use(c)
            if c is None:
                c = self.chunks.insert(key[0], key[1], self.pool.alloc(self.pages_for(len(key[1]))))
                self.chunks.acquire(c)
                found[key] = c
                if owner:
                    fetched.setdefault(owner, []).append(c)
            elif not c.pages and key not in at_host:  # ready for this step's kernels: its load runs first
                self.chunks.load(c, self.pool.alloc(self.pages_for(c.num_tokens)))
        # Jobs for new chunks; each job holds its own refs until its KV is written.
        prefix_chunk = found[parts[0]] if prefix else None
        for owner, cs in fetched.items():
            self.peers.fetch(owner, cs, prefix, prefix_chunk)
            req.peer_chunks += len(cs)
        for key, c in found.items():
            cond = key[0]
            if c.ready or c.fetching or key in at_host:
                continue
            if all(j.chunk is not c for j in self.jobs):
                self.queue_job(ChunkJob(c, prefix_chunk if cond else None))
        req.chunks = list(found.values())
        probe = self._probe_budget(req)
        # Deviation policy: each doc as one segment until the probe step has picked the pages.
        sels = [[] for _ in req.docs] if probe else self.recompute_selection(req)
        probe_docs = []
        pos = 0
        if prefix:
            req.segments.append(Segment(prefix_chunk.pages, 0, len(prefix)))
            pos = len(prefix)
        for j, (d, key, sel) in enumerate(zip(req.docs, doc_keys, sels)):
            c = found[key]
            # computed, or being computed for another request (not in rounds for this one)
            hit = existed[key] and key not in req.staged
            on_host = key in at_host
            if req.parallel_docs:
                pos = len(prefix)  # every doc right after the prefix (APE's parallel encoding)
            probe_docs.append((len(req.segments), hit))
            req.chunk_hits += int(hit)
            req.chunk_misses += int(not hit and c.peer < 0)  # (a peer's: counted by its owner)
            # Page-granular copy-on-write: the doc is alternating runs of the chunk's pages (shared,
            # never written) and request-owned pages recomputed in context with the suffix.
            for recompute, lo, n in page_runs(len(d), self.page_size, sel):
                if recompute:
                    seg = Segment(self.pool.alloc(self.pages_for(n)), pos + lo, n, is_doc=True, doc=j)
                    req.recomputed_pages += seg.pages
                    req.recomputed_tokens += n
                    req.pending_recompute.append((len(req.segments), 0, list(d[lo : lo + n])))
                else:
                    req.cached_tokens += n if hit else 0
                    pages = c.host_pages if on_host else c.pages
                    src = pages[lo // self.page_size : lo // self.page_size + self.pages_for(n)]
                    if on_host:  # attended where it lies (retrieval attention)
                        seg = Segment(src, pos + lo, n, is_doc=True, host=True, doc=j)
                    elif self.cache_mode == "block":
                        seg = Segment(self.pool.alloc(len(src)), pos + lo, n, is_doc=True, doc=j)
                        req.copied_pages += seg.pages
                        req.copies.append((src, seg.pages, pos - len(prefix)))
                    else:
                        seg = Segment(src, pos + lo, n, is_doc=True, doc=j)
                req.segments.append(seg)
            pos += len(d)
        if req.parallel_docs:  # the question follows the longest doc
            pos = len(prefix) + max(map(len, req.docs), default=0)
        if prefix and existed[parts[0]] and parts[0] not in req.staged:
            req.cached_tokens += len(prefix)
        if probe:
            req.probe_docs = probe_docs
            if self.cache_mode == "lazy":  # block recomputes into its own copies of the doc pages
                req.recompute_reserve = self.pool.alloc(probe)
                req.recomputed_pages += req.recompute_reserve
        req.own = Segment(self.pool.alloc(own_pages), pos, 0)
        req.segments.append(req.own)
        req.state = RequestState.CHUNKS
        return True

    # ---- planning -----------------------------------------------------------------------------
    def _prompt_in_prefill(self, req: Request) -> bool:
        """A running request with the same plain prompt has not cached it yet (n > 1 siblings, or
        the same prompt sent twice): waiting for its prefill lets this one match its pages."""
        if self.cache_mode == "none" or (req.is_rag and self.uses_chunks):
            return False
        if (len(req.prompt_ids) - 1 - req.score_len) // self.page_size == 0:
            return False  # not one full page to share
        return any(
            r.radix_node is not None and not r.prompt_cached and r.prompt_ids == req.prompt_ids
            for r in self.running
        )

    def _cache_prompt(self, req: Request) -> None:
        """The prompt's prefill is done: its full pages go into the radix now rather than when the
        request ends, so a request with the same prompt admitted meanwhile computes none of them.
        The request keeps reading the same pages; it locks the deeper node instead of the matched one."""
        req.prompt_cached = True
        full = len(req.prompt_ids) // self.page_size
        n_radix = len(req.radix_pages)
        if full <= n_radix or req.own is None:
            return
        tokens = req.prompt_ids[: full * self.page_size]
        mine = req.own.pages[: full - n_radix]
        rejected = set(self.radix.insert(tokens, req.radix_pages + mine))  # another request's won
        node = self.radix.node_of(tokens)
        self.radix.lock(node)
        self.radix.unlock(req.radix_node)
        req.radix_node = node
        req.radix_given = [p for p in mine if p not in rejected]

    def schedule(self) -> StepPlan:
        i = 0  # in arrival order; one waiting for a same-prompt request's prefill lets the next go
        self.blocked = None
        while i < len(self.waiting) and len(self.running) < self.max_running:
            req = self.waiting[i]
            if self._prompt_in_prefill(req):
                i += 1
                continue
            if not self._try_admit(req) and not (self._needs_rounds(req) and self._chunk_round(req)):
                self.blocked = req
                break
            del self.waiting[i]
            self.running.append(req)
            req.admitted_at = time.time()
        plan = StepPlan()
        budget = self.max_step_tokens
        for req in self.running:
            if req.state is not RequestState.DECODE:
                continue
            # a token in flight that reaches max_tokens ends it: a decode now would be thrown away
            if len(req.output_ids) + req.pending_tokens < req.max_new_tokens:
                plan.items.append(self._decode_item(req))
                budget -= 1
        for job in list(self.jobs):
            n = job.chunk.num_tokens
            if (job.cond is None or job.cond.ready) and (n <= budget or not plan.items):
                plan.items.append(self._chunk_item(job))
                self.jobs.remove(job)
                budget -= n
        for req in self.running:
            # (a chunk with only a host copy is complete: attended there, retrieval attention)
            if req.state is RequestState.CHUNKS and all(c.ready or c.host_pages for c in req.chunks):
                for src, dst, delta in req.copies:
                    plan.copies.append(PageCopy(src, dst, delta))
                req.copies = []
                if req.probe_docs is not None:
                    req.probe_scores = [[] for _ in req.docs]
                    req.state = RequestState.PROBE
                else:
                    req.state = RequestState.PREFILL
            if req.state is RequestState.PROBE:
                budget -= self._plan_probes(req, plan, budget)
            if req.state is RequestState.PREFILL:
                budget -= self._plan_prefill(req, plan, budget)
        for item in plan.items:
            if item.request is not None:
                item.request.pending_tokens += 1  # EngineCore applies it when the step's tokens arrive
        if plan.items or plan.probes or (self.peers is not None and self.chunks.owes_copies):
            # (peer KV: a document a peer waits for may need only its load from the host tier: a step
            # of copies alone)
            # Host tier copies owed by this schedule's evictions and hits (and any earlier one that
            # sent no step): before this step's kernels, the first that can write the device pages
            # the evictions freed or read the pages the loads fill (steps run in order on the device,
            # so an earlier step still in flight reads the evicted pages before they are reused).
            plan.offloads, plan.loads = self.chunks.take_transfers()
            plan.peer_loads = self.chunks.take_peer_loads()
            self._seq += 1
            plan.seq = self._seq
            for t in plan.loads + plan.peer_loads:
                t.chunk.ready_seq = plan.seq
            if self.peers is not None:
                self.peers.on_planned(plan.seq)
                if plan.peer_loads:
                    plan.peer_pools = self.peers.take_pools()
        return plan

    def _plan_prefill(self, req: Request, plan: StepPlan, budget: int) -> int:
        """Adds the next piece of the request's own prefill (chunked prefill: a long prompt goes in
        pieces that fit the step budget, so running decodes never stall behind it and it never waits
        for an idle step); returns the tokens planned. Recomputed doc pages go first: with the first
        piece if they fit, else in budget-sized pieces over the next steps, the suffix starting in
        the step they end in if room is left (a large recompute must neither starve behind running
        decodes nor stall them); a scored prompt in one piece (its logprobs come from one step)."""
        own = self._own_tokens(req)  # built once: for a plain prompt it is a copy of the prompt
        left = len(own) - req.own.num_tokens
        heads = sum(len(t) for _, _, t in req.pending_recompute)
        if heads and heads + left > budget:
            if plan.items and budget < min(heads, self.page_size):
                return 0  # too little room this step for a useful piece
            taken = self._recompute_piece(req, plan, max(budget, 1))
            if req.pending_recompute or req.score_len or budget - taken < min(left, self.page_size):
                return taken
            plan.items.append(self._own_prefill_item(req, own, budget - taken))
            return budget
        if heads + left <= budget or not plan.items:
            take = left if (req.score_len or heads + left <= budget) else max(budget - heads, 1)
        elif req.score_len or budget - heads < min(left, self.page_size):
            return 0  # too little room this step for a useful piece
        else:
            take = budget - heads
        plan.items += self._recompute_items(req)
        plan.items.append(self._own_prefill_item(req, own, take))
        return heads + take

    def _plan_probes(self, req: Request, plan: StepPlan, budget: int) -> int:
        """Deviation policy: the next docs after the first that fit the step's token budget (one
        at least in an otherwise empty step), each at its real positions, attending to all the
        request has before it and causally to itself (its cached segment: the worker writes
        nothing), so its K/V at PROBE_LAYER are the in-context ones (recompute.py). Counted in
        full against the budget: activations, not FLOPs, bound a step (a saturated server once
        probed 40 requests' documents in one step and ran out of device memory)."""
        taken = 0
        while req.probe_next < len(req.docs):
            j = req.probe_next
            if len(req.docs[j]) > budget - taken and (taken or plan.items or plan.probes):
                break
            req.probe_next += 1
            taken += len(req.docs[j])
            idx = req.probe_docs[j][0]
            seg = req.segments[idx]
            segs = req.segments[: idx + 1]
            plan.probes.append(
                ForwardItem(list(req.docs[j]), seg.start_pos, segs, seg, doc_logits=req.doc_logits)
            )
            plan.probe_for.append((req, j))
        return taken

    def _apply_probe(self, req: Request, scores: list[list[float]]) -> None:
        """Picks the pages from the probe's per-page deviations and splits each doc into runs: shared
        chunk pages and recomputed runs (lazy: in the reserved pages; block: over its own copies)."""
        sel = select_pages(
            "deviation", req.docs, req.suffix, self.page_size, self.recompute_pages, self.recompute_ratio,
            page_scores=scores,
        )
        req.recompute_sel = sel
        doc_at = {idx: j for j, (idx, _) in enumerate(req.probe_docs)}
        reserve = req.recompute_reserve
        segments: list[Segment] = []
        for i, seg in enumerate(req.segments):
            j = doc_at.get(i)
            if j is None or not sel[j]:
                segments.append(seg)
                continue
            d, hit = req.docs[j], req.probe_docs[j][1]
            for recompute, lo, n in page_runs(len(d), self.page_size, sel[j]):
                pages = seg.pages[lo // self.page_size : lo // self.page_size + self.pages_for(n)]
                if recompute:
                    if self.cache_mode == "lazy":
                        pages, reserve = reserve[: len(pages)], reserve[len(pages) :]
                    req.pending_recompute.append((len(segments), 0, list(d[lo : lo + n])))
                    req.recomputed_tokens += n
                    req.cached_tokens -= n if hit else 0
                segments.append(Segment(pages, seg.start_pos + lo, n, is_doc=True, doc=j))
        if reserve:  # fewer pages picked than reserved
            unused = set(reserve)
            req.recomputed_pages = [p for p in req.recomputed_pages if p not in unused]
            self.pool.free(reserve)
        req.segments = segments
        req.probe_docs, req.recompute_reserve, req.probe_scores = None, [], []
        req.state = RequestState.PREFILL

    def _recompute_items(self, req: Request) -> list[ForwardItem]:
        """Recomputed runs of doc pages, in context: a run at its real positions attends to
        everything the request has before it (prefix, earlier docs and the doc's earlier pages as
        the request sees them) and causally to itself. They share the step with the suffix: a layer
        stores every item's K/V before any attends, so later runs and the suffix see the earlier
        runs' fresh K/V at each layer."""
        items = []
        for idx, lo, tokens in req.pending_recompute:
            seg = req.segments[idx]
            items.append(
                ForwardItem(
                    tokens, seg.start_pos + lo, req.segments[: idx + 1], seg, doc_logits=req.doc_logits
                )
            )
        req.pending_recompute = []
        return items

    def _recompute_piece(self, req: Request, plan: StepPlan, budget: int) -> int:
        """The next `budget` tokens of the pending recomputed runs, in prompt order. A piece sees
        the earlier pieces' stored KV. Its key list ends at its own last token (a view of the run
        cut there), as every item's does: a dense-page backend aligns the causal mask to the end."""
        taken = 0
        while req.pending_recompute and taken < budget:
            idx, lo, tokens = req.pending_recompute[0]
            n = min(len(tokens), budget - taken)
            seg = req.segments[idx]
            view = Segment(seg.pages, seg.start_pos, lo + n, is_doc=seg.is_doc, doc=seg.doc)
            plan.items.append(
                ForwardItem(
                    tokens[:n],
                    seg.start_pos + lo,
                    req.segments[:idx] + [view],
                    view,
                    doc_logits=req.doc_logits,
                )
            )
            if n == len(tokens):
                req.pending_recompute.pop(0)
            else:
                req.pending_recompute[0] = (idx, lo + n, tokens[n:])
            taken += n
        return taken

    def _decode_item(self, req: Request) -> ForwardItem:
        pos = req.own.start_pos + req.own.num_tokens
        req.own.num_tokens += 1
        # its last token still in flight (overlapped scheduling): the worker takes it on the device
        token = req.output_ids[-1] if not req.pending_tokens else PENDING_TOKEN
        return ForwardItem([token], pos, req.segments, req.own, request=req, doc_logits=req.doc_logits)

    def _chunk_item(self, job: ChunkJob) -> ForwardItem:
        c = job.chunk
        start = len(job.cond.tokens) if job.cond else 0
        own = Segment(c.pages, start, c.num_tokens)
        segs = ([Segment(job.cond.pages, 0, start)] if job.cond else []) + [own]
        return ForwardItem(list(c.tokens), start, segs, own, job=job)

    def _own_tokens(self, req: Request) -> list[int]:
        """The prompt tokens the request computes itself, starting at req.own.start_pos."""
        if req.is_rag and self.uses_chunks:
            return req.suffix
        return req.prompt_ids[req.own.start_pos :]

    def _own_prefill_item(self, req: Request, own: list[int], take: int) -> ForwardItem:
        done = req.own.num_tokens
        tokens = own[done : done + take]
        req.own.num_tokens = done + len(tokens)
        last = req.own.num_tokens == len(own)
        if last:
            req.state = RequestState.DECODE  # its first token is sampled from this step
        pos = req.own.start_pos + done
        return ForwardItem(
            tokens, pos, req.segments, req.own, request=req if last else None, doc_logits=req.doc_logits
        )

    # ---- results ------------------------------------------------------------------------------
    def on_step_done(self, plan: StepPlan, probe_scores: list[list[float]] | None = None) -> None:
        """Marks computed chunks ready; applies the deviation probes' per-page scores (one list
        per plan.probes item, in order)."""
        if plan.probes:
            if probe_scores is None or len(probe_scores) != len(plan.probes):
                raise RuntimeError("the worker returned no deviation scores for the step's probes")
            done: dict[int, Request] = {}
            for (req, j), scores in zip(plan.probe_for, probe_scores):
                if req.state is RequestState.PROBE:  # not aborted meanwhile
                    req.probe_scores[j] = list(scores)
                    done[req.rid] = req
            for req in done.values():
                if req.probe_next == len(req.docs):  # every doc probed: pick the pages
                    self._apply_probe(req, req.probe_scores)
        for item in plan.items:
            req = item.request
            if (
                req is not None and req.radix_node is not None and not req.prompt_cached
                and req.state is not RequestState.FINISHED
            ):  # its prompt's last tokens were in this step  # fmt: skip
                self._cache_prompt(req)
            if item.job is not None:
                job = item.job
                job.chunk.ready = True
                job.chunk.ready_seq = plan.seq
                for x in (job.chunk, job.cond):
                    if x is not None:
                        self.chunks.release(x)

    def on_step_complete(self, plan: StepPlan) -> None:
        """The step's results came back: its device work (and every earlier step's) is done."""
        self.complete_seq = max(self.complete_seq, plan.seq)
        if self.peers is not None:
            self.peers.on_complete(self.complete_seq)

    def finish(self, req: Request, reason: str, keep_kv: bool = True) -> None:
        """Release everything the request holds. Plain prompts leave their full pages in the radix,
        unless keep_kv is False (a failed step may not have written the KV its tokens count)."""
        if req.state is RequestState.FINISHED:
            return
        if req.state is RequestState.WAITING:
            self.waiting.remove(req)
            self._unpin(req)
        else:
            self.running.remove(req)
            for c in req.chunks:
                self.chunks.release(c)
                if c.peer >= 0 and not c.ref_count and not c.fetching and c.heap_seq >= 0:
                    self.pool.free(self.chunks.remove(c))  # a peer's document: its owner keeps it
            self.pool.free(req.copied_pages)
            self.pool.free(req.recomputed_pages)
            own = req.own.pages if req.own else []
            if req.radix_node is not None and not keep_kv:
                self.radix.unlock(req.radix_node)
                given = set(req.radix_given)  # the radix's now: fail_running drops them
                self.pool.free([p for p in own if p not in given])
            elif req.radix_node is not None:
                # KV exists for the prompt and every output token but the last (never fed back).
                tokens = (req.prompt_ids + req.output_ids)[: req.own.start_pos + req.own.num_tokens]
                full = len(tokens) // self.page_size
                n_radix = len(req.radix_pages)
                dup = self.radix.insert(
                    tokens[: full * self.page_size], req.radix_pages + own[: full - n_radix]
                )
                self.radix.unlock(req.radix_node)
                self.pool.free(dup + own[max(full - n_radix, 0) :])
            else:
                self.pool.free(own)
        req.chunks, req.copied_pages, req.own, req.segments = [], [], None, []
        req.radix_given = []
        req.recomputed_pages, req.pending_recompute, req.copies = [], [], []
        req.probe_docs, req.recompute_reserve, req.probe_scores = None, [], []
        req.finish_reason = reason
        req.state = RequestState.FINISHED

    def fail_running(self, plans: list[StepPlan]) -> list[Request]:
        """A step failed: `plans` are the steps whose KV can no longer be trusted (the failed one and,
        with overlap, the one in flight with it). Finishes every running request without caching
        its KV (its state went with the step), and drops the chunks those steps computed (marked
        ready at a deferred submit, or still held by their job) and every pending chunk job, so no
        later request reads their KV. Waiting requests hold nothing yet: they stay queued."""
        failed = list(self.running)
        given = {p for req in failed for p in req.radix_given}
        for req in failed:
            self.finish(req, "error", keep_kv=False)
        # prompts they put in the radix after their prefill: a failed request's KV is not kept (the
        # step in flight with the failed one may have been that prefill); no lock is left on them now.
        # Also any radix page those steps wrote: a request that ended (EOS, stop, abort) while the
        # step in flight still wrote its last fed token's slot has put that page in the radix.
        written = {p for plan in plans for it in plan.items for p in _written_pages(it, self.page_size)}
        self.pool.free(self.radix.drop(given | written))
        jobs = {id(j): j for j in self.jobs + [it.job for p in plans for it in p.items if it.job]}
        self.jobs = []
        for job in jobs.values():
            if not job.chunk.ready:  # on_step_done has not released the job's refs
                for x in (job.chunk, job.cond):
                    if x is not None:
                        self.chunks.release(x)
            job.chunk.ready = False
        # Host tier copies those steps (or the next one, not yet sent: its offloads may read pages
        # those steps wrote) were to make may not have happened: each chunk keeps only the copy it
        # had before them, or leaves the table. A waiting request's host-tier pins (retrieval
        # attention) may be on such a chunk (added while the step that offloaded it was in flight):
        # they let go first and pin again what is still in the host tier.
        for req in self.waiting:
            self._unpin(req)
        offloads, loads = self.chunks.take_transfers()
        offloads += [t for p in plans for t in p.offloads]
        loads += [t for p in plans for t in p.loads]
        self.pool.free(self.chunks.drop_unfinished(offloads, loads))
        for c in [c for c in self.chunks if not c.ready and c.pages and c.ref_count == 0 and not c.fetching]:
            self.pool.free(self.chunks.remove(c))
        for req in self.waiting:
            self._pin_host_docs(req)
        if self.peers is not None:
            self.peers.on_failed()
        return failed

    def flush(self) -> int:
        """Drop every cached page no running request holds; returns how many pages were freed."""
        freed = self.radix.reset() if not self.running else self.radix.evict(self.radix.num_pages)
        freed += self.chunks.clear_unreferenced()
        self.pool.free(freed)
        return len(freed)

    def held_pages(self) -> int:
        """Pages owned by running requests (own + block copies + recomputed pages), for leak checks."""
        return sum(
            len(r.own.pages) - len(r.radix_given) + len(r.copied_pages) + len(r.recomputed_pages)
            for r in self.running
            if r.own
        )


def _written_pages(item: ForwardItem, page_size: int) -> list[int]:
    """The pages a step item writes its tokens' KV into (its target's slots for its tokens)."""
    first = item.start_pos - item.target.start_pos
    last = first + len(item.token_ids) - 1
    return item.target.pages[first // page_size : last // page_size + 1] if item.token_ids else []
