"""`Term`: one resolved regularizer, its typed per-step result and the checks every output passes."""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from lit_losses.regularizers.legacy import legacy_term
from lit_losses.regularizers.registry import check_needs, resolve
from lit_losses.regularizers.spec import RegularizerSpec


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
    """A resolved `RegularizerSpec` with its run-time state (weight, enabled)."""

    spec: RegularizerSpec
    call: Callable[[Any], Any]
    needs: tuple[str, ...]
    differentiable: bool
    is_async: bool
    weight: float
    enabled: bool
    pointwise: bool = False
    warned: bool = False

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

    def check_values(self, out: Tensor, valid_values: Tensor, training: bool) -> None:
        """Non-finite values at valid positions are an error of the term; so is a missing gradient path
        in training, unless the term is declared non-differentiable (then it warns once)."""
        if not bool(torch.isfinite(valid_values.detach()).all()):
            raise RegularizerError(f"{self.where} returned a non-finite value (NaN or Inf)")
        if training and torch.is_grad_enabled() and not out.requires_grad:
            if self.differentiable:
                raise TermMisuse(
                    f"{self.where} has no gradient path to any parameter (its output does not require "
                    "grad), so it would silently contribute zero gradient; set differentiable: false if "
                    "intended"
                )
            if not self.warned:
                self.warned = True
                rank_zero_warn(f"{self.where} is declared non-differentiable: it adds to the loss value only")

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


def _is_coroutine_function(fn: Any) -> bool:
    while isinstance(fn, functools.partial):
        fn = fn.func
    if inspect.isfunction(fn) or inspect.ismethod(fn):
        return inspect.iscoroutinefunction(fn)
    return inspect.iscoroutinefunction(type(fn).__call__)


def build_term(spec: RegularizerSpec) -> Term:
    """Resolve ``spec.fn`` (or its name) in the registry and bind its arguments."""
    where = f"regularizer {spec.name!r}"
    entry = resolve(spec.fn if spec.fn is not None else spec.name, where)
    call = entry.build(spec.args) if not spec.legacy else legacy_term(entry.target, **spec.args)
    needs = check_needs(spec.needs, f"{where}.needs") if spec.needs is not None else entry.needs
    differentiable = entry.differentiable if spec.differentiable is None else spec.differentiable
    pointwise = entry.pointwise if spec.pointwise is None else spec.pointwise
    is_async = _is_coroutine_function(call)
    return Term(
        spec, call, needs, differentiable, is_async, spec.weight, spec.enabled, pointwise and not spec.legacy
    )
