"""The default backend, and turning what users pass (an Engine, a backend) into a backend."""

from __future__ import annotations

import threading

from lazyrt_frontend.backends.base import Backend

_default: Backend | None = None
_lock = threading.Lock()
_wrapped: dict[int, Backend] = {}  # id(Engine) -> its LocalEngine, so one engine gets one loop thread


def _as_backend(backend: object) -> Backend:
    from lazyrt import Engine
    from lazyrt_frontend.backends.local_engine import LocalEngine

    if isinstance(backend, Engine):
        with _lock:
            if id(backend) not in _wrapped:
                _wrapped[id(backend)] = LocalEngine(backend)
            return _wrapped[id(backend)]
    if all(hasattr(backend, m) for m in ("generate", "score", "rag")):
        return backend  # type: ignore[return-value]
    raise TypeError(f"not a backend: {type(backend).__name__} (use RuntimeEndpoint(url) or lazyrt.Engine())")


def set_default_backend(backend: object) -> None:
    """Programs and rag() without backend= use this: RuntimeEndpoint(url) or a lazyrt.Engine."""
    global _default
    _default = _as_backend(backend)


def get_default_backend() -> Backend | None:
    return _default


def resolve_backend(backend: object = None) -> Backend:
    if backend is not None:
        return _as_backend(backend)
    if _default is None:
        raise RuntimeError("no backend: call set_default_backend(RuntimeEndpoint(url) or Engine()) first")
    return _default
