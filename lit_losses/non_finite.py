"""Non-finite optimizer steps: a NaN or Inf never reaches the weights unseen.

A poisoned batch, an overflow or a diverging run makes a step's loss and gradients NaN or Inf; applied,
the step turns every weight into NaN, and the checkpoints written after it are lost too. `RegularizedLM`
checks the gradients of every optimizer step before it is applied (after gradient accumulation and the
data-parallel reduction, so every rank decides alike; one boolean all-reduce when the gradients are
sharded):

- **with a training controller** (a callback whose ``handles_non_finite_steps`` is true, as
  `lit_losses.TrainingController`), the step is skipped: its gradients are dropped, so neither the
  weights nor the optimizer's moments change. The step's logged ``train/loss_total`` is NaN, and
  ``train/non_finite_step`` is 1, for the controller's rules to act on (stop the run, roll back with
  ``SpikeRecovery``); the hidden-state check of the head is off, so that the NaN gets there.
- **without one**, the run stops with `NonFiniteStepError`, which names the options that change this.
- ``check_finite: false`` (``model.init_args.check_finite``) applies such steps as they are (the old
  behaviour, for those who handle NaNs themselves).

With fp16 mixed precision, the gradient scaler already skips steps with non-finite gradients (and lowers
its scale): the check leaves them to it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lit_losses.errors import ConfigError
from lit_losses.validation import all_finite

NON_FINITE_KEY = "train/non_finite_step"
"""Logged once per optimizer step: 1 when the step was skipped for non-finite gradients, else 0."""


class NonFiniteStepError(ConfigError):
    """An optimizer step's gradients are NaN/Inf and nothing in the run handles it (no controller)."""


def non_finite_steps_handled(trainer: Any) -> bool:
    """Whether a callback of ``trainer`` takes non-finite steps as an event (``handles_non_finite_steps``)."""
    callbacks = getattr(trainer, "callbacks", None) or ()
    return any(getattr(callback, "handles_non_finite_steps", False) for callback in callbacks)


def gradients_finite(parameters: Iterable[torch.nn.Parameter]) -> bool:
    """Whether every gradient among ``parameters`` is finite (this process's shard of a sharded one).

    Read by `all_finite` (the gradients' sums first, in one read from the device).

    Example:
        >>> p = torch.nn.Parameter(torch.ones(2))
        >>> p.grad = torch.tensor([1.0, float("nan")])
        >>> gradients_finite([p]), gradients_finite([torch.nn.Parameter(torch.ones(1))])
        (False, True)
    """
    grads = (p.grad for p in parameters if p.grad is not None)
    return all_finite([g.to_local() if hasattr(g, "to_local") else g for g in grads])


def check_hidden_states(hidden: torch.Tensor, where: str) -> None:
    """Refuse non-finite hidden states before the head (the run has no controller to skip the step).

    Raises:
        NonFiniteStepError: how many values are NaN/Inf, ``where`` (e.g. the training step), the options.
    """
    if not all_finite([hidden]):
        bad = int((~torch.isfinite(hidden)).sum())
        raise NonFiniteStepError(
            f"{where}: the hidden states contain {bad} non-finite value(s) (NaN/Inf) before the output head; "
            f"{_OPTIONS}"
        )


_OPTIONS = (
    "add a TrainingController to skip such steps and act on them (configs/controller/stop_on_runaway.yaml, "
    "recover_from_spike.yaml), or set model.init_args.check_finite=false to apply them as they are"
)


def _optimizer_parameters(optimizer: Any) -> list[torch.nn.Parameter]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _scaler_skips(trainer: Any) -> bool:
    """Whether fp16 mixed precision's gradient scaler skips non-finite steps itself."""
    return getattr(getattr(trainer, "precision_plugin", None), "scaler", None) is not None


def check_optimizer_step(module: Any, optimizer: Any) -> bool:
    """`RegularizedLM.on_before_optimizer_step`: skip (controller) or refuse (no controller) a step whose
    gradients are not finite; returns whether the step goes ahead. Every rank decides the same.

    Raises:
        NonFiniteStepError: non-finite gradients and no controller to handle them.
    """
    trainer = module.trainer
    if not module.check_finite or _scaler_skips(trainer):
        return True
    parameters = _optimizer_parameters(optimizer)
    finite = trainer.strategy.reduce_boolean_decision(gradients_finite(parameters), all=True)
    handled = non_finite_steps_handled(trainer)
    if handled:
        module.log(NON_FINITE_KEY, 0.0 if finite else 1.0, on_step=True, on_epoch=False)
    if finite:
        return True
    step = int(trainer.global_step) + 1
    if not handled:
        raise NonFiniteStepError(
            f"optimizer step {step}: the loss or the gradients are not finite (NaN/Inf); {_OPTIONS}"
        )
    rank_zero_warn(f"optimizer step {step}: non-finite gradients (NaN/Inf); the step is skipped")
    for p in parameters:
        p.grad = None  # the optimizer leaves parameters without a gradient untouched (moments included)
    return False
