"""Safety: hostile or malformed rules are refused at validation and nothing runs."""

from __future__ import annotations

import pytest

from lit_losses.controller import RuleEvaluator, TrainingController
from lit_losses.errors import ConfigError

HOSTILE = [
    "__import__('os').system('touch /tmp/lit_losses_pwned')",
    "__import__('subprocess')",
    "import os",
    "exec('1')",
    "eval('1+1')",
    "open('/etc/passwd').read()",
    "compile('1', 'x', 'eval')",
    "globals()",
    "locals()",
    "vars()",
    "dir()",
    "getattr(train_loss, '__class__')",
    "type(train_loss)",
    "().__class__.__bases__[0].__subclasses__()",
    "train_loss.__class__",
    "train_loss['loss'].__class__.__mro__",
    "[].__class__.__base__",
    "''.__class__.__mro__[1].__subclasses__()",
    "(lambda: 1)()",
    "lambda x: x",
    "[x for x in range(10**9)]",
    "{x: x for x in range(10**9)}",
    "{x for x in range(10**9)}",
    "list(x for x in range(10**9))",
    "sum(x for x in range(10**9))",
    "range(10**9)",
    "10 ** 10 ** 10",
    "2 ** 100000",
    "9 ** 999",
    "train_loss['loss'] ** 1000",
    "'a' * 10**9",
    "'a' * 1000000 > ''",
    "[1] * 10**9",
    "(1,) * 10**9",
    "'" + "x" * 5000 + "'",
    "unknown_metric > 1",
    "train_loss['loss'] > threshold",
    "_private > 0",
    "__builtins__",
    "__name__",
    "train_loss['loss'] if (y := 3) else 0",
    "f'{train_loss}'",
    "train_loss['loss'] > 1; import os",
    "train_loss['loss'] >",
    "train_loss[",
    "",
    "   ",
    "max(*train_loss)",
    "max(key=abs)",
    "sum(train_loss, start=0)",
    "train_loss[train_loss]",
    "train_loss[1:2]",
    "print('hi')",
    "input()",
    "breakpoint()",
    "setattr(train_loss, 'x', 1)",
    "delattr(train_loss, 'x')",
    "memoryview(b'x')",
    "b'bytes' == b'bytes'",
    "1j + 1",
    "...",
    "await train_loss",
    "(yield)",
    "train_loss if train_loss else [i for i in ()]",
    "len([" + ", ".join(["1"] * 40) + "])",
    "abs.__self__",
    "max.__call__(1, 2)",
    "x" * 1200,
]


def config_with(rule: str) -> dict:
    return {
        "controller-metrics": [{"name": "train_loss", "class": "Loss"}],
        "controllers": [
            {
                "name": "hostile",
                "triggers": ["on_train_batch_end"],
                "rule": rule,
                "operations": ["lightning.should_log"],
            }
        ],
    }


def test_there_are_at_least_fifty_hostile_rules():
    assert len(HOSTILE) >= 50 and len(set(HOSTILE)) == len(HOSTILE)


@pytest.mark.parametrize("rule", HOSTILE)
def test_hostile_rule_is_refused_at_validation_without_running(rule, monkeypatch, tmp_path):
    def never(*args, **kwargs):
        raise AssertionError("a rule was evaluated during validation")

    monkeypatch.setattr(RuleEvaluator, "evaluate", never)
    with pytest.raises(ConfigError, match=r"controllers\[0\] \(hostile\)\.rule: "):
        TrainingController(config_with(rule))


def test_nothing_was_executed():
    import os

    assert not os.path.exists("/tmp/lit_losses_pwned")


@pytest.mark.parametrize(
    ("rule", "values", "expected"),
    [
        ('train_loss["loss"] > 10 or not is_finite(train_loss["loss"])', {"loss": 11.0}, True),
        ('train_loss["loss"] > 10 or not is_finite(train_loss["loss"])', {"loss": float("nan")}, True),
        ('train_loss["loss"] > 10 or not is_finite(train_loss["loss"])', {"loss": 3.0}, False),
        ('abs(train_loss["loss"] - 2) < 0.5 and train_loss["step"] >= 10', {"loss": 2.2, "step": 12}, True),
        ('max(train_loss["loss"], 1) ** 2 == 9', {"loss": 3.0}, True),
        ('round(train_loss["loss"], 1) in (1.5, 2.5)', {"loss": 2.46}, True),
    ],
)
def test_accepted_rules_evaluate_as_python_would(rule, values, expected):
    controller = TrainingController(config_with(rule))
    assert controller.evaluator.evaluate(rule, {"train_loss": values}) is expected


def test_a_misspelled_metric_name_gets_a_suggestion():
    with pytest.raises(ConfigError, match=r"name 'train_los' is not defined \(did you mean 'train_loss'\?\)"):
        TrainingController(config_with('train_los["loss"] > 3'))
