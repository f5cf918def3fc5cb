"""`RegularizerSet`: runs the terms of a step, aggregates them, weighs them and reports telemetry."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from lit_losses.aggregation import LABELS_KEY, AggMode, aggregate, batch_mask
from lit_losses.aggregation.stats import batch_segment_ids
from lit_losses.errors import BatchKeyError, ConfigError
from lit_losses.loss.context import LossContext
from lit_losses.regularizers.executors import TermExecutors
from lit_losses.regularizers.scalar import scalar_value
from lit_losses.regularizers.sequences import sequence_inputs
from lit_losses.regularizers.spec import RegularizerSpec, as_spec, check_weight
from lit_losses.regularizers.term import RegularizerError, Term, TermMisuse, TermResult, build_term


class RegularizerSet:
    """The loss terms of a `RegularizedLM`: ``Σ_i w_i(step) · r_i`` with telemetry.

    In a step, async terms (on one persistent event loop), ``executor: thread`` and ``process`` terms
    start first and run concurrently with the main-thread terms; results are combined in name order, so
    the order of the terms in the config never changes the result. A term is ``fn(ctx)`` or, in the
    sequence form, ``fn(data, logprobs_list)`` (`lit_losses.regularizers.sequences`). Each output is
    checked (a tensor, of shape ``[B, T]`` or scalar, finite at valid positions, with a gradient path
    unless declared non-differentiable) and aggregated with the global counts of its mask key: a
    matrix with `aggregate`, a scalar with the term's ``scalar`` rule (`scalar_value`).

    Errors: wrong types and shapes and missing gradient paths always raise; exceptions, non-finite
    values and timeouts follow the term's ``on_error`` (``raise`` | ``skip`` | ``warn``).

    Args:
        specs: the terms (`RegularizerSpec` or dicts with its fields).
        default_agg: aggregation mode of terms that do not set ``agg``.
        grad_norm: also compute each term's gradient norm w.r.t. the per-token head outputs
            (log-probabilities, and the lse and entropy where a term consumes them).
        executors: where offloaded terms run (default: a new `TermExecutors`).

    Example:
        >>> import torch
        >>> from lit_losses.heads import HeadOutput
        >>> from lit_losses.loss import LossContext
        >>> from lit_losses.aggregation import GlobalStats
        >>> terms = RegularizerSet([{"name": "z_loss", "weight": 0.5}])
        >>> batch = {"labels": torch.tensor([[1, 2, -100]])}
        >>> lse = torch.tensor([[1.0, 3.0, 0.0]], requires_grad=True)
        >>> ctx = LossContext(batch, HeadOutput(lse=lse), lse, batch["labels"] != -100,
        ...                   GlobalStats.local_only(batch), step=0, stage="train")
        >>> total, results = terms(ctx)
        >>> float(total.detach()), float(results["z_loss"].value)  # 0.5 · (1² + 3²) / 2 valid tokens
        (2.5, 5.0)
    """

    def __init__(
        self,
        specs: Sequence[RegularizerSpec | Mapping[str, Any]] = (),
        default_agg: AggMode = "token-mean",
        grad_norm: bool = False,
        executors: TermExecutors | None = None,
    ) -> None:
        specs = [as_spec(s, f"model.regularizers[{i}]") for i, s in enumerate(specs)]
        seen: set[str] = set()
        for i, s in enumerate(specs):
            if s.name in seen:
                raise ConfigError(f"model.regularizers[{i}]: duplicate regularizer name {s.name!r}")
            seen.add(s.name)
        self.terms = {t.name: t for t in sorted((build_term(s) for s in specs), key=lambda t: t.name)}
        self.default_agg = default_agg
        self.grad_norm = grad_norm
        self.agg_norm: float | None = None
        """The constant of ``seq-mean-token-sum-norm`` (set by the `Objective`: ``model.loss_agg_norm``)."""
        self.executors = executors if executors is not None else TermExecutors()

    # ---- introspection and run-time control ---------------------------------------------------
    def __len__(self) -> int:
        return len(self.terms)

    def __contains__(self, name: str) -> bool:
        return name in self.terms

    def term(self, name: str) -> Term:
        if name not in self.terms:
            raise KeyError(f"no regularizer named {name!r}; known: {sorted(self.terms)}")
        return self.terms[name]

    def active(self) -> list[Term]:
        """The enabled terms, in name order."""
        return [t for t in self.terms.values() if t.enabled]

    def needs(self) -> tuple[str, ...]:
        """Union of the enabled terms' needs (plus ``logprobs`` for gradient norms)."""
        needs = {n for t in self.active() for n in t.needs}
        if self.grad_norm and self.active():
            needs.add("logprobs")
        return tuple(sorted(needs))

    def mask_keys(self) -> tuple[str, ...]:
        return tuple(sorted({t.spec.mask_key for t in self.terms.values()} - {LABELS_KEY}))

    def check_mask_keys(self, keys: Sequence[str], provider: str | None = None) -> None:
        """Refuse a term whose ``mask_key`` is not among ``keys``: the keys of a batch, or (``provider``,
        a data module's name) those of the micro-batches a data module provides, before training.

        Raises:
            BatchKeyError: naming the term, its mask key and the keys there are (a `ConfigError` and a
                ``KeyError``).

        Example:
            >>> terms = RegularizerSet([{"name": "z_loss", "mask_key": "completion_mask"}])
            >>> terms.check_mask_keys(["input_ids", "labels"])
            Traceback (most recent call last):
            ...
            lit_losses.errors.BatchKeyError: regularizer 'z_loss' aggregates over its mask_key ...
        """
        for term in self.terms.values():
            key = term.spec.mask_key
            if key == LABELS_KEY or key in keys:
                continue
            where = (
                f"is missing from the batch; the batch has keys {sorted(keys)}"
                if provider is None
                else f"{provider} never provides; its micro-batches have keys {sorted(keys)}"
            )
            raise BatchKeyError(
                f"regularizer {term.name!r} aggregates over its mask_key {key!r}, which {where}"
            )

    def effective_weight(self, name: str, step: int) -> float:
        return self.term(name).effective_weight(step)

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

    # ---- the fused path ----------------------------------------------------------------------
    def fusable(self) -> bool:
        """Whether every enabled term can run chunk by chunk inside the fused head (`FusedTerms`).

        True when each is pointwise, synchronous on the main thread, differentiable, aggregated over
        ``labels`` with ``on_error: raise``, needs no hidden states, and gradient norms are off.
        """
        active = self.active()
        return (
            bool(active)
            and not self.grad_norm
            and all(
                t.pointwise
                and t.differentiable
                and not t.is_async
                and t.form == "context"
                and t.spec.executor == "none"
                and t.spec.on_error == "raise"
                and t.spec.mask_key == LABELS_KEY
                and "hidden" not in t.needs
                for t in active
            )
        )

    # ---- the general path ----------------------------------------------------------------------
    def __call__(self, ctx: LossContext) -> tuple[Tensor, dict[str, TermResult]]:
        """``(Σ_i w_i · r_i, result per term)`` for one micro-batch."""
        active = self.prepare(ctx)
        return self.combine(ctx, active, self.executors.run(active, ctx))

    async def call_async(self, ctx: LossContext) -> tuple[Tensor, dict[str, TermResult]]:
        """`__call__` from a coroutine: async terms run on the caller's event loop."""
        active = self.prepare(ctx)
        return self.combine(ctx, active, await self.executors.run_async(active, ctx))

    def prepare(self, ctx: LossContext) -> list[Term]:
        """The enabled terms; builds the sequence form's ``(data, logprobs_list)`` once, on this thread."""
        active = self.active()
        if any(t.form == "sequences" for t in active):
            sequence_inputs(ctx)
        return active

    def combine(
        self, ctx: LossContext, active: list[Term], outcomes: list[Any]
    ) -> tuple[Tensor, dict[str, TermResult]]:
        """Check, aggregate and weigh the raw ``outcomes`` of the ``active`` terms (in name order)."""
        by_name = {t.name: out for t, out in zip(active, outcomes, strict=True)}
        total = torch.zeros((), dtype=torch.float32, device=ctx.mask.device)
        results: dict[str, TermResult] = {}
        for name, t in self.terms.items():  # name order: the result never depends on config order
            result = TermResult(total.new_zeros(()), t.effective_weight(ctx.step), total.new_zeros(()))
            result.grad_norm_sq = total.new_zeros(()) if self.grad_norm else None
            results[name] = result
            if name not in by_name:
                continue
            try:
                value, result.custom = aggregate_output(
                    t, by_name[name], ctx, default_agg=self.default_agg, norm=self.agg_norm
                )
            except Exception as exc:
                self._handle_error(t, exc)
                result.error = 1.0
                continue
            contribution = result.weight * value
            total = total + contribution
            result.value = value.detach()
            result.contribution = contribution.detach()
            if self.grad_norm:
                result.grad_norm_sq = _grad_norm_sq(contribution, ctx)
        return total, results

    def _handle_error(self, term: Term, exc: BaseException) -> None:
        if isinstance(exc, TermMisuse) or term.spec.on_error == "raise":
            message = str(exc) if term.where in str(exc) else f"{term.where} failed: {exc!r}"
            raise RegularizerError(message) from exc
        if term.spec.on_error == "warn":
            rank_zero_warn(f"{term.where} skipped this step: {exc!r}")

    def close(self) -> None:
        self.executors.close()


