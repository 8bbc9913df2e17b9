"""lazyrt: an LLM serving runtime for RAG. Document KV is computed once and reused at any position."""

from lazyrt.prompt import RagPrompt
from lazyrt.runtime.engine.engine import Engine
from lazyrt.sampling_params import SamplingParams

__all__ = ["Engine", "RagPrompt", "SamplingParams"]
__version__ = "0.1.0"
