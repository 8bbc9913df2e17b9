"""Where batch jobs run: an in-process Engine (chunks through Engine.generate, so each chunk is one
continuously batched run) or a running server (concurrent POST /generate). Both yield results in
input order, each as soon as it and everything before it is done."""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor

from lazyrt.batch_input import Job
from lazyrt.runtime.tokenizer.rag_template import build_program_prompt

Result = dict  # {"text", "meta"} or {"error": {"message"}}


def chat_only(job: Job) -> bool:
    """A question without docs or system. /generate would take its `text` as a raw completion, so
    both runners send it as one chat turn (the program form, tokenized alike by Engine and server)."""
    return job.prompt is None and not job.docs and job.system is None


def chat_turn(question: str) -> list[dict]:
    return [{"role": "user", "content": question}, {"role": "assistant", "content": ""}]


def _result(out: dict) -> Result:
    """What a job's output line keeps: the text and meta, plus every completion (n > 1) and the
    tokens' logprobs when the job's sampling_params asked for them."""
    extra = {k: out[k] for k in ("outputs", "logprobs") if k in out}
    return {"text": out["text"], "meta": out["meta"], **extra}


def _error(e: BaseException) -> Result:
    return {"error": {"message": str(e) or type(e).__name__, "type": type(e).__name__}}


class LocalRunner:
    def __init__(self, engine, chunk_size: int):
        self.engine = engine
        self.chunk_size = max(1, chunk_size)

    def _prompt(self, job: Job):
        if job.prompt is not None:
            return job.prompt
        if chat_only(job):
            return build_program_prompt(self.engine.tokenizer, chat_turn(job.question), [], None, True)
        return self.engine.rag_prompt(job.docs, job.question, job.system)

    def _run_chunk(self, jobs: list[Job]) -> list[Result]:
        results: list[Result | None] = [None] * len(jobs)
        prompts, params, where = [], [], []
        for i, job in enumerate(jobs):
            try:
                prompts.append(self._prompt(job))
            except (ValueError, TypeError) as e:
                results[i] = _error(e)
                continue
            params.append(job.sampling)
            where.append(i)
        if prompts:
            try:
                # a request whose constraint fails while decoding gets its error entry, the rest run on
                outs = self.engine.generate(prompts, params, return_errors=True)
            except (ValueError, TypeError):  # one bad prompt rejects the chunk: run one by one
                outs = []
                for p, sp in zip(prompts, params):
                    try:
                        outs.append(self.engine.generate([p], sp, return_errors=True)[0])
                    except (ValueError, TypeError) as e:
                        outs.append(_error(e))
            for i, out in zip(where, outs):
                results[i] = out if "error" in out else _result(out)
        return results  # type: ignore[return-value]

    def run(self, jobs: Iterable[Job]) -> Iterator[tuple[Job, Result]]:
        chunk: list[Job] = []
        for job in jobs:
            chunk.append(job)
            if len(chunk) == self.chunk_size:
                yield from zip(chunk, self._run_chunk(chunk))
                chunk = []
        if chunk:
            yield from zip(chunk, self._run_chunk(chunk))


class EndpointRunner:
    def __init__(self, url: str, concurrency: int, api_key: str | None = None, timeout: float = 600.0):
        import httpx

        self.url = url.rstrip("/")
        self.concurrency = max(1, concurrency)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(base_url=self.url, headers=headers, timeout=timeout)

    def check(self) -> None:
        """Raise if the server cannot take work (then the job cannot run at all)."""
        r = self.client.get("/health")
        if r.status_code != 200:
            raise RuntimeError(f"{self.url}/health answered {r.status_code}: {r.text[:200]}")

    @staticmethod
    def body(job: Job) -> dict:
        """The job as a /generate body: every sampling field it has (not only the common ones: a
        line's n, logprobs, penalties or constraint were dropped in --endpoint mode)."""
        params = {k: v for k, v in dataclasses.asdict(job.sampling).items() if v is not None}
        if job.prompt is not None:
            return {"text": job.prompt, "sampling_params": params}
        if chat_only(job):
            return {"messages": chat_turn(job.question), "continue_final": True, "sampling_params": params}
        return {"text": job.question, "docs": job.docs, "system": job.system, "sampling_params": params}

    def _one(self, job: Job) -> Result:
        body = self.body(job)
        try:
            r = self.client.post("/generate", json=body)
        except Exception as e:  # transport errors fail this line (a re-run retries it); the job goes on
            return {"error": {"message": f"{type(e).__name__}: {e}", "type": "transport_error"}}
        if r.status_code != 200:
            try:
                msg = r.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                msg = r.text[:500]
            # the server failed or was overloaded: retried by a re-run; a 4xx is the line's answer
            kind = "server_error" if r.status_code >= 500 or r.status_code == 429 else "http_error"
            return {"error": {"message": f"HTTP {r.status_code}: {msg}", "type": kind}}
        out = r.json()
        return _result(out)

    def run(self, jobs: Iterable[Job]) -> Iterator[tuple[Job, Result]]:
        """Results in input order. Stopped early (closed, or an interrupt): the queued requests are
        cancelled, and those answered but not handed back yet are left in `received`."""
        self.received: list[tuple[Job, Result]] = []
        pool = ThreadPoolExecutor(self.concurrency)
        window: deque = deque()
        try:
            for job in jobs:  # keep ~2x concurrency in flight, hand results back in order
                window.append((job, pool.submit(self._one, job)))
                while len(window) > 2 * self.concurrency or (window and window[0][1].done()):
                    j, f = window.popleft()
                    yield j, f.result()
            while window:
                j, f = window.popleft()
                yield j, f.result()
        finally:
            pool.shutdown(wait=False, cancel_futures=True)  # (requests being sent still finish)
            self.received = [(j, f.result()) for j, f in window if f.done() and not f.cancelled()]
