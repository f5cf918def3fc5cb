"""`ModelParallelMixin`: the default ``configure_model`` of `RegularizedLM` (Lightning's hook for
``ModelParallelStrategy``)."""

from __future__ import annotations

from typing import Any

from lit_losses.parallel.clipping import clip_grad_norm_by_mesh, spans_meshes
from lit_losses.parallel.config import ParallelConfig
from lit_losses.parallel.plan import parallelize


class ModelParallelMixin:
    """``configure_model``: under ``ModelParallelStrategy``, parallelize the model with its
    ``parallel_config`` (a `ParallelConfig`; the defaults when the model has none); under any other
    strategy (no device mesh), nothing. ``configure_gradient_clipping``: Lightning's, except clipping by
    norm over parameters on several device meshes (tensor parallel), which `clip_grad_norm_by_mesh` does.

    Example:
        >>> from lit_losses import TinyLM
        >>> model = TinyLM(vocab_size=16, d_model=8, n_layers=1, n_heads=2)
        >>> model.configure_model()  # no ModelParallelStrategy: the model is left as it is
        >>> type(model).__name__
        'TinyLM'
    """

    def configure_model(self) -> None:
        mesh = getattr(self, "device_mesh", None)
        if mesh is not None:
            parallelize(self, mesh, ParallelConfig.coerce(getattr(self, "parallel_config", None)))

    def configure_gradient_clipping(
        self,
        optimizer: Any,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if gradient_clip_val and gradient_clip_algorithm in (None, "norm") and spans_meshes(params):
            clip_grad_norm_by_mesh(params, gradient_clip_val)
            return
        self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)
