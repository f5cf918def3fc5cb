"""Output heads: per-token log-probabilities, log-sum-exp and entropy from hidden states.

`FusedLMHead` is the interface; the backends that compute it are `HeadBackend` s registered in
`HEAD_BACKENDS` (``chunked``, ``naive``, ``torch``, ``liger``), one module each, and `select_backend`
decides which one computes a call. `VocabParallelHead` (the ``vocab_parallel`` backend) computes the same
over an output projection sharded along the vocabulary (tensor parallel).
"""

from lit_losses.heads.backend import HEAD_BACKENDS, HeadBackend, register_backend, select_backend
from lit_losses.heads.fused_head import BACKEND_OUTPUTS, BACKENDS, Backend, FusedLMHead
from lit_losses.heads.output import HEAD_OUTPUTS, HeadOutput
from lit_losses.heads.vocab_parallel import VocabParallelHead, head_for
from lit_losses.heads.vocab_shard import VocabShard

__all__ = [
    "BACKENDS",
    "BACKEND_OUTPUTS",
    "HEAD_BACKENDS",
    "HEAD_OUTPUTS",
    "Backend",
    "FusedLMHead",
    "HeadBackend",
    "HeadOutput",
    "VocabParallelHead",
    "VocabShard",
    "head_for",
    "register_backend",
    "select_backend",
]
