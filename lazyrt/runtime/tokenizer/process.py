"""Tokenizer/detokenizer: turns requests into token ids on the way in and sampled tokens into text on
the way out (incremental, whole characters only, stop strings never emitted). TokenizerLoop runs in
a process of its own (run_tokenizer_process) or, with --tokenizer-in-http, inside the HTTP process
(server/pipeline_client.py), which saves a process hop each way: there on_http runs on a thread of
its own, on_scheduler on the event loop.

When it sees a stop string it finishes the request towards HTTP and sends an abort upstream so the
scheduler frees the pages; tokens the scheduler produced meanwhile are dropped here.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import zmq

from lazyrt.documents import DocumentStore, open_store
from lazyrt.runtime.ipc.messages import (
    AbortReq,
    ControlReq,
    ControlResp,
    DocumentReq,
    ErrorOut,
    GenerateReq,
    TextBatch,
    TextOut,
    TokenBatch,
    WorkerReady,
)
from lazyrt.runtime.ipc.sockets import PARENT_CHECK_MS, IpcPaths, child_setup, poll, recv, send, socket
from lazyrt.runtime.tokenizer.detokenizer import IncrementalDetokenizer
from lazyrt.runtime.tokenizer.document_ops import handle_document_req
from lazyrt.runtime.tokenizer.request_tokenizer import InvalidRequest, RequestTokenizer
from lazyrt.runtime.tokenizer.token_text import TokenTexts
from lazyrt.runtime.tokenizer.tool_calls import tool_format

logger = logging.getLogger("lazyrt.tokenizer")
MAX_DRAIN = 256  # messages the tokenizer takes off its inbox at once


def tokenizing_failed(rid: int, e: Exception) -> ErrorOut:
    """The answer to a request the tokenizer failed on (a bug, not a bad request): a 500."""
    return ErrorOut(rid, f"tokenization failed: {e}", None, 500, "server_error")


@dataclass
class _Live:
    detok: IncrementalDetokenizer
    meta: dict = field(default_factory=dict)
    # completions echo: the prompt's text and token ids, and whether its logprobs are asked
    echo: tuple[str, list[int], bool] | None = None


class TokenizerLoop:
    def __init__(
        self,
        tokenizer,
        ready: WorkerReady,
        to_sched: Callable[[object], None],
        to_http: Callable[[object], None],
        store: DocumentStore | None = None,
        encoder=None,
    ):
        """to_sched / to_http: where messages go (a socket's send, or the HTTP process's dispatch).
        encoder: the tokenizer on_http encodes with, where on_http runs on another thread than
        on_scheduler's decoding (a HF fast tokenizer used from two threads at once can fail with
        'Already borrowed'); default: `tokenizer`."""
        self.tokenizer = tokenizer
        encoder = tokenizer if encoder is None else encoder
        self.req_tokenizer = RequestTokenizer(encoder, ready.max_context, ready.vocab_size, store=store,
                                              placement_keys=ready.kv_export is not None)  # fmt: skip
        self.store = store
        self.to_sched, self.to_http = to_sched, to_http
        self.live: dict[int, _Live] = {}
        self.token_texts = TokenTexts(tokenizer)

    def quick(self, msg: object) -> bool:
        """Whether on_http(msg) is short work (an abort, a control, a request whose documents'
        ids are cached: RequestTokenizer.quick)."""
        if isinstance(msg, (AbortReq, ControlReq)):
            return True
        try:
            return isinstance(msg, GenerateReq) and self.req_tokenizer.quick(msg)
        except Exception:  # noqa: BLE001 (an odd request: on_http, on the thread, answers it)
            return False

    def on_http_many(self, msgs: list[object], handle: Callable[[object], None] | None = None) -> None:
        """on_http of each, in order, after the new documents of them all are tokenized in one batch
        (a fast tokenizer encodes a batch on several cores). handle: what runs on_http for one (the
        HTTP process's, which answers a tokenizer bug)."""
        handle = handle or self.on_http
        self.prefetch(msgs)
        for msg in msgs:
            handle(msg)

    def prefetch(self, msgs: list[object]) -> None:
        """Tokenize the new documents of the requests among msgs in one batch (on_http then finds
        them cached). A request this cannot read is left to on_http, which answers it."""
        try:  # (fewer than two new documents: nothing here, the request's own tokenize takes them)
            self.req_tokenizer.prefetch_docs([m for m in msgs if isinstance(m, GenerateReq)])
        except Exception:  # noqa: BLE001 (an odd request: its own on_http answers it)
            logger.debug("prefetch failed", exc_info=True)

    def on_http(self, msg: object) -> None:
        if isinstance(msg, GenerateReq):
            got = time.time()
            try:
                tok = self.req_tokenizer.tokenize(msg)
            except InvalidRequest as e:
                kind = "not_found_error" if e.status == 404 else "invalid_request_error"
                self.to_http(ErrorOut(msg.rid, str(e), e.param, e.status, kind))
                return
            except Exception as e:  # a tokenizer bug must fail one request, not the server
                logger.exception("tokenizing request %d failed", msg.rid)
                self.to_http(tokenizing_failed(msg.rid, e))
                return
            sp = msg.sampling
            detok = IncrementalDetokenizer(self.tokenizer, sp.stop, sp.stop_token_ids)
            live = self.live[msg.rid] = _Live(detok)
            if msg.echo:
                text = msg.text if msg.text is not None else self.req_tokenizer.tokenizer.decode(tok.suffix)
                live.echo = (text, list(tok.suffix), sp.logprobs is not None)
            tok.received_at, tok.tokenizing_at, tok.tokenized_at = msg.received_at, got, time.time()
            self.to_sched(tok)
        elif isinstance(msg, AbortReq):
            self.live.pop(msg.rid, None)
            self.to_sched(msg)
        elif isinstance(msg, ControlReq):
            self.to_sched(msg)
        elif isinstance(msg, DocumentReq):
            rt = self.req_tokenizer
            self.to_http(handle_document_req(msg, self.store, rt.doc_cache.get, rt.max_context))

    def on_scheduler(self, msg: object) -> None:
        if isinstance(msg, TokenBatch):
            outs = [o for o in (self._detokenize(t) for t in msg.outs) if o is not None]
            if outs:
                self.to_http(TextBatch(outs))
        elif isinstance(msg, ErrorOut):
            self.live.pop(msg.rid, None)
            self.to_http(msg)
        elif isinstance(msg, (ControlResp, WorkerReady)):
            self.to_http(msg)

    def _detokenize(self, out) -> TextOut | None:
        live = self.live.get(out.rid)
        if live is None:  # aborted, or already finished by a stop string
            return None
        if out.meta:
            live.meta.update(out.meta)
        d = live.detok
        used = d.add(out.token_ids)
        lps = self.token_texts.logprobs(out.token_ids[:used], out.logprobs)
        reason = out.finish_reason
        if d.stopped:
            if reason is None:
                self.to_sched(AbortReq(out.rid, "stop"))
            reason = "stop"
        final = reason is not None
        text = d.take(final=final)
        if not final:
            return TextOut(out.rid, text, used, logprobs=lps)
        self.live.pop(out.rid, None)  # (an abort on on_http's thread may have taken it meanwhile)
        meta = {**live.meta, "completion_tokens": len(d.ids), "finish_reason": reason}
        if live.echo is not None:
            meta["echo_text"] = live.echo[0]
            if live.echo[2]:  # (a one-token prompt has nothing scored: its entry alone)
                meta["prompt_logprobs"] = self._prompt_logprobs(live.echo[1], meta)
        return TextOut(out.rid, text, used, reason, meta, list(d.ids), lps)


    def _prompt_logprobs(self, ids: list[int], meta: dict) -> list[dict]:
        """Echo: one entry per prompt token (the first has no logprob: nothing precedes it)."""
        lps = meta.pop("continuation_logprobs", [])
        top_ids, top_lps = meta.pop("continuation_top_logprobs", None) or ([[]] * len(lps), [[]] * len(lps))
        first = {**self.token_texts.entry(ids[0], None), "top_logprobs": []}
        return [first, *self.token_texts.logprobs(ids[1:], [list(x) for x in zip(lps, top_ids, top_lps)])]


def open_tokenizer_loop(
    ready: WorkerReady,
    document_store: str | None,
    to_sched: Callable[[object], None],
    to_http: Callable[[object], None],
    separate_encoder: bool = False,
) -> TokenizerLoop:
    """The loop for the model the worker reported ready (it says where its tokenizer lives, so only
    the worker resolves and loads the model); sets ready.tool_format. document_store:
    EngineConfig.document_store (None = the model's default file, "none" = off). separate_encoder:
    a second tokenizer instance for on_http (TokenizerLoop's encoder), for a caller that runs on_http
    and on_scheduler on two threads. Raises SystemExit when the store cannot be opened (another
    model's file, say)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(ready.tokenizer_path)
    encoder = AutoTokenizer.from_pretrained(ready.tokenizer_path) if separate_encoder else None
    store = open_store(document_store, ready.model_id)
    if store is not None and os.path.exists(store.path):  # else created by the first registration
        try:
            logger.info("document store %s (%d documents)", store.path, len(store.open()))
        except (OSError, ValueError, sqlite3.Error) as e:
            logger.error("cannot open the document store: %s", e)
            raise SystemExit(1) from e
    ready.tool_format = tool_format(getattr(tokenizer, "chat_template", None))
    return TokenizerLoop(tokenizer, ready, to_sched, to_http, store, encoder)


def run_tokenizer_process(ipc: IpcPaths, log_level: str, document_store: str | None = None) -> None:
    """document_store: EngineConfig.document_store (None = the model's default file, "none" = off)."""
    watch = child_setup("tokenizer", log_level)
    ctx = zmq.Context()
    from_http = socket(ctx, zmq.PULL, ipc.tokenizer_in, bind=True)
    from_sched = socket(ctx, zmq.PULL, ipc.detok_in, bind=True)
    to_sched = socket(ctx, zmq.PUSH, ipc.scheduler_in, bind=False)
    to_http = socket(ctx, zmq.PUSH, ipc.http_in, bind=False)
    while not poll([from_sched], PARENT_CHECK_MS):
        watch.check()
    ready = recv(from_sched)
    loop = open_tokenizer_loop(ready, document_store, partial(send, to_sched), partial(send, to_http))
    send(to_http, ready)
    while True:
        ready_socks = poll([from_sched, from_http], PARENT_CHECK_MS)
        if not ready_socks:
            watch.check()
        # Outputs first: they free memory and unblock clients.
        if from_sched in ready_socks:
            loop.on_scheduler(recv(from_sched))
        if from_http in ready_socks:  # everything queued: their new documents tokenized together
            msgs = [recv(from_http)]
            while len(msgs) < MAX_DRAIN and poll([from_http], 0):
                msgs.append(recv(from_http))
            loop.on_http_many(msgs)
