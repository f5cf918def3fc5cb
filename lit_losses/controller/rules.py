"""Rule expressions: validated statically (nothing runs), then evaluated with simpleeval.

A rule is one Python *expression* over the metric names in scope, e.g.
``train_loss["loss"] > 10 or not is_finite(train_loss["loss"])``. Validation walks its syntax tree and
accepts only a small language: literals (numbers, short strings, ``True``/``False``/``None``, small
tuples/lists), names in scope, subscripts with literal keys, arithmetic, comparisons, boolean logic,
conditional expressions and calls of the functions in `RULE_FUNCTIONS`. Attributes, lambdas,
comprehensions, f-strings, assignments, starred arguments, keyword arguments, dunder names, huge powers
and string repetition are refused. Evaluation then runs in `simpleeval` (never Python ``eval``), which
adds its own limits.
"""

from __future__ import annotations

import ast
import difflib
import math
from collections.abc import Iterable, Mapping
from typing import Any

import simpleeval

from lit_losses.errors import ConfigError


def _is_finite(value: Any) -> bool:
    try:
        return math.isfinite(float(value))
    except (TypeError, ValueError):
        return False


RULE_FUNCTIONS: dict[str, Any] = {
    "abs": abs,
    "len": len,
    "min": min,
    "max": max,
    "round": round,
    "sum": sum,
    "float": float,
    "int": int,
    "is_finite": _is_finite,
    "mean": lambda values: sum(values) / len(values) if len(values) else float("nan"),
    "all": all,
    "any": any,
    "str": str,
    "math_trunc": math.trunc,
    "math_floor": math.floor,
    "math_ceil": math.ceil,
    "math_sqrt": math.sqrt,
}
"""Functions available in rules (fms-hf-tuning's ``math_*`` included)."""

MAX_RULE_CHARS = 1000
MAX_NODES = 200
MAX_STRING = 256
MAX_COLLECTION = 16
MAX_EXPONENT = 64
MAX_INT = 10**18

_ALLOWED = (
    ast.Expression,
    ast.BoolOp,
    ast.And,
    ast.Or,
    ast.BinOp,
    ast.Add,
    ast.Sub,
    ast.Mult,
    ast.Div,
    ast.FloorDiv,
    ast.Mod,
    ast.Pow,
    ast.UnaryOp,
    ast.Not,
    ast.USub,
    ast.UAdd,
    ast.Compare,
    ast.Eq,
    ast.NotEq,
    ast.Lt,
    ast.LtE,
    ast.Gt,
    ast.GtE,
    ast.In,
    ast.NotIn,
    ast.Is,
    ast.IsNot,
    ast.IfExp,
    ast.Name,
    ast.Load,
    ast.Constant,
    ast.Subscript,
    ast.Call,
    ast.Tuple,
    ast.List,
)


class RuleError(ValueError):
    """A rule that cannot be accepted; the message says why."""


class RuleFailure(ConfigError, RuntimeError):
    """A rule failed while training (it raised, or its value is not a boolean); the message names the
    controller, the rule, the step, the event and the values of the metrics it reads. An error of the
    configuration found at run time: ``lit-losses`` reports it on one line, exit code 2."""


def check_rule(rule: str, names: Iterable[str]) -> ast.Expression:
    """Parse and validate ``rule`` without running it.

    Args:
        rule: one Python expression in the language described in this module's docstring.
        names: the metric names in scope (with `RULE_FUNCTIONS`, the only names a rule may use).

    Returns:
        The parsed expression.

    Raises:
        RuleError: the rule is not accepted; the message says why (with a suggestion for a
            misspelled name).

    Example:
        >>> from lit_losses.controller import check_rule
        >>> type(check_rule('loss["value"] > 2 and is_finite(loss["value"])', ["loss"])).__name__
        'Expression'
        >>> check_rule("loss.__class__", ["loss"])
        Traceback (most recent call last):
        ...
        lit_losses.controller.rules.RuleError: Attribute is not allowed in rules
    """
    if not isinstance(rule, str) or not rule.strip():
        raise RuleError(f"a rule must be a non-empty string, got {rule!r}")
    if len(rule) > MAX_RULE_CHARS:
        raise RuleError(f"rule is {len(rule)} characters long (at most {MAX_RULE_CHARS})")
    try:
        tree = ast.parse(rule.strip(), mode="eval")
    except SyntaxError as exc:
        raise RuleError(f"syntax error in rule: {exc.msg} at column {exc.offset}") from None
    scope = set(names) | set(RULE_FUNCTIONS)
    nodes = list(ast.walk(tree))
    if len(nodes) > MAX_NODES:
        raise RuleError(f"rule has {len(nodes)} syntax nodes (at most {MAX_NODES})")
    for node in nodes:
        _check_node(node, scope)
    if (isinstance(tree.body, _NOT_BOOLEAN) and not _is_not(tree.body)) or (
        isinstance(tree.body, ast.Constant) and not isinstance(tree.body.value, bool)
    ):
        raise RuleError(f"a rule must be a condition, but {ast.unparse(tree.body)!r} is not a boolean")
    return tree


