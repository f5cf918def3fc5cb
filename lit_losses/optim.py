"""Optimizer and learning-rate schedule of `RegularizedLM`: AdamW, linear warmup, then cosine decay."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from lit_losses.errors import ConfigError


@dataclass
class OptimizerConfig:
    """AdamW with a per-step schedule ``lr(s) = lr · f(s)``.

    ``f`` rises linearly from 0 to 1 over ``warmup_steps``, then follows ``schedule`` down to
    ``min_lr_ratio`` at ``total_steps``: ``cosine``: ``r + (1−r)·½(1+cos πu)``, ``linear``:
    ``1 − (1−r)·u``, ``constant``: 1, with ``u`` the fraction of the post-warmup steps done.
    """

    lr: float = 3e-4
    """Peak learning rate."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas."""
    eps: float = 1e-8
    """AdamW epsilon."""
    weight_decay: float = 0.1
    """Decoupled weight decay, applied to matrices only (not to norms, biases or 1-D parameters)."""
    warmup_steps: int = 100
    """Optimizer steps of linear warmup."""
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    """Decay after warmup."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of ``lr``."""
    total_steps: int | None = None
    """Steps of the whole schedule; default: the trainer's estimated optimizer steps."""

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ConfigError(f"optimizer.lr must be > 0, got {self.lr}")
        if self.warmup_steps < 0:
            raise ConfigError(f"optimizer.warmup_steps must be >= 0, got {self.warmup_steps}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(f"optimizer.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.total_steps is not None and self.total_steps < 1:
            raise ConfigError(f"optimizer.total_steps must be >= 1, got {self.total_steps}")
        self.betas = tuple(self.betas)  # YAML gives lists

    def lr_factor(self, step: int, total_steps: int) -> float:
        """The multiplier ``f(step)`` of the peak learning rate."""
        if step < self.warmup_steps:
            return (step + 1) / (self.warmup_steps + 1)
        if self.schedule == "constant":
            return 1.0
        u = min(1.0, (step - self.warmup_steps) / max(1, total_steps - self.warmup_steps))
        r = self.min_lr_ratio
        if self.schedule == "linear":
            return 1.0 - (1.0 - r) * u
        return r + (1.0 - r) * 0.5 * (1.0 + math.cos(math.pi * u))


def build_optimizer(
    module: nn.Module, config: OptimizerConfig, total_steps: int
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over ``module``'s trainable parameters (decay on ≥2-D ones) and its per-step scheduler."""
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
    total = config.total_steps or total_steps
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: config.lr_factor(s, total))
    return optimizer, scheduler
