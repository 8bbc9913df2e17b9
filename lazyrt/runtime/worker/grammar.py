"""Structured output in the worker: one llguidance matcher per constrained request, its token mask
applied to the request's logits before sampling.

- The tokenizer's vocabulary for llguidance is built from the worker's HF tokenizer on the first
  constrained request (~0.3 s for a 49k vocabulary), once per worker.
- A grammar is compiled once per grammar text (a bounded cache of pristine matchers); each request
  gets a deep copy.
- The masks of all constrained rows of a step are filled in one call on llguidance's thread pool
  (GIL released) into one pinned int32 bitmask, copied to the device and applied there.
- Overlap schedule: the worker samples step t+1 before the host has seen step t's tokens. `advance`
  only keeps step t's sampled tokens (still on the device, a pinned copy on its way); `prepare` at
  step t+1 runs after the step's forward is launched and hands the matcher updates and the mask
  computation to a background thread, which waits for step t's tokens only. The worker samples
  step t+1 (`finish`: upload the bitmask, mask, sample) at the start of its next call, so the host
  plans step t+2 while the masks are computed and the device runs step t+1's forward: the masks
  cost the step nothing while they take less than the forward and the scheduler's own work.
  Constrained rows keep overlapping; nothing is disabled.
- A matcher that has finished (it consumed EOS) or failed allows only EOS: a request the scheduler
  still runs for a step in flight, or one whose grammar cannot go on, ends.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import llguidance.hf
import numpy as np
import torch
from llguidance import LLMatcher

from lazyrt.constraint import grammar_text
from lazyrt.kernels.host_copy import to_device
from lazyrt.sampling_params import SamplingParams

COMPILED_CACHE_SIZE = 256
logger = logging.getLogger("lazyrt.worker")


class GrammarConstraints:
    def __init__(self, tokenizer: object, vocab_size: int, eos_ids: set[int], device: torch.device | str):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_ids = sorted(eos_ids)
        self.device = torch.device(device)
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._executor: llguidance.LLExecutor | None = None
        self._compiled: OrderedDict[str, LLMatcher] = OrderedDict()
        self._matchers: dict[int, LLMatcher] = {}
        self._failed: set[int] = set()  # requests whose matcher failed (logged once each)
        self._new_failed: dict[int, str] = {}  # of those, the ones not reported yet: rid -> why
        self._lock = threading.Lock()  # (the mask job fills _new_failed on its thread)
        # step t's sampled tokens not yet fed to the matchers: (rid -> row, tokens on the device)
        self._pending: tuple[dict[int, int], torch.Tensor] | None = None
        self._bitmask: torch.Tensor | None = None  # host [rows, words] int32, grown on demand
        self._bits = torch.arange(32, dtype=torch.int32, device=self.device)
        self._copied: torch.cuda.Event | None = None  # the last bitmask upload (pinned: reuse waits)
        # the mask job of a prepared step: matchers and the bitmask are its alone until it is done
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="lazyrt-grammar")
        self._job: Future | None = None
        # where the time goes (benchmarks/structured_output.py): seconds summed over the jobs
        self.timings = {"jobs": 0, "feed_s": 0.0, "mask_s": 0.0, "finish_wait_s": 0.0}

    def __len__(self) -> int:
        self._wait_job()
        return len(self._matchers)

    def release(self, rid: int) -> None:
        self._wait_job()
        self._matchers.pop(rid, None)
        self._failed.discard(rid)

    def take_failed(self) -> dict[int, str]:
        """The requests whose matcher failed since the last call (rid -> llguidance's error): their
        rows were given EOS only, so the scheduler must fail them, not finish them as complete."""
        with self._lock:
            failed, self._new_failed = self._new_failed, {}
        return failed

    def drop_pending(self) -> None:
        """Forget sampled tokens not fed yet and a prepared step's masks (their step failed; its
        requests are aborted)."""
        self._wait_job(raise_error=False)
        self._pending = None

    def _wait_job(self, raise_error: bool = True) -> None:
        job, self._job = self._job, None
        if job is not None:
            try:
                job.result()
            except Exception:
                if raise_error:
                    raise

    def _tokenizer_info(self) -> llguidance.LLTokenizer:
        if self._ll_tokenizer is None:
            # the model's EOS ids the tokenizer knows (a dummy preset beside a carried tokenizer has
            # ids past it; llguidance refuses those, and the model never ends on them through text)
            known = [e for e in self.eos_ids if e < len(self.tokenizer)] or self.eos_ids
            try:
                self._ll_tokenizer = llguidance.hf.from_tokenizer(
                    self.tokenizer, n_vocab=self.vocab_size, eos_token=known
                )
            except ValueError as e:
                raise ValueError(f"structured output needs a fast (tokenizers) HF tokenizer: {e}") from e
            # half the cores: the other half keep torch's own threads (CPU logits) from starving
            self._executor = llguidance.LLExecutor(max(1, min(16, (os.cpu_count() or 2) // 2)))
        return self._ll_tokenizer

    def _matcher(self, rid: int, params: SamplingParams) -> LLMatcher:
        m = self._matchers.get(rid)
        if m is not None:
            return m
        kind, value = params.constraint
        text = grammar_text(kind, value)
        base = self._compiled.get(text)
        if base is None:
            base = LLMatcher(self._tokenizer_info(), text, log_level=0)
            if base.is_error():
                raise ValueError(f"SamplingParams.{kind}: {base.get_error()}")
            self._compiled[text] = base
            if len(self._compiled) > COMPILED_CACHE_SIZE:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(text)
        m = self._matchers[rid] = base.deep_copy()
        return m

    def _feed_pending(self) -> None:
        if self._pending is None:
            return
        rows, tokens, ready = self._pending
        self._pending = None
        if ready is not None:
            ready.synchronize()  # the step that sampled them only (the GIL is released meanwhile)
        sampled = tokens.tolist()
        for rid, i in rows.items():
            m = self._matchers.get(rid)
            if m is not None and not m.is_stopped() and not m.is_error():
                m.consume_token(sampled[i])  # a token outside the grammar leaves m in error: EOS next

    def apply(self, logits: torch.Tensor, rids: list[int], params: list[SamplingParams]) -> torch.Tensor:
        """logits [n, vocab] (rows: rids / params); each constrained row's tokens outside its grammar
        set to -inf. Returns logits itself when no row is constrained, else a new tensor."""
        return self.finish(logits, self.prepare(rids, params, logits.shape[-1]))

    def prepare(self, rids: list[int], params: list[SamplingParams], width: int) -> Future | None:
        """Starts computing the masks of a step's constrained rows (rows: rids / params, logits of
        `width` tokens) on the background thread; None when no row is constrained. Every other call
        waits for it; `finish` applies it."""
        rows = [i for i, p in enumerate(params) if p.constraint is not None]
        if not rows:
            return None
        self._wait_job()
        self._job = self._thread.submit(self._fill, rids, params, rows, width)
        return self._job

    def finish(self, logits: torch.Tensor, prepared: Future | None) -> torch.Tensor:
        """logits with the prepared step's masks applied (logits itself when nothing was prepared)."""
        if prepared is None:
            return logits
        t0 = time.perf_counter()
        self._wait_job()  # the job's error (a grammar that does not compile) is raised here
        self.timings["finish_wait_s"] += time.perf_counter() - t0
        rows, mask = prepared.result()
        return self._masked(logits, rows, mask)

    def _fill(self, rids: list[int], params: list[SamplingParams], rows: list[int], width: int) -> tuple:
        """The background job: feed the last step's tokens, then fill one bitmask row per row."""
        t0 = time.perf_counter()
        self._feed_pending()
        t1 = time.perf_counter()
        matchers = [self._matcher(rids[i], params[i]) for i in rows]
        words = (width + 31) // 32
        if self._bitmask is None or self._bitmask.shape[0] < len(rows) or self._bitmask.shape[1] != words:
            pin = self.device.type == "cuda"
            self._bitmask = torch.empty((max(len(rows), 16), words), dtype=torch.int32, pin_memory=pin)
        if self._copied is not None:
            self._copied.synchronize()
        mask = self._bitmask[: len(rows)]
        live = [(m, j) for j, m in enumerate(matchers) if not m.is_error()]
        if len(live) == 1:  # no thread hop for one row
            m, j = live[0]
            m.unsafe_compute_mask_ptr(mask[j].data_ptr(), words * 4)
        elif live:
            self._executor.unsafe_compute_mask_ptr(live, mask.data_ptr(), words * 4, len(rows))
        for j, m in enumerate(matchers):
            if m.is_error():  # nothing valid can follow: end the request
                rid = rids[rows[j]]
                if rid not in self._failed:  # (a parser limit: the output so far may not match)
                    self._failed.add(rid)
                    why = m.get_error()
                    logger.warning("request %d: structured-output matcher failed, ending it: %s", rid, why)
                    with self._lock:
                        self._new_failed[rid] = why
                mask[j].zero_()
                for e in self.eos_ids:
                    mask[j, e // 32] |= 1 << (e % 32)
        t = self.timings
        t["jobs"] += 1
        t["feed_s"] += t1 - t0
        t["mask_s"] += time.perf_counter() - t1
        return rows, mask

    def _masked(self, logits: torch.Tensor, rows: list[int], mask: torch.Tensor) -> torch.Tensor:
        """logits with the tokens whose bit is 0 in mask[j] set to -inf in row rows[j]."""
        n, v = len(rows), logits.shape[-1]
        dev = logits.device
        if dev.type == "cpu":  # one pass of numpy over the bytes (int32 words are little-endian)
            bits = np.unpackbits(mask.numpy().view(np.uint8), axis=1, count=v, bitorder="little")
            allowed = torch.from_numpy(bits.view(np.bool_))
        else:  # upload the 32x smaller bitmask and unpack it on the device
            words = mask.to(dev, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()
            allowed = ((words[:, :, None] >> self._bits.to(dev)) & 1).view(n, -1)[:, :v].bool()
        # nothing here may wait for the device (a Python scalar, a pinned index upload): a blocking
        # copy would hold the host until the step's forward ends, and the overlap is lost
        ninf = float("-inf")
        if n == logits.shape[0]:
            return torch.where(allowed, logits, ninf)
        idx = to_device(rows, dev, torch.long)
        out = logits.clone()
        out[idx] = torch.where(allowed, logits[idx], ninf)
        return out

    def advance(self, rids: list[int], params: list[SamplingParams], tokens: torch.Tensor) -> None:
        """Keep the tokens just sampled (tokens[i] for rids[i], on the device) for the constrained
        rows; the matchers take them at the next apply (or flush)."""
        rows = {rids[i]: i for i, p in enumerate(params) if p.constraint is not None}
        if not rows:
            return
        self._wait_job()
        self._feed_pending()  # an older step's tokens (no constrained row ran since): long done
        ready = None
        if tokens.is_cuda:  # a pinned copy in stream order: the job waits on its event, not the GIL
            host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            host.copy_(tokens, non_blocking=True)
            tokens, ready = host, torch.cuda.Event()
            ready.record()
        self._pending = (rows, tokens, ready)

    def flush(self) -> None:
        """Feed the kept tokens now (tests; a synchronous caller that wants the matchers current)."""
        self._wait_job()
        self._feed_pending()

    def finished(self, rid: int) -> bool:
        """Whether rid's matcher has consumed a complete output (tests and diagnostics)."""
        self._wait_job()
        m = self._matchers.get(rid)
        return m is not None and m.is_stopped()
