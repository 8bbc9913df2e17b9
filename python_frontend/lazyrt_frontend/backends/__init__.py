"""Backends a program runs on: a running lazyrt server (HTTP) or an in-process lazyrt.Engine."""

from lazyrt_frontend.backends.base import Backend, ProgramPrompt
from lazyrt_frontend.backends.local_engine import LocalEngine
from lazyrt_frontend.backends.runtime_endpoint import RuntimeEndpoint

__all__ = ["Backend", "LocalEngine", "ProgramPrompt", "RuntimeEndpoint"]
