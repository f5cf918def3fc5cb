import pytest
import torch
from torch import nn

from lit_losses.errors import ConfigError
from lit_losses.optim import OptimizerConfig, build_optimizer, optimizer_and_schedule


def test_decay_applies_to_matrices_only_and_frozen_parameters_are_left_out():
    model = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3), nn.Linear(3, 2))
    model[2].weight.requires_grad_(False)
    optimizer, scheduler = build_optimizer(model, OptimizerConfig(weight_decay=0.3, warmup_steps=0), 10)
    decay, no_decay = optimizer.param_groups
    assert decay["weight_decay"] == 0.3 and [p.shape for p in decay["params"]] == [torch.Size([3, 4])]
    assert no_decay["weight_decay"] == 0.0 and len(no_decay["params"]) == 4  # biases and norm
    assert scheduler.get_last_lr() == [OptimizerConfig().lr] * 2


def test_configure_optimizers_dict_steps_the_schedule_per_optimizer_step():
    out = optimizer_and_schedule(nn.Linear(2, 2), OptimizerConfig(lr=1.0, warmup_steps=3))
    assert out["lr_scheduler"]["interval"] == "step"
    assert out["optimizer"].param_groups[0]["lr"] == pytest.approx(0.25)  # (0 + 1) / (3 + 1)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"lr": 0}, r"optimizer\.lr must be > 0"),
        ({"warmup_steps": -1}, "warmup_steps must be >= 0"),
        ({"min_lr_ratio": 2}, r"min_lr_ratio must be in \[0, 1\]"),
        ({"warmup_start_ratio": 1.0}, r"optimizer\.warmup_start_ratio=1\.0 must be in \[0, 1\)"),
        ({"warmup_start_ratio": -0.1}, r"optimizer\.warmup_start_ratio=-0\.1 must be in \[0, 1\)"),
        ({"total_steps": 0}, "total_steps must be >= 1"),
        ({"schedule": "cosin"}, "did you mean 'cosine'"),
    ],
)
def test_bad_settings(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        OptimizerConfig(**kwargs)


def test_warmup_start_ratio_sets_the_first_warmup_step():
    """``f(k) = s₀ + (1 − s₀)·k/w`` during the warmup: from 0 (transformers'), or from ``s₀``; the default
    starts at ``1/(w+1)``."""
    factors = {
        start: [OptimizerConfig(warmup_steps=4, warmup_start_ratio=start).lr_factor(k, 10) for k in range(5)]
        for start in (0.0, 0.5, None)
    }
    assert factors[0.0] == pytest.approx([0.0, 0.25, 0.5, 0.75, 1.0])
    assert factors[0.5] == pytest.approx([0.5, 0.625, 0.75, 0.875, 1.0])
    assert factors[None] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])


def test_a_whole_warmup_given_as_a_float_is_a_number_of_steps():
    """``warmup_steps: 20.0`` (how a parser may read ``20`` for ``int | float``) is 20 steps, an int in the
    saved options and the messages; a fraction stays a float."""
    config = OptimizerConfig(warmup_steps=20.0)
    assert config.warmup_steps == 20 and isinstance(config.warmup_steps, int)
    assert config.warmup(total_steps=50) == 20
    assert OptimizerConfig(warmup_steps=0.5).warmup_steps == 0.5
    with pytest.raises(ConfigError, match=r"optimizer\.warmup_steps=20 and optimizer\.warmup_ratio=0\.1 "):
        OptimizerConfig(warmup_steps=20.0, warmup_ratio=0.1)
