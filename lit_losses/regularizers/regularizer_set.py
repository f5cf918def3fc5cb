"""`RegularizerSet`: runs the terms of a step, aggregates them, weighs them and reports telemetry."""

from __future__ import annotations

import concurrent.futures
import functools
import inspect
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from lit_losses.aggregation import (
    LABELS_KEY,
    GlobalStats,
    aggregate,
    batch_mask,
    reweight_mean,
    token_weights,
)
from lit_losses.errors import ConfigError
from lit_losses.regularizers.executors import TermExecutors
from lit_losses.regularizers.legacy import legacy_term
from lit_losses.regularizers.registry import check_needs, resolve
from lit_losses.regularizers.spec import RegularizerSpec, check_weight

if TYPE_CHECKING:
    from lit_losses.module import LossContext


class RegularizerError(RuntimeError):
    """A loss term failed; the message names it."""


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


def _is_coroutine_function(fn: Any) -> bool:
    while isinstance(fn, functools.partial):
        fn = fn.func
    if inspect.isfunction(fn) or inspect.ismethod(fn):
        return inspect.iscoroutinefunction(fn)
    return inspect.iscoroutinefunction(type(fn).__call__)


def build_term(spec: RegularizerSpec) -> Term:
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


class RegularizerSet:
    """The loss terms of a `RegularizedLM`: ``Σ_i w_i(step) · r_i`` with telemetry.

    In a step, async terms (on one persistent event loop) and ``executor: thread`` terms start first
    and run concurrently with the main-thread terms; results are combined in name order, so the order
    of the terms in the config never changes the result. Each output is checked (a tensor, of shape
    ``[B, T]`` or scalar, finite at valid positions, with a gradient path unless declared
    non-differentiable) and aggregated with the global counts of its mask key.

    Errors: wrong types and shapes and missing gradient paths always raise; exceptions, non-finite
    values and timeouts follow the term's ``on_error`` (``raise`` | ``skip`` | ``warn``).

    Args:
        specs: the terms (`RegularizerSpec` or dicts with its fields).
        default_agg: aggregation mode of terms that do not set ``agg``.
        grad_norm: also compute each term's gradient norm w.r.t. the per-token head outputs
            (log-probabilities, and the lse and entropy where a term consumes them).
    """

    def __init__(
        self,
        specs: Sequence[RegularizerSpec | Mapping[str, Any]] = (),
        default_agg: str = "token-mean",
        grad_norm: bool = False,
    ) -> None:
        specs = [s if isinstance(s, RegularizerSpec) else RegularizerSpec(**s) for s in specs]
        seen: set[str] = set()
        for i, s in enumerate(specs):
            if s.name in seen:
                raise ConfigError(f"model.regularizers[{i}]: duplicate regularizer name {s.name!r}")
            seen.add(s.name)
        self.terms = {t.name: t for t in sorted((build_term(s) for s in specs), key=lambda t: t.name)}
        self.default_agg, self.grad_norm = default_agg, grad_norm
        self.executors = TermExecutors()

    # ---- introspection and run-time control ---------------------------------------------------
    def __len__(self) -> int:
        return len(self.terms)

    def __contains__(self, name: str) -> bool:
        return name in self.terms

    def term(self, name: str) -> Term:
        if name not in self.terms:
            raise KeyError(f"no regularizer named {name!r}; known: {sorted(self.terms)}")
        return self.terms[name]

    def needs(self) -> tuple[str, ...]:
        """Union of the enabled terms' needs (plus ``logprobs`` for gradient norms)."""
        needs = {n for t in self.terms.values() if t.enabled for n in t.needs}
        if self.grad_norm and any(t.enabled for t in self.terms.values()):
            needs.add("logprobs")
        return tuple(sorted(needs))

    def mask_keys(self) -> tuple[str, ...]:
        return tuple(sorted({t.spec.mask_key for t in self.terms.values()} - {LABELS_KEY}))

    def effective_weight(self, name: str, step: int) -> float:
        term = self.term(name)
        return term.weight * (term.spec.schedule.factor(step) if term.spec.schedule else 1.0)

    def set_weight(self, name: str, weight: float) -> None:
        term = self.term(name)
        term.weight = check_weight(name, weight, term.spec.allow_negative_weight)

    def scale_weight(self, name: str, factor: float) -> None:
        self.set_weight(name, self.term(name).weight * factor)

    def set_enabled(self, name: str, enabled: bool) -> None:
        self.term(name).enabled = bool(enabled)

    def state_dict(self) -> dict[str, dict[str, Any]]:
        """Run-time weights and enabled flags, per term."""
        return {n: {"weight": t.weight, "enabled": t.enabled} for n, t in self.terms.items()}

    def load_state_dict(self, state: Mapping[str, Mapping[str, Any]]) -> None:
        unknown = sorted(set(state) - set(self.terms))
        if unknown:
            rank_zero_warn(f"checkpoint has regularizers {unknown} that this model does not define; ignored")
        for name, values in state.items():
            if name in self.terms:
                self.set_weight(name, values["weight"])
                self.set_enabled(name, values["enabled"])

    def fusable(self) -> bool:
        """Whether every enabled term can run chunk by chunk inside the fused head (`fused_chunk_loss`).

        True when each is pointwise, synchronous on the main thread, differentiable, aggregated over
        ``labels`` with ``on_error: raise``, needs no hidden states, and gradient norms are off.
        """
        active = [t for t in self.terms.values() if t.enabled]
        return (
            bool(active)
            and not self.grad_norm
            and all(
                t.pointwise
                and t.differentiable
                and not t.is_async
                and t.spec.executor == "none"
                and t.spec.on_error == "raise"
                and t.spec.mask_key == LABELS_KEY
                and "hidden" not in t.needs
                for t in active
            )
        )

    def fused_chunk_loss(
        self,
        batch: Mapping[str, Any],
        mask: Tensor,
        stats: GlobalStats,
        step: int,
        base_weights: Tensor,
        base_loss_weight: float,
    ) -> tuple[Callable[..., Tensor], Callable[[], tuple[Tensor, Tensor, dict[str, dict[str, Any]]]]]:
        """``(chunk_loss, finish)`` for `FusedLMHead.pointwise_loss` (requires `fusable`).

        ``chunk_loss(start, end, logprobs, lse, entropy)`` returns ``base_loss_weight · base +
        Σ_i w_i · r_i`` restricted to the valid tokens ``[start, end)``, with the same per-token
        aggregation weights as the general path; ``finish()`` returns ``(base, regularizer_total,
        telemetry)`` once the head has seen every chunk.
        """
        from lit_losses.heads import HeadOutput
        from lit_losses.module import LossContext

        active = [t for t in self.terms.values() if t.enabled]
        segment_ids = batch.get("segment_ids")
        dtype = base_weights.dtype
        weights = {
            t.name: token_weights(
                mask, t.spec.agg or self.default_agg, stats.get(LABELS_KEY), segment_ids, dtype
            )[mask]
            for t in active
        }
        compact = {k: v[mask] for k, v in batch.items() if isinstance(v, Tensor) and v.shape == mask.shape}
        sums = {t.name: base_weights.new_zeros(()) for t in active}
        term_weights = {name: self.effective_weight(name, step) for name in self.terms}
        customs: dict[str, dict[str, float]] = {}
        base_sum = [base_weights.new_zeros(())]

        def chunk_loss(start: int, end: int, logprobs: Tensor, lse: Tensor, entropy: Tensor | None) -> Tensor:
            chunk_batch = {**batch, **{k: v[start:end] for k, v in compact.items()}}
            chunk_mask = torch.ones(end - start, dtype=torch.bool, device=logprobs.device)
            ctx = LossContext(
                chunk_batch, HeadOutput(logprobs, lse, entropy), None, chunk_mask, stats, step, "train"
            )
            base = -(base_weights[start:end] * logprobs).sum()
            base_sum[0] += base.detach()
            loss = base_loss_weight * base
            for t in active:
                where = f"regularizer {t.name!r}"
                try:
                    out = t.call(ctx)
                except Exception as exc:
                    raise RegularizerError(f"{where} failed: {exc!r}") from exc
                out, customs[t.name] = _split_custom(out, where)
                if not isinstance(out, Tensor) or out.shape != logprobs.shape:
                    got = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
                    raise RegularizerError(
                        f"{where} is declared pointwise but returned {got} for a chunk of {end - start} "
                        "tokens; a pointwise term returns one value per token"
                    )
                _check_values(t, out, out, training=True)
                value = (weights[t.name][start:end] * out).sum()
                sums[t.name] += value.detach()
                loss = loss + term_weights[t.name] * value
            return loss

        def finish() -> tuple[Tensor, Tensor, dict[str, dict[str, Any]]]:
            telemetry, total = {}, base_weights.new_zeros(())
            for name in self.terms:  # a disabled term has no sum: value and contribution 0
                value = sums.get(name, base_weights.new_zeros(()))
                contribution = term_weights[name] * value
                total = total + contribution
                telemetry[name] = {
                    "value": value,
                    "weight": term_weights[name],
                    "contribution": contribution,
                    "error": 0.0,
                    "custom": customs.get(name, {}),
                    "grad_norm_sq": None,
                }
            return base_sum[0], total, telemetry

        return chunk_loss, finish

    # ---- one step ----------------------------------------------------------------------------
    def __call__(self, ctx: LossContext) -> tuple[Tensor, dict[str, dict[str, Any]]]:
        """``(Σ_i w_i · r_i, telemetry per term)`` for one micro-batch."""
        active = [t for t in self.terms.values() if t.enabled]
        started = time.monotonic()
        futures = {}
        for t in active:
            if t.is_async:
                futures[t.name] = self.executors.submit_async(lambda t=t: t.call(ctx))
            elif t.spec.executor == "thread":
                futures[t.name] = self.executors.submit_thread(lambda t=t: t.call(ctx))
        raw: dict[str, Any] = {}
        for t in active:
            if t.name not in futures:
                raw[t.name] = _attempt(lambda t=t: t.call(ctx))
        for name, future in futures.items():
            raw[name] = self._result(self.terms[name], future, started)

        total = ctx.hidden.new_zeros((), dtype=torch.float32)
        telemetry: dict[str, dict[str, Any]] = {}
        for name, t in self.terms.items():  # name order: the result never depends on config order
            weight = self.effective_weight(name, ctx.step)
            entry = {"value": total.new_zeros(()), "weight": weight, "contribution": total.new_zeros(())}
            entry.update(error=0.0, custom={}, grad_norm_sq=total.new_zeros(()) if self.grad_norm else None)
            telemetry[name] = entry
            if not t.enabled:
                continue
            outcome = raw[name]
            if not isinstance(outcome, BaseException):
                outcome = _attempt(lambda t=t, out=outcome: self._aggregate(t, out, ctx))
            if isinstance(outcome, BaseException):
                self._handle_error(t, outcome)
                entry["error"] = 1.0
                continue
            value, custom = outcome
            contribution = weight * value
            total = total + contribution
            entry.update(value=value.detach(), contribution=contribution.detach(), custom=custom)
            if self.grad_norm:
                entry["grad_norm_sq"] = _grad_norm_sq(contribution, ctx)
        return total, telemetry

    def _result(self, term: Term, future: concurrent.futures.Future, started: float) -> Any:
        timeout = term.spec.timeout_s
        remaining = None if timeout is None else max(0.0, timeout - (time.monotonic() - started))
        try:
            return future.result(timeout=remaining)
        except concurrent.futures.TimeoutError:
            future.cancel()
            return RegularizerError(f"regularizer {term.name!r} timed out after {timeout} s")
        except Exception as exc:
            return exc

    def _aggregate(self, term: Term, out: Any, ctx: LossContext) -> tuple[Tensor, dict[str, float]]:
        where = f"regularizer {term.name!r}"
        out, custom = _split_custom(out, where)
        if not isinstance(out, Tensor):
            raise _Fatal(f"{where} returned a {type(out).__name__}, not a tensor")
        key = term.spec.mask_key
        mask = ctx.mask if key == LABELS_KEY else batch_mask(ctx.batch, key)
        scalar = out.dim() == 0 or (out.dim() == 1 and out.numel() == 1)
        if not scalar and out.shape != mask.shape:
            raise _Fatal(
                f"{where} returned shape {tuple(out.shape)}; expected a scalar or the mask shape "
                f"{tuple(mask.shape)}"
            )
        _check_values(term, out, out.reshape(()) if scalar else out[mask], ctx.stage == "train")
        agg = term.spec.agg or self.default_agg
        stats = ctx.stats.get(key)
        if scalar:
            value = reweight_mean(out.reshape(()), agg, ctx.stats.get_local(key), stats)
        else:
            value = aggregate(out, mask, agg, stats, ctx.batch.get("segment_ids"), name=where)
        return value.to(torch.promote_types(value.dtype, torch.float32)), custom

    def _handle_error(self, term: Term, exc: BaseException) -> None:
        if isinstance(exc, _Fatal) or term.spec.on_error == "raise":
            message = str(exc) if term.name in str(exc) else f"regularizer {term.name!r} failed: {exc!r}"
            raise RegularizerError(message) from exc
        if term.spec.on_error == "warn":
            rank_zero_warn(f"regularizer {term.name!r} skipped this step: {exc!r}")

    def close(self) -> None:
        self.executors.close()


