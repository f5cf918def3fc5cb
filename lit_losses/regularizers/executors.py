"""Where offloaded terms run: one persistent event loop (async terms) and one thread pool (sync terms)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import torch

from lit_losses.regularizers.term import RegularizerError, Term


def _autograd_modes() -> tuple[bool, bool]:
    return torch.is_grad_enabled(), torch.is_inference_mode_enabled()


def _in_modes(modes: tuple[bool, bool], fn: Callable[[], Any]) -> Any:
    grad, inference = modes
    with torch.inference_mode(inference), torch.set_grad_enabled(grad):
        return fn()


class TermExecutors:
    """A background event loop (created once, reused every step) and a thread pool, both lazy.

    Grad mode and inference mode are thread-local in PyTorch; each offloaded call runs under the
    caller's modes so that a term builds a graph exactly when the main thread would.
    """

    def __init__(self, max_threads: int = 4) -> None:
        self.max_threads = max_threads
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def run(self, terms: Sequence[Term], ctx: Any) -> dict[str, Any]:
        """Each term's raw output on ``ctx``, or the exception it raised (or its timeout).

        Async and ``executor: thread`` terms start first and run concurrently with the main-thread
        terms; a term's ``timeout_s`` counts from the start of the step.
        """
        started = time.monotonic()
        futures = {}
        for t in terms:
            if t.is_async:
                futures[t.name] = self.submit_async(lambda t=t: t.call(ctx))
            elif t.spec.executor == "thread":
                futures[t.name] = self.submit_thread(lambda t=t: t.call(ctx))
        outcomes: dict[str, Any] = {}
        for t in terms:
            if t.name not in futures:
                outcomes[t.name] = _attempt(lambda t=t: t.call(ctx))
        for t in terms:
            if t.name in futures:
                outcomes[t.name] = _result(t, futures[t.name], started)
        return outcomes

    def submit_async(self, fn: Callable[[], Coroutine[Any, Any, Any]]) -> concurrent.futures.Future:
        modes = _autograd_modes()

        async def run() -> Any:
            grad, inference = modes
            with torch.inference_mode(inference), torch.set_grad_enabled(grad):
                return await fn()

        return asyncio.run_coroutine_threadsafe(run(), self._event_loop())

    def submit_thread(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        modes = _autograd_modes()
        return self._thread_pool().submit(_in_modes, modes, fn)

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                threading.Thread(target=self._loop.run_forever, name="lit-losses-terms", daemon=True).start()
            return self._loop

    def _thread_pool(self) -> concurrent.futures.ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(self.max_threads, "lit-losses-term")
            return self._pool

    def close(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._loop = None
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def __getstate__(self) -> dict[str, Any]:  # copies and pickles start without threads
        return {"max_threads": self.max_threads}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["max_threads"])


def _attempt(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception as exc:
        return exc


def _result(term: Term, future: concurrent.futures.Future, started: float) -> Any:
    timeout = term.spec.timeout_s
    remaining = None if timeout is None else max(0.0, timeout - (time.monotonic() - started))
    try:
        return future.result(timeout=remaining)
    except concurrent.futures.TimeoutError:
        future.cancel()
        return RegularizerError(f"{term.where} timed out after {timeout} s")
    except Exception as exc:
        return exc
