"""The ``chunked`` backend: a pure-PyTorch fused output head that never materializes ``[N, V]`` logits.

It runs on CPU and CUDA, gives every per-token output (``logprobs``, ``lse``, ``entropy``; recompute in
backward, four ``N·D·V`` matmuls) and has fused paths, gradients computed in forward (three matmuls),
for the plain cross-entropy with any token weights and for pointwise losses. ``auto`` takes those fused
paths for a weight in the compute dtype (and its per-token outputs on CUDA). The autograd Functions are
in `lit_losses.heads.functions`, the per-chunk kernels and the maths in `lit_losses.heads.chunked_ops`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor

from lit_losses.heads.backend import (
    ChunkLoss,
    HeadBackend,
    HeadConfig,
    register_backend,
    scatter_valid,
    valid_tokens,
    weight_vector,
)
from lit_losses.heads.chunked_ops import default_chunk_size
from lit_losses.heads.entropy_kernels import use_compiled_entropy_kernels
from lit_losses.heads.functions import ChunkedLogProbs, ChunkedPointwiseLoss, ChunkedWeightedCE

if TYPE_CHECKING:
    from lit_losses.heads.output import HeadOutput

__all__ = [
    "CHUNKED",
    "ChunkLoss",
    "ChunkedLogProbs",
    "ChunkedPointwiseLoss",
    "ChunkedWeightedCE",
    "chunk_size_for",
    "chunked_per_token",
    "chunked_pointwise",
    "chunked_weighted_ce",
    "default_chunk_size",
]


def chunk_size_for(head: HeadConfig, n_tokens: int, with_entropy: bool = False) -> int:
    """The head's ``chunk_size``, or `default_chunk_size` for ``n_tokens`` valid tokens on the weight's
    device.

    On CPU ``with_entropy``, the eager entropy passes keep two ``[chunk, V]`` work tensors (``log p`` and
    ``p``), so they get half as many tokens: the memory of one chunk of the other paths, and no page faults
    of a second buffer (measured, `benchmarks/rl_step.py`). Chunks that the compiled entropy kernels take
    (`lit_losses.heads.entropy_kernels`) keep one work tensor and the full size, as accelerators do: their
    matmuls need the tokens (`lit_losses.heads.chunked_ops.DEFAULT_CHUNK_BYTES`)."""
    if head.chunk_size:
        return head.chunk_size
    device = head.weight.device
    rows = default_chunk_size(n_tokens, head.vocab_size, device=device)
    if (
        with_entropy
        and device.type == "cpu"
        and not use_compiled_entropy_kernels(device, rows, head.vocab_size)
    ):
        rows = default_chunk_size(n_tokens, head.vocab_size, bytes_per_elem=8, device=device)
    return rows


def chunked_per_token(
    head: HeadConfig, hidden: Tensor, targets: Tensor, outputs: tuple[str, ...]
) -> HeadOutput:
    """Per-token ``logprobs``/``lse``/``entropy`` with `ChunkedLogProbs` on the valid positions only.

    Args:
        head: weight ``[V, D]``, bias, chunk size, ``ignore_index``, ``accum_dtype``.
        hidden: ``[..., D]`` hidden states.
        targets: ``[...]`` token ids (``ignore_index`` where none).
        outputs: the requested outputs (the entropy is computed only when asked).

    Returns:
        A `HeadOutput` whose requested fields are shaped like ``targets``, 0 at ignored positions.
    """
    valid, h, y = valid_tokens(hidden, targets, head.ignore_index)
    logprobs, lse, entropy = ChunkedLogProbs.apply(
        h,
        head.weight,
        head.bias,
        y,
        "entropy" in outputs,
        chunk_size_for(head, h.shape[0], "entropy" in outputs),
        head.accum_dtype,
    )
    return scatter_valid({"logprobs": logprobs, "lse": lse, "entropy": entropy}, outputs, valid)


def chunked_weighted_ce(head: HeadConfig, h: Tensor, y: Tensor, token_weights: Tensor | float) -> Tensor:
    """``Σ_t w_t · (−log p_t[y_t])`` over valid tokens ``h [n, D]``, ``y [n]`` with `ChunkedWeightedCE`.

    Args:
        head: weight, bias, chunk size, ``accum_dtype``.
        h: ``[n, D]`` hidden states of the valid tokens.
        y: ``[n]`` their targets (int64).
        token_weights: one float for every token or ``[n]`` weights.

    Returns:
        The scalar loss; its gradients were computed in forward (backward rescales them).
    """
    w = weight_vector(token_weights, h.shape[0], h.device)
    loss, _ = ChunkedWeightedCE.apply(
        h, head.weight, head.bias, y, w, chunk_size_for(head, h.shape[0]), head.accum_dtype
    )
    return loss


def chunked_pointwise(
    head: HeadConfig, h: Tensor, y: Tensor, chunk_loss: ChunkLoss, with_entropy: bool
) -> Tensor:
    """``Σ_chunks chunk_loss(s, e, ℓ[s:e], lse[s:e], H[s:e])`` over valid tokens with `ChunkedPointwiseLoss`.

    Args:
        head: weight, bias, chunk size, ``accum_dtype``.
        h: ``[n, D]`` hidden states of the valid tokens.
        y: ``[n]`` their targets (int64).
        chunk_loss: per-chunk loss of per-token values (each token's loss depends on its own values only).
        with_entropy: pass the entropy (else ``None``) to ``chunk_loss``.

    Returns:
        The scalar loss; its gradients were computed in forward (backward rescales them).
    """
    return ChunkedPointwiseLoss.apply(
        h,
        head.weight,
        head.bias,
        y,
        chunk_loss,
        with_entropy,
        chunk_size_for(head, h.shape[0], with_entropy),
        head.accum_dtype,
    )


#: The ``chunked`` backend (``auto``'s fused paths for a weight in the compute dtype).
CHUNKED = register_backend(
    HeadBackend(
        name="chunked",
        outputs=("logprobs", "lse", "entropy"),
        per_token=chunked_per_token,
        fused_ce=chunked_weighted_ce,
        fused_ce_weights="any",
        fused_pointwise=chunked_pointwise,
        description="pure PyTorch, CPU/CUDA, logits chunk by chunk (recompute in backward)",
    )
)
