"""Resuming from a checkpoint with other options than the checkpointed run's: never silently.

A `RegularizedLM`'s own options (`RUN_OPTIONS`: loss, regularizers, optimizer and schedule, head) may change
between runs: the resumed run's win, a warning lists each difference, and the checkpoint's run-time state
is restored only where it still applies (a regularizer configured differently starts from its new
configuration, the optimizer state takes the new learning rate, betas, eps and weight decay). A subclass
adds its own such options in ``resume_changeable_options`` (e.g. how it is sharded, where its weights were
first loaded from) and names in ``resume_unsaved_options`` the arguments that are not saved with it (a
built model object). Any other option is the model's architecture (a subclass's own arguments, its class):
a difference is an error naming the option.

A checkpoint is a file, or a folder of shards (Lightning's ``save_distributed_checkpoint``: the non-tensor
state in ``meta.pt``); `read_checkpoint` reads either without loading the weights' shards.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lit_losses.checkpoint.stopped_epoch import reopen_stopped_epoch
from lit_losses.checkpoint.topology import Topology, follow_topology
from lit_losses.errors import ConfigError
from lit_losses.hparams import plain_data
from lit_losses.optim import OptimizerConfig
from lit_losses.regularizers import RegularizerSpec

RUN_OPTIONS = (
    "head_backend",
    "head_chunk_size",
    "head_matmul_precision",
    "loss_agg",
    "optimizer",
    "ignore_index",
    "check_finite",
    "regularizers",
    "regularizer_grad_norm",
    "base_loss_weight",
    "base_loss",
    "base_loss_args",
    "loss_agg_norm",
    "grpo",
    "dpo",
    "kto",
    "cpo",
    "orpo",
    "ref_model",
    "distillation",
    "token_metrics",
)
"""`RegularizedLM`'s own arguments: what a resumed run may change (the others are the architecture)."""

#: Options added after the first release, with their defaults: a checkpoint written before they existed
#: trained with these values, so their absence from it is no change.
ADDED_OPTION_DEFAULTS = {
    "base_loss": "cross_entropy",
    "base_loss_args": None,
    "loss_agg_norm": None,
    "grpo": None,
    "dpo": None,
    "kto": None,
    "cpo": None,
    "orpo": None,
    "ref_model": None,
    "distillation": None,
    "token_metrics": False,
    "head_matmul_precision": "auto",
}

ARCHITECTURE_HINT = (
    "the model's architecture cannot change when resuming: give the checkpointed run's options (its "
    "config.yaml), or load the weights into a new run instead of resuming"
)


@dataclass(frozen=True)
class OptionChange:
    """One option whose value differs between the checkpoint and this run.

    Example:
        >>> str(OptionChange("model.init_args.d_model", 64, 128, changeable=False))
        'model.init_args.d_model: 64 in the checkpoint, 128 now'
    """

    path: str
    saved: Any
    given: Any
    changeable: bool

    def __str__(self) -> str:
        if self.saved is _ABSENT:
            return f"{self.path}: added ({self.given!r})"
        if self.given is _ABSENT:
            return f"{self.path}: removed (was {self.saved!r})"
        return f"{self.path}: {self.saved!r} in the checkpoint, {self.given!r} now"


_ABSENT = type("Absent", (), {"__repr__": lambda self: "absent"})()


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def _unparsed(value: Any) -> Any:
    """``value`` as the plain data it was before jsonargparse parsed it: a ``Namespace`` as a dict.
    ``load_from_checkpoint`` of a LightningCLI checkpoint parses the hyper-parameters with jsonargparse,
    which turns the dicts inside the checkpoint's lists into ``Namespace`` objects in place, before
    ``on_load_checkpoint`` reads them.

    Example:
        >>> _unparsed(argparse.Namespace(name="z_loss", args=argparse.Namespace(k=1)))
        {'name': 'z_loss', 'args': {'k': 1}}
    """
    if isinstance(value, argparse.Namespace):
        return {k: _unparsed(v) for k, v in vars(value).items()}
    return value


def _spec(value: Any) -> RegularizerSpec:
    """A regularizer as saved (a dict of `RegularizerSpec`'s fields) or as jsonargparse parsed it
    (``{class_path: lit_losses.RegularizerSpec, init_args: {...}}``)."""
    if isinstance(value, RegularizerSpec):
        return value
    value = _unparsed(value)
    if isinstance(value, Mapping) and "class_path" in value and "name" not in value:
        value = {**(value.get("init_args") or {}), **(value.get("dict_kwargs") or {})}
    return RegularizerSpec(**value)


