"""RagPrompt: a prompt made of a shared prefix, position-agnostic documents and a suffix."""

from __future__ import annotations

from dataclasses import dataclass, field

Part = str | list[int]


@dataclass
class RagPrompt:
    """Positions run contiguously over prefix, docs[0..n-1], suffix.

    Each doc attends causally to the prefix and to itself only, seeing the prefix as if the doc
    came right after it; so a doc's KV depends only on (prefix, doc) and is reused at any offset.
    The suffix (and generated tokens) attend to everything before them. Text parts are tokenized
    on their own, without special tokens.
    """

    prefix: Part = field(default_factory=list)
    docs: list[Part] = field(default_factory=list)
    suffix: Part = field(default_factory=list)
