"""The parts a program adds to its state with `s += ...`: plain values, applied by ProgramState."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class System:
    text: str


@dataclass(frozen=True)
class Doc:
    """A retrieved document: its KV is computed once and reused wherever it appears. Either its
    text, or the id of a document registered on the backend (POST /v1/documents, Engine.add_document)."""

    text: str | None = None
    id: str | None = None

    def ref(self) -> str | dict:
        """As a request's documents take it: the text, or {"id": ...}."""
        return self.text if self.id is None else {"id": self.id}


@dataclass(frozen=True)
class User:
    text: str


@dataclass(frozen=True)
class Assistant:
    text: str


@dataclass(frozen=True)
class Gen:
    name: str
    sampling: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Select:
    name: str
    choices: tuple[str, ...]


Part = System | Doc | User | Assistant | Gen | Select


def _text(what: str, text: object) -> str:
    if not isinstance(text, str):
        raise TypeError(f"{what}() takes a string, got {type(text).__name__}")
    return text


def system(text: str) -> System:
    return System(_text("system", text))


def doc(text: str | None = None, *, id: str | None = None) -> Doc:  # noqa: A002 (the API's name)
    """doc(text), or doc(id=...) for a document registered on the backend (its stored tokens)."""
    if (text is None) == (id is None):
        raise ValueError("doc() takes a text or id=..., exactly one")
    if id is not None:
        if not isinstance(id, str) or not id:
            raise TypeError(f"doc(id=...) takes a non-empty string, got {id!r}")
        return Doc(id=id)
    if not _text("doc", text).strip():
        raise ValueError("doc() text is empty")
    return Doc(text)


def user(text: str) -> User:
    return User(_text("user", text))


def assistant(text: str) -> Assistant:
    return Assistant(_text("assistant", text))


def gen(
    name: str,
    max_tokens: int = 128,
    stop: str | list[str] | None = None,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = -1,
    min_p: float | None = None,
    seed: int | None = None,
    doc_attention_temperature: float | None = None,
    doc_attention_scale: float | None = None,
    doc_positions: str | None = None,
    presence_penalty: float | None = None,
    frequency_penalty: float | None = None,
    repetition_penalty: float | None = None,
    logit_bias: dict[int, float] | None = None,
    min_tokens: int | None = None,
    stop_token_ids: list[int] | None = None,
    logprobs: int | None = None,
    citations: bool | None = None,
    json_schema: dict | None = None,
    json_object: bool | None = None,
    regex: str | None = None,
    choices: list[str] | None = None,
    grammar: str | None = None,
    ignore_eos: bool | None = None,
) -> Gen:
    """Generate into the assistant turn; the text is stored as s[name]. temperature 0 = greedy.
    doc_attention_temperature / doc_attention_scale / doc_positions: the program's documents as
    lazyrt.SamplingParams takes them (None: the engine's setting). The penalties, logit_bias,
    min_tokens, stop_token_ids, min_p and ignore_eos are lazyrt.SamplingParams'; with logprobs (the
    number of top tokens, 0 = the sampled one's only), s.metas[name]["logprobs"] holds one entry per
    token; with citations, s.metas[name]["citations"] ranks the program's documents by the attention
    paid them.
    Structured output (at most one, enforced while decoding): json_schema (a JSON schema dict),
    json_object=True (any JSON object), regex (the whole output matches it), choices (the output is
    one of them; unlike select(), which scores each choice, this generates under a grammar) or
    grammar (Lark / GBNF)."""
    sampling: dict = {"max_tokens": max_tokens, "temperature": temperature, "top_p": top_p, "top_k": top_k}
    if stop is not None:  # (an empty one too: SamplingParams refuses it, naming stop)
        sampling["stop"] = [stop] if isinstance(stop, str) else list(stop)
    optional = {"min_p": min_p, "seed": seed, "doc_attention_temperature": doc_attention_temperature,
                "doc_attention_scale": doc_attention_scale, "doc_positions": doc_positions,
                "presence_penalty": presence_penalty, "frequency_penalty": frequency_penalty,
                "repetition_penalty": repetition_penalty, "logit_bias": logit_bias, "min_tokens": min_tokens,
                "stop_token_ids": stop_token_ids, "logprobs": logprobs, "citations": citations,
                "json_schema": json_schema, "json_object": json_object, "regex": regex, "choice": choices,
                "grammar": grammar, "ignore_eos": ignore_eos}  # fmt: skip
    sampling.update({k: v for k, v in optional.items() if v is not None})
    return Gen(_text("gen", name), sampling)


def select(name: str, choices: list[str]) -> Select:
    """Append the choice with the highest mean per-token log-probability; stored as s[name]."""
    if isinstance(choices, str) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise ValueError("select() needs choices: a non-empty list of non-empty strings")
    return Select(_text("select", name), tuple(choices))
