"""The ``liger_scaled`` backend: Liger-Kernel's fused linear *scaled* cross-entropy on CUDA, per-token
log-probabilities and entropy (optional extra ``[liger]``; on Hopper also ``liger-kernel[cutedsl]``).

The name is Liger's (``LigerFusedLinearScaledCrossEntropyFunction``, "scaled" by a temperature), so a
Liger user finds it; it gives ``logprobs`` (``−nll``) and ``entropy``, not ``lse``. The call is the
public ``liger_kernel.ops.LigerFusedLinearScaledCrossEntropyFunction.apply(h, W, y, temperature=1.0,
return_entropy=...)`` on the valid tokens only (ignored positions are removed before, so Liger's own
``ignore_index`` is left at its default, and they get 0 and no gradient, like every backend's). What
Liger 0.8.5 does, and what follows here:

* **Implementations.** On a compute-capability 9.0 GPU (H100, H200) Liger always runs its CuTe DSL SM90
  kernel, which takes bf16 hidden states and weight only and needs ``nvidia-cutlass-dsl``
  (``pip install 'liger-kernel[cutedsl]'``); anywhere else a PyTorch fallback in 512-token chunks. So
  on Hopper an fp32 operand dtype (``matmul_precision="full"``, or an fp32 model) is refused here
  (`ValueError`), and so is float64 everywhere (Liger computes in fp32 at most).
* **Precision.** The SM90 kernel accumulates the logits in fp32 and stages them through fp16 shared
  memory before its fp32 online softmax (fp16 rounding, 2⁻¹¹ relative, and fp16's range: ±65504).
  ``nll`` is fp32; the **entropy is returned in the operand dtype**: bf16 under bf16
  operands (the SM90 kernel stores it in bf16 and its backward reuses that bf16 value; the fallback
  computes it in fp32 and rounds it to the input dtype). The fallback also rounds the logits to the
  operand dtype before its fp32 softmax. Both accumulate the weight's gradient in the operand dtype
  (bf16 across token waves/chunks), where the head's contract accumulates in fp32. Outputs are cast to
  ``promote(hidden, accum_dtype)`` (fp32), but the values keep the bf16 rounding: about 2⁻⁸ relative
  on the entropy.
* **Temperature.** Liger's native ``temperature`` divides the fp32 logits; the head applies its own
  ``temperature`` before any backend (``(h / T) Wᵀ``, `HeadSettings.tempered`), so Liger is called with
  1 and every backend sees the same tempered operands.
* **Bias.** Liger's kernel has none: a head with a bias is refused (`ValueError`).
* **Gradients.** Backward takes any per-token upstream gradient on both outputs (both implementations
  scale each row of the logit gradient by its token's upstream values, and an output not used gets
  zeros), so every loss of the two outputs is exact to the precision above. First-order only: double
  backward is refused (`first_order_only`).

``backend="auto"`` never picks it: it is not at the head's precision contract under bf16 (the entropy
above), it has no bias and no ``lse``, and the ``chunked`` backend gives the same outputs on every device.
The plain cross-entropy asked of it is computed from its per-token ``logprobs`` (any token weights: the
upstream gradient is per token); pointwise losses that need ``lse`` are refused, with the backends that
give it named.

Liger's tensor-parallel variant (``liger_fused_linear_scaled_cross_entropy_tp``, a vocabulary-sharded
weight) is not a backend here: it needs an initialized process group at the call (and on Hopper an NVSHMEM
team matching it), has no bias either, and its native path takes bf16 only; `VocabParallelHead` covers a
sharded head with every output. It would belong there, as an opt-in kernel, once tested on several GPUs.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lit_losses.heads import peer_kernels
from lit_losses.heads.backend import HeadBackend, HeadConfig, register_backend, scatter_valid, valid_tokens
from lit_losses.heads.output import HeadOutput

NAME = "liger_scaled"
_INSTALL = "lit_losses[liger]"
_SM90 = (9, 0)
_OPERANDS = (torch.bfloat16, torch.float16, torch.float32)


def liger_scaled_available() -> bool:
    """True when CUDA is available and Liger's scaled cross-entropy imports (``[liger]``,
    liger-kernel>=0.8.5), with its CuTe DSL (``liger-kernel[cutedsl]``) on a compute-capability 9.0 GPU,
    where Liger requires it."""
    if not torch.cuda.is_available():
        return False
    try:
        from liger_kernel.ops import LigerFusedLinearScaledCrossEntropyFunction  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.get_device_capability() != _SM90 or peer_kernels.module_importable("cutlass")


def _scaled_function(hidden: Tensor) -> Any:
    """Liger's function, after the checks of the implementation it dispatches ``hidden`` to."""
    ops = peer_kernels.import_peer(NAME, "liger_kernel.ops", _INSTALL)
    if not hasattr(ops, "LigerFusedLinearScaledCrossEntropyFunction"):
        raise RuntimeError(
            f"head backend {NAME!r} needs liger-kernel>=0.8.5 (LigerFusedLinearScaledCrossEntropyFunction): "
            f"pip install -U '{_INSTALL}'"
        )
    if torch.cuda.get_device_capability(hidden.device) == _SM90:
        _require_sm90_dtype(hidden)
        peer_kernels.import_peer(NAME, "cutlass", "liger-kernel[cutedsl]")
    return ops.LigerFusedLinearScaledCrossEntropyFunction