def aggregate_output(
    term: Term, out: Any, ctx: LossContext, default_agg: AggMode, norm: float | None = None
) -> tuple[Tensor, dict[str, float]]:
    """A term's raw output (or exception) checked and aggregated: ``(value, custom metrics)``."""
    if isinstance(out, BaseException):
        raise out
    out, custom = term.split_custom(out)
    if not isinstance(out, Tensor):
        raise TermMisuse(f"{term.where} returned a {type(out).__name__}, not a tensor")
    key = term.spec.mask_key
    mask = ctx.mask if key == LABELS_KEY else batch_mask(ctx.batch, key)
    scalar = out.dim() == 0 or (out.dim() == 1 and out.numel() == 1)
    if not scalar and (term.form == "sequences" or term.spec.executor == "process"):
        kind = "a (data, logprobs_list) function" if term.form == "sequences" else "a process term"
        raise TermMisuse(f"{term.where} returned shape {tuple(out.shape)}; {kind} returns a scalar loss")
    if not scalar and out.shape != mask.shape:
        raise TermMisuse(
            f"{term.where} returned shape {tuple(out.shape)}; expected a scalar or the mask shape "
            f"{tuple(mask.shape)}"
        )
    sources = (ctx.head.logprobs, ctx.head.lse, ctx.head.entropy, ctx.hidden)
    term.check_values(out, out.reshape(()) if scalar else out[mask], ctx.stage == "train", sources=sources)
    agg = term.spec.agg or default_agg
    stats = ctx.stats.get(key)
    if scalar:
        value = scalar_value(
            out.reshape(()), term.spec.scalar, agg, local=ctx.stats.get_local(key), stats=stats
        )
    else:
        value = aggregate(
            out, mask, agg, stats=stats, segment_ids=batch_segment_ids(ctx.batch), name=term.where, norm=norm
        )
    return value.to(torch.promote_types(value.dtype, torch.float32)), custom


def _grad_norm_sq(contribution: Tensor, ctx: LossContext) -> Tensor:
    """``‖∂(w·r)/∂(logprobs, lse, entropy)‖²``: the weighted gradient w.r.t. the per-token head outputs."""
    outputs = [
        o for o in (ctx.head.logprobs, ctx.head.lse, ctx.head.entropy) if o is not None and o.requires_grad
    ]
    if not outputs or not contribution.requires_grad:
        return contribution.new_zeros(())
    grads = torch.autograd.grad(contribution, outputs, retain_graph=True, allow_unused=True)
    return sum((g.float().pow(2).sum() for g in grads if g is not None), contribution.new_zeros(()))
