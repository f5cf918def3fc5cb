"""The controller's YAML schema, loaded and validated up front (every problem reported at once)."""

from __future__ import annotations

import ast
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from lit_losses.controller.metrics import ALL_EVENTS, METRIC_HANDLERS, MetricHandler
from lit_losses.controller.operations import OPERATION_HANDLERS, LightningOperations, OperationHandler
from lit_losses.controller.rules import RULE_FUNCTIONS, RuleError, check_rule
from lit_losses.errors import ConfigError

TOP_LEVEL = ("controller-metrics", "controller_metrics", "operations", "controllers")
PATIENCE_MODES = ("reset_on_failure", "no_reset")


@dataclass
class Patience:
    """Fire after ``patience_threshold`` consecutive (``reset_on_failure``) or cumulative (``no_reset``)
    evaluations on which the rule held; the count restarts after each firing."""

    patience_threshold: int = 1
    mode: str = "reset_on_failure"


@dataclass
class Controller:
    """One rule: when it holds on one of its triggers (any rank), perform its operations."""

    name: str
    triggers: list[str]
    rule: str
    operations: list[tuple[str, str]]
    patience: Patience = field(default_factory=Patience)
    names: frozenset[str] = frozenset()
    """Metric names the rule reads."""


@dataclass
class ControllerConfig:
    metrics: dict[str, MetricHandler]
    operations: dict[str, OperationHandler]
    controllers: list[Controller]


def load_source(source: str | Path | Mapping[str, Any]) -> dict[str, Any]:
    """A config from a dict, a YAML file path, or an inline YAML string."""
    if isinstance(source, Mapping):
        return dict(source)
    text = str(source)
    if "\n" not in text and Path(text).suffix in (".yaml", ".yml", ".json"):
        path = Path(text)
        if not path.is_file():
            raise ConfigError(f"controller config file {text!r} does not exist")
        text = path.read_text()
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"controller config is not valid YAML: {exc}") from None
    if not isinstance(data, Mapping):
        raise ConfigError(
            f"controller config must be a mapping with keys {TOP_LEVEL}, got {type(data).__name__}"
        )
    return dict(data)


def parse_config(source: str | Path | Mapping[str, Any]) -> ControllerConfig:
    """Load and validate; raises one `ConfigError` listing every problem with its YAML path."""
    data = load_source(source)
    problems: list[str] = []
    for key in data:
        if key not in TOP_LEVEL:
            problems.append(f"{key}: unknown key (allowed: {list(TOP_LEVEL)})")
    if "controller-metrics" in data and "controller_metrics" in data:
        problems.append("controller_metrics: give either controller-metrics or controller_metrics, not both")
    metric_key = "controller-metrics" if "controller-metrics" in data else "controller_metrics"
    metrics = _build_entries(data.get(metric_key) or [], metric_key, METRIC_HANDLERS, problems, "metric")
    for path, handler in list(metrics.items()):
        try:
            handler.validate()
        except ConfigError as exc:
            problems.append(f"{handler._path}.arguments: {exc}")
            del metrics[path]
    metric_names = tuple(metrics)
    for name, handler in metrics.items():
        if name in RULE_FUNCTIONS or not name.isidentifier() or name.startswith("_"):
            problems.append(f"{handler._path}.name: {name!r} must be an identifier, not a rule function name")
    operations = {"lightning": LightningOperations("lightning")}
    operations.update(
        _build_entries(data.get("operations") or [], "operations", OPERATION_HANDLERS, problems, "operation")
    )
    for handler in operations.values():
        try:
            handler.validate(metric_names)
        except (ConfigError, RuleError) as exc:
            problems.append(f"{getattr(handler, '_path', 'operations.lightning')}.arguments: {exc}")
    controllers = _build_controllers(data.get("controllers"), metric_names, operations, problems)
    if problems:
        listing = "\n".join(f"  {p}" for p in problems)
        raise ConfigError(f"controller config has {len(problems)} problem(s):\n{listing}")
    return ControllerConfig(metrics, operations, controllers)


