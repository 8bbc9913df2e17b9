"""ProgramState: a running program's conversation, docs and named results.

Parts apply eagerly: `s += gen("x")` calls the backend and returns when s["x"] is known. Messages
follow the chat template's roles; gen/select write into an open assistant turn (continued by the
next gen/select, closed by the next user/assistant/system part). Docs belong to the user turn that
follows them (all of a program's docs to one turn), placed before that turn's text like Engine.rag.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator

from lazyrt_frontend.backends.base import Backend, ProgramPrompt
from lazyrt_frontend.parts import Assistant, Doc, Gen, Part, Select, System, User

_END = object()


class ProgramError(RuntimeError):
    pass


class ProgramState:
    def __init__(self, backend: Backend, stream: bool = False):
        self.backend = backend
        self.messages: list[dict] = []
        self.docs: list[str | dict] = []  # texts, or {"id": ...} of registered documents
        self.doc_turn: int | None = None
        self.variables: dict[str, str] = {}
        self.metas: dict[str, dict] = {}  # gen name -> the backend's meta (tokens, chunk hits, ...)
        self.error: BaseException | None = None
        self._pending_docs: list[str | dict] = []
        self._open = False  # the last message is an assistant turn gen/select still write into
        self._stream: queue.Queue | None = queue.Queue() if stream else None
        self._done = threading.Event()

    # ---- building ---------------------------------------------------------------------------------
    def __iadd__(self, part: Part | str) -> ProgramState:
        if isinstance(part, str):  # bare text continues the open turn, or is a user turn
            part = Assistant(part) if self._open else User(part)
            if isinstance(part, Assistant):
                self._append_open(part.text)
                return self
        if isinstance(part, System):
            self._close()
            self.messages.append({"role": "system", "content": part.text})
        elif isinstance(part, Doc):
            if self.doc_turn is not None:
                raise ProgramError("all doc()s of a program must come before the same user() turn")
            self._pending_docs.append(part.ref())
        elif isinstance(part, User):
            self._close()
            self.messages.append({"role": "user", "content": part.text})
            if self._pending_docs:
                self.docs, self._pending_docs = self._pending_docs, []
                self.doc_turn = len(self.messages) - 1
        elif isinstance(part, Assistant):
            self._close()
            self.messages.append({"role": "assistant", "content": part.text})
        elif isinstance(part, Gen):
            self._gen(part)
        elif isinstance(part, Select):
            self._select(part)
        else:
            raise TypeError(f"cannot add {type(part).__name__} to a program state")
        return self

    def _close(self) -> None:
        self._open = False

    def _prompt(self) -> ProgramPrompt:
        if self._pending_docs:
            raise ProgramError("doc() must be followed by a user() turn before gen/select")
        if not self._open:
            self.messages.append({"role": "assistant", "content": ""})
            self._open = True
        return ProgramPrompt([dict(m) for m in self.messages], list(self.docs), self.doc_turn)

    def _append_open(self, text: str) -> None:
        self.messages[-1]["content"] += text
        if self._stream is not None and text:
            self._stream.put(text)

    def _gen(self, g: Gen) -> None:
        prompt = self._prompt()
        on_text = self._stream.put if self._stream is not None else None
        out = self.backend.generate(prompt, g.sampling, on_text)
        self.messages[-1]["content"] += out["text"]  # streamed pieces already went out via on_text
        self.variables[g.name] = out["text"]
        self.metas[g.name] = out.get("meta") or {}
        if out.get("logprobs") is not None:
            self.metas[g.name] = {**self.metas[g.name], "logprobs": out["logprobs"]}

    def _select(self, s: Select) -> None:
        scores = self.backend.score(self._prompt(), list(s.choices))
        best = max(range(len(scores)), key=lambda i: scores[i])  # first of equals
        self._append_open(s.choices[best])
        self.variables[s.name] = s.choices[best]
        self.metas[s.name] = {"scores": dict(zip(s.choices, scores))}

    # ---- reading ----------------------------------------------------------------------------------
    def __getitem__(self, name: str) -> str:
        self.wait()
        return self.variables[name]

    def __contains__(self, name: str) -> bool:
        return name in self.variables

    def wait(self) -> ProgramState:
        """Block until the program finished (streaming runs); re-raise its error if it failed."""
        self._done.wait()
        if self.error is not None:
            raise ProgramError(f"the program failed: {self.error}") from self.error
        return self

    def text_iter(self) -> Iterator[str]:
        """Generated text as it arrives (run(stream=True) only); ends when the program ends."""
        if self._stream is None:
            raise ProgramError("text_iter() needs run(..., stream=True)")
        while True:
            piece = self._stream.get()
            if piece is _END:
                break
            yield piece
        self.wait()

    def _finish(self, error: BaseException | None = None) -> None:
        self.error = error
        self._done.set()
        if self._stream is not None:
            self._stream.put(_END)

    def __repr__(self) -> str:
        return (
            f"ProgramState(messages={self.messages!r}, docs={len(self.docs)}, variables={self.variables!r})"
        )
