"""Where regularizer terms run, for terms that call slow or blocking code: the main thread, one persistent
event loop (async terms), daemon threads (``executor: thread``) and a process pool (``executor: process``),
each with its time limit.

The user need: a term that waits on I/O (a reward model or judge behind an HTTP API), runs long Python code
holding the GIL, or may hang. Without this module such a term runs inline on the training thread: every
step waits for it, terms run one after another instead of together, and a term that never returns hangs
the run with no error. With it, an async term shares one event loop, a thread or process term runs beside
the others, and one past its ``timeout_s`` fails with a `RegularizerError` (its ``on_error`` policy
decides).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import torch

from lit_losses.regularizers import process
from lit_losses.regularizers.spec import DEFAULT_TIMEOUT
from lit_losses.regularizers.term import RegularizerError, Term

DEFAULT_TIMEOUT_S: float = 60.0
"""Time limit (seconds) of an async, thread or process term whose ``timeout_s`` is ``"default"``; read
each time a term runs, so setting it (``lit_losses.regularizers.executors.DEFAULT_TIMEOUT_S = 10``)
applies to every such term."""


def timeout_of(term: Term) -> float | None:
    """The term's time limit in seconds (``None``: none)."""
    timeout = term.spec.timeout_s
    return DEFAULT_TIMEOUT_S if timeout == DEFAULT_TIMEOUT else timeout


def _autograd_modes() -> tuple[bool, bool]:
    return torch.is_grad_enabled(), torch.is_inference_mode_enabled()


def _in_modes(modes: tuple[bool, bool], fn: Callable[[], Any]) -> Any:
    grad, inference = modes
    with torch.inference_mode(inference), torch.set_grad_enabled(grad):
        return fn()


