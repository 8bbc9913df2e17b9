"""SamplingParams: how to pick tokens and when to stop. Validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


def positive_number(v: object) -> bool:
    return not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v) and v > 0


@dataclass
class SamplingParams:
    max_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) = off
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    ignore_eos: bool = False
    # Document attention (lazy/block, APE-style; None = the engine's setting): the question's and the
    # generated tokens' logits on document tokens are divided by doc_attention_temperature and the
    # attention mass the documents receive is multiplied by doc_attention_scale.
    doc_attention_temperature: float | None = None
    doc_attention_scale: float | None = None
    # Document positions (lazy/block; None = the engine's setting): "sequential" or "parallel" (every
    # document right after the shared prefix, APE-style; EngineConfig.doc_positions).
    doc_positions: str | None = None
    # Retrieval attention (None = the engine's retrieval_top_k): keys retrieved per host-tier document
    # and query head for this request; >= a document's keys attends to all of them (exact).
    retrieval_top_k: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.validate()

    def validate(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"SamplingParams.{name}={getattr(self, name)!r}: {why}")

        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise bad("max_tokens", "must be an integer >= 1")
        if not isinstance(self.temperature, (int, float)) or not self.temperature >= 0:
            raise bad("temperature", "must be a number >= 0")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise bad("top_p", "must be in (0, 1]")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise bad("top_k", "must be an integer >= 1, or -1/0 to disable")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", "must be a list of non-empty strings")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise bad("seed", "must be an integer or None")
        for name in ("doc_attention_temperature", "doc_attention_scale"):
            v = getattr(self, name)
            if v is not None and not positive_number(v):
                raise bad(name, "must be a finite number > 0, or None for the engine's setting")
        k = self.retrieval_top_k
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise bad("retrieval_top_k", "must be an integer >= 1, or None for the engine's setting")
        if self.doc_positions not in (None, "sequential", "parallel"):
            raise bad("doc_positions", "must be 'sequential', 'parallel', or None for the engine's setting")

    @classmethod
    def from_dict(cls, d: dict | None) -> SamplingParams:
        d = dict(d or {})
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s): {', '.join(sorted(unknown))}")
        return cls(**d)