def _build_entries(
    entries: Any, key: str, registry: Mapping[str, Any], problems: list[str], kind: str
) -> dict:
    built: dict[str, Any] = {}
    if not isinstance(entries, list):
        problems.append(f"{key}: must be a list, got {type(entries).__name__}")
        return built
    for i, entry in enumerate(entries):
        path = f"{key}[{i}]"
        if not isinstance(entry, Mapping):
            problems.append(f"{path}: must be a mapping with name, class, arguments")
            continue
        unknown = sorted(set(entry) - {"name", "class", "arguments"})
        if unknown:
            problems.append(f"{path}: unknown keys {unknown}")
        name, cls, arguments = entry.get("name"), entry.get("class"), entry.get("arguments") or {}
        if not isinstance(name, str) or not name:
            problems.append(f"{path}.name: missing or not a string")
            continue
        if name in built or (kind == "operation" and name == "lightning" and cls != "LightningOperations"):
            problems.append(f"{path}.name: duplicate or reserved {kind} name {name!r}")
            continue
        if cls not in registry:
            problems.append(f"{path}.class: unknown {kind} class {cls!r}; registered: {sorted(registry)}")
            continue
        if not isinstance(arguments, Mapping):
            problems.append(f"{path}.arguments: must be a mapping")
            continue
        handler = registry[cls](name, **arguments)
        handler._path = path
        built[name] = handler
    return built


def _build_controllers(
    entries: Any, metric_names: tuple[str, ...], operations: dict, problems: list[str]
) -> list:
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
        unknown = sorted(set(entry) - {"name", "triggers", "rule", "operations", "patience"})
        if unknown:
            problems.append(f"{path}: unknown keys {unknown}")
        name = entry.get("name")
        if not isinstance(name, str) or not name or name in seen:
            problems.append(f"{path}.name: missing, not a string, or duplicate ({name!r})")
            name = f"#{i}"
        seen.add(name)
        label = f"{path} ({name})"
        triggers = entry.get("triggers")
        if not isinstance(triggers, list) or not triggers:
            problems.append(
                f"{label}.triggers: must be a non-empty list of Lightning hooks {list(ALL_EVENTS)}"
            )
            triggers = []
        for t in triggers:
            if t not in ALL_EVENTS:
                problems.append(f"{label}.triggers: unknown trigger {t!r}; choose among {list(ALL_EVENTS)}")
        rule, names = entry.get("rule"), frozenset()
        try:
            tree = check_rule(rule, metric_names)
            names = frozenset(
                n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id in metric_names
            )
        except RuleError as exc:
            problems.append(f"{label}.rule: {exc}")
        ops = []
        raw_ops = entry.get("operations")
        if not isinstance(raw_ops, list) or not raw_ops:
            problems.append(f"{label}.operations: must be a non-empty list of 'operation.action'")
            raw_ops = []
        for op in raw_ops:
            target, _, action = str(op).partition(".")
            if target not in operations:
                defined = sorted(operations)
                problems.append(
                    f"{label}.operations: unknown operation {target!r} in {op!r}; defined: {defined}"
                )
            elif action not in operations[target].actions():
                actions = list(operations[target].actions())
                problems.append(
                    f"{label}.operations: unknown action {action!r} of {target!r}; actions: {actions}"
                )
            else:
                ops.append((target, action))
        patience = _patience(entry.get("patience"), f"{label}.patience", problems)
        controllers.append(Controller(name, list(triggers), str(rule), ops, patience, names))
    return controllers


def _patience(raw: Any, path: str, problems: list[str]) -> Patience:
    if raw is None:
        return Patience()
    if not isinstance(raw, Mapping):
        problems.append(f"{path}: must be a mapping with patience_threshold and mode")
        return Patience()
    unknown = sorted(set(raw) - {"patience_threshold", "mode"})
    threshold, mode = raw.get("patience_threshold", 1), raw.get("mode", "reset_on_failure")
    if unknown:
        problems.append(f"{path}: unknown keys {unknown}")
    if not isinstance(threshold, int) or isinstance(threshold, bool) or threshold < 1:
        problems.append(f"{path}.patience_threshold: must be an integer >= 1, got {threshold!r}")
        threshold = 1
    if mode not in PATIENCE_MODES:
        problems.append(f"{path}.mode: {mode!r} is not one of {list(PATIENCE_MODES)}")
    return Patience(threshold, mode)
