"""`LogControl`: a log line with placeholders, written in one of the registered `MessageForm` s: lit_losses'
own (rule expressions, ``message``), or another convention's (fms-hf-tuning's ``log_format``, registered by
`lit_losses.controller.fms`)."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lit_losses.controller.operations import LOG_LEVELS, OperationHandler, register_operation_handlers
from lit_losses.controller.rules import RuleEvaluator, check_rule
from lit_losses.errors import ConfigError

log = logging.getLogger("lit_losses.controller")

_PLACEHOLDER = re.compile(r"\{([^{}]+)\}")


@dataclass(frozen=True)
class MessageForm:
    """One way of writing `LogControl`'s message.

    Attributes:
        argument: the argument that holds the message (``message``).
        level_argument: the argument that holds its logging level (``level``).
        check: ``check(text, metric_names)`` when the config is parsed (raise `ConfigError`).
        render: ``render(text, context) -> str`` with the action's ``context`` (``metrics``, ``controller``,
            ``event_name``, ``trainer``, ``control``, ``event_kwargs``, …).
    """

    argument: str
    level_argument: str
    check: Callable[[str, tuple[str, ...]], None]
    render: Callable[[str, dict[str, Any]], str]


MESSAGE_FORMS: dict[str, MessageForm] = {}
"""The registered forms, by the argument that holds the message."""


def register_message_form(form: MessageForm) -> MessageForm:
    """Accept ``form.argument`` (and ``form.level_argument``) as `LogControl` arguments; returns ``form``."""
    MESSAGE_FORMS[form.argument] = form
    return form


def _split_format(expression: str) -> tuple[str, str]:
    """``(expression, format spec)`` of a placeholder's text ``expression[:spec]``."""
    head, sep, spec = expression.rpartition(":")
    if sep and re.fullmatch(r"[<>=^+\- #0-9,._a-zA-Z%]*", spec) and head.count("[") == head.count("]"):
        return head, spec
    return expression, ""


_EVALUATOR = RuleEvaluator()


FORMAT_SAMPLES = (1.5, 1, "text")
"""Values of the types a placeholder renders (a float, an int or bool, a string): a format spec must fit
one of them."""


def check_format_spec(spec: str, placeholder: str, where: str) -> None:
    """Refuse, when the config is parsed, a format spec that no value can take (``.3q``, ``%Y``): at run
    time it would only render as ``<placeholder: ValueError>`` in the log.

    Raises:
        ConfigError: naming ``where``, the placeholder, the spec and Python's reason.

    Example:
        >>> check_format_spec(".3f", "loss", "arguments.message")
        >>> check_format_spec(".3q", "loss", "arguments.message")
        Traceback (most recent call last):
        ...
        lit_losses.errors.ConfigError: arguments.message: {loss:.3q} has a format spec that fits no value ...
    """
    if not spec or "{" in spec:  # nested fields ({x:{width}}) are filled at run time
        return
    reasons = []
    for sample in FORMAT_SAMPLES:
        try:
            format(sample, spec)
            return
        except (ValueError, TypeError) as exc:
            reasons.append(str(exc))
    raise ConfigError(
        f"{where}: {{{placeholder}:{spec}}} has a format spec that fits no value (a float, an int or a "
        f"string): {reasons[0]}; see Python's format specification mini-language"
    )


def _check_expressions(text: str, metric_names: tuple[str, ...]) -> None:
    for expression in _PLACEHOLDER.findall(text):
        head, spec = _split_format(expression)
        check_rule(head, metric_names)
        check_format_spec(spec, head, "arguments.message")


def _render_expression(match: re.Match, context: dict[str, Any]) -> str:
    expression, spec = _split_format(match.group(1))
    try:
        return format(_EVALUATOR.evaluate(expression, context["metrics"]), spec)
    except Exception as exc:  # a metric not available yet: say so in the message
        return f"<{expression}: {type(exc).__name__}>"


def _render_expressions(text: str, context: dict[str, Any]) -> str:
    return _PLACEHOLDER.sub(lambda m: _render_expression(m, context), text)


register_message_form(MessageForm("message", "level", _check_expressions, render=_render_expressions))


class LogControl(OperationHandler):
    """``should_log``: a message logged on the ``lit_losses.controller`` logger, stored as
    ``context["message"]``.

    Arguments: ``message`` with ``{expression}`` placeholders, rule expressions over the metrics
    (validated like rules), e.g. ``"loss {train_loss['loss']:.3f} at step {state['global_step']}"`` (a
    format spec may follow ``:``), and ``level`` (a `LogLevel`, default ``INFO``); or the arguments of
    another registered `MessageForm` (fms-hf-tuning's ``log_format`` and ``log_level``).

    A placeholder that cannot be rendered yet renders as ``<placeholder: ErrorName>``.
    """

    def validate(self, metric_names):
        forms = list(MESSAGE_FORMS.values())
        self._unknown_arguments(tuple(a for f in forms for a in (f.argument, f.level_argument)))
        given = [f for f in forms if f.argument in self.arguments]
        if len(given) != 1:
            names = " or ".join(f"arguments.{f.argument}" for f in forms)
            raise ConfigError(f"LogControl needs one of {names} (a string)")
        levels = [f.level_argument for f in forms if f.level_argument in self.arguments]
        if len(levels) > 1:
            raise ConfigError(f"give {' or '.join(f'arguments.{a}' for a in levels)}, not both")
        level = str(self.arguments[levels[0]] if levels else "INFO").upper()
        if level not in LOG_LEVELS:
            raise ConfigError(f"arguments.level {level!r} is not a logging level; choose among {LOG_LEVELS}")
        self.level = getattr(logging, level)
        self.form = given[0]
        text = self.arguments[self.form.argument]
        if not isinstance(text, str):
            raise ConfigError(f"LogControl's message must be a string, got {text!r}")
        self.form.check(text, metric_names)

    def should_log(self, trainer, pl_module, context) -> None:
        message = self.form.render(self.arguments[self.form.argument], context)
        log.log(self.level, "[controller %s] %s", context["controller"], message)
        context["message"] = message


register_operation_handlers(LogControl)
