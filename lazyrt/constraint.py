"""Structured-output constraints: a request's JSON schema / JSON object / regex / choice / grammar as
an llguidance grammar, checked without a tokenizer (so every process can reject a bad one early).

Why llguidance (not xgrammar): it computes each token mask on the fly from a lexer over a token trie
(measured here: 0.01-0.07 ms per row for JSON on the 49k SmolLM2 vocabulary, 0.2 ms for 16 rows in
one call), with no per-schema pass over the vocabulary (a new schema costs < 1 ms before its first
step); its executor fills the masks of a whole batch in one call on a Rust thread pool with the GIL
released, which is the shape of our batch sampler (one int32 bitmask row per constrained row); it
takes JSON schema, regex, Lark and GBNF grammars; and its wheel has no dependencies (xgrammar's
needs apache-tvm-ffi, and it compiles each schema against the vocabulary before the first token).
xgrammar was not benchmarked side by side.
"""

from __future__ import annotations

import json

from llguidance import LLMatcher, grammar_from, regex_to_lark

# JSON output without free whitespace: small and random models otherwise loop on whitespace tokens
# between items until max_tokens. Separators as json.dumps writes them.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

# The SamplingParams fields that hold a constraint, in the order errors name them.
FIELDS = ("json_schema", "json_object", "regex", "choice", "grammar")
# llguidance's parser holds at most 2,000 items in a row (LLParserLimits.max_items_in_row) and a choice
# list puts one per choice plus one in its first row; past that the matcher fails while decoding
MAX_CHOICES = 1000


def grammar_text(kind: str, value: object) -> str:
    """The llguidance grammar for one constraint (kind: one of FIELDS); ValueError saying what is
    wrong with value when it is not a valid constraint of that kind."""
    if kind == "json_schema":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"is not valid JSON: {e}") from e
        if not isinstance(value, dict):
            raise ValueError("must be a JSON schema object")
        grammar = LLMatcher.grammar_from_json_schema(value, overrides=JSON_OPTIONS)
    elif kind == "json_object":
        if value is not True:
            raise ValueError("must be true to ask for a JSON object")
        grammar = LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)
    elif kind == "regex":
        if not isinstance(value, str) or not value:
            raise ValueError("must be a non-empty regular expression string")
        # \d as [0-9] (Python's re.ASCII, ECMAScript, JSON schema); Rust's \d takes any Unicode digit
        grammar = LLMatcher.grammar_from_lark(f"start: /{regex_to_lark(value, 'd')}/")
    elif kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise ValueError("must be a non-empty list of non-empty strings")
        if len(value) > MAX_CHOICES:
            raise ValueError(f"has {len(value)} choices; at most {MAX_CHOICES}")
        grammar = grammar_from("choice", list(value))
    elif kind == "grammar":
        if not isinstance(value, str) or not value.strip():
            raise ValueError("must be a non-empty Lark or GBNF grammar string")
        grammar = grammar_from("grammar", value)
    else:
        raise ValueError(f"unknown constraint kind {kind!r} (one of {', '.join(FIELDS)})")
    err = LLMatcher.validate_grammar(grammar)
    if err:
        raise ValueError(f"is not a valid {kind.replace('_', ' ')}: {err.strip()}")
    return grammar


class ConstraintFailed(ValueError):
    """A request whose structured-output matcher failed while decoding (a parser limit): its output
    so far may not match the constraint, so it is an error, not an answer."""

    def __init__(self, why: str):
        super().__init__(
            "structured output failed while decoding (the output so far may not match the constraint; a "
            f"simpler or smaller constraint may fit the parser's limits): {why}"
        )
