"""The controller's YAML schema, loaded and validated up front (every problem reported at once)."""

from __future__ import annotations

import ast
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

import yaml

from lit_losses.controller.metrics import ALL_EVENTS, METRIC_HANDLERS, MetricHandler, Trigger
from lit_losses.controller.operations import OPERATION_HANDLERS, LightningOperations, OperationHandler
from lit_losses.controller.rules import RULE_FUNCTIONS, RuleError, check_rule
from lit_losses.errors import ConfigError
from lit_losses.registry import Registry

TOP_LEVEL = ("controller-metrics", "controller_metrics", "operations", "controllers")

PatienceMode = Literal["reset_on_failure", "no_reset_on_failure"]
"""How a failed evaluation affects the patience count (fms-hf-tuning's names)."""

PATIENCE_MODES: tuple[PatienceMode, ...] = get_args(PatienceMode)
PATIENCE_ALIASES: dict[str, PatienceMode] = {"no_reset": "no_reset_on_failure"}
"""Earlier spellings of patience modes, still accepted."""


@dataclass
class Patience:
    """When a controller whose rule holds fires.

    It fires after ``patience_threshold`` consecutive (``reset_on_failure``: a failed evaluation
    restarts the count) or cumulative (``no_reset_on_failure``) evaluations on which the rule held;
    the count restarts after each firing.

    Attributes:
        patience_threshold: evaluations on which the rule must hold (>= 1).
        mode: a `PatienceMode`.
    """

    patience_threshold: int = 1
    mode: PatienceMode = "reset_on_failure"


@dataclass
class Controller:
    """One rule: when it holds on one of its triggers (any rank), perform its operations.

    Attributes:
        name: unique among the controllers.
        triggers: the hooks on which the rule is evaluated.
        rule: the validated rule expression.
        operations: ``(operation name, action)`` pairs, performed in order.
        patience: when a rule that holds fires.
        names: the metric names the rule reads (it skips until all are available).
    """

    name: str
    triggers: list[Trigger]
    rule: str
    operations: list[tuple[str, str]]
    patience: Patience = field(default_factory=Patience)
    names: frozenset[str] = frozenset()
    """Metric names the rule reads."""


@dataclass
class ControllerConfig:
    """A validated controller config (what `parse_config` returns).

    Attributes:
        metrics: the metric handlers, by name (the names rules read).
        operations: the operation handlers, by name (``lightning`` always included).
        controllers: the controllers, in YAML order.
    """

    metrics: dict[str, MetricHandler]
    operations: dict[str, OperationHandler]
    controllers: list[Controller]


def load_source(source: str | Path | Mapping[str, Any]) -> dict[str, Any]:
    """A config from a dict, a YAML file path, or an inline YAML string.

    Raises:
        ConfigError: a missing file, invalid YAML, or a document that is not a mapping.
    """
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
    """Load and validate a controller config (fms-hf-tuning's trainer-controller schema).

    Everything that can be checked without a trainer is: keys, handler classes (registered names or
    import paths ``pkg.module.Class``) and their arguments, rules (statically, nothing runs),
    triggers, operations and their actions, patience.

    Args:
        source: a dict, a YAML file path (``.yaml``/``.yml``/``.json``), or an inline YAML string.

    Returns:
        The handlers, built and validated, and the controllers.

    Raises:
        ConfigError: one error listing every problem, each with its YAML path.

    Example:
        >>> from lit_losses.controller import parse_config
        >>> config = parse_config(
        ...     {
        ...         "controller-metrics": [{"name": "train_loss", "class": "Loss"}],
        ...         "controllers": [
        ...             {
        ...                 "name": "loss-runaway",
        ...                 "triggers": ["on_train_batch_end"],
        ...                 "rule": 'train_loss["loss"] > 10',
        ...                 "operations": ["lightning.should_training_stop"],
        ...             }
        ...         ],
        ...     }
        ... )
        >>> [c.name for c in config.controllers], sorted(config.metrics), sorted(config.operations)
        (['loss-runaway'], ['train_loss'], ['lightning'])
        >>> parse_config({"controllers": [{"name": "c", "triggers": ["on_step_end"]}]})  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        lit_losses.errors.ConfigError: controller config has 3 problem(s):
          controllers[0] (c).triggers: unknown trigger 'on_step_end'; choose among [...]
          controllers[0] (c).rule: a rule must be a non-empty string, got None
          controllers[0] (c).operations: must be a non-empty list of 'operation.action'
    """
    data = load_source(source)
    problems: list[str] = []
    for key in data:
        if key not in TOP_LEVEL:
            problems.append(f"{key}: unknown key (allowed: {list(TOP_LEVEL)})")
    if "controller-metrics" in data and "controller_metrics" in data:
        problems.append("controller_metrics: give either controller-metrics or controller_metrics, not both")
    metric_key = "controller-metrics" if "controller-metrics" in data else "controller_metrics"
    metrics = _build_entries(data.get(metric_key) or [], metric_key, METRIC_HANDLERS, problems)
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
        _build_entries(
            data.get("operations") or [],
            "operations",
            OPERATION_HANDLERS,
            problems,
            reserved={"lightning": LightningOperations},
        )
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
    entries: Any,
    key: str,
    registry: Registry[type],
    problems: list[str],
    reserved: Mapping[str, type] | None = None,
) -> dict:
    """The handlers of the ``key`` list, by name; each problem is appended to ``problems``.

    ``reserved`` maps names that only one class may take (``lightning``) to that class.
    """
    reserved = reserved or {}
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
        if name in built:
            problems.append(f"{path}.name: duplicate {registry.kind} name {name!r}")
            continue
        if not isinstance(cls, str) or not cls:
            problems.append(
                f"{path}.class: must be a registered {registry.kind} name or an import path, got {cls!r}"
            )
            continue
        try:
            handler_cls = registry.get(cls, where=f"{path}.class")
        except ConfigError as exc:
            problems.append(str(exc))
            continue
        if name in reserved and handler_cls is not reserved[name]:
            problems.append(f"{path}.name: {name!r} is reserved for {reserved[name].__name__}")
            continue
        if not isinstance(arguments, Mapping):
            problems.append(f"{path}.arguments: must be a mapping")
            continue
        handler = handler_cls(name, **arguments)
        handler._path = path
        built[name] = handler
    return built


def _build_controllers(
    entries: Any, metric_names: tuple[str, ...], operations: dict, problems: list[str]
) -> list:
    """The ``controllers`` list; each problem is appended to ``problems``."""
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
    if not isinstance(threshold, int) or isinstance(threshold, bool) or threshold < 1:
        problems.append(f"{path}.patience_threshold: must be an integer >= 1, got {threshold!r}")
        threshold = 1
    mode = PATIENCE_ALIASES.get(mode, mode) if isinstance(mode, str) else mode
    if mode not in PATIENCE_MODES:
        problems.append(f"{path}.mode: {mode!r} is not one of {list(PATIENCE_MODES)}")
    return Patience(threshold, mode)
