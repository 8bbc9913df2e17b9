"""rag(docs, question): one retrieval-augmented answer, exactly lazyrt.Engine.rag on any backend."""

from __future__ import annotations

from collections.abc import Sequence

from lazyrt_frontend.backend_registry import resolve_backend


def rag(
    docs: Sequence[str | dict],
    question: str,
    *,
    system: str | None = None,
    max_tokens: int = 128,
    temperature: float = 0.0,
    backend: object = None,
    **sampling: object,
) -> str:
    """Answer `question` from `docs` (each doc's KV is reused from the chunk table when seen before).
    A doc is a text, or {"id": ...} of a document registered on the backend."""
    if isinstance(docs, str) or not docs or not all(_is_doc(d) for d in docs):
        raise ValueError("rag() needs docs: a non-empty list of texts, {'id': str} or {'text': str}")
    sampling = {k: v for k, v in sampling.items() if v is not None}  # None: the default, as in gen()
    lost = {"n": sampling.get("n", 1) != 1, "logprobs": "logprobs" in sampling,
            "citations": sampling.get("citations", False) is not False}  # fmt: skip
    for name in (k for k, v in lost.items() if v):  # rag() returns the answer's text only
        raise ValueError(f"rag() returns one answer's text: {name}={sampling[name]!r} would be lost; "
                         "use a program (gen) or lazyrt.Engine.rag for it")  # fmt: skip
    params = {"max_tokens": max_tokens, "temperature": temperature, **sampling}
    return resolve_backend(backend).rag(list(docs), question, system, params)["text"]


def _is_doc(d: object) -> bool:
    if isinstance(d, str):
        return bool(d.strip())
    return isinstance(d, dict) and len(d) == 1 and isinstance(d.get("id", d.get("text")), str)
