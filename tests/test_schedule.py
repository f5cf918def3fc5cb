"""One `Schedule` serves regularizer weights and the learning rate: checked against the formulas."""

import math

import pytest

from lit_losses.errors import ConfigError
from lit_losses.optim import OptimizerConfig
from lit_losses.schedule import Schedule


def reference_lr_factor(step, warmup, total, kind, r):
    """The learning-rate formula of `OptimizerConfig`, written out independently."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if kind == "constant":
        return 1.0
    u = min(1.0, (step - warmup) / max(1, total - warmup))
    return 1.0 - (1.0 - r) * u if kind == "linear" else r + (1.0 - r) * 0.5 * (1.0 + math.cos(math.pi * u))


@pytest.mark.parametrize("kind", ["cosine", "linear", "constant"])
@pytest.mark.parametrize(("warmup", "total"), [(0, 10), (5, 20), (10, 10), (10, 3)])
def test_learning_rate_schedule_matches_its_formula(kind, warmup, total):
    cfg = OptimizerConfig(warmup_steps=warmup, schedule=kind, min_lr_ratio=0.2)
    for step in range(total + warmup + 5):
        assert cfg.lr_factor(step, total) == pytest.approx(
            reference_lr_factor(step, warmup, total, kind, 0.2)
        )


def test_weight_schedules():
    warm = Schedule("linear_warmup", warmup_steps=4, start=0.2)
    assert [warm.factor(s) for s in (0, 2, 4, 9)] == pytest.approx([0.2, 0.6, 1.0, 1.0])
    cos = Schedule("cosine", warmup_steps=0, total_steps=4, final=0.0)
    assert [cos.factor(s) for s in (0, 2, 4, 8)] == pytest.approx([1.0, 0.5, 0.0, 0.0])
    lin = Schedule("linear", warmup_steps=0, total_steps=4, final=0.5)
    assert [lin.factor(s) for s in (0, 2, 4)] == pytest.approx([1.0, 0.75, 0.5])
    assert [Schedule("step", step_size=2, gamma=0.5).factor(s) for s in (0, 1, 2, 5)] == [1, 1, 0.5, 0.25]
    assert Schedule().factor(123) == 1.0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"kind": "cosin"}, "did you mean 'cosine'"),
        ({"kind": "cosine", "total_steps": None}, "total_steps > warmup_steps"),
        ({"kind": "linear", "warmup_steps": 5, "total_steps": 5}, "total_steps > warmup_steps"),
        ({"warmup_steps": -1}, "warmup_steps must be >= 0"),
    ],
)
def test_bad_schedules(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        Schedule(**kwargs)
