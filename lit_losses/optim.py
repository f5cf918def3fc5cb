"""Optimizer and learning-rate schedule of `RegularizedLM`: AdamW, linear warmup, then cosine decay."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from lit_losses.choices import check_choice
from lit_losses.errors import ConfigError
from lit_losses.schedule import Schedule

LRSchedule = Literal["cosine", "linear", "constant"]

DEFAULT_WARMUP_STEPS = 100
"""The warmup, in optimizer steps, when neither ``warmup_steps`` nor ``warmup_ratio`` is given."""

ADAMW_WORDS = {"beta": "betas", "epsilon": "eps", "weight_decay": "weight_decay", "learning rate": "lr"}
"""The word of each ``torch.optim.AdamW`` refusal, and the option it is about."""
ADAMW_BOUNDS = {
    "betas": "two numbers, each in [0, 1)",
    "eps": "a number >= 0",
    "weight_decay": "a number >= 0",
    "lr": "a number > 0",
}


@dataclass
class OptimizerConfig:
    """AdamW with a per-step schedule ``lr(s) = lr · f(s)``.

    ``f`` rises linearly from ``s₀`` to 1 over the ``w`` warmup steps (`warmup`): ``f(k) = s₀ + (1−s₀)·k/w``
    for ``k < w``, with ``s₀ = warmup_start_ratio``, by default ``1/(w+1)`` (never 0, so that the first
    step trains; transformers' schedules start at ``s₀ = 0``: their first optimizer step has learning rate
    0). Then ``f`` follows ``schedule`` down to ``r = min_lr_ratio`` at ``total_steps``: ``cosine``:
    ``r + (1−r)·½(1+cos πu)``, ``linear``: ``1 − (1−r)·u``, ``constant``: 1, with ``u`` the fraction of the
    post-warmup steps done (one `Schedule`, the same type that schedules regularizer weights).

    The warmup is given as transformers' ``TrainingArguments`` give it: a number of steps
    (``warmup_steps: 100``), or a fraction of the run's optimizer steps, rounded up: ``warmup_steps: 0.1``
    (a float below 1, as in transformers 5) or ``warmup_ratio: 0.1`` (transformers 4's name); one of the
    two fields, not both.

    Example:
        >>> cfg = OptimizerConfig(lr=1e-3, warmup_steps=3, schedule="linear", min_lr_ratio=0.5)
        >>> [round(cfg.lr_factor(step, total_steps=7), 3) for step in range(8)]
        [0.25, 0.5, 0.75, 1.0, 0.875, 0.75, 0.625, 0.5]
        >>> OptimizerConfig(warmup_ratio=0.1).warmup(total_steps=25), OptimizerConfig().warmup(total_steps=25)
        (3, 100)
        >>> hf = OptimizerConfig(warmup_steps=2, warmup_start_ratio=0.0, schedule="linear", min_lr_ratio=0.0)
        >>> [hf.lr_factor(step, total_steps=4) for step in range(5)]  # transformers' linear schedule
        [0.0, 0.5, 1.0, 0.5, 0.0]
    """

    lr: float = 3e-4
    """Peak learning rate."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas."""
    eps: float = 1e-8
    """AdamW epsilon."""
    weight_decay: float = 0.1
    """Decoupled weight decay, applied to matrices only (not to norms, biases or 1-D parameters)."""
    warmup_steps: int | float | None = None
    """Optimizer steps of linear warmup, or, a float in [0, 1), that fraction of ``total_steps`` (rounded
    up, as transformers 5's ``warmup_steps``); ``None``: `DEFAULT_WARMUP_STEPS`, unless ``warmup_ratio``."""
    warmup_ratio: float | None = None
    """The warmup as a fraction of ``total_steps`` in [0, 1], rounded up to whole steps (transformers 4's
    ``warmup_ratio``); not with ``warmup_steps``."""
    warmup_start_ratio: float | None = None
    """The learning rate of the warmup's first step as a fraction of ``lr``, in [0, 1); ``None``:
    ``1/(w+1)`` for a warmup of ``w`` steps. ``0.0`` is transformers' warmup, whose first optimizer step
    has learning rate 0 (AdamW still updates its moments then)."""
    schedule: LRSchedule = "cosine"
    """Decay after warmup."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of ``lr``."""
    total_steps: int | None = None
    """Steps of the whole schedule; default: the trainer's estimated optimizer steps."""

    def __post_init__(self) -> None:
        check_choice(self.schedule, LRSchedule, "optimizer.schedule")
        if self.lr <= 0:
            raise ConfigError(f"optimizer.lr must be > 0, got {self.lr}")
        steps = self.warmup_steps
        if isinstance(steps, float) and steps >= 1 and steps.is_integer():
            self.warmup_steps = int(steps)  # a whole number of steps (a parser may give `20` as 20.0)
        self.check_warmup()
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(f"optimizer.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.total_steps is not None and self.total_steps < 1:
            raise ConfigError(f"optimizer.total_steps must be >= 1, got {self.total_steps}")
        self.betas = tuple(self.betas)  # YAML gives lists
        if len(self.betas) != 2:
            raise ConfigError(f"optimizer.betas={self.betas!r} must be {ADAMW_BOUNDS['betas']}")
        self.check_adamw()

    def check_warmup(self) -> None:
        """``warmup_steps`` is a number of steps or a fraction below 1, ``warmup_ratio`` a fraction in
        [0, 1], at most one of them is given, and ``warmup_start_ratio`` is in [0, 1).

        Raises:
            ConfigError: naming ``optimizer.<field>`` and its value.

        Example:
            >>> OptimizerConfig(warmup_steps=20, warmup_ratio=0.1)
            Traceback (most recent call last):
            ...
            lit_losses.errors.ConfigError: optimizer.warmup_steps=20 and optimizer.warmup_ratio=0.1 both ...
        """
        steps, ratio = self.warmup_steps, self.warmup_ratio
        if steps is not None and ratio is not None:
            raise ConfigError(
                f"optimizer.warmup_steps={steps} and optimizer.warmup_ratio={ratio} both set the warmup; "
                "give one (warmup_steps: a number of steps, or a fraction below 1 as in transformers 5)"
            )
        if steps is not None and steps < 0:
            raise ConfigError(f"optimizer.warmup_steps must be >= 0, got {steps}")
        if steps is not None and steps >= 1 and steps != int(steps):
            raise ConfigError(
                f"optimizer.warmup_steps={steps} is neither a whole number of steps nor a fraction of the "
                "run's steps (a float below 1)"
            )
        if ratio is not None and not 0.0 <= ratio <= 1.0:
            raise ConfigError(
                f"optimizer.warmup_ratio={ratio} must be in [0, 1] (a fraction of the run's steps)"
            )
        start = self.warmup_start_ratio
        if start is not None and not 0.0 <= start < 1.0:
            raise ConfigError(
                f"optimizer.warmup_start_ratio={start} must be in [0, 1) (the first warmup step's learning "
                "rate as a fraction of optimizer.lr; 0.0: transformers' warmup)"
            )

    def warmup(self, total_steps: int) -> int:
        """The number of warmup steps of a schedule of ``total_steps`` optimizer steps (``total_steps`` if
        set): ``warmup_steps``, or ``ceil(fraction × total_steps)`` for a fraction, as transformers'
        ``TrainingArguments.get_warmup_steps``."""
        total = self.total_steps or total_steps
        if self.warmup_ratio is not None:
            return math.ceil(total * self.warmup_ratio)
        if self.warmup_steps is None:
            return DEFAULT_WARMUP_STEPS
        if self.warmup_steps < 1:
            return math.ceil(total * self.warmup_steps)
        return int(self.warmup_steps)

    def resolved(self) -> OptimizerConfig:
        """The same settings with the default warmup written out (``warmup_steps``: `DEFAULT_WARMUP_STEPS`
        when neither warmup field is given), so that two configs of the same run compare equal."""
        if self.warmup_steps is None and self.warmup_ratio is None:
            return dataclasses.replace(self, warmup_steps=DEFAULT_WARMUP_STEPS)
        return self

    def check_adamw(self) -> None:
        """Let ``torch.optim.AdamW`` check the values it refuses (each beta in ``[0, 1)``, ``eps`` and
        ``weight_decay`` ``>= 0``, no NaN) now, on a one-element parameter, instead of when training starts.

        Raises:
            ConfigError: naming ``optimizer.<field>``, its value and torch's reason.

        Example:
            >>> OptimizerConfig(betas=(0.9, 1.5))
            Traceback (most recent call last):
            ...
            lit_losses.errors.ConfigError: optimizer.betas=(0.9, 1.5): torch.optim.AdamW refuses it ...
        """
        probe = torch.zeros(1, requires_grad=True)
        try:
            torch.optim.AdamW(
                [probe], lr=self.lr, betas=self.betas, eps=self.eps, weight_decay=self.weight_decay
            )
        except (ValueError, TypeError) as err:
            field = next((f for word, f in ADAMW_WORDS.items() if word in str(err)), None)
            where = f"optimizer.{field}={getattr(self, field)!r}" if field else "optimizer"
            allowed = f"; {field} must be {ADAMW_BOUNDS[field]}" if field else ""
            raise ConfigError(f"{where}: torch.optim.AdamW refuses it ({err}){allowed}") from None

    @classmethod
    def coerce(cls, value: OptimizerConfig | dict | None) -> OptimizerConfig:
        """``value`` as an `OptimizerConfig` (a dict of its fields, or ``None`` for the defaults)."""
        return cls(**value) if isinstance(value, dict) else value or cls()

    def lr_schedule(self, total_steps: int) -> Schedule:
        """The `Schedule` of ``f``: warmup from ``warmup_start_ratio``, by default ``1/(w+1)`` (never a zero
        learning rate)."""
        warmup = self.warmup(total_steps)
        start = self.warmup_start_ratio
        return Schedule(
            "linear_warmup" if self.schedule == "constant" else self.schedule,
            warmup_steps=warmup,
            start=1.0 / (warmup + 1) if start is None else start,
            total_steps=max(self.total_steps or total_steps, warmup + 1),
            final=self.min_lr_ratio,
        )

    def lr_factor(self, step: int, total_steps: int) -> float:
        """The multiplier ``f(step)`` of the peak learning rate."""
        return self.lr_schedule(total_steps).factor(step)


def check_trainable_dtypes(
    named_parameters: Iterable[tuple[str, torch.Tensor]], config: OptimizerConfig, cause: str = ""
) -> None:
    """Refuse trainable parameters of a dtype in which AdamW's ``eps`` rounds to 0 (``1e-8`` in float16):
    AdamW would divide ``0 / (√0 + 0)`` wherever a gradient is 0 (an unused embedding row), and the
    weights would turn NaN at the first step.

    Args:
        named_parameters: ``(name, parameter)`` pairs (``module.named_parameters()``).
        config: the optimizer's settings.
        cause: the option that gave the parameters their dtype, named first in the message
            (``model.init_args.dtype=float16``).

    Raises:
        ConfigError: naming ``optimizer.eps``, the dtype, a parameter and the ways out.

    Example:
        >>> weight = torch.nn.Parameter(torch.zeros(2, dtype=torch.float16))
        >>> check_trainable_dtypes([("w", weight)], OptimizerConfig(eps=1e-4))  # 1e-4 is not 0 in float16
        >>> check_trainable_dtypes([("w", weight)], OptimizerConfig())
        Traceback (most recent call last):
        ...
        lit_losses.errors.ConfigError: optimizer.eps=1e-08 rounds to 0 in torch.float16, the dtype of ...
    """
    underflow = [
        (name, p.dtype)
        for name, p in named_parameters
        if p.requires_grad and p.is_floating_point() and float(torch.tensor(config.eps, dtype=p.dtype)) == 0
    ]
    if not underflow:
        return
    name, dtype = underflow[0]
    fix = f"{cause.partition('=')[0]}: float32, " if cause else ""
    raise ConfigError(
        f"{cause + ': ' if cause else ''}optimizer.eps={config.eps!r} rounds to 0 in {dtype}, the dtype of "
        f"{len(underflow)} trainable parameter(s) (e.g. {name!r}): AdamW would divide by 0 where a gradient "
        f"is 0 (NaN weights at the first step); train float32 weights under mixed precision ({fix}"
        "trainer.precision: bf16-mixed or 16-mixed, not 16-true) or raise optimizer.eps (e.g. 1e-4)"
    )


def build_optimizer(
    module: nn.Module, config: OptimizerConfig, total_steps: int
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over ``module``'s trainable parameters (decay on ≥2-D ones) and its per-step scheduler."""
    check_trainable_dtypes(module.named_parameters(), config)
    params = [p for p in module.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": config.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(
        [g for g in groups if g["params"]], lr=config.lr, betas=config.betas, eps=config.eps
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, config.lr_schedule(total_steps).factor)
    return optimizer, scheduler


def optimizer_and_schedule(module: nn.Module, config: OptimizerConfig, trainer: Any = None) -> dict[str, Any]:
    """`build_optimizer` over the estimated optimizer steps, as ``configure_optimizers`` returns it."""
    total = int(trainer.estimated_stepping_batches) if trainer is not None else 1
    optimizer, scheduler = build_optimizer(module, config, max(total, 1))
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
