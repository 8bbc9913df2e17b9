"""lazyrt_frontend: a small language for RAG programs on lazyrt.

from lazyrt_frontend import function, system, doc, user, gen, select, set_default_backend, RuntimeEndpoint

@function
def qa(s, docs, question):
    s += system("Answer briefly.")
    for d in docs:
        s += doc(d)          # cached once, reused in any order by any program
    s += user(question)
    s += gen("answer", max_tokens=32)

set_default_backend(RuntimeEndpoint("http://127.0.0.1:30000"))   # or lazyrt.Engine()
print(qa.run(docs=[...], question="...")["answer"])
"""

from lazyrt_frontend.backend_registry import get_default_backend, set_default_backend
from lazyrt_frontend.backends import LocalEngine, ProgramPrompt, RuntimeEndpoint
from lazyrt_frontend.parts import assistant, doc, gen, select, system, user
from lazyrt_frontend.program import Program, function
from lazyrt_frontend.rag import rag
from lazyrt_frontend.state import ProgramError, ProgramState

__all__ = [
    "LocalEngine",
    "Program",
    "ProgramError",
    "ProgramPrompt",
    "ProgramState",
    "RuntimeEndpoint",
    "assistant",
    "doc",
    "function",
    "gen",
    "get_default_backend",
    "rag",
    "select",
    "set_default_backend",
    "system",
    "user",
]
