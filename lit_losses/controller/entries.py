"""The ``controllers`` entries of a controller config: triggers, rule, operations, patience, ``config``,
``on_error`` (fms-hf-tuning's schema), each problem reported with its YAML path."""

from __future__ import annotations

import ast
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from lit_losses.controller.events import Trigger, resolve_event
from lit_losses.controller.operations import LOG_LEVELS
from lit_losses.controller.rules import RuleError, check_rule
from lit_losses.errors import ConfigError

CONTROLLER_KEYS = ("name", "triggers", "rule", "operations", "patience", "config", "on_error")

PatienceMode = Literal["reset_on_failure", "no_reset_on_failure"]
"""How a failed evaluation affects the patience count (fms-hf-tuning's names)."""

PATIENCE_MODES: tuple[PatienceMode, ...] = get_args(PatienceMode)
PATIENCE_ALIASES: dict[str, PatienceMode] = {"no_reset": "no_reset_on_failure"}
"""Earlier spellings of patience modes, still accepted."""

OnError = Literal["raise", "warn"]
"""What a rule that fails at run time does: stop the run with an error, or log a warning (every time)."""


@dataclass
class Patience:
    """When a controller whose rule holds acts (fms-hf-tuning's semantics).

    Each evaluation of the rule (one per occurrence of a trigger: one per optimizer step for
    ``on_optimizer_step_end``) on which it holds counts; the controller acts when the count *exceeds*
    ``patience_threshold``, then the count restarts. ``reset_on_failure``: an evaluation on which the
    rule does not hold restarts the count (consecutive holds); ``no_reset_on_failure``: it does not
    (cumulative). Without a ``patience`` mapping the threshold is 0 (act whenever the rule holds); with
    one, it defaults to 1 (act on the second hold).

    Attributes:
        patience_threshold: holds tolerated before acting (>= 0).
        mode: a `PatienceMode`.
    """

    patience_threshold: int = 0
    mode: PatienceMode = "reset_on_failure"


@dataclass
class Controller:
    """One rule: when it holds on one of its triggers (any rank), perform its operations.

    Attributes:
        name: unique among the controllers.
        triggers: the events on which the rule is evaluated (Hugging Face names resolved).
        rule: the validated rule expression.
        operations: ``(operation name, action)`` pairs, performed in order.
        patience: when a rule that holds acts.
        names: the metric names the rule reads (it skips until all are available).
        trigger_names: each trigger as the YAML names it (``on_log`` for ``on_optimizer_step_end``).
        log_level: the level of the "controller fired" line (``config.trigger_log_level``).
        on_error: what a rule that fails at run time does.
    """

    name: str
    triggers: list[Trigger]
    rule: str
    operations: list[tuple[str, str]]
    patience: Patience = field(default_factory=Patience)
    names: frozenset[str] = frozenset()
    trigger_names: dict[str, str] = field(default_factory=dict)
    log_level: int = logging.INFO
    on_error: OnError = "raise"


def build_controllers(
    entries: Any, metric_names: tuple[str, ...], operations: dict, problems: Any
) -> list[Controller]:
    """The ``controllers`` list; each problem is appended to ``problems`` (operations whose class is not
    registered yet, ``problems.unregistered``, are not checked: their class is the problem)."""
    controllers: list[Controller] = []
    if not isinstance(entries, list) or not entries:
        problems.append("controllers: must be a non-empty list")
        return controllers
    seen: set[str] = set()
    for i, entry in enumerate(entries):
        path = f"controllers[{i}]"
        if not isinstance(entry, Mapping):
            problems.append(f"{path}: must be a mapping")
            continue
        unknown = sorted(set(entry) - set(CONTROLLER_KEYS))
        if unknown:
            problems.append(f"{path}: unknown keys {unknown} (allowed: {list(CONTROLLER_KEYS)})")
        name = entry.get("name")
        if not isinstance(name, str) or not name or name in seen:
            problems.append(f"{path}.name: missing, not a string, or duplicate ({name!r})")
            name = f"#{i}"
        seen.add(name)
        label = f"{path} ({name})"
        trigger_names = _triggers(entry.get("triggers"), f"{label}.triggers", problems)
        rule, names = entry.get("rule"), frozenset()
        try:
            tree = check_rule(rule, metric_names)
            names = frozenset(
                n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id in metric_names
            )
        except RuleError as exc:
            problems.append(f"{label}.rule: {exc}")
        ops = _operations(
            entry.get("operations"), label, operations, triggers=list(trigger_names), problems=problems
        )
        patience = _patience(entry.get("patience"), f"{label}.patience", problems)
        level = _config(entry.get("config"), f"{label}.config", problems)
        on_error = entry.get("on_error", "raise")
        if on_error not in get_args(OnError):
            problems.append(f"{label}.on_error: {on_error!r} is not one of {get_args(OnError)}")
        triggers = list(trigger_names)
        controllers.append(
            Controller(
                name,
                triggers,
                str(rule),
                operations=ops,
                patience=patience,
                names=names,
                trigger_names=trigger_names,
                log_level=level,
                on_error=on_error,
            )
        )
    return controllers