class TermExecutors:
    """A background event loop (created once, reused every step), daemon threads and a process pool.

    Grad mode and inference mode are thread-local in PyTorch; each offloaded call runs under the
    caller's modes so that a term builds a graph exactly when the main thread would. Threads are
    daemons: a thread term that never returns is abandoned at its time limit and never blocks the
    interpreter's exit. Process workers (`process.ProcessWorkers`, ``spawn``: safe with threads) are
    started and warmed up before any time limit counts, one per process term; a process term past its
    limit has its worker killed.
    """

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._workers: process.ProcessWorkers | None = None
        self._lock = threading.Lock()

    # ---- one step ----------------------------------------------------------------------------
    def run(self, terms: Sequence[Term], ctx: Any) -> list[Any]:
        """Each term's output on ``ctx``, or the exception it raised (or its timeout), in order.

        Async, thread and process terms start first and run concurrently with the main-thread terms;
        a term's time limit counts from the start of the step.
        """
        self._warm_up(terms)
        started = time.monotonic()
        submitted = [self._submit(t, ctx) for t in terms]
        outcomes = [
            _attempt(t.call, ctx) if future is None else None
            for t, (future, _) in zip(terms, submitted, strict=True)
        ]
        for i, (t, (future, sources)) in enumerate(zip(terms, submitted, strict=True)):
            if future is not None:
                outcomes[i] = _rebuilt(self._result(t, future, started), sources)
        return outcomes

    async def run_async(self, terms: Sequence[Term], ctx: Any) -> list[Any]:
        """`run` for a caller on an event loop: async terms run on that loop, the others as in `run`."""
        self._warm_up(terms)
        started = time.monotonic()
        pending: dict[int, tuple[Any, Any, Any]] = {}  # index: (awaitable, concurrent future, sources)
        for i, t in enumerate(terms):
            if t.is_async:
                pending[i] = (asyncio.ensure_future(t.call(ctx)), None, None)
            else:
                future, sources = self._submit(t, ctx)
                if future is not None:
                    pending[i] = (asyncio.wrap_future(future), future, sources)
        outcomes = [None if i in pending else _attempt(t.call, ctx) for i, t in enumerate(terms)]
        for i, (awaitable, future, sources) in pending.items():
            outcomes[i] = _rebuilt(await self._await(terms[i], awaitable, future, started), sources)
        return outcomes

    def _submit(self, term: Term, ctx: Any) -> tuple[concurrent.futures.Future | None, list | None]:
        """``(future, None)`` for an async or thread term, ``(future, its input tensors)`` for a process
        term, ``(None, None)`` for a main-thread term."""
        if term.is_async:
            return self.submit_async(lambda: term.call(ctx)), None
        if term.spec.executor == "thread":
            return self.submit_thread(lambda: term.call(ctx)), None
        if term.spec.executor == "process":
            blob, sources = process.payload(term, ctx)
            return self.submit_process(blob), sources
        return None, None

    def _result(self, term: Term, future: concurrent.futures.Future, started: float) -> Any:
        try:
            return future.result(timeout=self._remaining(term, started))
        except concurrent.futures.TimeoutError as exc:
            if future.done():  # the term's own TimeoutError
                return exc
            future.cancel()
            process.ProcessWorkers.kill(future)
            return self._timed_out(term)
        except Exception as exc:
            return exc

    async def _await(self, term: Term, awaitable: Any, future: Any, started: float) -> Any:
        try:
            return await asyncio.wait_for(awaitable, self._remaining(term, started))
        except asyncio.TimeoutError as exc:
            if awaitable.done() and not awaitable.cancelled():  # the term's own TimeoutError
                return exc
            process.ProcessWorkers.kill(future)
            return self._timed_out(term)
        except Exception as exc:
            return exc

    @staticmethod
    def _remaining(term: Term, started: float) -> float | None:
        timeout = timeout_of(term)
        return None if timeout is None else max(0.0, timeout - (time.monotonic() - started))

    def _timed_out(self, term: Term) -> RegularizerError:
        default = " (the default timeout_s; set a number, or null for none)"
        default = default if term.spec.timeout_s == DEFAULT_TIMEOUT else ""
        return RegularizerError(f"{term.where} timed out after {timeout_of(term)} s{default}")

    # ---- submission --------------------------------------------------------------------------
    def submit_async(self, fn: Callable[[], Coroutine[Any, Any, Any]]) -> concurrent.futures.Future:
        modes = _autograd_modes()

        async def run() -> Any:
            grad, inference = modes
            with torch.inference_mode(inference), torch.set_grad_enabled(grad):
                return await fn()

        return asyncio.run_coroutine_threadsafe(run(), self._event_loop())

    def submit_thread(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """``fn()`` in a new daemon thread, under the caller's autograd modes."""
        modes, future = _autograd_modes(), concurrent.futures.Future()

        def work() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(_in_modes(modes, fn))
            except BaseException as exc:
                future.set_exception(exc)

        threading.Thread(target=work, name="lit-losses-term", daemon=True).start()
        return future

    def submit_process(self, blob: bytes) -> concurrent.futures.Future:
        """`process.run_term` on ``blob`` in a worker process (a future of the pickled result)."""
        return self._process_workers().submit(blob)

    # ---- resources ---------------------------------------------------------------------------
    def _warm_up(self, terms: Sequence[Term]) -> None:
        """Start a worker per process term before any time limit counts (workers import torch: seconds)."""
        count = sum(t.spec.executor == "process" and not t.is_async for t in terms)
        if count:
            self._process_workers().warm_up(count)

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                threading.Thread(target=self._loop.run_forever, name="lit-losses-terms", daemon=True).start()
            return self._loop

    def _process_workers(self) -> process.ProcessWorkers:
        with self._lock:
            if self._workers is None:
                self._workers = process.ProcessWorkers()
            return self._workers

    def close(self) -> None:
        """Stop the event loop and the idle worker processes (started again on demand)."""
        with self._lock:
            loop, self._loop = self._loop, None
            workers, self._workers = self._workers, None
        if loop is not None:
            loop.call_soon_threadsafe(loop.stop)
        if workers is not None:
            workers.close()

    def __getstate__(self) -> dict[str, Any]:  # copies and pickles start without threads or processes
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()


def _rebuilt(outcome: Any, sources: list | None) -> Any:
    """A process term's pickled result as its output, on the main thread (autograd graph included)."""
    if sources is None or isinstance(outcome, BaseException):
        return outcome
    return _attempt(process.rebuild, outcome, sources)


def _attempt(fn: Callable[..., Any], *args: Any) -> Any:
    try:
        return fn(*args)
    except Exception as exc:
        return exc
