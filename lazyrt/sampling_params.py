"""SamplingParams: how to pick tokens and when to stop. Validated on construction."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from lazyrt.constraint import FIELDS as CONSTRAINT_FIELDS
from lazyrt.constraint import grammar_text


def positive_number(v: object) -> bool:
    return not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v) and v > 0


MAX_LOGPROBS = 20  # top log-probabilities per token (OpenAI's limit)
MAX_N = 64  # completions per prompt
# counts (max_tokens, min_tokens, top_k) stay 32-bit and seeds 64-bit: what torch and the processes'
# wire format (msgpack) take; a larger value would fail past validation
MAX_COUNT = 2**31 - 1
SEED_RANGE = (-(2**63), 2**63)


class SamplingParamError(ValueError):
    """A SamplingParams field out of its domain; param names the field, why says what is wrong."""

    def __init__(self, param: str, value: object, why: str):
        super().__init__(f"SamplingParams.{param}={value!r}: {why}")
        self.param, self.value, self.why = param, value, why


def _int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _token_key(k: object) -> object:
    digits = k.strip().lstrip("-") if isinstance(k, str) else ""
    # ("²".isdigit() holds, but int() refuses it; past 10 digits no token id, and int() of 4,300 raises)
    if digits.isascii() and digits.isdecimal() and len(digits) <= 10:
        return int(k)
    return k


@dataclass
class SamplingParams:
    max_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) = off
    min_p: float = 0.0  # keep tokens >= min_p x as likely as the likeliest (after top-k / top-p); 0 = off
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
    # Penalties on the logits before sampling (OpenAI / HF semantics): presence and frequency subtract
    # `presence * (count > 0) + frequency * count` over the generated tokens; repetition divides a
    # positive logit (multiplies a negative one) of every token in the prompt or the output.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many tokens are generated
    stop_token_ids: list[int] = field(default_factory=list)  # finish (reason "stop") on any of them
    # Log-probabilities of each sampled token (from the model's logits, before penalties, bias and
    # temperature) plus the `logprobs` most likely ones; None = off, 0 = the sampled token's only.
    logprobs: int | None = None
    n: int = 1  # completions per prompt (each its own request; seeded ones use seed, seed + 1, ...)
    # Report each document's share of the attention the generated tokens paid (meta["citations"]);
    # its steps run eagerly and synchronously.
    citations: bool = False
    # Structured output (at most one; enforced while decoding by a token mask, the request ends
    # with EOS once the output is complete): a JSON schema, any JSON object, a regex the whole
    # output matches, one of a list of strings, or a Lark / GBNF grammar.
    json_schema: dict | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        for name in ("stop", "stop_token_ids"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, (list, tuple)):  # (a dict or a set would pass list())
                raise SamplingParamError(name, v, "must be a list")
            setattr(self, name, list(v or []))
        if self.logit_bias is not None and not isinstance(self.logit_bias, dict):
            raise ValueError(
                f"SamplingParams.logit_bias={self.logit_bias!r}: must be a dict of token id -> bias"
            )
        if self.logit_bias:  # JSON and msgpack may hand the ids over as strings
            self.logit_bias = {_token_key(k): v for k, v in self.logit_bias.items()}
        self.validate()

    @property
    def needs_logits_processing(self) -> bool:
        """Whether the worker must change this request's logits before sampling."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1
            or self.logit_bias
            or self.min_tokens
        )

    @property
    def constraint(self) -> tuple[str, object] | None:
        """(field name, value) of the structured-output constraint, or None."""
        for name in CONSTRAINT_FIELDS:
            v = getattr(self, name)
            if v not in (None, False):
                return name, v
        return None

    def validate(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return SamplingParamError(name, getattr(self, name), why)

        if not _int(self.max_tokens) or not 1 <= self.max_tokens <= MAX_COUNT:
            raise bad("max_tokens", f"must be an integer in [1, {MAX_COUNT}]")
        if not _number(self.temperature) or not self.temperature >= 0:
            raise bad("temperature", "must be a finite number >= 0")
        if not _number(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", "must be a number in (0, 1]")
        if not isinstance(self.ignore_eos, bool):
            raise bad("ignore_eos", "must be a boolean")
        if not _number(self.min_p) or not 0 <= self.min_p <= 1:
            raise bad("min_p", "must be a number in [0, 1] (0 = off)")
        if not _int(self.top_k) or not -1 <= self.top_k <= MAX_COUNT:
            raise bad("top_k", f"must be an integer in [1, {MAX_COUNT}], or -1/0 to disable")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", "must be a list of non-empty strings")
        if self.seed is not None and (not _int(self.seed) or not SEED_RANGE[0] <= self.seed < SEED_RANGE[1]):
            raise bad("seed", "must be an integer in [-2**63, 2**63) or None")
        for name in ("doc_attention_temperature", "doc_attention_scale"):
            v = getattr(self, name)
            if v is not None and not positive_number(v):
                raise bad(name, "must be a finite number > 0, or None for the engine's setting")
        k = self.retrieval_top_k
        if k is not None and (not _int(k) or not 1 <= k <= MAX_COUNT):
            why = f"must be an integer in [1, {MAX_COUNT}], or None for the engine's setting"
            raise bad("retrieval_top_k", why)
        if self.doc_positions not in (None, "sequential", "parallel"):
            raise bad("doc_positions", "must be 'sequential', 'parallel', or None for the engine's setting")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _number(v) or not -2 <= v <= 2:
                raise bad(name, "must be a number in [-2, 2]")
        if not positive_number(self.repetition_penalty):
            raise bad("repetition_penalty", "must be a finite number > 0 (1 = off)")
        if self.logit_bias is not None:
            for k, v in self.logit_bias.items():
                if not _int(k) or k < 0:
                    raise bad("logit_bias", f"key {k!r} is not a token id")
                if not _number(v) or not -100 <= v <= 100:
                    raise bad("logit_bias", f"bias {v!r} for token {k} must be a number in [-100, 100]")
        if not _int(self.min_tokens) or not 0 <= self.min_tokens <= MAX_COUNT:
            raise bad("min_tokens", f"must be an integer in [0, {MAX_COUNT}]")
        if self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        if not all(_int(t) and t >= 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be a list of token ids")
        if self.logprobs is not None and (not _int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise bad("logprobs", f"must be an integer in [0, {MAX_LOGPROBS}], or None for off")
        if not isinstance(self.citations, bool):
            raise bad("citations", "must be a boolean")
        if not _int(self.n) or not 1 <= self.n <= MAX_N:
            raise bad("n", f"must be an integer in [1, {MAX_N}]")
        self._validate_constraint(bad)

    def _validate_constraint(self, bad: Callable[[str, str], ValueError]) -> None:
        if not isinstance(self.json_object, bool):
            raise bad("json_object", "must be a boolean")
        given = [n for n in CONSTRAINT_FIELDS if getattr(self, n) not in (None, False)]
        if len(given) > 1:
            raise bad(given[1], f"cannot be combined with {given[0]} (one constraint per request)")
        if not given:
            return
        name = given[0]
        try:
            grammar_text(name, getattr(self, name))
        except ValueError as e:
            raise bad(name, str(e)) from None
        # the grammar decides when the output ends: it needs EOS allowed from the first token on
        if self.ignore_eos:
            raise bad("ignore_eos", f"cannot be combined with {name} (the constraint ends the output)")
        if self.min_tokens:
            raise bad("min_tokens", f"cannot be combined with {name} (the constraint ends the output)")

    def expand_n(self) -> list[SamplingParams]:
        """One n=1 copy per completion; seeded ones take seed, seed + 1, ... (reproducible, distinct)."""
        if self.n == 1:
            return [self]
        lo, hi = SEED_RANGE  # (wrapping inside the range a seed may take)
        seeds = [None] * self.n
        if self.seed is not None:
            seeds = [(self.seed + i - lo) % (hi - lo) + lo for i in range(self.n)]
        return [dataclasses.replace(self, n=1, seed=s) for s in seeds]

    @classmethod
    def from_dict(cls, d: dict | None) -> SamplingParams:
        d = dict(d or {})
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s): {', '.join(sorted(unknown))}")
        return cls(**d)


def out_of_vocab(params: SamplingParams, vocab_size: int) -> str | None:
    """What names a token id outside [0, vocab_size) in params (logit_bias, stop_token_ids), or None."""
    for t in params.logit_bias or {}:
        if t >= vocab_size:
            return f"logit_bias: token id {t} is outside the vocabulary [0, {vocab_size})"
    for t in params.stop_token_ids:
        if t >= vocab_size:
            return f"stop_token_ids: token id {t} is outside the vocabulary [0, {vocab_size})"
    return None