def _triggers(raw: Any, path: str, problems: list[str]) -> dict[str, str]:
    """Each trigger's event and the name the YAML gives it (Hugging Face names resolved)."""
    if not isinstance(raw, list) or not raw:
        problems.append(f"{path}: must be a non-empty list of events (Lightning hooks or Hugging Face names)")
        return {}
    events: dict[str, str] = {}
    for name in raw:
        try:
            events.setdefault(resolve_event(name, path), name)
        except ConfigError as exc:
            problems.append(str(exc))
    return events


def _operations(raw: Any, label: str, operations: dict, triggers: list[str], problems: Any) -> list:
    if not isinstance(raw, list) or not raw:
        problems.append(f"{label}.operations: must be a non-empty list of 'operation.action'")
        return []
    ops = []
    for op in raw:
        target, _, action = str(op).partition(".")
        if target in problems.unregistered:
            continue  # reported with its class
        if target not in operations:
            defined = sorted(operations)
            problems.append(f"{label}.operations: unknown operation {target!r} in {op!r}; defined: {defined}")
        elif action not in operations[target].actions():
            actions = list(operations[target].actions())
            problems.append(
                f"{label}.operations: unknown action {action!r} of {target!r}; actions: {actions}"
            )
        else:
            allowed = operations[target].action_triggers.get(action)
            if allowed and set(triggers) - set(allowed):
                problems.append(
                    f"{label}.operations: {op} can only run on {list(allowed)}, not on "
                    f"{sorted(set(triggers) - set(allowed))}"
                )
            handler = operations[target]
            lacking = [a for a in handler.action_arguments.get(action, ()) if a not in handler.arguments]
            if lacking:
                where = getattr(handler, "_path", f"operations.{target}")
                problems.append(
                    f"{label}.operations: {op} needs {where}.arguments.{lacking[0]} (operation {target!r} "
                    "has none)"
                )
            ops.append((target, action))
    return ops


def _patience(raw: Any, path: str, problems: list[str]) -> Patience:
    """A controller's ``patience`` mapping (earlier mode spellings mapped to their current name)."""
    if raw is None:
        return Patience()
    if not isinstance(raw, Mapping):
        problems.append(f"{path}: must be a mapping with patience_threshold and mode")
        return Patience()
    unknown = sorted(set(raw) - {"patience_threshold", "mode"})
    threshold, mode = raw.get("patience_threshold", 1), raw.get("mode", "reset_on_failure")
    if unknown:
        problems.append(f"{path}: unknown keys {unknown}")
    if not isinstance(threshold, int) or isinstance(threshold, bool) or threshold < 0:
        problems.append(f"{path}.patience_threshold: must be an integer >= 0, got {threshold!r}")
        threshold = 0
    mode = PATIENCE_ALIASES.get(mode, mode) if isinstance(mode, str) else mode
    if mode not in PATIENCE_MODES:
        problems.append(f"{path}.mode: {mode!r} is not one of {list(PATIENCE_MODES)}")
    return Patience(threshold, mode)


def _config(raw: Any, path: str, problems: list[str]) -> int:
    """A controller's ``config`` mapping (fms-hf-tuning's): the level of its "fired" log line."""
    if raw is None:
        return logging.INFO
    if not isinstance(raw, Mapping):
        problems.append(f"{path}: must be a mapping with trigger_log_level")
        return logging.INFO
    unknown = sorted(set(raw) - {"trigger_log_level"})
    if unknown:
        problems.append(f"{path}: unknown keys {unknown} (allowed: ['trigger_log_level'])")
    level = str(raw.get("trigger_log_level", "INFO")).upper()
    if level not in LOG_LEVELS:
        problems.append(f"{path}.trigger_log_level: {level!r} is not one of {LOG_LEVELS}")
        return logging.INFO
    return getattr(logging, level)
