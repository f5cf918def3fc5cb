"""What the backends over other libraries' CUDA kernels (``liger_scaled``, ``cce``) check before a call:
a CUDA tensor, their optional package, operand dtypes they compute exactly, no bias where the kernel
has none. Each refusal names the backend and what to use instead.

Example:
    >>> import torch
    >>> from lit_losses.heads.peer_kernels import refuse_bias
    >>> refuse_bias("cce", torch.zeros(3))
    Traceback (most recent call last):
    ...
    ValueError: head backend 'cce' has no bias term (the kernel takes none); use backend='chunked' ...
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence

import torch
from torch import Tensor

from lit_losses.heads.higher_order import first_order_only

#: The backend every refusal points to: all outputs, any device and dtype, bias, double backward.
INSTEAD = "chunked"


def module_importable(module: str) -> bool:
    """Whether ``module`` imports (an optional package, installed and loadable)."""
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def import_peer(backend: str, module: str, install: str) -> object:
    """Import ``module`` for ``backend``, or raise a `RuntimeError` saying what to install.

    Args:
        backend: the backend's name, for the message.
        module: the module to import.
        install: the pip requirement that provides it, e.g. ``"lit_losses[cce]"``.
    """
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise RuntimeError(
            f"head backend {backend!r} needs {module!r}: pip install '{install}' (or use backend={INSTEAD!r})"
        ) from err


def require_cuda(backend: str, hidden: Tensor) -> None:
    """Refuse (`RuntimeError`) hidden states that are not on a CUDA device."""
    if hidden.device.type != "cuda":
        raise RuntimeError(
            f"head backend {backend!r} runs on CUDA tensors only, got hidden on {hidden.device}; "
            f"use backend={INSTEAD!r}"
        )


def refuse_bias(backend: str, bias: Tensor | None) -> None:
    """Refuse (`ValueError`) a head with a bias, for a kernel that has no bias term."""
    if bias is not None:
        raise ValueError(
            f"head backend {backend!r} has no bias term (the kernel takes none); use backend={INSTEAD!r} "
            "for a head with a bias"
        )


def require_dtype(
    backend: str, hidden: Tensor, accum_dtype: torch.dtype, dtypes: Sequence[torch.dtype]
) -> None:
    """Refuse (`ValueError`) operands the kernel does not take or computes less precisely than the head's
    contract: an operand dtype outside ``dtypes``, or an ``accum_dtype`` wider than fp32 (the kernels
    accumulate in fp32 at most)."""
    if hidden.dtype not in dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(
            f"head backend {backend!r} takes operands in {names} here, got {hidden.dtype} (the head's "
            f"operand dtype, `lit_losses.heads.precision`); use backend={INSTEAD!r}"
        )
    if torch.finfo(accum_dtype).bits > 32:
        raise ValueError(
            f"head backend {backend!r} accumulates in fp32 at most, but accum_dtype={accum_dtype}; "
            f"use backend={INSTEAD!r}"
        )


def check_operands(
    backend: str, hidden: Tensor, bias: Tensor | None, accum_dtype: torch.dtype, dtypes: Sequence[torch.dtype]
) -> torch.dtype:
    """Refuse a call the kernel cannot compute (`require_cuda`, `refuse_bias`, `require_dtype`) and return
    the dtype of its outputs, ``promote(hidden, accum_dtype)``."""
    require_cuda(backend, hidden)
    refuse_bias(backend, bias)
    require_dtype(backend, hidden, accum_dtype, dtypes=dtypes)
    return torch.promote_types(hidden.dtype, accum_dtype)


def kernel_output(backend: str, output: Tensor) -> Tensor:
    """A kernel's ``output`` whose backward refuses double backward (`first_order_only`), pointing to
    `INSTEAD`."""
    instead = f"use backend={INSTEAD!r} for a loss you differentiate twice"
    return first_order_only(output, f"head backend {backend!r}", instead)


def empty_rows(hidden: Tensor, weight: Tensor, dtype: torch.dtype) -> Tensor:
    """A ``[0]`` result for zero valid tokens, in the graph of ``hidden`` and ``weight`` (zero gradients),
    since the kernels refuse empty inputs."""
    return (hidden @ weight[:1].T)[:, 0].to(dtype) * 0
