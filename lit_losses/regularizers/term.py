"""`Term`: one resolved regularizer, its typed per-step result and the checks every output passes."""

from __future__ import annotations

import math
import pickle
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn

from lit_losses.errors import ConfigError
from lit_losses.regularizers.arguments import check_args
from lit_losses.regularizers.registry import RegistryEntry, check_needs, resolve
from lit_losses.regularizers.sequences import is_coroutine_function, sequences_term, takes_sequences
from lit_losses.regularizers.spec import RegularizerSpec

Form = Literal["context", "sequences"]
"""A term's calling convention: ``fn(ctx)`` or the sequence form ``fn(data, logprobs_list)``."""


class RegularizerError(RuntimeError):
    """A loss term failed; the message names it."""


class TermMisuse(RegularizerError):
    """A misuse that no ``on_error`` policy hides (wrong type or shape, no gradient path)."""


@dataclass
class TermResult:
    """One term's values in one micro-batch (already normalized by the global counts).

    ``contribution = weight · value``; ``error`` is 1 when the term failed and was skipped;
    ``grad_norm_sq`` is ``‖∂ contribution / ∂(head outputs)‖²`` when gradient norms are on. Fields
    can also be read by key (``result["value"]``).
    """

    value: Tensor | float = 0.0
    weight: float = 0.0
    contribution: Tensor | float = 0.0
    error: float = 0.0
    custom: dict[str, float] = field(default_factory=dict)
    grad_norm_sq: Tensor | None = None

    def __getitem__(self, key: str) -> Any:
        return getattr(self, key)


@dataclass
class Term:
    """A resolved `RegularizerSpec` with its run-time state (weight, enabled).

    ``call(ctx)`` runs it; ``fn`` is the user's callable (arguments bound) in its own ``form``.
    ``differentiable``: ``True``: its value must have a gradient path; ``False``: none expected (warns
    once); ``None`` (sequence-form functions): a value without gradient is allowed and adds to the loss
    value only (non-differentiable sequence-form terms, warned once). A value that requires grad but has
    no path to the head outputs or a parameter is an error in every case but ``False``.
    """

    spec: RegularizerSpec
    call: Callable[[Any], Any]
    needs: tuple[str, ...]
    differentiable: bool | None
    is_async: bool
    weight: float
    enabled: bool
    pointwise: bool = False
    warned: bool = False
    fn: Callable[..., Any] | None = None
    form: Form = "context"

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def where(self) -> str:
        """How messages name this term."""
        return f"regularizer {self.name!r}"

    def effective_weight(self, step: int) -> float:
        """``weight × schedule(step)``."""
        return self.weight * (self.spec.schedule.factor(step) if self.spec.schedule else 1.0)

    def check_values(
        self, out: Tensor, valid_values: Tensor, training: bool, sources: Iterable[Tensor | None] = ()
    ) -> None:
        """Non-finite values at valid positions are an error of the term. In training: an output with
        no gradient path is an error (unless allowed, see the class doc); so is one that requires grad
        without any path to ``sources`` (the tensors it was given) or to an ``nn.Parameter``."""
        if not bool(torch.isfinite(valid_values.detach()).all()):
            hint = ""
            if self.form == "sequences":
                hint = "; note that logprobs_list[i] is empty for a sequence without target (its mean is NaN)"
            raise RegularizerError(f"{self.where} returned a non-finite value (NaN or Inf){hint}")
        if not (training and torch.is_grad_enabled()):
            return
        if self.differentiable is False:
            if not out.requires_grad:
                self._warn_once("is declared non-differentiable: it adds to the loss value only")
            return
        if out.requires_grad:
            if not has_grad_path(out, sources):
                raise TermMisuse(
                    f"{self.where} returned a tensor that requires grad but has no gradient path to the "
                    "log-probabilities or to any parameter (e.g. a new leaf made with requires_grad=True), "
                    "so it would train with zero gradient; compute it from the inputs it is given"
                )
            return
        if self.differentiable:
            raise TermMisuse(
                f"{self.where} has no gradient path to any parameter (its output does not require "
                "grad), so it would silently contribute zero gradient; set differentiable: false if "
                "intended"
            )
        if self.differentiable is None:
            self._warn_once(
                "returned a value without gradient: it adds to the loss value only (declare "
                "differentiable: false to say so, or true to make this an error)"
            )

    def _warn_once(self, what: str) -> None:
        if not self.warned:
            self.warned = True
            rank_zero_warn(f"{self.where} {what}")

    def split_custom(self, out: Any) -> tuple[Any, dict[str, float]]:
        """A term's ``(value, {"key": number})`` return, or a bare value with no custom metrics."""
        if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], Mapping):
            return out[0], self._custom_metrics(out[1])
        return out, {}

    def _custom_metrics(self, values: Mapping[str, Any]) -> dict[str, float]:
        out = {}
        for key, value in values.items():
            if isinstance(value, Tensor) and value.numel() == 1:
                value = value.item()
            if not isinstance(value, int | float):
                raise TermMisuse(
                    f"{self.where}: custom metric {key!r} must be a number, got {type(value).__name__}"
                )
            out[str(key)] = float(value) if math.isfinite(float(value)) else float("nan")
        return out


