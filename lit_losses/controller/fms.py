"""fms-hf-tuning's calling conventions, so that its handlers run unchanged next to lit_losses' own.

lit_losses handlers take Lightning objects: ``compute(event, trainer, pl_module)`` and actions
``should_x(trainer, pl_module, context)``. fms-hf-tuning's take keyword arguments in the Hugging Face style:
``compute(state=..., **kwargs)`` and actions ``should_x(control, **kwargs)``, where ``state`` is a
``TrainerState`` and ``control`` a ``TrainerControl`` whose flags the trainer obeys. A method with three
required positional parameters is called the lit_losses way, any other the fms way, with the objects below.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field, fields
from typing import Any

import lightning as L


def takes_lightning_arguments(method: Any) -> bool:
    """Whether ``method`` (bound) is called as ``method(a, b, c)`` (lit_losses) rather than with keyword
    arguments (fms-hf-tuning): it has at least three required positional parameters.

    Example:
        >>> class Ours:
        ...     def compute(self, event, trainer, pl_module): ...
        >>> class Theirs:
        ...     def compute(self, state=None, **kwargs): ...
        >>> takes_lightning_arguments(Ours().compute), takes_lightning_arguments(Theirs().compute)
        (True, False)
    """
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    required = [
        p
        for p in inspect.signature(method).parameters.values()
        if p.kind in positional and p.default is inspect.Parameter.empty
    ]
    return len(required) >= 3


@dataclass
class TrainerControl:
    """The flags of Hugging Face's ``TrainerControl`` that an action may set; the controller then does
    what each one asks, on every rank (a flag set on any rank is set on all).

    Example:
        >>> control = TrainerControl()
        >>> control.should_training_stop = True
        >>> control.requested()
        ['should_training_stop']
    """

    should_training_stop: bool = False
    """Stop training after this step."""
    should_epoch_stop: bool = False
    """End the current epoch after this optimizer step."""
    should_save: bool = False
    """Save a checkpoint now."""
    should_evaluate: bool = False
    """Run the validation loop now."""
    should_log: bool = False
    """Send the current metrics to the loggers now."""

    def requested(self) -> list[str]:
        """The flags that are set."""
        return [f.name for f in fields(self) if getattr(self, f.name)]


@dataclass
class TrainerStateView:
    """What fms-hf-tuning handlers read from Hugging Face's ``TrainerState``, taken from a Lightning trainer.

    ``epoch`` is fractional (1.0 at the end of the first epoch); ``log_history`` holds one entry per
    optimizer step (``loss``, ``epoch``, ``step``) and per validation (``eval_<metric>``, ``epoch``,
    ``step``) since the controller started.
    """

    epoch: float = 0.0
    global_step: int = 0
    max_steps: int = -1
    num_train_epochs: int = -1
    log_history: list[dict[str, Any]] = field(default_factory=list)
    is_local_process_zero: bool = True
    is_world_process_zero: bool = True
    best_model_checkpoint: str | None = None

    @classmethod
    def of(cls, trainer: L.Trainer, epoch: float, log_history: list[dict[str, Any]]) -> TrainerStateView:
        checkpoint = getattr(trainer, "checkpoint_callback", None)
        return cls(
            epoch=epoch,
            global_step=trainer.global_step,
            max_steps=trainer.max_steps,
            num_train_epochs=trainer.max_epochs if trainer.max_epochs is not None else -1,
            log_history=log_history,
            is_local_process_zero=trainer.local_rank == 0,
            is_world_process_zero=trainer.is_global_zero,
            best_model_checkpoint=getattr(checkpoint, "best_model_path", None) or None,
        )
