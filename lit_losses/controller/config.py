"""The controller's YAML schema (fms-hf-tuning's trainer-controller schema), loaded and validated up front:
every problem is reported at once, with its YAML path."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from lit_losses.controller.entries import Controller, build_controllers
from lit_losses.controller.events import resolve_handler_events
from lit_losses.controller.metrics import METRIC_HANDLERS, MetricHandler
from lit_losses.controller.operations import (
    OPERATION_HANDLERS,
    HFControls,
    LightningOperations,
    OperationHandler,
)
from lit_losses.controller.rules import RULE_FUNCTIONS, RuleError
from lit_losses.errors import ConfigError
from lit_losses.registry import Registry

TOP_LEVEL = ("controller-metrics", "controller_metrics", "operations", "controllers")
RESERVED_OPERATIONS: dict[str, type[OperationHandler]] = {
    "lightning": LightningOperations,
    "hfcontrols": HFControls,
}
"""Operations every config has, under these names."""


@dataclass
class ControllerConfig:
    """A validated controller config (what `parse_config` returns).

    Attributes:
        metrics: the metric handlers, by name (the names rules read).
        operations: the operation handlers, by name (``lightning`` and ``hfcontrols`` always included).
        controllers: the controllers, in YAML order.
    """

    metrics: dict[str, MetricHandler]
    operations: dict[str, OperationHandler]
    controllers: list[Controller]


class UnregisteredClassError(ConfigError):
    """A config whose only problems are handler classes not registered yet (fms-hf-tuning registers
    custom handlers on the callback after creating it: `TrainingController` waits for them)."""


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


class _Problems(list):
    """Problems found so far, and the handler names whose class is not registered (yet)."""

    def __init__(self) -> None:
        super().__init__()
        self.unregistered: set[str] = set()


def parse_config(source: str | Path | Mapping[str, Any]) -> ControllerConfig:
    """Load and validate a controller config (fms-hf-tuning's trainer-controller schema).

    Everything that can be checked without a trainer is: keys, handler classes (registered names or
    import paths ``pkg.module.Class``) and their arguments, rules (statically, nothing runs), triggers
    (Lightning events or Hugging Face names), operations and their actions, patience, ``config``.

    Args:
        source: a dict, a YAML file path (``.yaml``/``.yml``/``.json``), or an inline YAML string.

    Returns:
        The handlers, built and validated, and the controllers.

    Raises:
        ConfigError: one error listing every problem, each with its YAML path
            (`UnregisteredClassError` when the only problems are unregistered class names).

    Example:
        >>> from lit_losses.controller import parse_config
        >>> config = parse_config(
        ...     {
        ...         "controller-metrics": [{"name": "train_loss", "class": "Loss"}],
        ...         "controllers": [
        ...             {
        ...                 "name": "loss-runaway",
        ...                 "triggers": ["on_log"],
        ...                 "rule": 'train_loss["loss"] > 10',
        ...                 "operations": ["hfcontrols.should_training_stop"],
        ...             }
        ...         ],
        ...     }
        ... )
        >>> [c.triggers for c in config.controllers], sorted(config.operations)
        ([['on_optimizer_step_end']], ['hfcontrols', 'lightning'])
        >>> parse_config({"controllers": [{"name": "c", "triggers": ["on_step"]}]})  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        lit_losses.errors.ConfigError: controller config has 3 problem(s):
          controllers[0] (c).triggers: unknown trigger 'on_step'; did you mean ...
          controllers[0] (c).rule: a rule must be a non-empty string, got None
          controllers[0] (c).operations: must be a non-empty list of 'operation.action'
    """
    data = load_source(source)
    problems = _Problems()
    for key in data:
        if key not in TOP_LEVEL:
            problems.append(f"{key}: unknown key (allowed: {list(TOP_LEVEL)})")
    if "controller-metrics" in data and "controller_metrics" in data:
        problems.append("controller_metrics: give either controller-metrics or controller_metrics, not both")
    metric_key = "controller-metrics" if "controller-metrics" in data else "controller_metrics"
    metrics = _build_entries(data.get(metric_key) or [], metric_key, METRIC_HANDLERS, problems)
    for name, handler in list(metrics.items()):
        if not _check_metric(handler, problems):
            del metrics[name]
    metric_names = (*metrics, *(n for n in problems.unregistered if n not in metrics))
    for name in metrics:
        if name in RULE_FUNCTIONS or not name.isidentifier() or name.startswith("_"):
            problems.append(
                f"{metrics[name]._path}.name: {name!r} must be an identifier, not a rule function"
            )
    operations = {name: cls(name) for name, cls in RESERVED_OPERATIONS.items()}
    entries = data.get("operations") or []
    operations.update(
        _build_entries(entries, "operations", OPERATION_HANDLERS, problems, RESERVED_OPERATIONS)
    )
    for name, handler in operations.items():
        try:
            handler.validate(metric_names)
        except (ConfigError, RuleError) as exc:
            problems.append(f"{getattr(handler, '_path', f'operations.{name}')}.arguments: {exc}")
    controllers = build_controllers(data.get("controllers"), metric_names, operations, problems)
    if problems:
        listing = "\n".join(f"  {p}" for p in problems)
        unregistered_only = all(p.startswith("!") for p in problems)
        error = UnregisteredClassError if unregistered_only else ConfigError
        raise error(f"controller config has {len(problems)} problem(s):\n{listing.replace('  !', '  ')}")
    return ControllerConfig(metrics, operations, controllers)


def _check_metric(handler: MetricHandler, problems: list[str]) -> bool:
    """Validate a metric handler and resolve its events; False (with a problem) when it is refused."""
    try:
        accepted = handler.validate()
        handler.event_names = resolve_handler_events(handler.events, f"{handler._path}.events")
        handler.events = tuple(handler.event_names)
    except (ConfigError, RuleError) as exc:
        problems.append(f"{handler._path}.arguments: {exc}")
        return False
    if accepted is False:
        cls = type(handler).__name__
        problems.append(f"{handler._path}: {cls}.validate() refused its arguments {handler.arguments}")
        return False
    return True


def _build_entries(
    entries: Any,
    key: str,
    registry: Registry[type],
    problems: _Problems,
    reserved: Mapping[str, type] | None = None,
) -> dict:
    """The handlers of the ``key`` list, by name; each problem is appended to ``problems`` (a class not
    registered yet is marked with a leading ``!`` and its entry's name kept in ``unregistered``).

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
            problems.append(str(exc) if "." in cls else f"!{exc}")
            if "." not in cls:
                problems.unregistered.add(name)
            continue
        if name in reserved and handler_cls is not reserved[name]:
            problems.append(f"{path}.name: {name!r} is reserved for {reserved[name].__name__}")
            continue
        if not isinstance(arguments, Mapping):
            problems.append(f"{path}.arguments: must be a mapping")
            continue
        try:
            handler = handler_cls(name=name, **arguments)
        except ConfigError as exc:
            problems.append(f"{path}.arguments: {exc}")
            continue
        except Exception as exc:  # a handler whose constructor refuses its arguments
            problems.append(f"{path}: {cls}({dict(arguments)}) failed: {type(exc).__name__}: {exc}")
            continue
        handler._path = path
        built[name] = handler
    return built
