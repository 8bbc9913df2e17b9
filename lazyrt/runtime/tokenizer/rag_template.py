"""Build a RagPrompt from a model's chat template: docs inside the (last) user turn, before its text."""

from __future__ import annotations

from lazyrt.prompt import RagPrompt

_MARK = "\x1eLAZYRT_DOCS\x1e"
DOC_SEPARATOR = "\n\n"
# A document is a text, or the token ids of a registered one (lazyrt.documents), which already end
# with the separator: the same ids the text gets here, so both reuse the same chunk KV.
DocPart = str | list[int]


def doc_part(doc: DocPart) -> DocPart:
    """A document as it sits in a RAG prompt: its text and a blank line (token ids: as stored)."""
    return doc + DOC_SEPARATOR if isinstance(doc, str) else list(doc)


def render_chat(
    tokenizer, messages: list[dict], continue_final: bool = False, tools: list[dict] | None = None
) -> str:
    """The prompt text for chat messages, ending where the assistant's answer starts.

    continue_final: the last message is an assistant turn still being written; the text ends right
    after its content (no end-of-turn), so generation continues it.
    """
    if continue_final:
        if not messages or messages[-1].get("role") != "assistant":
            raise ValueError("continue_final needs the last message to be an assistant message")
        # The template's generation prompt opens the assistant turn; its content follows verbatim.
        return render_chat(tokenizer, messages[:-1], tools=tools) + messages[-1]["content"]
    if getattr(tokenizer, "chat_template", None):
        kw = {"tools": tools} if tools else {}
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kw)
    # No template: a plain rendering (system text, then each turn on its own line).
    out = ""
    for m in messages:
        out += m["content"] + ("\n\n" if m["role"] == "system" else "\n")
    return out


def build_rag_chat_prompt(
    tokenizer,
    messages: list[dict],
    docs: list[DocPart],
    doc_turn: int | None = None,
    continue_final: bool = False,
    tools: list[dict] | None = None,
) -> RagPrompt:
    """Docs go at the start of a user message's content: the last one, or messages[doc_turn].

    prefix = the rendered conversation up to that content (what each doc's KV is conditioned on),
    docs = each doc + blank line (doc_part), suffix = the user's text and the rest of the conversation.
    """
    if doc_turn is None:
        doc_turn = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=None)
        if doc_turn is None:
            raise ValueError("documents need a user message to attach to")
    elif not 0 <= doc_turn < len(messages) or messages[doc_turn].get("role") != "user":
        raise ValueError(f"doc_turn={doc_turn} does not name a user message")
    msgs = [dict(m) for m in messages]
    msgs[doc_turn]["content"] = _MARK + msgs[doc_turn]["content"]
    text = render_chat(tokenizer, msgs, continue_final, tools)
    head, sep, tail = text.partition(_MARK)
    if not sep or _MARK in tail:
        raise ValueError(
            "the chat template does not place the user message verbatim; cannot split documents out"
        )
    return RagPrompt(prefix=head, docs=[doc_part(d) for d in docs], suffix=tail)


def build_rag_prompt(tokenizer, docs: list[DocPart], question: str, system: str | None = None) -> RagPrompt:
    """A system prompt (optional) and one user turn: docs, then the question."""
    messages = ([{"role": "system", "content": system}] if system is not None else []) + [
        {"role": "user", "content": question}
    ]
    return build_rag_chat_prompt(tokenizer, messages, docs)


def build_program_prompt(
    tokenizer,
    messages: list[dict],
    docs: list[DocPart],
    doc_turn: int | None = None,
    continue_final: bool = False,
) -> RagPrompt:
    """A frontend program's state as a RagPrompt (also with no docs, so both backends tokenize alike)."""
    if docs:
        return build_rag_chat_prompt(tokenizer, messages, docs, doc_turn, continue_final)
    return RagPrompt(prefix="", docs=[], suffix=render_chat(tokenizer, messages, continue_final))
