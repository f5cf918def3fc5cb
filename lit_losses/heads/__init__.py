"""Output heads: per-token log-probabilities, log-sum-exp and entropy from hidden states.

`FusedLMHead` is the interface; the backends that compute it are `HeadBackend` s registered in
`HEAD_BACKENDS` (``chunked``, ``naive``, ``torch``, ``liger``), one module each, and `select_backend`
decides which one computes a call.
"""

from lit_losses.heads.backend import HEAD_BACKENDS, HeadBackend, register_backend, select_backend
from lit_losses.heads.fused_head import BACKEND_OUTPUTS, BACKENDS, Backend, FusedLMHead
from lit_losses.heads.output import HEAD_OUTPUTS, HeadOutput

__all__ = [
    "BACKENDS",
    "BACKEND_OUTPUTS",
    "HEAD_BACKENDS",
    "HEAD_OUTPUTS",
    "Backend",
    "FusedLMHead",
    "HeadBackend",
    "HeadOutput",
    "register_backend",
    "select_backend",
]