def has_grad_path(out: Tensor, sources: Iterable[Tensor | None]) -> bool:
    """Whether ``out``'s autograd graph reaches one of ``sources`` or an ``nn.Parameter``.

    Walks ``grad_fn.next_functions`` from ``out`` and stops at the first source, so the cost is the
    size of the term's own graph. A leaf that is neither a source nor a parameter has no path.
    """
    sources = [s for s in sources if s is not None and s.requires_grad]
    nodes = {s.grad_fn for s in sources if s.grad_fn is not None}
    leaves = {id(s) for s in sources if s.grad_fn is None}

    def reaches(variable: Tensor) -> bool:
        return id(variable) in leaves or isinstance(variable, nn.Parameter)

    if out.grad_fn is None:
        return reaches(out)
    stack, seen = [out.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if node in nodes:
            return True
        variable = getattr(node, "variable", None)  # AccumulateGrad: a leaf
        if variable is not None:
            if reaches(variable):
                return True
            continue
        stack.extend(next_node for next_node, _ in node.next_functions)
    return False


def _bind(entry: RegistryEntry, spec: RegularizerSpec, where: str) -> Callable[..., Any]:
    """``entry`` with ``spec.args`` bound; arguments it does not take, or of a type its signature refuses,
    are a `ConfigError` now (`check_args`), not at step 1."""
    check_args(entry.target, spec.args, where, name=spec.name, legacy=spec.legacy)
    try:
        return entry.build(spec.args)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}.args {spec.args!r}: {exc}") from exc


def _check_executor(spec: RegularizerSpec, fn: Any, is_async: bool, where: str) -> None:
    if is_async and spec.executor != "none":
        raise ConfigError(
            f"{where}: executor {spec.executor!r} (or run_in_executor) is for sync functions; this one is "
            "async and already runs concurrently on the event loop"
        )
    if spec.executor == "process":
        try:
            pickle.dumps(fn)
        except Exception as exc:
            raise ConfigError(
                f"{where}: executor 'process' needs a picklable function (defined at module level, "
                f"its arguments picklable); {getattr(fn, '__qualname__', fn)!r} is not: {exc}"
            ) from exc


def build_term(spec: RegularizerSpec) -> Term:
    """Resolve ``spec.fn`` (or its name) in the registry, bind its arguments and tell its form."""
    where = f"regularizer {spec.name!r}"
    entry = resolve(spec.fn if spec.fn is not None else spec.name, where)
    fn = _bind(entry, spec, where)
    sequences = spec.legacy if spec.legacy is not None else takes_sequences(fn)
    needs = check_needs(spec.needs, f"{where}.needs") if spec.needs is not None else entry.needs
    if sequences and "logprobs" not in needs:
        needs = ("logprobs", *needs)
    differentiable = spec.differentiable
    if differentiable is None:
        differentiable = None if sequences and entry.differentiable else entry.differentiable
    pointwise = entry.pointwise if spec.pointwise is None else spec.pointwise
    is_async = is_coroutine_function(fn)
    _check_executor(spec, fn, is_async, where=where)
    call = sequences_term(fn) if sequences else fn
    return Term(
        spec,
        call,
        needs,
        differentiable=differentiable,
        is_async=is_async,
        weight=spec.weight,
        enabled=spec.enabled,
        pointwise=pointwise and not sequences,
        fn=fn,
        form="sequences" if sequences else "context",
    )
