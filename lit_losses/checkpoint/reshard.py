"""A checkpoint read on another layout than the one that wrote it: a folder of shards as one whole
checkpoint, a whole checkpoint into a sharded model.

Lightning writes two layouts. A checkpoint **file** holds whole tensors and the optimizer state keyed by
the parameter's index in the optimizer (``optimizer_states``: ``state {0: …}``, ``param_groups
[{"params": [0, 1, …]}]``). A sharded checkpoint **folder** (``ModelParallelStrategy`` with
``save_distributed_checkpoint``) holds a ``torch.distributed.checkpoint`` of ``state_dict`` and
``optimizer_<i>`` (keyed by the parameter's name, any number of shards per tensor) and ``meta.pt`` with
the rest. ``torch.distributed.checkpoint`` reshards: a folder written by N processes loads into M, and
the whole tensors of a file load into any sharding. What is left to do here is the keys:

- `read_sharded` reads a folder into the file layout (the whole tensors in memory, once: no temporary
  file), its optimizer states keyed by index in the order of their ``param_groups`` (the writer's
  optimizer order, which the same model's optimizer follows).
- `load_into_sharded` loads a file into a model sharded with FSDP2 or tensor parallelism: the optimizer
  state's indices are turned into names with the optimizer's own parameter order, which the checkpoint
  records (`PARAM_NAMES_KEY`) or the live optimizer gives (Lightning's own path names them in the order
  of ``model.parameters()``, which is not the optimizer's when its groups regroup the parameters).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lit_losses.checkpoint.topology import has_sharded_parameters
from lit_losses.errors import ConfigError

SHARDED_METADATA = "meta.pt"
"""The file of a sharded checkpoint folder that holds everything but the tensors (Lightning's)."""
PARAM_NAMES_KEY = "lit_losses_optimizer_params"
"""Checkpoint key: per optimizer, the parameter names of its state's indices ``0, 1, …``."""


def optimizer_param_names(module: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The names of ``optimizer``'s parameters in its own order (the indices of its ``state_dict``).

    Example:
        >>> model = nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2))
        >>> groups = [{"params": [model[0].weight, model[1].weight]}, {"params": [model[0].bias]}]
        >>> optimizer_param_names(model, torch.optim.SGD(groups, lr=0.1))
        ['0.weight', '1.weight', '0.bias']
    """
    names = {id(p): name for name, p in module.named_parameters(remove_duplicate=False)}
    unnamed = [i for i, p in enumerate(_params(optimizer)) if id(p) not in names]
    if unnamed:
        raise ConfigError(f"optimizer parameter {unnamed[0]} is not a parameter of {type(module).__name__}")
    return [names[id(p)] for p in _params(optimizer)]


def _params(optimizer: torch.optim.Optimizer) -> list[Any]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def index_keyed(state: Mapping[str, Any]) -> dict[str, Any]:
    """A name-keyed optimizer state (a distributed checkpoint's) keyed by index, in the order of its
    ``param_groups`` (what ``Optimizer.load_state_dict`` reads).

    Example:
        >>> named = {"state": {"b": {"step": 1}, "a": {"step": 2}},
        ...          "param_groups": [{"lr": 0.1, "params": ["b"]}, {"lr": 0.2, "params": ["a"]}]}
        >>> indexed = index_keyed(named)
        >>> indexed["state"], [g["params"] for g in indexed["param_groups"]]
        ({0: {'step': 1}, 1: {'step': 2}}, [[0], [1]])
    """
    order = [name for group in state["param_groups"] for name in group["params"]]
    index = {name: i for i, name in enumerate(order)}
    unknown = [name for name in state["state"] if name not in index]
    if unknown:
        raise ConfigError(f"the optimizer state has a parameter outside its param_groups: {unknown[0]!r}")
    return {
        "state": {index[name]: value for name, value in state["state"].items()},
        "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in state["param_groups"]],
    }


def name_keyed(state: Mapping[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """An index-keyed optimizer state (a checkpoint file's) keyed by parameter name; ``names[i]`` is the
    name of index ``i`` (`optimizer_param_names`).

    Raises:
        ConfigError: the state has more parameters than ``names``.

    Example:
        >>> indexed = {"state": {0: {"step": 1}}, "param_groups": [{"lr": 0.1, "params": [0, 1]}]}
        >>> name_keyed(indexed, ["w", "b"])
        {'state': {'w': {'step': 1}}, 'param_groups': [{'lr': 0.1, 'params': ['w', 'b']}]}
    """
    count = sum(len(g["params"]) for g in state["param_groups"])
    if count != len(names):
        raise ConfigError(
            f"the checkpoint's optimizer has {count} parameters, this model's optimizer {len(names)}: "
            "not the same model"
        )
    return {
        "state": {names[int(i)]: value for i, value in state["state"].items()},
        "param_groups": [
            {**g, "params": [names[int(i)] for i in g["params"]]} for g in state["param_groups"]
        ],
    }


def read_distributed_checkpoint(folder: str | Path) -> dict[str, Any]:
    """The whole tensors and objects of a ``torch.distributed.checkpoint`` folder, nested as they were
    saved (``{"state_dict": {...}, "optimizer_0": {...}}``), read in this process alone (no collective).
    Costs the checkpoint's size in memory (what ``dcp_to_torch_save`` holds before it writes)."""
    from torch.distributed.checkpoint import (
        DefaultLoadPlanner,
        FileSystemReader,
        TensorStorageMetadata,
        load,
    )

    reader = FileSystemReader(str(folder))
    metadata = reader.read_metadata()
    flat: dict[str, Any] = {
        key: torch.empty(item.size, dtype=item.properties.dtype)
        if isinstance(item, TensorStorageMetadata)
        else None
        for key, item in metadata.state_dict_metadata.items()
    }
    planner = DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False)  # fills `flat`
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # no_dist: as meant
        load(flat, storage_reader=reader, planner=planner, no_dist=True)
    paths = metadata.planner_data or {}
    nested: dict[Any, Any] = {}
    for key, value in flat.items():
        path = paths.get(key, (key,))
        node = nested
        for step in path[:-1]:
            node = node.setdefault(step, {})
        node[path[-1]] = value
    return _lists(nested)


def _lists(node: Any) -> Any:
    """Dicts keyed ``0..n-1`` (lists flattened by the distributed checkpoint) back into lists."""
    if not isinstance(node, dict):
        return node
    node = {k: _lists(v) for k, v in node.items()}
    if node and all(isinstance(k, int) for k in node) and sorted(node) == list(range(len(node))):
        return [node[i] for i in range(len(node))]
    return node


def read_sharded(folder: str | Path, weights_only: bool | None = None) -> dict[str, Any]:
    """A sharded checkpoint folder as the checkpoint file of the same state (what a strategy without a
    sharded model restores): ``meta.pt``'s contents, ``state_dict`` whole, ``optimizer_states`` keyed by
    index (`index_keyed`), and the names of those indices (`PARAM_NAMES_KEY`)."""
    folder = Path(folder)
    tensors = read_distributed_checkpoint(folder)
    checkpoint = torch.load(folder / SHARDED_METADATA, map_location="cpu", weights_only=weights_only)
    checkpoint["state_dict"] = tensors.pop("state_dict", {})
    keys = sorted((k for k in tensors if k.startswith("optimizer_")), key=lambda k: int(k.rpartition("_")[2]))
    optimizers = [tensors[key] for key in keys]  # Lightning's optimizer_0, optimizer_1, …
    checkpoint["optimizer_states"] = [index_keyed(state) for state in optimizers]
    checkpoint[PARAM_NAMES_KEY] = [[n for g in s["param_groups"] for n in g["params"]] for s in optimizers]
    return checkpoint


def record_param_names(checkpoint: dict[str, Any], module: nn.Module, optimizers: Sequence[Any]) -> None:
    """Write the names of the optimizer states' indices into ``checkpoint`` (`PARAM_NAMES_KEY`), so that a
    sharded model can load them (and a file be turned into a folder) without the model. Only for states
    keyed by index in the optimizer's own order: not those of a sharded model (keyed by name in a folder;
    in a file, by Lightning's order)."""
    states = checkpoint.get("optimizer_states") or []
    if not states or not optimizers or has_sharded_parameters(module):
        return
    if all(isinstance(key, int) for state in states for key in state.get("state", {})):
        checkpoint[PARAM_NAMES_KEY] = [optimizer_param_names(module, optimizer) for optimizer in optimizers]


def load_into_sharded(
    checkpoint: dict[str, Any], module: nn.Module, optimizers: Sequence[Any], strict: bool = True
) -> dict[str, Any]:
    """Load a checkpoint file's whole tensors into a model sharded with FSDP2 / tensor parallelism (and
    its optimizers' states), each process taking its shard of them; returns the rest of the checkpoint.

    The optimizer states' indices are named with the checkpoint's `PARAM_NAMES_KEY` when it has them,
    else with the live optimizers' order (`optimizer_param_names`: a model's optimizer groups its
    parameters the same way in every run).
    """
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, strict=strict)
    set_model_state_dict(module, checkpoint.pop("state_dict"), options=options)
    states = checkpoint.get("optimizer_states") or []
    recorded = checkpoint.get(PARAM_NAMES_KEY) or []
    for i, (optimizer, state) in enumerate(zip(optimizers, states, strict=False)):
        names = recorded[i] if i < len(recorded) else optimizer_param_names(module, optimizer)
        set_optimizer_state_dict(
            module,
            optimizer,
            optim_state_dict=name_keyed(state, names),
            options=StateDictOptions(full_state_dict=True),
        )
    return checkpoint
