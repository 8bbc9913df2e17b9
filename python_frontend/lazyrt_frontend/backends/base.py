"""The backend interface: four calls, each taking a program's state as chat messages plus docs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

TextCallback = Callable[[str], None]


@dataclass
class ProgramPrompt:
    """What gen/select send: the conversation so far, its docs and the user turn they belong to.

    The last message is the assistant turn being written (continued, not closed). Both backends turn
    this into the same RagPrompt with lazyrt.runtime.tokenizer.rag_template.build_program_prompt, so each doc
    is a position-agnostic chunk conditioned only on the text before its user turn.
    """

    messages: list[dict]
    docs: list[str | dict] = field(default_factory=list)  # texts, or {"id": ...} of registered ones
    doc_turn: int | None = None


class Backend(Protocol):
    def generate(self, prompt: ProgramPrompt, sampling: dict, on_text: TextCallback | None = None) -> dict:
        """Continue the last (assistant) message; returns {"text", "meta"}."""
        ...

    def score(self, prompt: ProgramPrompt, continuations: list[str]) -> list[float]:
        """Mean per-token log-probability of each continuation appended to the last message."""
        ...

    def rag(self, docs: list[str | dict], question: str, system: str | None, sampling: dict) -> dict:
        """Exactly lazyrt.Engine.rag: {"text", "meta"}."""
        ...

    def add_document(
        self, text: str, id: str | None = None, metadata: dict | None = None, precompute: bool = False
    ) -> str:
        """Register a document on the backend (POST /v1/documents / Engine.add_document); returns
        the id that doc(id=...) and rag()'s {"id": ...} then use."""
        ...

    def cache_stats(self) -> dict: ...
