"""Build a RagPrompt from a model's chat template: docs inside the (last) user turn, before its text."""

from __future__ import annotations

from lazyrt.prompt import RagPrompt

_MARK = "\x1eLAZYRT_DOCS\x1e"
DOC_SEPARATOR = "\n\n"


def render_chat(tokenizer, messages: list[dict]) -> str:
    """The prompt text for chat messages, ending where the assistant's answer starts."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    # No template: a plain rendering (system text, then each turn on its own line).
    out = ""
    for m in messages:
        out += m["content"] + ("\n\n" if m["role"] == "system" else "\n")
    return out


def build_rag_chat_prompt(tokenizer, messages: list[dict], docs: list[str]) -> RagPrompt:
    """Docs go at the start of the last user message's content.

    prefix = the rendered conversation up to that content (what each doc's KV is conditioned on),
    docs = each doc + blank line, suffix = the user's text and the rest of the template.
    """
    last = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=None)
    if last is None:
        raise ValueError("documents need a user message to attach to")
    msgs = [dict(m) for m in messages]
    msgs[last]["content"] = _MARK + msgs[last]["content"]
    text = render_chat(tokenizer, msgs)
    head, sep, tail = text.partition(_MARK)
    if not sep or _MARK in tail:
        raise ValueError(
            "the chat template does not place the user message verbatim; cannot split documents out"
        )
    return RagPrompt(prefix=head, docs=[d + DOC_SEPARATOR for d in docs], suffix=tail)


def build_rag_prompt(tokenizer, docs: list[str], question: str, system: str | None = None) -> RagPrompt:
    """A system prompt (optional) and one user turn: docs, then the question."""
    messages = ([{"role": "system", "content": system}] if system is not None else []) + [
        {"role": "user", "content": question}
    ]
    return build_rag_chat_prompt(tokenizer, messages, docs)
