"""`parallelize`: tensor parallelism then FSDP2 over Lightning's ``(data_parallel, tensor_parallel)`` mesh.

FSDP2 gathers a unit's parameters in the pre-forward hook of that module and frees them after it. A
`RegularizedLM` computes its loss in ``compute_loss`` (body, then the fused head reading the output
projection), not in ``forward``, so the root's methods that run the model are registered as FSDP forward
methods (`torch.distributed.fsdp.register_fsdp_forward_method`): inside them the root's parameters, the
(tied) output projection among them, are whole tensors, and gradients flow into them and are
reduce-scattered after backward, averaged over the data-parallel dimension.
"""

from __future__ import annotations

from collections.abc import Iterable
from fnmatch import fnmatchcase
from typing import Any

from torch import nn

from lit_losses.errors import ConfigError
from lit_losses.parallel.config import ParallelConfig

DATA_PARALLEL = "data_parallel"
TENSOR_PARALLEL = "tensor_parallel"
#: The root's methods that run the model (FSDP gathers the root's parameters around them): the loss, the
#: inference calls, `forward_backward_custom`'s forward pass, and `HFCausalLM`'s packing probe and
#: ``generate``.
FORWARD_METHODS = (
    "compute_loss",
    "predict_step",
    "forward_logits",
    "forward_head_outputs",
    "probe_packing",
    "generate",
)


def mesh_dim(mesh: Any, name: str) -> Any:
    """The 1-D sub-mesh ``name`` of ``mesh`` (``None`` when the mesh has no such dimension)."""
    if mesh is None or name not in (mesh.mesh_dim_names or ()):
        return None
    return mesh[name]


def name_matches(name: str, pattern: str) -> bool:
    """`fnmatch` segment by segment: ``body.blocks.*`` matches ``body.blocks.0``, not ``body.blocks.0.mlp``.

    Example:
        >>> name_matches("body.blocks.0", "body.blocks.*"), name_matches("body.blocks.0.mlp", "body.blocks.*")
        (True, False)
    """
    parts, pattern_parts = name.split("."), pattern.split(".")
    return len(parts) == len(pattern_parts) and all(map(fnmatchcase, parts, pattern_parts))


def fsdp_units(module: nn.Module, patterns: Iterable[str] | None) -> list[nn.Module]:
    """The submodules that ``patterns`` name (default: the model's ``fsdp_modules``, else the items of every
    ``nn.ModuleList``), deepest first, the root excepted.

    Raises:
        ConfigError: a pattern that matches no submodule.
    """
    patterns = patterns if patterns is not None else getattr(module, "fsdp_modules", None)
    named = [(name, m) for name, m in module.named_modules() if name]
    if patterns is None:
        lists = {name for name, m in named if isinstance(m, nn.ModuleList)}
        chosen = [(name, m) for name, m in named if name.rpartition(".")[0] in lists]
    else:
        chosen = []
        for pattern in patterns:
            hits = [(name, m) for name, m in named if name_matches(name, pattern)]
            if not hits:
                examples = [name for name, _ in named][:8]
                raise ConfigError(
                    f"model.parallel.fsdp_modules: {pattern!r} matches no submodule of "
                    f"{type(module).__name__} (e.g. {examples})"
                )
            chosen += [hit for hit in hits if hit not in chosen]
    return [m for _, m in sorted(chosen, key=lambda item: -item[0].count("."))]


def _tp_styles() -> dict[str, Any]:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {
        "colwise": ColwiseParallel,
        "rowwise": RowwiseParallel,
        "embedding": lambda: RowwiseParallel(input_layouts=Replicate()),
    }


def apply_tensor_parallel(module: nn.Module, tp_mesh: Any, plan: dict[str, str] | None) -> None:
    """``parallelize_module`` with ``plan`` (default: the model's ``tensor_parallel_plan``).

    Raises:
        ConfigError: no plan, or a module name the model does not have.
    """
    from torch.distributed.tensor.parallel import parallelize_module

    plan = plan if plan is not None else getattr(module, "tensor_parallel_plan", None)
    if not plan:
        raise ConfigError(
            f"tensor_parallel_size={tp_mesh.size()} but {type(module).__name__} has no tensor-parallel plan: "
            "set model.parallel.tensor_parallel_plan (e.g. {lm_head: colwise}) or tensor_parallel_size: 1"
        )
    names = dict(module.named_modules())
    styles = _tp_styles()
    for name in plan:
        if name not in names:
            raise ConfigError(
                f"model.parallel.tensor_parallel_plan: {type(module).__name__} has no module {name!r}"
            )
    parallelize_module(module, tp_mesh, {name: styles[style]() for name, style in plan.items()})


def _check_projection_in_root(module: nn.Module, units: list[nn.Module]) -> None:
    projection = getattr(module, "output_projection", None)
    if projection is None:
        return
    weight = projection()[0]
    for unit in units:
        if any(p is weight for p in unit.parameters()):
            name = next(n for n, m in module.named_modules() if m is unit)
            raise ConfigError(
                f"model.parallel.fsdp_modules: {name!r} holds the output projection, which the fused head "
                "reads outside that module's forward; leave it to the root unit"
            )


def apply_fsdp(module: nn.Module, dp_mesh: Any, config: ParallelConfig) -> None:
    """``fully_shard`` each unit of `fsdp_units`, then the root, and register `FORWARD_METHODS`."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

    units = fsdp_units(module, config.fsdp_modules)
    _check_projection_in_root(module, units)
    param_dtype, reduce_dtype = config.mixed_precision()
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for unit in units:
        fully_shard(unit, mesh=dp_mesh, reshard_after_forward=config.reshard_after_forward, mp_policy=policy)
    fully_shard(module, mesh=dp_mesh, reshard_after_forward=False, mp_policy=policy)
    for method in FORWARD_METHODS:
        if hasattr(module, method):
            register_fsdp_forward_method(module, method)


def parallelize(module: nn.Module, mesh: Any, config: ParallelConfig | None = None) -> None:
    """Apply ``config`` to ``module`` over Lightning's device ``mesh`` (see `ParallelConfig`); a module
    already parallelized is left as it is (Lightning may call ``configure_model`` again)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    if isinstance(module, FSDPModule) or any(isinstance(p, DTensor) for p in module.parameters()):
        return
    config = config or ParallelConfig()
    tp_mesh = mesh_dim(mesh, TENSOR_PARALLEL)
    if tp_mesh is not None and tp_mesh.size() > 1:
        apply_tensor_parallel(module, tp_mesh, config.tensor_parallel_plan)
    dp_mesh = mesh_dim(mesh, DATA_PARALLEL)
    if not config.fsdp and dp_mesh is not None and dp_mesh.size() > 1:
        raise ConfigError(
            f"model.parallel.fsdp: false with data_parallel_size={dp_mesh.size()}: nothing would average the "
            "gradients over the data-parallel ranks; keep fsdp: true (or use strategy: ddp)"
        )
    if config.fsdp and dp_mesh is not None:
        apply_fsdp(module, dp_mesh, config)
