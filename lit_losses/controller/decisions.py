"""A controller's decision on one event: its rule evaluated, the outcomes of every rank combined in one
reduction, patience counted."""

from __future__ import annotations

import logging
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

import lightning as L
import torch

from lit_losses.controller.entries import Controller
from lit_losses.controller.rules import RuleEvaluator

log = logging.getLogger("lit_losses.controller")


@dataclass
class Outcome:
    """One controller's rule on one event: evaluated or skipped (a metric not available yet), whether it
    holds, or the failure (an exception, or a value that is not a boolean)."""

    evaluated: bool = False
    holds: bool = False
    error: str | None = None


ELSEWHERE = "failed on another rank"
"""The error of an outcome whose rule failed on another rank only."""


def _is_boolean(value: Any) -> bool:
    return isinstance(value, bool) or type(value).__name__ == "bool_"  # numpy's bool too


def evaluate(
    controller: Controller, evaluator: RuleEvaluator, values: Mapping[str, Any], step: int, event: str
) -> Outcome:
    """Evaluate ``controller``'s rule over the metric ``values``.

    Returns:
        Not evaluated when a metric it reads is not available yet; else whether it holds, or the error
        naming the controller, the rule, the step, the event and the values it read.
    """
    if controller.names - values.keys():
        return Outcome()
    try:
        value = evaluator.evaluate(controller.rule, values)
        if _is_boolean(value):
            return Outcome(evaluated=True, holds=bool(value))
        problem = f"evaluated to {value!r} ({type(value).__name__}), not a boolean"
    except Exception as exc:
        problem = f"raised {type(exc).__name__}: {exc}"
    read = ", ".join(f"{name}={values[name]!r}" for name in sorted(controller.names))
    return Outcome(
        evaluated=True,
        error=f"controller {controller.name!r}: rule {controller.rule!r} {problem} at step {step} on {event} "
        f"(metric values: {read or 'none'})",
    )


def combine_across_ranks(
    trainer: L.Trainer, pl_module: L.LightningModule, outcomes: list[Outcome]
) -> list[Outcome]:
    """Every rank's outcomes, combined in one reduction: a rule evaluated, holding or failing on any rank
    does so on all (so that every rank takes the same branch and no collective is left waiting)."""
    if trainer.world_size == 1 or not outcomes:
        return outcomes
    local = [[float(o.evaluated), float(o.holds), float(o.error is not None)] for o in outcomes]
    votes = trainer.strategy.reduce(torch.tensor(local, device=pl_module.device), reduce_op="sum").tolist()
    combined = []
    for outcome, (evaluated, holds, failed) in zip(outcomes, votes, strict=True):
        error = outcome.error or (ELSEWHERE if failed else None)
        combined.append(Outcome(evaluated > 0, holds > 0, error))
    return combined


def patience_reached(counters: MutableMapping[str, int], controller: Controller, holds: bool) -> bool:
    """Count one evaluation (fms-hf-tuning's semantics): act when the holds counted exceed the threshold,
    then restart the count."""
    patience = controller.patience
    if holds:
        counters[controller.name] += 1
    elif patience.mode == "reset_on_failure":
        counters[controller.name] = 0
    if counters[controller.name] > patience.patience_threshold:
        counters[controller.name] = 0
        return True
    return False


def any_rank(trainer: L.Trainer, pl_module: L.LightningModule, flags: Sequence[bool]) -> list[bool]:
    """``flags`` set on any rank, on every rank (one reduction; none on a single process)."""
    if trainer.world_size == 1:
        return list(flags)
    votes = torch.tensor([float(f) for f in flags], device=pl_module.device)
    return [v > 0 for v in trainer.strategy.reduce(votes, reduce_op="sum").tolist()]
