"""Scaling out beyond DDP: FSDP2 and tensor parallelism through Lightning's ``ModelParallelStrategy``
(`ParallelConfig`, `parallelize`, the mixin that gives `RegularizedLM` its ``configure_model``), and the head
loss of the last stage of a ``torch.distributed.pipelining`` schedule (`PipelineLoss`).

The vocabulary-parallel head itself is `lit_losses.heads.VocabParallelHead`.
"""

from lit_losses.parallel.config import ParallelConfig, TPStyle
from lit_losses.parallel.mixin import ModelParallelMixin
from lit_losses.parallel.pipeline import PipelineLoss
from lit_losses.parallel.plan import fsdp_units, parallelize

__all__ = [
    "ModelParallelMixin",
    "ParallelConfig",
    "PipelineLoss",
    "TPStyle",
    "fsdp_units",
    "parallelize",
]
