"""``executor: process``: a sync term run in a worker process, with its exact gradient brought back.

The user need: a term whose Python code holds the GIL for long (a CPU-bound metric, a parser, a library
that is not thread-safe) or that may crash or hang the interpreter. In a thread it would still stall the
training thread and a crash would take the run down; in a worker process it runs beside training, a hang is
ended by killing the worker at ``timeout_s``, and its gradient still reaches the model. Without this module
such terms have no isolation: ``executor: process`` would be refused.

The worker receives detached copies of the term's inputs (``(data, logprobs_list)``, or a `LossContext`
with the head outputs it consumes), makes them leaves, calls the term and, when the scalar it returns
requires grad, computes ``g_x = ∂value/∂x`` for each input ``x``. The main process rebuilds
``value + Σ_x ⟨g_x, x − x.detach()⟩``: the same value, and the same gradient with respect to the inputs
(a linearization: gradients travel as weights). A process term returns a scalar; workers
compute on CPU copies of the inputs (the value and gradients come back to the inputs' device).
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import pickle
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from lit_losses.errors import ConfigError
from lit_losses.heads import HeadOutput
from lit_losses.loss.context import LossContext
from lit_losses.regularizers.sequences import Datum, sequence_inputs

if TYPE_CHECKING:
    from lit_losses.regularizers.term import Term

HEAD_FIELDS = ("logprobs", "lse", "entropy")


START_TIMEOUT_S = 300.0
"""How long a worker may take to start (import torch and this package) before it counts as failed."""

MAIN_GUARD_HINT = (
    "a script that uses executor: process must guard its entry point with `if __name__ == '__main__':` "
    "(workers are started with 'spawn', which imports the main script again)"
)


def serve(conn: Any) -> None:
    """A worker's loop: say it is ready, then run each pickled call it receives until the pipe closes."""
    torch.set_num_threads(1)  # the workers provide the parallelism
    conn.send(("ready", None))
    while True:
        try:
            blob = conn.recv()
        except (EOFError, OSError):
            return
        try:
            reply = ("ok", run_term(blob))
        except BaseException as exc:
            reply = ("error", exc)
        try:
            conn.send(reply)
        except Exception:  # an exception that does not pickle
            conn.send(("error", RuntimeError(repr(reply[1]))))


class ProcessWorkers:
    """Worker processes (``spawn``), one call at a time each, started on demand and warmed up first.

    A call past its time limit kills its worker only (`kill`); a worker that dies is reported by the
    calls it had, never respawned in a loop (a script without a main guard fails at once, saying so).
    """

    def __init__(self) -> None:
        self.context = multiprocessing.get_context("spawn")
        self.idle: list[tuple[Any, Any]] = []
        self.lock = threading.Lock()

    def warm_up(self, count: int) -> None:
        """Have at least ``count`` workers started and ready (in parallel)."""
        with self.lock:
            missing = max(0, count - len(self.idle))
        starting = [self._start() for _ in range(missing)]
        for proc, conn in starting:
            self._wait_ready(proc, conn)
        with self.lock:
            self.idle.extend(starting)

    def _start(self) -> tuple[Any, Any]:
        conn, child = self.context.Pipe()
        proc = self.context.Process(target=serve, args=(child,), name="lit-losses-term", daemon=True)
        proc.start()
        child.close()
        return proc, conn

    def _wait_ready(self, proc: Any, conn: Any) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline and proc.is_alive():
            if conn.poll(0.05):
                try:
                    if conn.recv()[0] == "ready":
                        return
                except EOFError:
                    break
        alive = proc.is_alive()
        proc.kill()
        proc.join(1.0)
        what = f"did not start within {START_TIMEOUT_S} s" if alive else f"exited (code {proc.exitcode})"
        raise ConfigError(f"executor 'process': a worker process {what} while starting; {MAIN_GUARD_HINT}")

    def submit(self, blob: bytes) -> concurrent.futures.Future:
        """Run `run_term` on ``blob`` in an idle worker (a new one if none): a future of the result,
        whose ``worker`` attribute is the process (for `kill`)."""
        with self.lock:
            worker = self.idle.pop() if self.idle else None
        if worker is None:
            worker = self._start()
            self._wait_ready(*worker)
        proc, conn = worker
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.set_running_or_notify_cancel()
        future.worker = proc  # type: ignore[attr-defined]

        def wait() -> None:
            try:
                conn.send(blob)
                kind, value = conn.recv()
            except (EOFError, OSError):
                proc.join(0.1)
                if not future.done():
                    future.set_exception(RuntimeError(f"the worker process died (exit code {proc.exitcode})"))
                return
            with self.lock:
                self.idle.append(worker)
            if not future.done():
                (future.set_result if kind == "ok" else future.set_exception)(value)

        threading.Thread(target=wait, name="lit-losses-term-result", daemon=True).start()
        return future

    @staticmethod
    def kill(future: concurrent.futures.Future) -> None:
        """Stop the call of ``future`` by killing its worker (it is never reused)."""
        proc = getattr(future, "worker", None)
        if proc is not None and proc.is_alive():
            proc.kill()

    def close(self) -> None:
        with self.lock:
            idle, self.idle = self.idle, []
        for proc, conn in idle:
            conn.close()
            proc.kill()


