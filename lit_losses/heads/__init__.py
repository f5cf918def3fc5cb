"""Output heads: per-token log-probabilities, log-sum-exp and entropy from hidden states, and fused losses,
logits never materialized. Depends on torch alone (no Lightning, no transformers).

Three layers, as in Liger-Kernel: the functional API (`linear_logprobs`, `linear_cross_entropy`,
`linear_pointwise_loss`; `lit_losses.heads.functional`), `FusedLMHead` the object over it, and the backends
that compute it: `HeadBackend` s registered in `HEAD_BACKENDS` (``chunked``, ``blocked``, ``naive``,
``torch``, ``liger``, ``liger_scaled``, ``cce``), one module each, among which `select_backend` (the one
dispatcher) picks for a call.
`VocabParallelHead` (the ``vocab_parallel`` backend) computes the same over an output projection sharded
along the vocabulary (tensor parallel). `linear_distillation` (two heads streamed together: a per-token
divergence between a student's and a teacher's distributions) and `topk_distillation` (a teacher given as
top-k log-probabilities) never materialize logits either (`lit_losses.heads.divergence`). `token_stats`
gives per-token statistics of the distribution (entropy, ``log Σ p²``, mean logit, top-1) in one no-grad pass.
"""

from lit_losses.heads.backend import (
    HEAD_BACKENDS,
    HeadBackend,
    check_backend_runs,
    register_backend,
    select_backend,
)
from lit_losses.heads.collision import log_sum_sq_probs
from lit_losses.heads.distillation import linear_distillation
from lit_losses.heads.divergence import DistillationLoss
from lit_losses.heads.functional import (
    BACKEND_OUTPUTS,
    BACKENDS,
    Backend,
    linear_cross_entropy,
    linear_logprobs,
    linear_pointwise_loss,
)
from lit_losses.heads.fused_head import FusedLMHead
from lit_losses.heads.output import HEAD_OUTPUTS, HeadOutput
from lit_losses.heads.precision import MatmulPrecision
from lit_losses.heads.token_statistics import TOKEN_STATISTICS, TokenStatistic, TokenStats, token_stats
from lit_losses.heads.topk import topk_distillation
from lit_losses.heads.vocab_parallel import VocabParallelHead, head_for
from lit_losses.heads.vocab_shard import VocabShard

__all__ = [
    "BACKENDS",
    "BACKEND_OUTPUTS",
    "HEAD_BACKENDS",
    "HEAD_OUTPUTS",
    "TOKEN_STATISTICS",
    "Backend",
    "DistillationLoss",
    "FusedLMHead",
    "HeadBackend",
    "HeadOutput",
    "MatmulPrecision",
    "TokenStatistic",
    "TokenStats",
    "VocabParallelHead",
    "VocabShard",
    "check_backend_runs",
    "head_for",
    "linear_cross_entropy",
    "linear_distillation",
    "linear_logprobs",
    "linear_pointwise_loss",
    "log_sum_sq_probs",
    "register_backend",
    "select_backend",
    "token_stats",
    "topk_distillation",
]
