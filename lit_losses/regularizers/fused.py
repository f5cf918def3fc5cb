"""`FusedTerms`: pointwise terms evaluated chunk by chunk inside the fused head (gradients in forward)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from lit_losses.aggregation import LABELS_KEY, GlobalStats, token_weights
from lit_losses.aggregation.stats import batch_segment_ids
from lit_losses.heads import HeadOutput
from lit_losses.loss.context import LossContext
from lit_losses.regularizers.runner import RegularizerSet
from lit_losses.regularizers.term import RegularizerError, TermMisuse, TermResult


class FusedTerms:
    """The chunk loss that `FusedLMHead.pointwise_loss` calls, and the step's telemetry afterwards.

    Called as ``fused(start, end, logprobs, lse, entropy)`` on the valid tokens ``[start, end)``, it
    returns ``base_loss_weight · base + Σ_i w_i · r_i`` restricted to them, with the same per-token
    aggregation weights as the general path; `finish` returns ``(base, regularizer_total, terms)``
    once the head has seen every chunk. For a `RegularizerSet` whose terms are `fusable`.
    ``base = Σ_t base_weights_t · L_t`` with ``L_t = base_loss(start, end, logprobs)`` (a pointwise base
    loss of `lit_losses.objectives`), or ``L_t = −log p_t`` (cross-entropy) without one.
    """

    def __init__(
        self,
        regularizers: RegularizerSet,
        batch: Mapping[str, Any],
        mask: Tensor,
        stats: GlobalStats,
        step: int,
        base_weights: Tensor,
        base_loss_weight: float,
        base_loss: Callable[[int, int, Tensor], Tensor] | None = None,
    ) -> None:
        terms, default_agg, norm = regularizers.terms, regularizers.default_agg, regularizers.agg_norm
        self.terms = terms
        self.active = regularizers.active()
        self.batch = batch
        self.stats = stats
        self.step = step
        self.base_weights = base_weights
        self.base_loss_weight = base_loss_weight
        self.base_loss = base_loss
        segment_ids = batch_segment_ids(batch)
        dtype = base_weights.dtype
        self.weights = {
            t.name: token_weights(
                mask,
                t.spec.agg or default_agg,
                stats.get(LABELS_KEY),
                segment_ids=segment_ids,
                dtype=dtype,
                norm=norm,
            )[mask]
            for t in self.active
        }
        self.compact = {
            k: v[mask] for k, v in batch.items() if isinstance(v, Tensor) and v.shape == mask.shape
        }
        self.term_weights = {name: t.effective_weight(step) for name, t in terms.items()}
        self.sums = {t.name: base_weights.new_zeros(()) for t in self.active}
        self.customs: dict[str, dict[str, float]] = {}
        self.base_sum = base_weights.new_zeros(())

    def __call__(self, start: int, end: int, logprobs: Tensor, lse: Tensor, entropy: Tensor | None) -> Tensor:
        chunk_batch = {**self.batch, **{k: v[start:end] for k, v in self.compact.items()}}
        chunk_mask = torch.ones(end - start, dtype=torch.bool, device=logprobs.device)
        head = HeadOutput(logprobs, lse, entropy)
        ctx = LossContext(
            chunk_batch, head, None, mask=chunk_mask, stats=self.stats, step=self.step, stage="train"
        )
        if self.base_loss is None:  # cross-entropy: L = −log p
            base = -(self.base_weights[start:end] * logprobs).sum()
        else:
            base = (self.base_weights[start:end] * self.base_loss(start, end, logprobs)).sum()
        self.base_sum += base.detach()
        loss = self.base_loss_weight * base
        for t in self.active:
            try:
                out = t.call(ctx)
            except Exception as exc:
                raise RegularizerError(f"{t.where} failed: {exc!r}") from exc
            out, self.customs[t.name] = t.split_custom(out)
            if not isinstance(out, Tensor) or out.shape != logprobs.shape:
                got = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
                raise TermMisuse(
                    f"{t.where} is declared pointwise but returned {got} for a chunk of {end - start} "
                    "tokens; a pointwise term returns one value per token"
                )
            t.check_values(out, out, training=True, sources=(logprobs, lse, entropy))
            value = (self.weights[t.name][start:end] * out).sum()
            self.sums[t.name] += value.detach()
            loss = loss + self.term_weights[t.name] * value
        return loss

    def finish(self) -> tuple[Tensor, Tensor, dict[str, TermResult]]:
        """``(base, regularizer_total, per-term results)`` after the last chunk."""
        results, total = {}, self.base_weights.new_zeros(())
        for name in self.terms:  # a disabled term has no sum: value and contribution 0
            value = self.sums.get(name, self.base_weights.new_zeros(()))
            contribution = self.term_weights[name] * value
            total = total + contribution
            results[name] = TermResult(
                value, self.term_weights[name], contribution, error=0.0, custom=self.customs.get(name, {})
            )
        return self.base_sum, total, results
