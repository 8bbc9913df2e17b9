"""LocalEngine: a program's backend on an in-process lazyrt.Engine.

Requests from many threads (run_batch) go through one EngineLoop thread, so they batch together.
"""

from __future__ import annotations

from lazyrt import Engine, SamplingParams
from lazyrt.runtime.engine.engine_loop import EngineLoop
from lazyrt.runtime.tokenizer.rag_template import build_program_prompt
from lazyrt_frontend.backends.base import ProgramPrompt, TextCallback


class LocalEngine:
    def __init__(self, engine: Engine | None = None, **engine_kwargs: object):
        self.engine = engine if engine is not None else Engine(**engine_kwargs)
        self.loop = EngineLoop(self.engine)

    def _rag_prompt(self, prompt: ProgramPrompt):
        # The server's tokenizer process calls the same functions: one chat-template path for both
        # (documents by id become their stored token ids, as there).
        docs = self.engine.resolve_documents(prompt.docs)
        return build_program_prompt(
            self.engine.tokenizer, prompt.messages, docs, prompt.doc_turn, continue_final=True
        )

    def generate(self, prompt: ProgramPrompt, sampling: dict, on_text: TextCallback | None = None) -> dict:
        out = self.loop.generate(
            self._rag_prompt(prompt), SamplingParams.from_dict(sampling), on_text
        ).result()
        return {"text": out["text"], "meta": out["meta"], "logprobs": out.get("logprobs")}

    def score(self, prompt: ProgramPrompt, continuations: list[str]) -> list[float]:
        futures = self.loop.score(self._rag_prompt(prompt), list(continuations))
        scores = []
        for f in futures:
            lps = f.result()["score_logprobs"]
            scores.append(sum(lps) / len(lps))
        return scores

    def rag(self, docs: list[str | dict], question: str, system: str | None, sampling: dict) -> dict:
        prompt = self.engine.rag_prompt(docs, question, system)
        out = self.loop.generate(prompt, SamplingParams.from_dict(sampling)).result()
        return {"text": out["text"], "meta": out["meta"], "logprobs": out.get("logprobs")}

    def add_document(
        self,
        text: str,
        id: str | None = None,  # noqa: A002
        metadata: dict | None = None,
        precompute: bool = False,
    ) -> str:
        # precompute runs a generation: on the loop thread, which alone touches the engine's steps
        doc_id = self.engine.add_document(text, id, metadata)
        if precompute:
            self.loop.generate(self.engine.precompute_prompt(doc_id), SamplingParams(max_tokens=1)).result()
        return doc_id

    def cache_stats(self) -> dict:
        return self.engine.cache_stats()