def _require_sm90_dtype(hidden: Tensor) -> None:
    """On a compute-capability 9.0 GPU Liger runs its SM90 kernel, which takes bf16 operands only."""
    if torch.cuda.get_device_capability(hidden.device) == _SM90 and hidden.dtype != torch.bfloat16:
        raise ValueError(
            f"head backend {NAME!r} on a compute-capability 9.0 GPU runs Liger's SM90 kernel, which "
            f"takes bf16 operands only, got {hidden.dtype}; use backend={peer_kernels.INSTEAD!r} (or "
            "bf16 operands: matmul_precision='low' with a bf16 model)"
        )


def liger_scaled_logprobs_entropy(
    hidden: Tensor, weight: Tensor, targets: Tensor, with_entropy: bool = True
) -> tuple[Tensor, Tensor | None]:
    """``(log p_t[y_t], entropy_t)`` of ``softmax(h Wᵀ)`` with Liger's fused linear scaled cross-entropy.

    Args:
        hidden: ``[n, D]`` hidden states (CUDA; bf16 on a compute-capability 9.0 GPU), ``n >= 1``.
        weight: ``[V, D]`` output projection, in ``hidden``'s dtype.
        targets: ``[n]`` token ids, all valid.
        with_entropy: also compute the entropy (else ``None``).

    Returns:
        fp32 log-probabilities and the entropy in ``hidden``'s dtype, each differentiable once with respect
        to ``hidden`` and ``weight`` for any upstream gradient.

    Raises:
        RuntimeError: not on CUDA, or liger-kernel (on Hopper: its ``[cutedsl]`` extra) not installed.
        ValueError: a dtype Liger's kernel here does not take.
    """
    peer_kernels.require_cuda(NAME, hidden)
    fn = _scaled_function(hidden)
    out = fn.apply(hidden, weight, targets.long(), temperature=1.0, return_entropy=with_entropy)
    nll, entropy = out if with_entropy else (out, None)
    logprobs = peer_kernels.kernel_output(NAME, -nll)
    if entropy is not None:
        entropy = peer_kernels.kernel_output(NAME, entropy)
    return logprobs, entropy


def liger_scaled_per_token(
    head: HeadConfig, hidden: Tensor, targets: Tensor, outputs: tuple[str, ...]
) -> HeadOutput:
    """`liger_scaled_logprobs_entropy` on the valid positions, in ``promote(hidden, accum_dtype)``,
    scattered back to the shape of ``targets`` (0 at ignored positions)."""
    out_dtype = peer_kernels.check_operands(
        NAME, hidden, head.bias, accum_dtype=head.accum_dtype, dtypes=_OPERANDS
    )
    _require_sm90_dtype(hidden)  # also when no token is valid: the same call refused either way
    valid, h, y = valid_tokens(hidden, targets, head.ignore_index)
    if h.shape[0] == 0:
        zeros = peer_kernels.empty_rows(h, head.weight, out_dtype)
        return scatter_valid(dict.fromkeys(outputs, zeros), outputs, valid)
    logprobs, entropy = liger_scaled_logprobs_entropy(h, head.weight, y, with_entropy="entropy" in outputs)
    values = {"logprobs": logprobs.to(out_dtype)}
    if entropy is not None:
        values["entropy"] = entropy.to(out_dtype)
    return scatter_valid(values, outputs, valid)


#: The ``liger_scaled`` backend: per-token log-probabilities and entropy with Liger's kernel, on CUDA, no
#: bias; never picked by ``auto`` (see the module docstring).
LIGER_SCALED = register_backend(
    HeadBackend(
        name=NAME,
        outputs=("logprobs", "entropy"),
        per_token=liger_scaled_per_token,
        cuda_only=True,
        available=liger_scaled_available,
        description="Liger-Kernel fused linear scaled CE (CUDA, [liger]): logprobs + entropy, no bias",
    )
)
