"""`Handler`: what metric handlers and operations share — a name, YAML arguments, checkpointed state."""

from __future__ import annotations

from typing import Any

from lit_losses.errors import ConfigError


class Handler:
    """A named controller entry built from its YAML ``arguments`` (base of `MetricHandler` and
    `OperationHandler`); ``state_dict``/``load_state_dict`` carry its state across checkpoints."""

    def state_dict(self) -> dict[str, Any]:
        """State to save in checkpoints (e.g. a window of past values); empty by default."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned."""

    def _unknown_arguments(self, allowed: tuple[str, ...]) -> None:
        unknown = sorted(set(self.arguments) - set(allowed))
        if unknown:
            raise ConfigError(f"unknown arguments {unknown} (allowed: {list(allowed)})")
