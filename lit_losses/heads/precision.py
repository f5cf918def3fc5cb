"""The head's dtype policy: every backend computes in one dtype, whatever autocast or the model's dtypes.

Under mixed precision the model body gives ``bf16``/``fp16`` hidden states while the output weight is an
fp32 master parameter (``bf16-mixed``, ``16-mixed``), or everything is ``bf16`` (``bf16-true``). The head
computes its logits, softmax statistics and gradients in

    ``compute dtype = promote(hidden, weight, bias, accum_dtype)``

(fp32 for every low-precision combination with the default ``accum_dtype``; float64 inputs stay float64),
with autocast disabled, in forward and in backward alike; every backend returns its outputs in that dtype.

The *operands* of the three matmuls (logits, gradient of hidden, gradient of weight) follow
``matmul_precision`` (`operand_dtype`):

- ``full``: the compute dtype. The error against float64 is that of an fp32 computation from the same
  inputs; the price of a low-precision weight (``bf16-true``) is an fp32 copy of it for the call.
- ``low``: bf16 when bf16 is in play (autocast's dtype when autocast is on at the call, else that of
  ``hidden`` or ``weight``), accumulated in the compute dtype (fp32 logits without rounding to bf16 where
  PyTorch has ``torch.mm(..., out_dtype=...)``, i.e. on CUDA): what autocast, Liger-Kernel and
  ``F.linear_cross_entropy`` do, on tensor cores. fp16 is never used for operands: the fused paths form
  the logit gradient in forward, already scaled by the token weights (about 1/N) and later by a
  GradScaler's factor, which fp16's range cannot hold; fp16 in play, fp32 or float64 inputs: ``full``.
- ``low_logits``: ``low``, and the ``blocked`` backend writes its logits in bf16 too, rounded as a bf16
  ``nn.Linear`` writes them for Hugging Face's own loss (and as Liger-Kernel's kernel computes them); their
  softmax statistics, log-probabilities and gradients are still computed in the compute dtype from the
  rounded values, and the logit gradient is rounded to bf16 for the matmuls as with ``low``. Half the bytes
  per logit (memory traffic, and a block's memory) against fp32 logits, for a rounding of each logit of
  about ``2⁻⁹ |z|``; the eager passes (without the compiled kernels) compute in an fp32 copy of each
  block. ``auto`` then takes ``blocked`` for every call of `FusedLMHead` (`select_backend`); another
  backend named, distillation and top-k compute as with ``low``. On CPU ``low`` rounds the logits to bf16
  already (the product of bf16 operands is bf16 there).
- ``auto`` (default): ``low`` on CUDA, ``full`` elsewhere (a CPU computes fp32 matmuls faster than bf16 ones).

Tensors are cast before a backend sees them (autograd casts the gradients back to each input's dtype).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, get_args

import torch
from torch import Tensor

if TYPE_CHECKING:
    from lit_losses.heads.backend import HeadConfig

#: The dtypes a head computes in (quantized or float8 tensors must be dequantized first).
FLOATING_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

#: Operands of the head's matmuls: the compute dtype (``full``), the low precision in play (``low``; with
#: the logits in it too: ``low_logits``), or ``low`` on CUDA and ``full`` elsewhere (``auto``); see the
#: module docstring.
MatmulPrecision = Literal["auto", "full", "low", "low_logits"]
"""The precision of the head's matmuls by name: their operands (``full``, ``low``, ``auto``) and, with
``low_logits``, the logits the ``blocked`` backend writes (the module docstring)."""


def compute_dtype(
    hidden: Tensor, weight: Tensor, bias: Tensor | None, accum_dtype: torch.dtype = torch.float32
) -> torch.dtype:
    """The dtype a head computes in: ``promote(hidden, weight, bias, accum_dtype)``.

    Args:
        hidden: ``[..., D]`` hidden states.
        weight: ``[V, D]`` output projection.
        bias: ``[V]`` or ``None``.
        accum_dtype: the least precise dtype logits and gradients are computed in.

    Returns:
        The compute dtype.

    Raises:
        ValueError: a tensor whose dtype is not one of `FLOATING_DTYPES` (e.g. an ``int8`` quantized
            weight); the message names the tensor, its dtype and the dtype it meets.

    Example:
        >>> import torch
        >>> from lit_losses.heads.precision import compute_dtype
        >>> h, w = torch.zeros(2, 4, dtype=torch.bfloat16), torch.zeros(8, 4)
        >>> compute_dtype(h, w, None), compute_dtype(h, w.bfloat16(), None)
        (torch.float32, torch.float32)
        >>> compute_dtype(h.double(), w, None)
        torch.float64
        >>> compute_dtype(h, w.to(torch.int8), None)
        Traceback (most recent call last):
        ...
        ValueError: head input 'weight' has dtype torch.int8, which cannot be combined with 'hidden' ...
    """
    named = {"hidden": hidden, "weight": weight, **({} if bias is None else {"bias": bias})}
    for name, tensor in named.items():
        if tensor.dtype not in FLOATING_DTYPES:
            other = "weight" if name == "hidden" else "hidden"
            raise ValueError(
                f"head input {name!r} has dtype {tensor.dtype}, which cannot be combined with {other!r} "
                f"(dtype {named[other].dtype}): the head computes in one of {FLOATING_DTYPES}; "
                f"dequantize or cast {name!r} first"
            )
    if accum_dtype not in FLOATING_DTYPES:
        raise ValueError(f"accum_dtype must be one of {FLOATING_DTYPES}, got {accum_dtype}")
    dtype = accum_dtype
    for tensor in named.values():
        dtype = torch.promote_types(dtype, tensor.dtype)
    return dtype


def operand_dtype(
    hidden: Tensor, weight: Tensor, dtype: torch.dtype, matmul_precision: MatmulPrecision = "auto"
) -> torch.dtype:
    """The dtype of the head's matmul operands (see the module docstring); call it before autocast is
    disabled, since it reads autocast's state.

    Args:
        hidden: ``[..., D]`` hidden states.
        weight: ``[V, D]`` output projection.
        dtype: the compute dtype (`compute_dtype`).
        matmul_precision: ``auto``, ``full``, ``low`` or ``low_logits`` (operands as ``low``).

    Returns:
        ``dtype``, or bf16 when it is in play (autocast's dtype, ``hidden``'s or ``weight``'s) and ``dtype``
        is not float64.

    Example:
        >>> import torch
        >>> h, w = torch.zeros(2, 4, dtype=torch.bfloat16), torch.zeros(8, 4)
        >>> operand_dtype(h, w, torch.float32, "low"), operand_dtype(h, w, torch.float32, "auto")  # on CPU
        (torch.bfloat16, torch.float32)
        >>> with torch.autocast("cpu", dtype=torch.bfloat16):
        ...     operand_dtype(h.float(), w, torch.float32, "low")
        torch.bfloat16
        >>> operand_dtype(h.float(), w, torch.float32, "low")  # fp32 inputs, no autocast: full precision
        torch.float32
        >>> operand_dtype(h.half(), w, torch.float32, "low")  # fp16 operands: never (its range)
        torch.float32
    """
    if matmul_precision not in get_args(MatmulPrecision):
        raise ValueError(
            f"matmul_precision must be one of {get_args(MatmulPrecision)}, got {matmul_precision!r}"
        )
    device = hidden.device.type
    if matmul_precision == "full" or (matmul_precision == "auto" and device != "cuda"):
        return dtype
    if dtype == torch.float64:
        return dtype
    candidates = [hidden.dtype, weight.dtype]
    if torch.is_autocast_enabled(device):
        candidates.insert(0, torch.get_autocast_dtype(device))
    return torch.bfloat16 if torch.bfloat16 in candidates else dtype


@dataclass(frozen=True)
class CastHead:
    """A head's settings with its weight and bias in the operand dtype (what a backend is given)."""

    weight: Tensor
    """``[V, D]`` in the operand dtype (`operand_dtype`)."""
    bias: Tensor | None
    """``[V]`` in the operand dtype, or ``None``."""
    chunk_size: int | None
    """Tokens per chunk (``None``: from a memory budget)."""
    ignore_index: int
    """Target value of positions without a label."""
    accum_dtype: torch.dtype
    """The least precise dtype of logits, statistics and gradient accumulation."""
    vocab_size: int
    """``V``, the weight's rows."""


@contextmanager
def in_compute_dtype(
    head: HeadConfig, hidden: Tensor, keep_weight: bool = False
) -> Iterator[tuple[HeadConfig, Tensor]]:
    """``(head, hidden)`` with the matmul operands in `operand_dtype` (the head's ``matmul_precision``,
    ``full`` for a head without one), autocast disabled inside the block.

    Tensors already in that dtype are passed as they are (no copy); others are cast with ``.to``, which
    autograd differentiates (gradients come back in each input's dtype). Backends accumulate in
    ``promote(operands, accum_dtype)``: the compute dtype. With ``keep_weight`` only ``hidden`` is cast:
    the weight and bias are given as they are, for a backend that casts the blocks it uses
    (`HeadBackend.casts_weight_blocks`) instead of copying the whole weight.

    Example:
        >>> import torch
        >>> from lit_losses.heads import FusedLMHead
        >>> from lit_losses.heads.precision import in_compute_dtype
        >>> head = FusedLMHead(torch.zeros(8, 4))
        >>> hidden = torch.ones(2, 4, dtype=torch.bfloat16)
        >>> with torch.autocast("cpu", dtype=torch.bfloat16), in_compute_dtype(head, hidden) as (cast, h):
        ...     torch.nn.functional.linear(h, cast.weight).dtype
        torch.float32
    """
    dtype = compute_dtype(hidden, head.weight, head.bias, accum_dtype=head.accum_dtype)
    dtype = operand_dtype(
        hidden, head.weight, dtype, matmul_precision=getattr(head, "matmul_precision", "full")
    )
    with autocast_off(hidden.device):
        if keep_weight or all(t is None or t.dtype == dtype for t in (hidden, head.weight, head.bias)):
            yield head, hidden.to(dtype)
            return
        bias = None if head.bias is None else head.bias.to(dtype)
        weight = head.weight.to(dtype)
        cast = CastHead(
            weight,
            bias,
            head.chunk_size,
            ignore_index=head.ignore_index,
            accum_dtype=head.accum_dtype,
            vocab_size=weight.shape[0],
        )
        yield cast, hidden.to(dtype)


def autocast_off(device: torch.device) -> torch.autocast:
    """A context in which autocast is disabled on ``device``'s type (backward passes use it too)."""
    return torch.autocast(device.type, enabled=False)
