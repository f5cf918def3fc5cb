"""`LogControl`: a log line with placeholders, in lit_losses' form (rule expressions) or fms-hf-tuning's
(``str.format`` fields)."""

from __future__ import annotations

import logging
import re
import string
from typing import Any

from lit_losses.controller.operations import LOG_LEVELS, OperationHandler, register_operation_handlers
from lit_losses.controller.rules import RuleEvaluator, check_rule
from lit_losses.errors import ConfigError

log = logging.getLogger("lit_losses.controller")

_PLACEHOLDER = re.compile(r"\{([^{}]+)\}")

FORMAT_FIELDS = (
    "event_name",
    "control_name",
    "args",
    "state",
    "control",
    "path",
    "hf_path",
    "is_final",
    "metrics",
)
"""The ``log_format`` fields besides the metric names (fms-hf-tuning's keyword arguments): the event as
the controller names it, the controller, the trainer (``args``), a `TrainerStateView`, the
`TrainerControl`; on ``on_save``: the checkpoint folder (``path``, ``hf_path``) and ``is_final``; on
``on_evaluate``: the validation ``metrics`` (``eval_<x>``)."""


def _split_format(expression: str) -> tuple[str, str]:
    head, sep, spec = expression.rpartition(":")
    if sep and re.fullmatch(r"[<>=^+\- #0-9,._a-zA-Z%]*", spec) and head.count("[") == head.count("]"):
        return head, spec
    return expression, ""


class LogControl(OperationHandler):
    """``should_log``: a message logged on the ``lit_losses.controller`` logger, stored as
    ``context["message"]``.

    Arguments, in either form:

    - ``message`` with ``{expression}`` placeholders: rule expressions over the metrics (validated like
      rules), e.g. ``"loss {train_loss['loss']:.3f} at step {state['global_step']}"`` (a format spec may
      follow ``:``); ``level`` (a `LogLevel`, default ``INFO``).
    - fms-hf-tuning's ``log_format``: ``str.format`` fields (``{trainer_state[epoch]:.0f}``, unquoted
      keys) over the metric names and `FORMAT_FIELDS`; ``log_level``.

    A placeholder that cannot be rendered yet renders as ``<placeholder: ErrorName>``.
    """

    def validate(self, metric_names):
        self._unknown_arguments(("message", "level", "log_format", "log_level"))
        if ("message" in self.arguments) == ("log_format" in self.arguments):
            raise ConfigError("LogControl needs one of arguments.message or arguments.log_format (a string)")
        if "level" in self.arguments and "log_level" in self.arguments:
            raise ConfigError("give arguments.level or arguments.log_level, not both")
        level = str(self.arguments.get("level", self.arguments.get("log_level", "INFO"))).upper()
        if level not in LOG_LEVELS:
            raise ConfigError(f"arguments.level {level!r} is not a logging level; choose among {LOG_LEVELS}")
        self.level = getattr(logging, level)
        text = self.arguments.get("message", self.arguments.get("log_format"))
        if not isinstance(text, str):
            raise ConfigError(f"LogControl's message must be a string, got {text!r}")
        if "message" in self.arguments:
            for expression in _PLACEHOLDER.findall(text):
                check_rule(_split_format(expression)[0], metric_names)
            self._evaluator = RuleEvaluator()
            return
        allowed = {*metric_names, *FORMAT_FIELDS}
        try:
            fields = [f for _, f, _, _ in string.Formatter().parse(text) if f is not None]
        except ValueError as exc:
            raise ConfigError(f"arguments.log_format is not a format string: {exc}") from None
        for name in fields:
            root = re.split(r"[.\[]", name, maxsplit=1)[0]
            if root not in allowed:
                raise ConfigError(f"arguments.log_format: unknown field {{{name}}}; known: {sorted(allowed)}")

    def should_log(self, trainer, pl_module, context) -> None:
        if "message" in self.arguments:
            message = _PLACEHOLDER.sub(
                lambda m: self._render_expression(m, context), self.arguments["message"]
            )
        else:
            message = self._render_format(self.arguments["log_format"], context)
        log.log(self.level, "[controller %s] %s", context["controller"], message)
        context["message"] = message

    def _render_expression(self, match: re.Match, context: dict) -> str:
        expression, spec = _split_format(match.group(1))
        try:
            return format(self._evaluator.evaluate(expression, context["metrics"]), spec)
        except Exception as exc:  # a metric not available yet: say so in the message
            return f"<{expression}: {type(exc).__name__}>"

    @staticmethod
    def _render_format(text: str, context: dict) -> str:
        formatter = string.Formatter()
        names: dict[str, Any] = {
            **context["metrics"],
            "event_name": context["event_name"],
            "control_name": context["controller"],
            "args": context.get("trainer"),
            "state": context.get("state"),
            "control": context.get("control"),
            **context.get("event_kwargs", {}),
        }
        parts = []
        for literal, name, spec, conversion in formatter.parse(text):
            parts.append(literal)
            if name is None:
                continue
            try:
                value = formatter.convert_field(formatter.get_field(name, (), names)[0], conversion)
                parts.append(formatter.format_field(value, spec or ""))
            except Exception as exc:  # a field not available on this event
                parts.append(f"<{name}: {type(exc).__name__}>")
        return "".join(parts)


register_operation_handlers(LogControl)
