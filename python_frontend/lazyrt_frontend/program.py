"""@function programs: `run` one, `run_batch` many concurrently (their requests batch on the backend)."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

from tqdm import tqdm

from lazyrt_frontend.backend_registry import resolve_backend
from lazyrt_frontend.state import ProgramState


class Program:
    def __init__(self, func: Callable[..., None]):
        self.func = func
        functools.update_wrapper(self, func)

    def run(
        self, *args: object, backend: object = None, stream: bool = False, **kwargs: object
    ) -> ProgramState:
        """Run the program; with stream=True return at once and read s.text_iter() as it generates."""
        state = ProgramState(resolve_backend(backend), stream=stream)
        if not stream:
            self._execute(state, args, kwargs)
            return state.wait()
        threading.Thread(target=self._execute, args=(state, args, kwargs), daemon=True).start()
        return state

    __call__ = run

    def _execute(self, state: ProgramState, args: tuple, kwargs: dict) -> None:
        try:
            self.func(state, *args, **kwargs)
        except BaseException as e:  # recorded on the state; wait()/s[name] re-raise it
            state._finish(e)
            return
        state._finish()

    def run_batch(
        self,
        batch_kwargs: Sequence[dict],
        *,
        backend: object = None,
        progress_bar: bool = False,
        max_concurrency: int = 16,
    ) -> list[ProgramState]:
        """Run once per kwargs dict, up to max_concurrency at a time; states come back in input order.
        A failed run does not stop the others: its state has .error set (s.wait() raises it)."""
        be = resolve_backend(backend)
        states = [ProgramState(be) for _ in batch_kwargs]
        bar = tqdm(total=len(states), disable=not progress_bar, desc=self.func.__name__)

        def one(i: int) -> None:
            kwargs = batch_kwargs[i]
            if isinstance(kwargs, Mapping):
                self._execute(states[i], (), dict(kwargs))
            else:  # this item fails alone
                states[i]._finish(TypeError(f"run_batch item {i} must be a dict of the program's keyword "
                                            f"arguments, got {type(kwargs).__name__}"))  # fmt: skip
            bar.update(1)

        with ThreadPoolExecutor(max_workers=max(1, max_concurrency)) as pool:
            list(pool.map(one, range(len(states))))
        bar.close()
        return states


def function(func: Callable[..., None]) -> Program:
    """Decorator: `@function def qa(s, question): s += user(question); s += gen("answer")`."""
    return Program(func)
