"""Output heads: per-token log-probabilities, log-sum-exp and entropy from hidden states."""

from lit_losses.heads.fused_head import BACKEND_OUTPUTS, BACKENDS, FusedLMHead
from lit_losses.heads.output import HEAD_OUTPUTS, HeadOutput

__all__ = ["BACKENDS", "BACKEND_OUTPUTS", "HEAD_OUTPUTS", "FusedLMHead", "HeadOutput"]
