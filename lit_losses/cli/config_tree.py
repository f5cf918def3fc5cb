"""`ConfigTree`: a ``lit-losses fit`` config built option by option, each line with a comment, written as
YAML that a reader can follow (``lit-losses from-trl`` writes one per TRL config)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import yaml

COMMENT_COLUMN = 44
"""The column at which the comments start (further right after a longer line)."""


@dataclass
class ConfigTree:
    """Nested options by dotted path (``model.init_args.optimizer.lr``), in the order first given, each
    with an optional comment; `yaml` writes them as block YAML with the comments at the ends of the lines.

    Example:
        >>> tree = ConfigTree()
        >>> tree.put("trainer.gradient_clip_val", 1.0, "max_grad_norm")
        >>> tree.put("model.init_args.optimizer.lr", 1e-6, "learning_rate")
        >>> tree.comment("model.init_args.optimizer", "transformers' AdamW")
        >>> print(tree.yaml())
        trainer:
          gradient_clip_val: 1.0                    # max_grad_norm
        model:
          init_args:
            optimizer:                              # transformers' AdamW
              lr: 1.0e-06                           # learning_rate
        >>> yaml.safe_load(tree.yaml()) == tree.values()
        True
    """

    options: dict[str, Any] = field(default_factory=dict)
    comments: dict[str, str] = field(default_factory=dict)

    def put(self, path: str, value: Any, comment: str = "") -> None:
        """Set the option at ``path`` (a dotted path) to ``value``, with ``comment``."""
        *sections, key = path.split(".")
        node = self.options
        for section in sections:
            node = node.setdefault(section, {})
        node[key] = value
        if comment:
            self.comments[path] = comment

    def comment(self, path: str, comment: str) -> None:
        """Comment the section or option at ``path``."""
        self.comments[path] = comment

    def get(self, path: str, default: Any = None) -> Any:
        """The value at ``path`` (``default`` when it is not set)."""
        node: Any = self.options
        for key in path.split("."):
            if not isinstance(node, dict) or key not in node:
                return default
            node = node[key]
        return node

    def values(self) -> dict[str, Any]:
        """The options as nested mappings (what `yaml` loads back as)."""
        return self.options

    def yaml(self) -> str:
        """The options as block YAML, one option a line, comments at the ends of the lines."""
        return "\n".join(self._lines(self.options, indent=0, prefix=""))

    def _lines(self, node: dict[str, Any], indent: int, prefix: str) -> list[str]:
        lines = []
        for key, value in node.items():
            path = f"{prefix}{key}"
            head = f"{' ' * indent}{key}:"
            if isinstance(value, dict) and value:
                lines.append(_commented(head, self.comments.get(path, "")))
                lines += self._lines(value, indent=indent + 2, prefix=f"{path}.")
            else:
                lines.append(_commented(f"{head} {flow(value)}", self.comments.get(path, "")))
        return lines


def flow(value: Any) -> str:
    """``value`` as one line of YAML (flow style for lists and mappings).

    Example:
        >>> flow(1e-6), flow([0.9, 0.999]), flow(None), flow("keep_start"), flow("1e-6")
        ('1.0e-06', '[0.9, 0.999]', 'null', 'keep_start', '1e-6')
    """
    text = yaml.safe_dump(value, default_flow_style=True, width=10**6, sort_keys=False).strip()
    return text.removesuffix("...").strip()


def _commented(line: str, comment: str) -> str:
    if not comment:
        return line
    return f"{line.ljust(COMMENT_COLUMN - 2)}  # {comment}"
