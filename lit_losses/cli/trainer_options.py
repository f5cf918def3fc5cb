"""Trainer options that Lightning accepts without a word although the run cannot go as the user meant.

The user need: a numeric trainer option below what makes sense (``gradient_clip_val: -1`` scales every
gradient by a negative norm, ``accumulate_grad_batches: 0`` hangs), or a ``ModelParallelStrategy`` whose
mesh does not match the processes the trainer starts (the stock ``configs/tensor_parallel.yaml`` on one
device), must be one line naming the option when the configuration is parsed, not a silent run nor a
traceback from inside the strategy's set-up.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lit_losses.errors import ConfigError

TRAINER_BOUNDS: dict[str, tuple[int, str]] = {
    "accumulate_grad_batches": (1, ""),
    "check_val_every_n_epoch": (1, ""),
    "gradient_clip_val": (0, " (0 or null: no clipping)"),
    "min_steps": (0, ""),
    "min_epochs": (0, ""),
    "num_sanity_val_steps": (-1, " (-1: every validation batch)"),
}
"""The least value of the numeric trainer options that Lightning takes without a word below it (and
then hangs, does nothing, or scales the gradients by a negative norm), with what the bound means."""


def check_trainer_numbers(trainer: Mapping[str, Any]) -> None:
    """Refuse a numeric trainer option below its least value (`TRAINER_BOUNDS`; NaN too).

    Raises:
        ConfigError: ``trainer.<option>=<value> must be >= <least>``.

    Example:
        >>> check_trainer_numbers({"gradient_clip_val": 1.0, "accumulate_grad_batches": 4})
        >>> check_trainer_numbers({"gradient_clip_val": -1.0})
        Traceback (most recent call last):
        ...
        lit_losses.errors.ConfigError: trainer.gradient_clip_val=-1.0 must be >= 0 (0 or null: no clipping)
    """
    for option, (least, meaning) in TRAINER_BOUNDS.items():
        value = trainer.get(option)
        if isinstance(value, int | float) and not isinstance(value, bool) and not value >= least:
            raise ConfigError(f"trainer.{option}={value} must be >= {least}{meaning}")


def device_count(devices: Any) -> int | None:
    """The number of devices that ``trainer.devices`` asks for, or ``None`` when the machine decides
    (``auto``, ``-1``).

    Example:
        >>> [device_count(d) for d in (2, "2", [0, 1], "0,1", "auto", -1)]
        [2, 2, 2, 2, None, None]
    """
    if isinstance(devices, list | tuple):
        return len(devices)
    if isinstance(devices, str) and "," in devices:
        return len([d for d in devices.split(",") if d.strip()])
    if isinstance(devices, str) and devices.strip().isdigit():
        devices = int(devices)
    return devices if isinstance(devices, int) and not isinstance(devices, bool) and devices > 0 else None


def check_parallel_sizes(trainer: Mapping[str, Any]) -> None:
    """Refuse a ``ModelParallelStrategy`` whose ``data_parallel_size × tensor_parallel_size`` differs from
    the processes the trainer starts (``devices × num_nodes``), which the strategy reports only once the
    processes are set up, as a traceback.

    Raises:
        ConfigError: naming both sizes, ``trainer.devices`` and ``trainer.num_nodes``.

    Example:
        >>> strategy = {"class_path": "lightning.pytorch.strategies.ModelParallelStrategy",
        ...             "init_args": {"data_parallel_size": 1, "tensor_parallel_size": 2}}
        >>> check_parallel_sizes({"strategy": strategy, "devices": 2, "num_nodes": 1})
        >>> check_parallel_sizes({"strategy": strategy, "devices": 1, "num_nodes": 1})
        Traceback (most recent call last):
        ...
        lit_losses.errors.ConfigError: trainer.strategy.init_args: data_parallel_size=1 × ...
    """
    strategy = trainer.get("strategy")
    if not isinstance(strategy, Mapping) or not str(strategy.get("class_path", "")).endswith(
        "ModelParallelStrategy"
    ):
        return
    args = strategy.get("init_args") or {}
    dp, tp = args.get("data_parallel_size", "auto"), args.get("tensor_parallel_size", "auto")
    devices, nodes = device_count(trainer.get("devices")), trainer.get("num_nodes") or 1
    if not all(isinstance(n, int) for n in (dp, tp, nodes)) or devices is None or dp * tp == devices * nodes:
        return
    hint = f"trainer.devices={dp * tp // nodes}" if dp * tp % nodes == 0 else "the sizes"
    raise ConfigError(
        f"trainer.strategy.init_args: data_parallel_size={dp} × tensor_parallel_size={tp} = {dp * tp} "
        f"processes, but trainer.devices={trainer.get('devices')} × trainer.num_nodes={nodes} starts "
        f"{devices * nodes}; set {hint} (or sizes whose product is {devices * nodes})"
    )
