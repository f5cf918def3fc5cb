"""The loss of a step: `LossContext`/`LossOutput` (context), the choice of path (`objective`), and the
exact per-step telemetry (`telemetry`)."""

from lit_losses.loss.context import LossContext, LossOutput

__all__ = ["LossContext", "LossOutput"]