def _copy(value: Any) -> Any:
    """A compact CPU copy of a tensor (a view would pickle its whole storage; workers compute on CPU)."""
    return value.detach().to("cpu", copy=True) if isinstance(value, Tensor) else value


def payload(term: Term, ctx: LossContext) -> tuple[bytes, list[Tensor]]:
    """``(pickled call, the main-process tensors its gradients are w.r.t.)`` for one term on ``ctx``."""
    grad = torch.is_grad_enabled()
    if term.form == "sequences":
        data, sources = sequence_inputs(ctx)
        copies = [
            Datum(
                {k: _copy(v) for k, v in d.fields.items()},
                d.row,
                d.segment,
                _copy(d.positions),
                _copy(d.target_mask),
            )
            for d in data
        ]
        inputs: Any = (copies, [_copy(x) for x in sources])
    else:
        names = [n for n in HEAD_FIELDS if getattr(ctx.head, n) is not None]
        sources = [getattr(ctx.head, n) for n in names]
        if "hidden" in term.needs and ctx.hidden is not None:
            names, sources = [*names, "hidden"], [*sources, ctx.hidden]
        batch = {k: _copy(v) for k, v in ctx.batch.items()}
        context = (batch, _copy(ctx.mask), ctx.stats, ctx.step, ctx.stage)
        inputs = (context, names, [_copy(x) for x in sources])
    return pickle.dumps((term.fn, term.form, inputs, grad)), sources


def run_term(blob: bytes) -> bytes:
    """Worker side: call the term on its inputs, and differentiate its scalar value (pickled result)."""
    fn, form, inputs, grad = pickle.loads(blob)
    with torch.set_grad_enabled(grad):
        if form == "sequences":
            data, leaves = inputs
            leaves = [x.requires_grad_(grad and x.is_floating_point()) for x in leaves]
            out = fn(data, leaves)
        else:
            (batch, mask, stats, step, stage), names, leaves = inputs
            leaves = [x.requires_grad_(grad and x.is_floating_point()) for x in leaves]
            values = dict(zip(names, leaves, strict=True))
            head = HeadOutput(*(values.get(n) for n in HEAD_FIELDS))
            out = fn(LossContext(batch, head, values.get("hidden"), mask, stats, step, stage))
    return pickle.dumps(_result(out, leaves))


def _result(out: Any, leaves: list[Tensor]) -> tuple[Any, ...]:
    value, custom = out, None
    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], Mapping):
        value, custom = out[0], {k: _number(v) for k, v in out[1].items()}
    if not isinstance(value, Tensor) or value.numel() != 1:  # the main process names the misuse
        return ("raw", _copy(value), custom)
    grads = None
    differentiable = [x for x in leaves if x.requires_grad]
    if value.requires_grad and differentiable:
        found = torch.autograd.grad(value.reshape(()), differentiable, allow_unused=True)
        if any(g is not None for g in found):
            by_leaf = {id(x): g for x, g in zip(differentiable, found, strict=True)}
            grads = [by_leaf.get(id(x)) for x in leaves]
    return ("scalar", value.detach(), value.requires_grad, grads, custom)


def _number(value: Any) -> Any:
    return value.item() if isinstance(value, Tensor) and value.numel() == 1 else value


def rebuild(blob: bytes, sources: list[Tensor]) -> Any:
    """Main side: the worker's result as the term's output, ``value + Σ_x ⟨g_x, x − x.detach()⟩``.

    A value that required grad in the worker but reached none of its inputs comes back as a leaf that
    requires grad, which the term's checks then report (no gradient path).
    """
    kind, *rest = pickle.loads(blob)
    if kind == "raw":
        value, custom = rest
    else:
        value, requires_grad, grads, custom = rest
        if sources:
            value = value.to(sources[0].device)
        if grads is not None:
            for g, x in zip(grads, sources, strict=True):
                if g is not None:
                    value = value + (g.to(x) * (x - x.detach())).sum()
        elif requires_grad:
            value = value.clone().requires_grad_(True)
    return value if custom is None else (value, custom)
