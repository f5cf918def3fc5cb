"""`ParallelConfig`: how a `RegularizedLM` shards itself under Lightning's ``ModelParallelStrategy``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from lit_losses.choices import check_choice
from lit_losses.validation import check_names

DType = Literal["float32", "bfloat16", "float16"]
#: Tensor-parallel styles of `torch.distributed.tensor.parallel` a plan can name: ``colwise``
#: (``ColwiseParallel``: a linear layer's output features, i.e. an ``lm_head``'s vocabulary), ``rowwise``
#: (``RowwiseParallel``: its input features), ``embedding`` (``RowwiseParallel`` over an ``nn.Embedding``'s
#: rows, with replicated token ids: a vocabulary-parallel embedding).
TPStyle = Literal["colwise", "rowwise", "embedding"]
"""How a module is split over the tensor-parallel dimension (torch's ``ColwiseParallel``,
``RowwiseParallel``, and the embedding's row split)."""


@dataclass
class ParallelConfig:
    """What `RegularizedLM`'s default ``configure_model`` does under ``ModelParallelStrategy``.

    The strategy builds a device mesh ``(data_parallel, tensor_parallel)``. The plan: tensor parallelism
    first (``tensor_parallel_plan`` over the ``tensor_parallel`` dimension, when it has more than one
    device), then FSDP2 (``fully_shard`` over the ``data_parallel`` dimension) of each module in
    ``fsdp_modules`` and of the root, whose forward methods (``compute_loss``, ``predict_step``,
    ``forward_logits``) FSDP manages, so that the body and the fused head run with gathered parameters. From
    YAML: ``model.init_args.parallel: {fsdp_modules: [...], param_dtype: bfloat16, ...}``.

    Example:
        >>> from lit_losses.parallel import ParallelConfig
        >>> ParallelConfig.coerce({"param_dtype": "bfloat16"}).mixed_precision()
        (torch.bfloat16, None)
        >>> ParallelConfig(param_dtype="bf16")
        Traceback (most recent call last):
        ...
        lit_losses.errors.ConfigError: model.parallel.param_dtype 'bf16' is not one of ...
    """

    fsdp: bool = True
    """Shard parameters, gradients and optimizer states with FSDP2 over the data-parallel dimension (also
    with one device there: the same code path, and every parameter a DTensor, which torch's ``foreach``
    optimizers on CUDA need next to tensor-parallel ones). ``False`` (``data_parallel_size: 1`` only):
    the parameters outside the tensor-parallel plan stay plain tensors."""
    fsdp_modules: list[str] | None = None
    """Submodules sharded as FSDP2 units of their own before the root, as `fnmatch` patterns over module
    names matched segment by segment (``body.blocks.*``: each block, not its layers); each must match.
    ``None``: the model's ``fsdp_modules`` attribute (`TinyLM`: its transformer blocks), else every item of
    every ``nn.ModuleList``. The module that owns the output projection must stay in the root (the head
    reads it outside that module's forward)."""
    reshard_after_forward: bool = True
    """Free each unit's gathered parameters after its forward and gather them again in backward (less
    memory, one more all-gather per unit and step); the root keeps its parameters until backward."""
    param_dtype: DType | None = None
    """FSDP2 mixed precision: the dtype parameters are gathered and computed in (``None``: their own). The
    fused head still computes logits and softmax statistics in fp32."""
    reduce_dtype: DType | None = None
    """dtype of the gradient reduce-scatter (``None``: ``param_dtype``)."""
    tensor_parallel_plan: dict[str, TPStyle] | None = None
    """``{module name: style}`` over the tensor-parallel dimension (`TPStyle`); ``None``: the model's
    ``tensor_parallel_plan`` attribute (`TinyLM` untied: ``{"lm_head": "colwise"}``, whose vocabulary-sharded
    weight the vocabulary-parallel head reads). Modules not in the plan are replicated over the group."""

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype"):
            if getattr(self, name) is not None:
                check_choice(getattr(self, name), DType, f"model.parallel.{name}")
        for module, style in (self.tensor_parallel_plan or {}).items():
            check_choice(style, TPStyle, f"model.parallel.tensor_parallel_plan[{module!r}]")
        check_names(self.fsdp_modules, "model.parallel.fsdp_modules", "name patterns", optional=True)

    @classmethod
    def coerce(cls, value: ParallelConfig | dict | None) -> ParallelConfig:
        """``value`` as a `ParallelConfig` (a dict of its fields, or ``None`` for the defaults)."""
        return cls(**value) if isinstance(value, dict) else value or cls()

    def mixed_precision(self) -> tuple[torch.dtype | None, torch.dtype | None]:
        """``(param_dtype, reduce_dtype)`` as torch dtypes (``None`` where unset)."""
        return tuple(None if d is None else getattr(torch, d) for d in (self.param_dtype, self.reduce_dtype))