_NOT_BOOLEAN = (ast.BinOp, ast.List, ast.Tuple, ast.UnaryOp)
"""Top-level expressions whose value is never a boolean (``not`` aside, checked apart)."""


def _is_not(node: ast.AST) -> bool:
    return isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not)


def _check_name(node: ast.Name, scope: set[str]) -> None:
    if node.id.startswith("_"):
        raise RuleError(f"name {node.id!r} is not allowed (names starting with '_')")
    if node.id not in scope:
        close = difflib.get_close_matches(node.id, sorted(scope), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise RuleError(f"name {node.id!r} is not defined{hint}; in scope: {sorted(scope)}")


def _check_constant(node: ast.Constant, scope: set[str]) -> None:
    value = node.value
    if isinstance(value, str | bytes) and len(value) > MAX_STRING:
        raise RuleError(f"string literal of {len(value)} characters (at most {MAX_STRING})")
    if isinstance(value, bytes | complex) or value is Ellipsis:
        raise RuleError(f"literal {value!r} is not allowed")
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_INT:
        raise RuleError(f"integer literal {value} is too large")


def _check_call(node: ast.Call, scope: set[str]) -> None:
    if not isinstance(node.func, ast.Name) or node.func.id not in RULE_FUNCTIONS:
        name = node.func.id if isinstance(node.func, ast.Name) else ast.unparse(node.func)
        raise RuleError(f"call of {name!r} is not allowed; functions: {sorted(RULE_FUNCTIONS)}")
    if node.keywords or any(isinstance(a, ast.Starred) for a in node.args):
        raise RuleError("keyword and starred arguments are not allowed in rules")


def _check_subscript(node: ast.Subscript, scope: set[str]) -> None:
    key = node.slice
    if not (isinstance(key, ast.Constant) and isinstance(key.value, str | int)) and not (
        isinstance(key, ast.UnaryOp) and isinstance(key.operand, ast.Constant)
    ):
        raise RuleError(f"subscripts take a literal key, got {ast.unparse(key)!r}")


def _check_collection(node: ast.Tuple | ast.List, scope: set[str]) -> None:
    if len(node.elts) > MAX_COLLECTION:
        raise RuleError(f"literal collection of {len(node.elts)} elements (at most {MAX_COLLECTION})")


def _check_binop(node: ast.BinOp, scope: set[str]) -> None:
    if isinstance(node.op, ast.Pow):
        exponent = node.right
        if not (isinstance(exponent, ast.Constant) and isinstance(exponent.value, int | float)):
            raise RuleError("the exponent of ** must be a number literal")
        if abs(exponent.value) > MAX_EXPONENT:
            raise RuleError(f"exponent {exponent.value} is too large (at most {MAX_EXPONENT})")
    if isinstance(node.op, ast.Mult) and any(
        (isinstance(side, ast.Constant) and isinstance(side.value, str))
        or isinstance(side, ast.List | ast.Tuple)
        for side in (node.left, node.right)
    ):
        raise RuleError("repeating strings or collections with * is not allowed")


_NODE_CHECKS: dict[type[ast.AST], Any] = {
    ast.Name: _check_name,
    ast.Constant: _check_constant,
    ast.Call: _check_call,
    ast.Subscript: _check_subscript,
    ast.Tuple: _check_collection,
    ast.List: _check_collection,
    ast.BinOp: _check_binop,
}
"""The checks of the node types that need more than being allowed."""


def _check_node(node: ast.AST, scope: set[str]) -> None:
    if not isinstance(node, _ALLOWED):
        raise RuleError(f"{type(node).__name__} is not allowed in rules")
    for node_type, check in _NODE_CHECKS.items():
        if isinstance(node, node_type):
            check(node, scope)


class RuleEvaluator:
    """Evaluates rules with simpleeval (never Python ``eval``) over a mapping of metric values.

    Rules should have passed `check_rule` first; simpleeval adds its own limits on top.

    Example:
        >>> from lit_losses.controller import RuleEvaluator
        >>> evaluator = RuleEvaluator()
        >>> evaluator.evaluate('mean(hist["window"]) > 1.5', {"hist": {"window": [1.0, 2.0, 3.0]}})
        True
    """

    def __init__(self) -> None:
        self._eval = simpleeval.EvalWithCompoundTypes(functions=dict(RULE_FUNCTIONS))

    def evaluate(self, rule: str, names: Mapping[str, Any]) -> Any:
        """The value of ``rule`` with ``names`` (metric name -> values) in scope.

        Args:
            rule: a rule expression.
            names: the values rules read, by metric name.

        Returns:
            What the expression evaluates to (the controller takes its truth value).

        Raises:
            Exception: whatever evaluation raises (e.g. `KeyError` for a key not logged yet).
        """
        self._eval.names = dict(names)
        return self._eval.eval(rule.strip())
