"""Gradient clipping by norm over parameters that live on several device meshes.

Under tensor parallelism with FSDP2, parameters are DTensors on different meshes (the ``lm_head`` on the
``(data_parallel, tensor_parallel)`` mesh, the replicated blocks on the ``data_parallel`` one; or plain
tensors next to DTensors), and ``torch.nn.utils.clip_grad_norm_`` cannot stack their norms. Here each
mesh's gradients get their norm first (one reduction per mesh), then the norms are combined:

    ‖g‖_p = (Σ_meshes ‖g_mesh‖_p^p)^{1/p},     g ← g · min(1, max_norm / (‖g‖_p + 1e-6))

(torch's own rule and epsilon).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor


def _mesh_key(t: Tensor) -> object:
    mesh = getattr(t, "device_mesh", None)
    return None if mesh is None else (id(mesh), tuple(mesh.mesh_dim_names or ()))


def spans_meshes(parameters: Iterable[Tensor]) -> bool:
    """Whether the parameters are DTensors on more than one device mesh, or DTensors and plain tensors."""
    return len({_mesh_key(p) for p in parameters}) > 1 and any(_mesh_key(p) is not None for p in parameters)


def total_grad_norm(parameters: Iterable[Tensor], norm_type: float = 2.0) -> Tensor:
    """``‖g‖_p`` over every gradient of ``parameters`` (a plain tensor, equal on every rank)."""
    groups: dict[object, list[Tensor]] = {}
    for p in parameters:
        if p.grad is not None:
            groups.setdefault(_mesh_key(p), []).append(p.grad)
    norms = []
    for grads in groups.values():
        per_tensor = torch.stack([torch.linalg.vector_norm(g, norm_type) for g in grads])
        norm = torch.linalg.vector_norm(per_tensor, norm_type)
        norms.append(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    if not norms:
        return torch.zeros(())
    return torch.linalg.vector_norm(torch.stack([n.to(torch.float64).cpu() for n in norms]), norm_type)


def clip_grad_norm_by_mesh(parameters: Iterable[Tensor], max_norm: float, norm_type: float = 2.0) -> Tensor:
    """Scale every gradient by ``min(1, max_norm / (‖g‖_p + 1e-6))``; returns ``‖g‖_p`` (before clipping).

    Example:
        >>> import torch
        >>> from lit_losses.parallel.clipping import clip_grad_norm_by_mesh
        >>> a, b = torch.zeros(2, requires_grad=True), torch.zeros(1, requires_grad=True)
        >>> a.grad, b.grad = torch.tensor([3.0, 0.0]), torch.tensor([4.0])
        >>> float(clip_grad_norm_by_mesh([a, b], max_norm=1.0))  # the norm before clipping
        5.0
        >>> round(float(torch.cat([a.grad, b.grad]).norm()), 4)
        1.0
    """
    parameters = list(parameters)
    total = total_grad_norm(parameters, norm_type)
    coef = min(1.0, float(max_norm) / (float(total) + 1e-6))
    if coef < 1.0:
        for p in parameters:
            if p.grad is not None:
                p.grad.mul_(coef)
    return total
