"""rag(docs, question): one retrieval-augmented answer, exactly lazyrt.Engine.rag on any backend."""

from __future__ import annotations

from collections.abc import Sequence

from lazyrt_frontend.backend_registry import resolve_backend


def rag(
    docs: Sequence[str],
    question: str,
    *,
    system: str | None = None,
    max_tokens: int = 128,
    temperature: float = 0.0,
    backend: object = None,
    **sampling: object,
) -> str:
    """Answer `question` from `docs` (each doc's KV is reused from the chunk table when seen before)."""
    if isinstance(docs, str) or not docs or not all(isinstance(d, str) and d.strip() for d in docs):
        raise ValueError("rag() needs docs: a non-empty list of non-empty strings")
    lost = {"n": sampling.get("n", 1) != 1, "logprobs": sampling.get("logprobs") is not None,
            "citations": sampling.get("citations", False) is not False}  # fmt: skip
    for name in (k for k, v in lost.items() if v):  # rag() returns the answer's text only
        raise ValueError(f"rag() returns one answer's text: {name}={sampling[name]!r} would be lost; "
                         "use a program (gen) or lazyrt.Engine.rag for it")  # fmt: skip
    params = {"max_tokens": max_tokens, "temperature": temperature, **sampling}
    return resolve_backend(backend).rag(list(docs), question, system, params)["text"]
