"""Liger-Kernel's decoder kernels (RoPE, RMSNorm, SwiGLU, ...) on one Hugging Face model whose loss the
fused head computes: what ``use_liger_kernel`` gives a `HFCausalLM`.

Hugging Face's and TRL's ``use_liger_kernel`` patch a model with Liger-Kernel's Triton kernels, its fused
linear cross-entropy included. Here the fused head computes the loss (``head_backend``), so only the
kernels of the decoder are applied: the loss patches (``cross_entropy``, ``fused_linear_cross_entropy``)
stay off. Liger's ``apply_liger_kernel_to_<model>`` also replaces names of the architecture's
``transformers`` module for the whole process; `apply_liger_decoder` keeps its effect to the model it is
given: the replaced classes are put back (models built later, a frozen reference or teacher, are Hugging
Face's own) and a replaced function (RoPE) runs Liger's kernel on CUDA tensors only. Needs the ``[liger]``
extra and a CUDA device (`check_liger_device`).
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from lit_losses.errors import ConfigError
from lit_losses.models.hf_load import causal_lm_of, refused_as
from lit_losses.registry import closest

#: Liger-Kernel's options that replace the model's loss: the fused head computes it here.
LOSS_PATCHES = ("cross_entropy", "fused_linear_cross_entropy")
#: The option that takes Liger's options, as errors name it.
CONFIG_OPTION = "model.init_args.liger_kernel_config"
#: The activations Liger's SwiGLU kernel computes (``silu(gate) * up``).
SWIGLU_ACTIVATIONS = ("silu", "swish")


def liger_appliers() -> dict[str, Callable[..., None]]:
    """Liger-Kernel's ``apply_liger_kernel_to_<model>`` function of each ``model_type`` it supports.

    Raises:
        ConfigError: Liger-Kernel is not installed, or does not import with this ``transformers``.

    Example:
        >>> liger_appliers()["llama"].__name__
        'apply_liger_kernel_to_llama'
    """
    try:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except ModuleNotFoundError as err:
        if not (err.name or "").startswith("liger_kernel"):
            raise ConfigError(
                f"model.init_args.use_liger_kernel: Liger-Kernel does not import: {err}"
            ) from None
        raise ConfigError(
            "model.init_args.use_liger_kernel needs Liger-Kernel: pip install 'lit_losses[liger]'"
        ) from None
    except ImportError as err:
        raise ConfigError(f"model.init_args.use_liger_kernel: Liger-Kernel does not import: {err}") from None
    return dict(MODEL_TYPE_TO_APPLY_LIGER_FN)


def checked_options(config: Any) -> dict[str, bool]:
    """``config`` as Liger's options: a mapping of names to booleans, no loss patch turned on.

    Raises:
        ConfigError: naming `CONFIG_OPTION` and the offending value.

    Example:
        >>> checked_options({"swiglu": False})
        {'swiglu': False}
    """
    if config is None:
        return {}
    if not isinstance(config, Mapping):
        raise ConfigError(
            f"{CONFIG_OPTION}={config!r}: expected a mapping of Liger's options, e.g. {{rope: false}}"
        )
    for name, value in config.items():
        if not isinstance(value, bool):
            raise ConfigError(f"{CONFIG_OPTION}.{name}={value!r}: expected true or false")
        if name in LOSS_PATCHES and value:
            raise ConfigError(
                f"{CONFIG_OPTION}.{name}=True: the fused head computes the loss here; remove it "
                "(model.init_args.head_backend: liger takes Liger's cross-entropy kernel for the head)"
            )
    return dict(config)


def apply_liger_decoder(model: nn.Module, config: Mapping[str, bool] | None = None) -> dict[str, bool]:
    """Patch ``model`` (a ``transformers`` causal LM, or a ``peft`` model around one) in place with
    Liger-Kernel's kernels for its architecture, the loss patches off, and only ``model``.

    Args:
        model: the model; its config's ``model_type`` picks Liger's ``apply_liger_kernel_to_<model>``.
        config: that function's options (Hugging Face's ``liger_kernel_config``), e.g. ``{rope: false}``;
            by default every kernel but the loss patches.

    Returns:
        The options the function was called with.

    Raises:
        ConfigError: Liger-Kernel is missing, has no kernels for this ``model_type``, ``config`` names an
            option the function does not take or turns a loss patch on, the SwiGLU kernel would replace
            another activation (``hidden_act``), or the function fails on this model.

    Example:
        >>> apply_liger_decoder(nn.Linear(2, 2), {"fused_linear_cross_entropy": True})  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        lit_losses.errors.ConfigError: model.init_args.liger_kernel_config.fused_linear_cross_entropy=...: ...
    """
    options = checked_options(config)
    lm = causal_lm_of(model)
    model_type = getattr(getattr(lm, "config", None), "model_type", None)
    appliers = liger_appliers()
    if model_type not in appliers:
        raise ConfigError(
            f"model.init_args.use_liger_kernel: Liger-Kernel has no kernels for model_type {model_type!r}"
            f"{closest(str(model_type), sorted(appliers))} (it has: {', '.join(sorted(appliers))})"
        )
    apply = appliers[model_type]
    parameters = {
        name: p
        for name, p in inspect.signature(apply).parameters.items()
        if name != "model" and p.kind is not inspect.Parameter.VAR_KEYWORD
    }
    unknown = sorted(set(options) - set(parameters))
    if unknown:
        raise ConfigError(
            f"{CONFIG_OPTION}: {unknown} are not options of Liger-Kernel's {apply.__name__} "
            f"(it takes {', '.join(name for name in parameters if name not in LOSS_PATCHES)})"
        )
    options.update({name: False for name in LOSS_PATCHES if name in parameters})
    if "swiglu" in parameters:
        check_swiglu_activation(lm.config, on=options.get("swiglu", parameters["swiglu"].default))
    modeling = sys.modules[type(lm).__module__]
    before = dict(vars(modeling))
    with refused_as("model.init_args.use_liger_kernel", {}):
        apply(model=lm, **options)
    keep_to_instance(modeling, before)
    return options


def check_swiglu_activation(config: Any, on: bool) -> None:
    """Refuse Liger's SwiGLU kernel (``silu(gate) * up``) for a model whose MLP uses another activation: its
    instance patch would silently replace it."""
    activation = getattr(config, "hidden_act", None) or getattr(config, "hidden_activation", None)
    if on and activation is not None and activation not in SWIGLU_ACTIVATIONS:
        raise ConfigError(
            f"model.init_args.use_liger_kernel: Liger-Kernel's SwiGLU kernel computes silu, and this model's "
            f"hidden_act is {activation!r}; set {CONFIG_OPTION}.swiglu: false"
        )


def keep_to_instance(modeling: Any, before: Mapping[str, Any]) -> None:
    """Undo the process-wide part of a Liger patch of ``modeling`` (a ``transformers`` modeling module):
    each class it replaced is put back, each function it replaced runs Liger's on CUDA tensors only
    (`cuda_only`); the patched model's own modules keep Liger's forwards."""
    for name, old in before.items():
        new = vars(modeling).get(name, old)
        if new is old:
            continue
        if isinstance(old, type):
            setattr(modeling, name, old)
        elif callable(old) and callable(new):
            setattr(modeling, name, cuda_only(new, old))


def cuda_only(kernel: Callable[..., Any], fallback: Callable[..., Any]) -> Callable[..., Any]:
    """``kernel`` when the call's first tensor argument is on a CUDA device, else ``fallback``.

    Example:
        >>> rope = cuda_only(lambda q: "liger", lambda q: "hugging face")
        >>> rope(torch.zeros(2))
        'hugging face'
    """

    @functools.wraps(fallback)
    def dispatch(*args: Any, **kwargs: Any) -> Any:
        first = next((a for a in (*args, *kwargs.values()) if isinstance(a, Tensor)), None)
        return (kernel if first is not None and first.is_cuda else fallback)(*args, **kwargs)

    return dispatch


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
