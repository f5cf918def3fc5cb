"""The controller's YAML schema (fms-hf-tuning's trainer-controller schema), loaded and validated up front:
every problem is reported at once, with its YAML path."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from lit_losses.controller.entries import Controller, build_controllers
from lit_losses.controller.events import resolve_handler_events
from lit_losses.controller.metrics import METRIC_HANDLERS, MetricHandler
from lit_losses.controller.operations import OPERATION_HANDLERS, LightningOperations, OperationHandler
from lit_losses.controller.rules import RULE_FUNCTIONS, RuleError
from lit_losses.errors import ConfigError
from lit_losses.registry import Registry

TOP_LEVEL = ("controller-metrics", "controller_metrics", "operations", "controllers")
RESERVED_OPERATIONS: dict[str, type[OperationHandler]] = {"lightning": LightningOperations}
"""Operations every config has, under these names (`reserve_operation`; the fms-hf-tuning adapter adds
``hfcontrols``)."""


def reserve_operation(name: str, cls: type[OperationHandler]) -> None:
    """Give every config the operation ``name`` of class ``cls`` (no other class may take that name).

    Raises:
        ValueError: ``name`` is reserved for another class already.
    """
    if RESERVED_OPERATIONS.setdefault(name, cls) is not cls:
        raise ValueError(f"operation name {name!r} is reserved for {RESERVED_OPERATIONS[name].__name__}")


@dataclass
class ControllerConfig:
    """A validated controller config (what `parse_config` returns).

    Attributes:
        metrics: the metric handlers, by name (the names rules read).
        operations: the operation handlers, by name (the `RESERVED_OPERATIONS` always included).
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
    text, name = os.fspath(source) if isinstance(source, os.PathLike) else str(source), "controller config"
    if "\n" not in text and Path(text).suffix in (".yaml", ".yml", ".json"):
        path = Path(text)
        if not path.is_file():
            raise ConfigError(
                f"controller config file {text!r} does not exist (a relative path is looked up in the folder "
                f"of the config file that names it, then in the working directory {os.getcwd()})"
            )
        text, name = path.read_text(), f"controller config file {text!r}"
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f", line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or type(exc).__name__
        raise ConfigError(f"{name} is not valid YAML ({problem}{where})") from None
    if not isinstance(data, Mapping):
        got = "an empty document" if data is None else f"a {type(data).__name__}"
        raise ConfigError(f"{name} must be a mapping with keys {TOP_LEVEL}, got {got}")
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
    metrics = _metric_handlers(data, problems)
    metric_names = (*metrics, *(n for n in problems.unregistered if n not in metrics))
    operations = _operation_handlers(data.get("operations") or [], metric_names, problems)
    controllers = build_controllers(
        data.get("controllers"), metric_names=metric_names, operations=operations, problems=problems
    )
    if problems:
        listing = "\n".join(f"  {p}" for p in problems)
        unregistered_only = all(p.startswith("!") for p in problems)
        error = UnregisteredClassError if unregistered_only else ConfigError
        raise error(f"controller config has {len(problems)} problem(s):\n{listing.replace('  !', '  ')}")
    return ControllerConfig(metrics, operations, controllers)


def _metric_handlers(data: Mapping[str, Any], problems: _Problems) -> dict[str, MetricHandler]:
    """The validated metric handlers of ``controller-metrics`` (or ``controller_metrics``), by name."""
    if "controller-metrics" in data and "controller_metrics" in data:
        problems.append("controller_metrics: give either controller-metrics or controller_metrics, not both")
    metric_key = "controller-metrics" if "controller-metrics" in data else "controller_metrics"
    metrics = _build_entries(
        data.get(metric_key) or [], key=metric_key, registry=METRIC_HANDLERS, problems=problems
    )
    for name, handler in list(metrics.items()):
        if not _check_metric(handler, problems):
            del metrics[name]
    for name in metrics:
        if name in RULE_FUNCTIONS or not name.isidentifier() or name.startswith("_"):
            problems.append(
                f"{metrics[name]._path}.name: {name!r} must be an identifier, not a rule function"
            )
    return metrics


