"""EngineLoop: one background thread runs an offline Engine's step loop, so many threads can submit
requests at once and they batch together (continuous batching), like the server's scheduler does.

Engine.generate runs a fixed list of prompts to completion; a frontend program or a batch job instead
produces requests one at a time from several threads. The Engine object is not thread-safe, so only
this thread touches it once the loop is running.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass

from lazyrt.constraint import ConstraintFailed
from lazyrt.runtime.engine.engine import Engine, PromptLike
from lazyrt.runtime.scheduler.engine_core import NoProgress
from lazyrt.runtime.scheduler.request import Request, RequestState
from lazyrt.runtime.tokenizer.detokenizer import IncrementalDetokenizer
from lazyrt.sampling_params import SamplingParams

TextCallback = Callable[[str], None]


@dataclass
class _Live:
    req: Request
    detok: IncrementalDetokenizer
    on_text: TextCallback | None
    future: Future


class EngineLoop:
    def __init__(self, engine: Engine):
        self.engine = engine
        self._inbox: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()

    def submit(self, make_request: Callable[[], Request], on_text: TextCallback | None = None) -> Future:
        """Queue a request (built on the loop thread by `make_request`, e.g. a bound
        Engine._make_request); the future gets the result dict Engine.generate would return, with
        `score_logprobs` added for scoring requests. on_text receives text pieces as they decode (if
        it raises, the request is aborted and its future gets that exception). `future.cancel()`
        aborts the request (queued, in prefill or decoding): its pages go back at the next step."""
        fut: Future = Future()
        self._inbox.put((make_request, on_text, fut))
        with self._start_lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="lazyrt-engine-loop", daemon=True)
                self._thread.start()
        return fut

    def generate(
        self, prompt: PromptLike, params: SamplingParams, on_text: TextCallback | None = None
    ) -> Future:
        """Like Engine.generate for one prompt, but returns at once; the future gets its result dict."""
        return self.submit(lambda: self.engine._make_request(prompt, params), on_text)

    def score(self, prompt: PromptLike, continuations: list[str]) -> list[Future]:
        """Like Engine.score; each future's result has `score_logprobs` (one per continuation token)."""
        return [self.submit(lambda c=c: self.engine.score_request(prompt, c)) for c in continuations]

    def _admit(self, live: dict[int, _Live], block: bool) -> None:
        while True:
            try:
                make, on_text, fut = self._inbox.get(block=block)
            except queue.Empty:
                return
            block = False
            if fut.cancelled():
                continue
            try:
                req = make()
                self.engine.core.add(req)
            except Exception as e:  # a bad request fails alone
                fut.set_exception(e)
                continue
            detok = IncrementalDetokenizer(self.engine.tokenizer, req.params.stop, req.params.stop_token_ids)
            live[req.rid] = _Live(req, detok, on_text, fut)

    def _run(self) -> None:
        core = self.engine.core
        live: dict[int, _Live] = {}
        while True:
            self._admit(live, block=not live)
            for rid in [rid for rid, lv in live.items() if lv.future.cancelled()]:
                del live[rid]  # cancelled by its caller: abort it, nobody takes its result
                core.abort(rid)
            if not live:
                continue
            try:
                outs = core.step()
            except Exception as e:  # fail what the step held; the loop keeps serving the rest
                # A failed step has aborted its running requests (core.failed_rids); waiting ones
                # stay queued. A step with nothing to run (NoProgress) fails the requests that
                # cannot go on (e.stuck); the rest are served by the next steps. Otherwise (none
                # told apart, or a failure that held no request) fail all: an error that would
                # repeat must not leave anyone waiting forever.
                if isinstance(e, NoProgress):  # each with its own reason
                    failed = {rid: NoProgress(why, [(rid, why)]) for rid, why in e.stuck if rid in live}
                else:
                    failed = {rid: e for rid in core.failed_rids}
                for rid in list(failed or live):
                    lv = live.pop(rid, None)
                    if lv is not None:
                        core.abort(rid)
                        _set_exception(lv.future, failed.get(rid, e))
                continue
            for out in outs:
                lv = live.get(out.rid)
                if lv is None:
                    continue
                used = lv.detok.add(out.token_ids)
                if out.logprobs is not None:
                    texts = self.engine.token_texts
                    lv.detok.logprobs.extend(texts.logprobs(out.token_ids[:used], out.logprobs))
                if lv.detok.stopped:
                    core.abort(out.rid, "stop")
                if lv.on_text is not None and lv.req.state is not RequestState.FINISHED:
                    piece = lv.detok.take()
                    if piece and not _call(lv.on_text, piece, lv.future):
                        del live[out.rid]  # its callback raised: it fails alone
                        core.abort(out.rid)
            errors, core.request_errors = core.request_errors, []
            for rid, why in errors:  # the worker could not go on with these (already aborted)
                lv = live.pop(rid, None)
                if lv is not None:
                    _set_exception(lv.future, ConstraintFailed(why))
            for rid in [r for r, lv in live.items() if lv.req.state is RequestState.FINISHED]:
                lv = live.pop(rid)
                result = self.engine._result(lv.req, lv.detok)
                if lv.on_text is not None and result["text"]:
                    if not _call(lv.on_text, result["text"], lv.future):  # the rest that was held back
                        continue
                result["text"] = lv.detok.text
                if lv.req.score_logprobs is not None:
                    result["score_logprobs"] = list(lv.req.score_logprobs)
                if not lv.future.cancelled():
                    try:
                        lv.future.set_result(result)
                    except InvalidStateError:  # cancelled meanwhile (by another thread)
                        pass


def _set_exception(fut: Future, e: BaseException) -> None:
    """Fails the future unless its caller cancelled it (a cancelled future takes no result)."""
    try:
        fut.set_exception(e)
    except InvalidStateError:
        pass


def _call(on_text: TextCallback, text: str, fut: Future) -> bool:
    """Gives on_text a piece; if it raises, fails the future with that exception and returns False."""
    try:
        on_text(text)
    except Exception as e:
        _set_exception(fut, e)
        return False
    return True
