"""Engine: the in-process API. Tokenizes, validates, runs the scheduler/model loop, detokenizes."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from lazyrt.config import EngineConfig
from lazyrt.constraint import ConstraintFailed
from lazyrt.documents import DocumentStore, list_json, open_store
from lazyrt.prompt import RagPrompt
from lazyrt.runtime.scheduler.engine_core import EngineCore
from lazyrt.runtime.scheduler.request import Request, RequestState
from lazyrt.runtime.scheduler.scheduler import Scheduler
from lazyrt.runtime.tokenizer.detokenizer import IncrementalDetokenizer
from lazyrt.runtime.tokenizer.doc_refs import register, resolve_doc, resolve_docs
from lazyrt.runtime.tokenizer.doc_token_cache import DocTokenCache
from lazyrt.runtime.tokenizer.rag_template import build_rag_prompt
from lazyrt.runtime.tokenizer.token_text import TokenTexts
from lazyrt.runtime.worker.cpu_threads import set_worker_cpu_threads
from lazyrt.runtime.worker.model_worker import ModelWorker
from lazyrt.runtime.worker.tp_follower import FollowerRanks
from lazyrt.sampling_params import SamplingParams, out_of_vocab

PromptLike = str | Sequence[int] | RagPrompt


class Engine:
    """Offline engine. `Engine()` serves the embedded SmolLM2-135M-Instruct on the best device."""

    def __init__(
        self,
        model: str | None = None,
        device: str = "auto",
        dtype: str = "auto",
        page_size: int = 16,
        cache_mode: str = "lazy",
        **kwargs: Any,
    ):
        cfg = EngineConfig(
            model=model, device=device, dtype=dtype, page_size=page_size, cache_mode=cache_mode, **kwargs
        )
        cfg.validate()
        if cfg.kv_peers:
            raise ValueError("kv_peers: a server option (replicas exchange KV through their scheduler "
                             "processes); the offline Engine has no peers")  # fmt: skip
        self.config = cfg
        # The offline Engine runs the server's step code in one process: the same ModelWorker and
        # EngineCore (plan -> StepMsg -> worker -> StepResult), called directly instead of over ZMQ,
        # so unit tests can reach the scheduler, pool and runner. Here the scheduler shares the
        # worker's PagePool; the server's scheduler process keeps a tensor-free copy of the allocator.
        # Tensor parallelism: this process runs rank 0; ranks 1..N-1 are processes of their own.
        self._tp_ranks = FollowerRanks(cfg) if cfg.tensor_parallel_size > 1 else None
        try:
            ranks = self._tp_ranks
            set_worker_cpu_threads(cfg, in_process=True)  # only an explicit worker_cpu_threads
            self.worker = ModelWorker(cfg, *((ranks.member0, ranks.check_alive) if ranks else ()))
            own = self.worker.model_config.max_context
            if cfg.max_model_len is not None and cfg.max_model_len > own:  # as the server refuses it
                raise ValueError(f"max_model_len={cfg.max_model_len}: the model's context length is {own}; "
                                 "pass at most that, or None for the model's own")  # fmt: skip
        except BaseException:
            self.close()
            raise
        self.tokenizer = self.worker.tokenizer
        self.model_id = self.worker.model_id
        self.model_config = self.worker.model_config
        self.model = self.worker.model
        self.max_context = self.worker.max_context
        self.pool = self.worker.pool
        self.runner = self.worker.runner
        self.eos_ids = self.worker.eos_ids
        info = self.worker.ready_info()
        self.scheduler = Scheduler.from_config(
            self.pool, cfg, self.model_id, info.host_pages, info.page_bytes
        )
        self.core = EngineCore(self.scheduler, self.worker, self.eos_ids, overlap=cfg.overlap_schedule)
        self._rids = itertools.count()
        # a popular document's text is tokenized once (as in the server's tokenizer process)
        self._doc_tokens = DocTokenCache(
            lambda text: self._tokens(text, "document", False),
            tokenize_batch=lambda texts: self.tokenizer(texts, add_special_tokens=False).input_ids,
        )
        self.token_texts = TokenTexts(self.tokenizer)
        # registered documents, used by id (EngineConfig.document_store; None when "none")
        self.documents: DocumentStore | None = open_store(cfg.document_store, self.model_id)

    # ---- tokenization and validation ----------------------------------------------------------
    def _doc_ids(self, doc: Any, i: int) -> list[int]:
        if isinstance(doc, dict):  # {"id"}: the stored ids (text + separator); {"text": t}: as t
            doc = resolve_doc(doc, self.documents, f"RagPrompt.docs[{i}]")
            if isinstance(doc, list):
                return doc
        if isinstance(doc, str):
            return self._doc_tokens.get(doc)
        return self._tokens(doc, f"RagPrompt.docs[{i}]", False)

    def _tokens(self, part: Any, what: str, special: bool) -> list[int]:
        if isinstance(part, str):
            return self.tokenizer(part, add_special_tokens=special).input_ids
        # (C-level passes over the ids: 0.51 ms for 10,240 ids on the CPU box, 0.86 with a generator)
        if isinstance(part, (list, tuple)) and (
            set(map(type, part)) <= {int}
            or all(isinstance(t, int) and not isinstance(t, bool) for t in part)  # int subclasses
        ):
            vocab = self.model_config.vocab_size
            if part and (min(part) < 0 or max(part) >= vocab):
                bad = next(t for t in part if not 0 <= t < vocab)
                raise ValueError(f"{what}: token id {bad} is outside the vocabulary [0, {vocab})")
            return list(part)
        raise TypeError(f"{what} must be a string or a list of token ids, got {type(part).__name__}")

    def _make_request(self, prompt: PromptLike, params: SamplingParams) -> Request:
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        params.validate()
        bad = out_of_vocab(params, self.model_config.vocab_size)
        if bad:
            raise ValueError(bad)
        if isinstance(prompt, RagPrompt):
            if not isinstance(prompt.docs, (list, tuple)):
                raise TypeError("RagPrompt.docs must be a list")
            prefix = self._tokens(prompt.prefix, "RagPrompt.prefix", False)
            docs = [self._doc_ids(d, i) for i, d in enumerate(prompt.docs)]
            for i, d in enumerate(docs):
                if not d:
                    raise ValueError(f"RagPrompt.docs[{i}] is empty")
            suffix = self._tokens(prompt.suffix, "RagPrompt.suffix", False)
            if not suffix:
                raise ValueError(
                    "RagPrompt.suffix is empty: there must be at least one token after the documents"
                )
            req = Request(next(self._rids), params, prefix=prefix, docs=docs, suffix=suffix)
        else:
            tokens = self._tokens(prompt, "prompt", True)
            if not tokens:
                raise ValueError("prompt is empty")
            req = Request(next(self._rids), params, suffix=tokens)
        n = req.prompt_len
        if n >= self.max_context:
            raise ValueError(
                f"prompt is {n} tokens but the model's context length is {self.max_context}; "
                "shorten the prompt or drop documents"
            )
        req.max_new_tokens = min(params.max_tokens, self.max_context - n)
        self.scheduler.check_fits(req)
        return req

    def rag_prompt(self, docs: Sequence[str | dict], question: str, system: str | None = None) -> RagPrompt:
        """The RagPrompt `rag()` runs: the model's chat template with docs before the question.
        Each doc is a text, {"text": ...} or {"id": ...} of a registered document (its stored ids)."""
        if not isinstance(question, str) or not question.strip():
            raise ValueError("question must be a non-empty string")
        if system is not None and not isinstance(system, str):
            raise TypeError(f"system must be a string or None, got {type(system).__name__}")
        return build_rag_prompt(self.tokenizer, self.resolve_documents(docs), question, system)

    def resolve_documents(self, docs: Sequence[str | dict], field: str = "docs") -> list[str | list[int]]:
        """Documents as rag() takes them -> texts and the token ids of those given by id (errors name
        `field[i]`: an unknown id raises lazyrt.documents.UnknownDocument, a LookupError)."""
        if isinstance(docs, str) or not isinstance(docs, Sequence):
            raise TypeError(f"{field} must be a list of documents, got {type(docs).__name__}")
        for i, d in enumerate(docs):
            if not isinstance(d, (str, dict)):
                raise TypeError(
                    f"{field}[{i}] must be a string or {{'id'|'text': str}}, got {type(d).__name__}"
                )
            if isinstance(d, str) and not d.strip():
                raise ValueError(f"{field}[{i}] is empty")
        return resolve_docs(list(docs), self.documents, field)

    # ---- generation ---------------------------------------------------------------------------
    def generate(
        self,
        prompts: PromptLike | Sequence[PromptLike],
        sampling_params: SamplingParams | dict | Sequence[SamplingParams | dict] | None = None,
        *,
        return_errors: bool = False,
    ) -> list[dict]:
        """Generate for each prompt (str, token ids or RagPrompt); returns dicts text/token_ids/meta.
        sampling_params: one for all prompts or one per prompt, SamplingParams or a dict of its fields.
        A request that fails while decoding (ConstraintFailed: its structured-output matcher broke
        down) raises for the whole call, or with return_errors=True gives its prompt the entry
        {"error": {"message", "type"}} while the other prompts run to completion. Bad input raises
        either way, before anything runs."""
        single = isinstance(prompts, (str, RagPrompt)) or (
            isinstance(prompts, Sequence) and bool(prompts) and isinstance(prompts[0], int)
        )
        prompts = [prompts] if single else list(prompts)
        if sampling_params is None or isinstance(sampling_params, (SamplingParams, dict)):
            params = [_sampling(sampling_params, "sampling_params")] * len(prompts)
        elif isinstance(sampling_params, Sequence) and not isinstance(sampling_params, str):
            params = [_sampling(sp, f"sampling_params[{i}]") for i, sp in enumerate(sampling_params)]
            if len(params) != len(prompts):
                raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling_params")
        else:
            raise TypeError("sampling_params must be SamplingParams, a dict of its fields or a list of them, "
                            f"got {type(sampling_params).__name__}")  # fmt: skip
        # the documents not cached yet, tokenized in one batch (on all cores)
        rag = [p for p in prompts if isinstance(p, RagPrompt) and isinstance(p.docs, (list, tuple))]
        self._doc_tokens.prefetch([d for p in rag for d in p.docs if isinstance(d, str)])
        # Validate everything before running anything: a bad prompt must not leave half a batch behind.
        # n > 1: n requests per prompt, run together (the documents' KV is computed once and shared).
        groups = [[self._make_request(p, one) for one in sp.expand_n()] for p, sp in zip(prompts, params)]
        results = iter(self._run([r for g in groups for r in g], return_errors))
        out = []
        for g in groups:
            first = next(results)
            rest = [next(results) for _ in g[1:]]
            failed = next((r for r in [first, *rest] if "error" in r), None)
            if failed is not None:  # (return_errors) one answer per prompt: a failed completion fails it
                out.append(failed)
                continue
            if len(g) > 1:  # every completion in `outputs`; the first one also at the top level
                first["outputs"] = [_completion(r) for r in [first, *rest]]
            out.append(first)
        return out

    def rag(
        self,
        docs: Sequence[str],
        question: str,
        system: str | None = None,
        sampling_params: SamplingParams | dict | None = None,
    ) -> dict:
        return self.generate([self.rag_prompt(docs, question, system)], sampling_params)[0]

    def score_request(self, prompt: PromptLike, continuation: str) -> Request:
        """A request whose prompt is `prompt` + `continuation` (tokenized on its own, appended after
        the prompt's last part) that reports each continuation token's logprob (Request.score_len)."""
        if not isinstance(continuation, str) or not continuation:
            raise ValueError("a continuation must be a non-empty string")
        cont = self._tokens(continuation, "continuation", False)
        if isinstance(prompt, RagPrompt):
            suffix = self._tokens(prompt.suffix, "RagPrompt.suffix", False)
            if not suffix:
                raise ValueError("RagPrompt.suffix is empty: the continuation needs a token before it")
            full: PromptLike = RagPrompt(prompt.prefix, list(prompt.docs), suffix + cont)
        else:
            full = self._tokens(prompt, "prompt", True) + cont
        req = self._make_request(full, SamplingParams(max_tokens=1))
        req.score_len = len(cont)
        return req

    def score(self, prompt: PromptLike, continuations: Sequence[str], normalize: bool = True) -> list[float]:
        """Log-probability of each continuation given the prompt (mean per token if normalize).

        Computed by the same model path as generation (one prefill of prompt + continuation, with
        the prompt's documents served from the chunk table), so it agrees with what gen would do.
        """
        if isinstance(continuations, str):
            raise TypeError("continuations must be a list of strings")
        reqs = [self.score_request(prompt, c) for c in continuations]
        self._run(reqs)
        out = []
        for r in reqs:
            lps = r.score_logprobs or []
            out.append(sum(lps) / len(lps) if normalize else sum(lps))
        return out

    def rag_batch(self, items: Sequence[dict]) -> list[dict]:
        """items: dicts with docs, question, optional system and sampling_params (dict or SamplingParams)."""
        prompts, params = [], []
        for i, it in enumerate(items):
            if not isinstance(it, dict) or "question" not in it:
                raise TypeError(f"rag_batch item {i} must be a dict with 'docs' and 'question'")
            prompts.append(self.rag_prompt(it.get("docs", []), it["question"], it.get("system")))
            params.append(_sampling(it.get("sampling_params"), f"rag_batch item {i}: sampling_params"))
        return self.generate(prompts, params)

    def _run(self, reqs: list[Request], return_errors: bool = False) -> list[dict]:
        core = self.core
        detoks = {r.rid: _detokenizer(self.tokenizer, r.params) for r in reqs}
        failed: dict[int, str] = {}  # return_errors: the requests the worker could not go on with
        try:
            for r in reqs:  # the scheduler may reject one (a mode it lacks): inside, so none stays queued
                core.add(r)
            while any(r.state is not RequestState.FINISHED for r in reqs):
                for out in core.step():
                    d = detoks[out.rid]
                    used = d.add(out.token_ids)
                    if out.logprobs is not None:
                        d.logprobs.extend(self.token_texts.logprobs(out.token_ids[:used], out.logprobs))
                    if d.stopped:  # the detokenizer saw a stop string: end the request now
                        core.abort(out.rid, "stop")
                if core.request_errors:  # the worker could not go on with these (already aborted)
                    errors, core.request_errors = core.request_errors, []
                    if not return_errors:
                        raise ConstraintFailed(errors[0][1])
                    failed.update(errors)  # the others go on
        except BaseException:
            for r in reqs:  # never leave pages held by requests nobody will finish
                core.abort(r.rid)
            raise
        return [
            _error(ConstraintFailed(failed[r.rid])) if r.rid in failed else self._result(r, detoks[r.rid])
            for r in reqs
        ]

    def _result(self, req: Request, detok: IncrementalDetokenizer) -> dict:
        out = {
            "text": detok.take(final=True),
            "token_ids": list(req.output_ids),
            "meta": {
                "prompt_tokens": req.prompt_len,
                "completion_tokens": len(req.output_ids),
                "cached_tokens": req.cached_tokens,
                "chunk_hits": req.chunk_hits,
                "chunk_misses": req.chunk_misses,
                "recomputed_tokens": req.recomputed_tokens,
                "ttft_s": (req.first_token_time or req.arrival) - req.arrival,
                "e2e_s": time.perf_counter() - req.arrival,
                "finish_reason": "stop" if detok.stopped else req.finish_reason,
            },
        }
        if req.params.citations:
            out["meta"]["citations"] = req.citations()
        if req.params.logprobs is not None:  # one entry per output token (token_ids)
            out["logprobs"] = detok.logprobs
        if req.host_chunks:  # retrieval attention: documents attended in the host tier
            out["meta"]["host_attended_chunks"] = req.host_chunks
        if req.chunk_rounds:  # its documents were computed in rounds while it waited
            out["meta"]["chunk_rounds"] = req.chunk_rounds
        return out

    # ---- documents by reference (lazyrt.documents) ---------------------------------------------
    def add_document(
        self,
        text: str,
        id: str | None = None,  # noqa: A002 (the API's field name)
        metadata: dict | None = None,
        precompute: bool = False,
        system: str | None = None,
    ) -> str:
        """Register a document; returns its id (content addressed unless `id` is given). Requests
        then pass {"id": ...} and use its stored token ids. precompute: run a 1-token rag() with the
        document alone (and `system`) so its chunk KV is in the chunk table before the first use."""
        if not isinstance(precompute, bool):
            raise TypeError(f"precompute must be a bool, got {type(precompute).__name__}")
        if system is not None and not precompute:
            raise ValueError("system only applies with precompute=True")
        # the tokenizer call the document token cache makes, but not the cache: without precompute
        # this touches no state of the step loop, so an EngineLoop thread may be running meanwhile
        tokenize = lambda t: self._tokens(t, "text", False)  # noqa: E731
        data, _ = register(self.documents, tokenize, text, id, metadata, self.max_context)
        if precompute:
            self.generate(self.precompute_prompt(data["id"], system), SamplingParams(max_tokens=1))
        return data["id"]

    def precompute_prompt(self, doc_id: str, system: str | None = None) -> RagPrompt:
        """What precompute runs: the document alone before an empty question (its chunk key is the
        same as in any rag() / chat request with this system prompt)."""
        if system is not None and not isinstance(system, str):
            raise TypeError(f"system must be a string or None, got {type(system).__name__}")
        docs = resolve_docs([{"id": doc_id}], self.documents, "documents")
        return build_rag_prompt(self.tokenizer, docs, "", system)

    def get_document(self, id: str, include_text: bool = False) -> dict:  # noqa: A002
        """{"id", "object": "document", "created", "tokens", "metadata"} (+ "text"), as GET
        /v1/documents/{id} answers; an unknown id raises UnknownDocument."""
        return self._store().get(id).to_json(include_text)

    def delete_document(self, id: str) -> None:  # noqa: A002
        """Forget a document (its chunk KV stays cached until evicted); unknown: UnknownDocument."""
        self._store().delete(id)

    def list_documents(self, limit: int = 20, after: str | None = None, include_text: bool = False) -> dict:
        """One page, in registration order: {"object": "list", "data", "first_id", "last_id", "has_more"}."""
        docs, more = self._store().list(limit, after)
        return list_json(docs, more, include_text)

    def _store(self) -> DocumentStore:
        if self.documents is None:
            raise ValueError("this Engine has no document store (document_store='none')")
        return self.documents

    # ---- cache management ---------------------------------------------------------------------
    def cache_stats(self) -> dict:
        return self.core.cache_stats(self.config.cache_mode)

    def flush_cache(self) -> int:
        return self.scheduler.flush()

    def engine_config(self) -> dict:
        return asdict(self.config)

    # ---- lifetime -----------------------------------------------------------------------------
    def close(self) -> None:
        """Stops the tensor-parallel ranks' processes (if any; also done when the Engine is
        collected or the interpreter exits). The Engine cannot generate afterwards."""
        if self._tp_ranks is not None:  # first: rank 0's communicator then closes with no peer waiting
            self._tp_ranks.stop()
        if hasattr(self, "worker"):
            self.worker.close()
        if hasattr(self, "core"):
            self.core.worker = _ClosedWorker()


    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _sampling(sp: SamplingParams | dict | None, what: str) -> SamplingParams:
    if sp is None or isinstance(sp, dict):
        return SamplingParams.from_dict(sp)
    if not isinstance(sp, SamplingParams):
        raise TypeError(f"{what} must be SamplingParams or a dict of its fields, got {type(sp).__name__}")
    return sp


def _detokenizer(tokenizer, params: SamplingParams) -> IncrementalDetokenizer:
    return IncrementalDetokenizer(tokenizer, params.stop, params.stop_token_ids)


def _error(e: BaseException) -> dict:
    """A prompt's entry when its request failed (generate's return_errors)."""
    return {"error": {"message": str(e), "type": type(e).__name__}}


def _completion(result: dict) -> dict:
    keep = ("text", "token_ids", "logprobs", "meta")  # meta: each completion's own (cached_tokens, ...)
    return {**{k: result[k] for k in keep if k in result}, "finish_reason": result["meta"]["finish_reason"]}


class _ClosedWorker:
    def execute(self, msg: object) -> None:
        raise RuntimeError("the Engine is closed")
