"""Liger-Kernel's decoder kernels (RoPE, RMSNorm, SwiGLU, ...) on a Hugging Face model whose loss the fused
head computes: what ``use_liger_kernel`` gives a `HFCausalLM`.

Hugging Face's and TRL's ``use_liger_kernel`` patch a model with Liger-Kernel's Triton kernels, its fused
linear cross-entropy included. Here the fused head computes the loss (``head_backend``; ``auto`` takes
Liger's cross-entropy kernel where it is the fastest), so only the kernels of the decoder are applied: the
loss patches (``cross_entropy``, ``fused_linear_cross_entropy``) stay off. Needs the ``[liger]`` extra and
a CUDA device (`check_liger_device`).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from lit_losses.errors import ConfigError
from lit_losses.models.hf_load import causal_lm_of
from lit_losses.registry import closest

#: Liger-Kernel's options that replace the model's loss: the fused head computes it here.
LOSS_PATCHES = ("cross_entropy", "fused_linear_cross_entropy")
WHERE = "model.init_args.liger_kernel_config"


def liger_appliers() -> dict[str, Any]:
    """Liger-Kernel's ``apply_liger_kernel_to_<model>`` function of each ``model_type`` it supports.

    Raises:
        ConfigError: Liger-Kernel is not installed.
    """
    try:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except ImportError as err:
        raise ConfigError(
            f"model.init_args.use_liger_kernel needs Liger-Kernel ({err}): pip install 'lit_losses[liger]'"
        ) from None
    return dict(MODEL_TYPE_TO_APPLY_LIGER_FN)


def apply_liger_decoder(model: nn.Module, config: dict[str, Any] | None = None) -> dict[str, Any]:
    """Patch ``model`` (a ``transformers`` causal LM, or a ``peft`` model around one) in place with
    Liger-Kernel's kernels for its architecture, the loss patches off.

    Args:
        model: the model; its config's ``model_type`` picks Liger's ``apply_liger_kernel_to_<model>``.
        config: that function's options (Hugging Face's ``liger_kernel_config``), e.g. ``{rope: false}``;
            by default every kernel but the loss patches.

    Returns:
        The options the function was called with.

    Raises:
        ConfigError: Liger-Kernel is missing, has no kernels for this ``model_type``, or ``config`` names
            an option the function does not take or turns a loss patch on.

    Example:
        >>> apply_liger_decoder(nn.Linear(2, 2), {"fused_linear_cross_entropy": True})  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        lit_losses.errors.ConfigError: model.init_args.liger_kernel_config.fused_linear_cross_entropy=...: ...
    """
    options = dict(config or {})
    for name in LOSS_PATCHES:
        if options.get(name):
            raise ConfigError(
                f"{WHERE}.{name}={options[name]!r}: the fused head computes the loss here; remove it "
                "(model.init_args.head_backend: liger takes Liger's cross-entropy kernel for the head)"
            )
    lm = causal_lm_of(model)
    model_type = getattr(getattr(lm, "config", None), "model_type", None)
    appliers = liger_appliers()
    if model_type not in appliers:
        raise ConfigError(
            f"model.init_args.use_liger_kernel: Liger-Kernel has no kernels for model_type {model_type!r}"
            f"{closest(str(model_type), sorted(appliers))} (it has: {', '.join(sorted(appliers))})"
        )
    apply = appliers[model_type]
    accepted = [name for name in inspect.signature(apply).parameters if name != "model"]
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ConfigError(
            f"{WHERE}: {unknown} are not options of Liger-Kernel's {apply.__name__} "
            f"(it takes {', '.join(name for name in accepted if name not in LOSS_PATCHES)})"
        )
    options.update({name: False for name in LOSS_PATCHES if name in accepted})
    apply(model=lm, **options)
    return options


def check_liger_device(device: torch.device | str) -> None:
    """Refuse, before any batch, Liger-Kernel's kernels on a device they cannot run on (Triton: CUDA).

    Raises:
        ConfigError: the device is not a CUDA device.

    Example:
        >>> check_liger_device("cuda:0")
        >>> check_liger_device("cpu")
        Traceback (most recent call last):
        ...
        lit_losses.errors.ConfigError: model.init_args.use_liger_kernel: Liger-Kernel's kernels run on ...
    """
    device_type = torch.device(device).type
    if device_type != "cuda":
        raise ConfigError(
            "model.init_args.use_liger_kernel: Liger-Kernel's kernels run on CUDA only and this run's "
            f"device is {device_type}; set it to false"
        )
