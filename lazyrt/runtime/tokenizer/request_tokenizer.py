"""RequestTokenizer: GenerateReq (validated JSON shapes) -> TokenizedReq (token ids, limits checked).

Each document is tokenized on its own (its KV is reused at any position, so its tokens must not
depend on its neighbours); a document given by id brings its stored token ids. Errors name the
request field at fault.
"""

from __future__ import annotations

from lazyrt.cache.placement import doc_key
from lazyrt.documents import DocumentError, DocumentStore
from lazyrt.prompt import RagPrompt
from lazyrt.runtime.ipc.messages import GenerateReq, TokenizedReq
from lazyrt.runtime.tokenizer.doc_refs import resolve_docs
from lazyrt.runtime.tokenizer.doc_token_cache import DocTokenCache
from lazyrt.runtime.tokenizer.rag_template import (
    build_program_prompt,
    build_rag_chat_prompt,
    build_rag_prompt,
    doc_part,
    render_chat,
)
from lazyrt.sampling_params import out_of_vocab

# A request with no new document and at most this much other text tokenizes in well under a
# millisecond: the HTTP process does it on its event loop instead of handing it to its thread.
QUICK_TEXT_CHARS = 4096
PREFIX_CACHE_TOKENS = 1 << 18
PREFETCH_TEXTS = 64  # new documents a prefetch batch takes (the request it serves first waits for all)


class InvalidRequest(ValueError):
    def __init__(self, message: str, param: str | None, status: int = 400):
        super().__init__(message)
        self.param = param
        self.status = status