def _operation_handlers(
    entries: Any, metric_names: tuple[str, ...], problems: _Problems
) -> dict[str, OperationHandler]:
    """The reserved operations and those of ``operations``, each validated against ``metric_names``."""
    operations = {name: cls(name) for name, cls in RESERVED_OPERATIONS.items()}
    operations.update(
        _build_entries(
            entries,
            key="operations",
            registry=OPERATION_HANDLERS,
            problems=problems,
            reserved=RESERVED_OPERATIONS,
        )
    )
    for name, handler in operations.items():
        try:
            handler.validate(metric_names)
        except (ConfigError, RuleError) as exc:
            problems.append(f"{getattr(handler, '_path', f'operations.{name}')}.arguments: {exc}")
    return operations


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
    built: dict[str, Any] = {}
    if not isinstance(entries, list):
        problems.append(f"{key}: must be a list, got {type(entries).__name__}")
        return built
    for i, entry in enumerate(entries):
        named = _build_entry(
            entry,
            path=f"{key}[{i}]",
            registry=registry,
            problems=problems,
            built=built,
            reserved=reserved or {},
        )
        if named is not None:
            built[named[0]] = named[1]
    return built


def _entry_fields(entry: Any, path: str, problems: _Problems) -> tuple[str, Any, Any] | None:
    """``(name, class, arguments)`` of one entry; ``None`` (with a problem) when it has no usable name."""
    if not isinstance(entry, Mapping):
        problems.append(f"{path}: must be a mapping with name, class, arguments")
        return None
    unknown = sorted(set(entry) - {"name", "class", "arguments"})
    if unknown:
        problems.append(f"{path}: unknown keys {unknown}")
    name = entry.get("name")
    if not isinstance(name, str) or not name:
        problems.append(f"{path}.name: missing or not a string")
        return None
    return name, entry.get("class"), entry.get("arguments") or {}


def _handler_class(
    cls: Any, name: str, path: str, registry: Registry[type], problems: _Problems
) -> type | None:
    """The class an entry names; ``None`` (with a problem) when it is not given or not found (a name
    not registered yet is marked with a leading ``!`` and kept in ``problems.unregistered``)."""
    if not isinstance(cls, str) or not cls:
        problems.append(
            f"{path}.class: must be a registered {registry.kind} name or an import path, got {cls!r}"
        )
        return None
    try:
        return registry.get(cls, where=f"{path}.class")
    except ConfigError as exc:
        problems.append(str(exc) if "." in cls else f"!{exc}")
        if "." not in cls:
            problems.unregistered.add(name)
        return None


def _build_entry(
    entry: Any,
    path: str,
    registry: Registry[type],
    problems: _Problems,
    built: Mapping[str, Any],
    reserved: Mapping[str, type],
) -> tuple[str, Any] | None:
    """``(name, handler)`` of one entry at ``path``, or ``None`` with its problems appended."""
    fields = _entry_fields(entry, path, problems)
    if fields is None:
        return None
    name, cls, arguments = fields
    if name in built:
        problems.append(f"{path}.name: duplicate {registry.kind} name {name!r}")
        return None
    handler_cls = _handler_class(cls, name=name, path=path, registry=registry, problems=problems)
    if handler_cls is None:
        return None
    if name in reserved and handler_cls is not reserved[name]:
        problems.append(f"{path}.name: {name!r} is reserved for {reserved[name].__name__}")
        return None
    if not isinstance(arguments, Mapping):
        problems.append(f"{path}.arguments: must be a mapping")
        return None
    try:
        handler = handler_cls(name=name, **arguments)
    except ConfigError as exc:
        problems.append(f"{path}.arguments: {exc}")
        return None
    except Exception as exc:  # a handler whose constructor refuses its arguments
        problems.append(f"{path}: {cls}({dict(arguments)}) failed: {type(exc).__name__}: {exc}")
        return None
    handler._path = path
    return name, handler