def _canonical(key: str, value: Any) -> Any:
    """``value`` as plain data that compares equal however it was given (dict, dataclass, tuple, list,
    jsonargparse ``Namespace``)."""
    value = _unparsed(value)
    try:
        if key == "regularizers":
            specs = [_spec(v) for v in value or ()]
            return {spec.name: _canonical("", plain_data(spec)) for spec in specs}
        if key == "optimizer":
            return _canonical("", plain_data(OptimizerConfig.coerce(value).resolved()))
    except (TypeError, ValueError):
        pass  # as given
    value = plain_data(value)
    if isinstance(value, Mapping):
        return {k: _canonical("", v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_canonical("", v) for v in value]
    return value


def _diff(path: str, saved: Any, given: Any, changeable: bool, out: list[OptionChange]) -> None:
    if isinstance(saved, Mapping) and isinstance(given, Mapping):
        for key in dict.fromkeys([*saved, *given]):
            sub = f"{path}[{key}]" if path.endswith("regularizers") else f"{path}.{key}"
            _diff(sub, saved.get(key, _ABSENT), given.get(key, _ABSENT), changeable=changeable, out=out)
    elif not _same(saved, given):
        out.append(OptionChange(path, saved, given, changeable=changeable))


def option_changes(
    saved: Mapping[str, Any],
    given: Mapping[str, Any],
    prefix: str = "model.init_args",
    model_class: type | None = None,
) -> list[OptionChange]:
    """The model options that differ between a checkpoint's ``hyper_parameters`` and this run's.

    Keys starting with ``_`` (LightningCLI's ``_class_path``, ``_instantiator``) are not options;
    ``_class_path`` is compared as ``model.class_path`` when both have it. ``model_class``'s
    ``resume_changeable_options`` may change like `RUN_OPTIONS`; its ``resume_unsaved_options`` are not
    compared; its ``resume_added_options`` (like `ADDED_OPTION_DEFAULTS`) are no change when a checkpoint
    lacks them and this run gives their default.

    Example:
        >>> saved = {"d_model": 64, "regularizers": [{"name": "z_loss", "weight": 1e-4}]}
        >>> given = {"d_model": 64, "regularizers": [{"name": "z_loss", "weight": 2e-4}, {"name": "entropy"}]}
        >>> for change in option_changes(saved, given):
        ...     print(change)  # doctest: +ELLIPSIS
        model.init_args.regularizers[z_loss].weight: 0.0001 in the checkpoint, 0.0002 now
        model.init_args.regularizers[entropy]: added ({'name': 'entropy', ...})
    """
    changes: list[OptionChange] = []
    classes = saved.get("_class_path"), given.get("_class_path")
    if None not in classes and classes[0] != classes[1]:
        changes.append(OptionChange(prefix.rpartition(".")[0] + ".class_path", *classes, changeable=False))
    changeable = (*RUN_OPTIONS, *getattr(model_class, "resume_changeable_options", ()))
    unsaved = getattr(model_class, "resume_unsaved_options", ())
    added = {**ADDED_OPTION_DEFAULTS, **getattr(model_class, "resume_added_options", {})}
    for key in dict.fromkeys([*saved, *given]):
        if key.startswith("_") or key in unsaved:
            continue
        before, after = saved.get(key, _ABSENT), given.get(key, _ABSENT)
        if before is _ABSENT and key in added and _same(after, added[key]):
            continue  # a checkpoint from before the option existed, resumed with its default
        if before is not _ABSENT:
            before = _canonical(key, before)
        if after is not _ABSENT:
            after = _canonical(key, after)
        _diff(f"{prefix}.{key}", before, after, changeable=key in changeable, out=changes)
    return changes


def check_changes(
    changes: list[OptionChange], where: str, allow_changes: bool = True, warn: bool = True
) -> None:
    """Raise for architecture changes (or for any change unless ``allow_changes``); warn for the others
    (unless not ``warn``).

    Raises:
        ConfigError: one line listing every offending option.
    """
    refused = [c for c in changes if not (c.changeable and allow_changes)]
    if refused:
        hint = ARCHITECTURE_HINT if any(not c.changeable for c in refused) else "(--resume_changes=error)"
        raise ConfigError(
            f"{where}: resuming with options that differ from the checkpoint's: "
            f"{'; '.join(map(str, refused))}; {hint}"
        )
    if changes and warn:
        rank_zero_warn(
            f"{where}: resuming with options that differ from the checkpoint's; this run's apply: "
            f"{'; '.join(map(str, changes))}"
        )


def restore_checkpoint_state(module: Any, checkpoint: dict[str, Any]) -> None:
    """`RegularizedLM.on_load_checkpoint`: reopen an epoch that ``max_steps`` stopped early
    (`reopen_stopped_epoch`), recount the data position for this run's data-parallel size
    (`follow_topology`), check the options against the checkpoint's, then restore the
    regularizers' run-time weights and flags (those configured as in the checkpoint) and make the
    optimizer state about to be restored follow this run's optimizer options.

    Raises:
        ConfigError: an architecture option differs from the checkpoint's.
    """
    reopen_stopped_epoch(checkpoint)
    trainer = getattr(module, "_trainer", None)
    if trainer is not None:
        follow_topology(checkpoint, Topology.of(trainer))
    saved = checkpoint.get("hyper_parameters") or {}
    changes = option_changes(saved, dict(module.hparams), model_class=type(module)) if saved else []
    check_changes(changes, "checkpoint")
    changed = {c.path.split("[")[1].split("]")[0] for c in changes if "regularizers[" in c.path}
    state = checkpoint.get("lit_losses_regularizers") or {}
    terms = module.regularizer_set
    module.regularizer_set.load_state_dict(
        {k: v for k, v in state.items() if k in terms and k not in changed}
    )
    if any(c.path.startswith("model.init_args.optimizer.") for c in changes):
        follow_optimizer_options(
            checkpoint, OptimizerConfig.coerce(saved.get("optimizer")), module.optimizer_config
        )


def follow_optimizer_options(checkpoint: dict[str, Any], old: OptimizerConfig, new: OptimizerConfig) -> None:
    """Rewrite the checkpoint's optimizer and scheduler states (before Lightning restores them) so that the
    run continues with ``new``'s learning rate (scaled where the schedule is), betas, eps and weight decay;
    the schedule's shape (warmup, decay) is rebuilt from ``new`` anyway."""
    scale = new.lr / old.lr if old.lr else 1.0
    for state in checkpoint.get("optimizer_states", []):
        for group in state.get("param_groups", []):
            group["lr"] = group.get("lr", old.lr) * scale
            if "initial_lr" in group:
                group["initial_lr"] = group["initial_lr"] * scale
            group["betas"], group["eps"] = list(new.betas), new.eps
            if group.get("weight_decay") == old.weight_decay:  # the decayed parameters' group
                group["weight_decay"] = new.weight_decay
    for state in checkpoint.get("lr_schedulers", []):
        for key in ("base_lrs", "_last_lr"):
            if key in state:
                state[key] = [lr * scale for lr in state[key]]


SHARDED_METADATA = "meta.pt"
"""The file of a sharded checkpoint folder that holds everything but the tensors' shards (Lightning's)."""


def is_sharded_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` is a folder written by Lightning's ``save_distributed_checkpoint`` (its shards and
    the ``meta.pt`` file beside them)."""
    return Path(path).is_dir() and (Path(path) / SHARDED_METADATA).is_file()


def read_checkpoint(path: str | Path, where: str = "--ckpt_path") -> dict[str, Any]:
    """A checkpoint's contents without the weights' shards: a checkpoint file whole (memory-mapped), or a
    sharded checkpoint folder's ``meta.pt`` (hyper-parameters, loops, callbacks, optimizer schedules).

    Raises:
        ConfigError: no such file or folder, an empty, truncated or foreign file, a folder that is no
            sharded checkpoint; the message starts with ``where`` and the path.

    Example:
        >>> read_checkpoint("no/such.ckpt")
        Traceback (most recent call last):
        ...
        lit_losses.errors.ConfigError: --ckpt_path no/such.ckpt: no such checkpoint file or folder
    """
    path = Path(path)
    if path.is_dir():
        if not is_sharded_checkpoint(path):
            raise ConfigError(
                f"{where} {path}: a folder without {SHARDED_METADATA}, not a sharded checkpoint (those that "
                "ModelParallelStrategy/FSDPStrategy write with save_distributed_checkpoint)"
            )
        return _load(path / SHARDED_METADATA, where, required="hyper_parameters")
    if not path.is_file():
        raise ConfigError(f"{where} {path}: no such checkpoint file or folder")
    return _load(path, where, required="state_dict")


def _load(path: Path, where: str, required: str) -> dict[str, Any]:
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:  # EOFError, RuntimeError, UnpicklingError: all mean "not a checkpoint"
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ConfigError(f"{where} {path} is not a readable checkpoint ({reason})") from None
    if not isinstance(checkpoint, dict) or required not in checkpoint:
        raise ConfigError(f"{where} {path} is not a Lightning checkpoint (no {required!r})")
    return checkpoint
