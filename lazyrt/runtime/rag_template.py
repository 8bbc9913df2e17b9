"""Build a RagPrompt from a model's chat template: docs inside the user turn, before the question."""

from __future__ import annotations

from lazyrt.prompt import RagPrompt

_MARK = "\x1eLAZYRT_DOCS\x1e"
DOC_SEPARATOR = "\n\n"


def build_rag_prompt(tokenizer, docs: list[str], question: str, system: str | None = None) -> RagPrompt:
    """prefix = template up to the user's content, docs = each doc + blank line, suffix = question + rest.

    The prefix (system prompt and turn header) is what each doc's KV is conditioned on.
    """
    messages = ([{"role": "system", "content": system}] if system is not None else []) + [
        {"role": "user", "content": _MARK + question}
    ]
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    else:
        text = (system + "\n\n" if system else "") + _MARK + question + "\n"
    head, sep, tail = text.partition(_MARK)
    if not sep or _MARK in tail:
        raise ValueError(
            "the chat template does not place the user message verbatim; cannot split documents out"
        )
    return RagPrompt(prefix=head, docs=[d + DOC_SEPARATOR for d in docs], suffix=tail)