class RequestTokenizer:
    def __init__(
        self,
        tokenizer,
        max_context: int,
        vocab_size: int,
        doc_cache_tokens: int = 8_000_000,
        store: DocumentStore | None = None,
        placement_keys: bool = False,
    ):
        """placement_keys: give each document's placement key (peer KV replicas only: hashing five
        2,048-token documents' text costs ~0.14 ms a request)."""
        self.tokenizer = tokenizer
        self.placement_keys = placement_keys
        self.max_context = max_context
        self.vocab_size = vocab_size
        self.doc_cache = DocTokenCache(lambda text: self._ids(text, False), doc_cache_tokens, self._batch_ids)
        # the text before the documents (the system prompt and the turns before them) repeats from
        # request to request: its ids are kept too (doc_cache_tokens=0: no caching at all)
        prefix_tokens = PREFIX_CACHE_TOKENS if doc_cache_tokens else 0
        self.prefix_cache = DocTokenCache(lambda text: self._ids(text, False), prefix_tokens)
        self.store = store  # registered documents, for requests that name them by id

    def _ids(self, text: str, special: bool) -> list[int]:
        return self.tokenizer(text, add_special_tokens=special).input_ids

    def _batch_ids(self, texts: list[str]) -> list[list[int]]:
        return self.tokenizer(texts, add_special_tokens=False).input_ids

    def prefetch_docs(self, reqs: list[GenerateReq], max_texts: int = PREFETCH_TEXTS) -> int:
        """Tokenize the new documents of several queued requests in one batch (a fast tokenizer encodes
        it on all cores; one at a time, each ~6 ms a 2,048-token document on a CPU core, they queue up
        when many requests arrive at once). At most max_texts new texts; returns how many it took."""
        new: dict[str, None] = {}
        for req in reqs:
            for d in req.docs or []:
                if isinstance(d, str) and (text := doc_part(d)) not in self.doc_cache:
                    new[text] = None
            if len(new) >= max_texts:
                break
        return len(self.doc_cache.prefetch(list(new)[:max_texts]))

    def quick(self, req: GenerateReq) -> bool:
        """Whether tokenize(req) is short work: every document given as text whose ids are cached,
        and at most QUICK_TEXT_CHARS of other text (question, system, messages) to tokenize."""
        if req.tools:
            return False
        for d in req.docs or []:
            if not isinstance(d, str) or doc_part(d) not in self.doc_cache:
                return False  # a new document (tokenized here), or one of the store's (read from it)
        n = sum(len(x) for x in (req.text, req.system, req.continuation, req.input_ids) if x is not None)
        for m in req.messages or []:
            content = m.get("content") if isinstance(m, dict) else None
            n += len(content) if isinstance(content, str) else QUICK_TEXT_CHARS + 1  # parts: not counted here
        return n <= QUICK_TEXT_CHARS

    def tokenize(self, req: GenerateReq) -> TokenizedReq:
        bad = out_of_vocab(req.sampling, self.vocab_size)
        if bad:
            raise InvalidRequest(bad, bad.split(":")[0])
        doc_field = "docs" if req.text_mode in ("rag", "program") else "documents"  # /generate's or OpenAI's
        try:
            docs = resolve_docs(req.docs or [], self.store, doc_field)
        except DocumentError as e:
            raise InvalidRequest(str(e), e.param, e.status) from e
        prompt: RagPrompt | None = None
        plain: list[int] = []
        try:
            if req.text_mode == "program":
                prompt = build_program_prompt(
                    self.tokenizer, req.messages, docs, req.doc_turn, req.continue_final
                )
            elif req.messages is not None:
                if docs:
                    prompt = build_rag_chat_prompt(self.tokenizer, req.messages, docs, tools=req.tools)
                else:
                    templated = bool(getattr(self.tokenizer, "chat_template", None))
                    text = render_chat(self.tokenizer, req.messages, tools=req.tools)
                    plain = self._ids(text, not templated)
            elif req.text is not None and req.text_mode == "rag" and (docs or req.system is not None):
                prompt = build_rag_prompt(self.tokenizer, docs, req.text, req.system)
            elif docs:  # a raw completion with documents: they go first, then the prompt
                rest = req.text if req.text is not None else list(req.input_ids or [])
                prompt = RagPrompt("", [doc_part(d) for d in docs], rest)
            elif req.text is not None:
                plain = self._ids(req.text, True)
            else:
                plain = self._check_ids(list(req.input_ids or []), req.param)
        except ValueError as e:
            if isinstance(e, InvalidRequest):
                raise
            raise InvalidRequest(str(e), req.param) from e
        if prompt is not None:
            prefix = self.prefix_cache.get(prompt.prefix) if isinstance(prompt.prefix, str) else prompt.prefix
            # cached ids go on as arrays: they cross to the scheduler as bytes (ipc/messages.py)
            # the documents not cached are tokenized in one batch (in parallel by a fast tokenizer)
            cached = iter(self.doc_cache.get_arrays([d for d in prompt.docs if isinstance(d, str)]))
            doc_ids = [next(cached) if isinstance(d, str) else d for d in prompt.docs]
            if isinstance(prompt.suffix, str):
                suffix = self._ids(prompt.suffix, False)
            else:
                suffix = self._check_ids(list(prompt.suffix), req.param)
            if not suffix:
                raise InvalidRequest("there must be at least one token after the documents", req.param)
            out = TokenizedReq(req.rid, req.sampling, 0, prefix=prefix, docs=doc_ids, suffix=suffix)
            if self.placement_keys and req.docs and len(req.docs) == len(doc_ids):  # peer KV
                out.doc_keys = [doc_key(d) for d in req.docs]
                if req.doc_owners is not None and len(req.doc_owners) == len(doc_ids):
                    out.doc_owners = list(req.doc_owners)
        else:
            if not plain:
                raise InvalidRequest("the prompt is empty", req.param)
            out = TokenizedReq(req.rid, req.sampling, 0, suffix=plain)
        if req.echo and req.sampling.logprobs is not None:  # the prompt's own logprobs (all but the first)
            if out.docs:
                raise InvalidRequest("echo with logprobs needs a prompt without documents", "echo")
            out.score_len = len(out.suffix) - 1
        cont = []
        if req.continuation is not None:  # scoring: the continuation is tokenized on its own
            cont = self._ids(req.continuation, False)
            out.suffix = out.suffix + cont
            out.score_len = len(cont)
        n = len(out.prefix) + sum(len(d) for d in out.docs) + len(out.suffix)
        if cont and n >= self.max_context and n - len(cont) < self.max_context:  # the prompt alone fits
            raise InvalidRequest(
                f"the prompt and this continuation are {n} tokens but the model's context length is "
                f"{self.max_context}; shorten the continuation", req.continuation_param,
            )  # fmt: skip
        if n >= self.max_context:
            where = f"{req.param} and {doc_field}" if docs else req.param
            raise InvalidRequest(
                f"the prompt is {n} tokens but the model's context length is {self.max_context}; "
                f"shorten the {where}",
                req.param,
            )
        m = req.sampling.max_tokens
        if req.max_tokens_param is not None and n + m > self.max_context:
            raise InvalidRequest(
                f"{req.max_tokens_param}: the prompt is {n} tokens and {m} more were asked for, past the "
                f"model's context length of {self.max_context}; ask for at most {self.max_context - n}",
                req.max_tokens_param,
            )
        out.max_new_tokens = min(m, self.max_context - n)  # a default max_tokens: what the context leaves
        return out

    def _check_ids(self, ids: list[int], param: str) -> list[int]:
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequest(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})", param)
        return ids