class _Fatal(RegularizerError):
    """A misuse that no ``on_error`` policy hides (wrong type or shape, no gradient path)."""


def _split_custom(out: Any, where: str) -> tuple[Any, dict[str, float]]:
    """A term's ``(value, {"key": number})`` return, or a bare value with no custom metrics."""
    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], Mapping):
        return out[0], _custom_metrics(out[1], where)
    return out, {}


def _check_values(term: Term, out: Tensor, valid_values: Tensor, training: bool) -> None:
    """Non-finite values at valid positions are an error of the term; so is a missing gradient path
    in training, unless the term is declared non-differentiable (then it warns once)."""
    where = f"regularizer {term.name!r}"
    if not bool(torch.isfinite(valid_values.detach()).all()):
        raise RegularizerError(f"{where} returned a non-finite value (NaN or Inf)")
    if training and torch.is_grad_enabled() and not out.requires_grad:
        if term.differentiable:
            raise _Fatal(
                f"{where} has no gradient path to any parameter (its output does not require grad), so "
                "it would silently contribute zero gradient; set differentiable: false if intended"
            )
        if not term.warned:
            term.warned = True
            rank_zero_warn(f"{where} is declared non-differentiable: it adds to the loss value only")


def _attempt(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception as exc:
        return exc


def _custom_metrics(values: Mapping[str, Any], where: str) -> dict[str, float]:
    out = {}
    for key, value in values.items():
        if isinstance(value, Tensor) and value.numel() == 1:
            value = value.item()
        if not isinstance(value, int | float):
            raise _Fatal(f"{where}: custom metric {key!r} must be a number, got {type(value).__name__}")
        out[str(key)] = float(value) if math.isfinite(float(value)) else float("nan")
    return out


def _grad_norm_sq(contribution: Tensor, ctx: LossContext) -> Tensor:
    """``‖∂(w·r)/∂(logprobs, lse, entropy)‖²``: the weighted gradient w.r.t. the per-token head outputs."""
    outputs = [
        o for o in (ctx.head.logprobs, ctx.head.lse, ctx.head.entropy) if o is not None and o.requires_grad
    ]
    if not outputs or not contribution.requires_grad:
        return contribution.new_zeros(())
    grads = torch.autograd.grad(contribution, outputs, retain_graph=True, allow_unused=True)
    return sum((g.float().pow(2).sum() for g in grads if g is not None), contribution.new_zeros(()))
