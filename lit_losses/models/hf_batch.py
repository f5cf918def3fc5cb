"""Hugging Face batches as `HFCausalLM` reads them: the two label conventions, and packed rows.

**Labels.** `TextDataModule` (and every lit_losses batch) carries *next-token* labels,
``labels[t] = input_ids[t + 1]``; Hugging Face collators carry labels *aligned* with ``input_ids``
(``labels[t] = input_ids[t]``; the model shifts them). `shift_labels` (`lit_losses.data.hf_text`) turns
the second into the first (never across a document boundary), and `check_label_format` refuses a batch
that evidently follows the other convention, rather than let it train a useless model.

**Packed rows.** Several documents in one row are told apart by ``segment_ids``, or, in Hugging Face's
format (``DataCollatorWithFlattening``), by ``position_ids`` restarting at 0
(`lit_losses.aggregation.batch_segment_ids`). `body_inputs` gives the model an explicit block-diagonal
causal mask (``sdpa``, ``eager``, ...) or, for FlashAttention, the restarting ``position_ids`` it reads as
variable-length sequences. `packing_leak` measures on a probe whether a model really keeps packed
documents apart.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from lit_losses.aggregation.stats import LabelFormat, batch_segment_ids, shift_labels
from lit_losses.errors import ConfigError

__all__ = [
    "LabelFormat",
    "body_inputs",
    "check_label_format",
    "packed_attention_mask",
    "packing_leak",
    "packing_tolerance",
    "segment_positions",
    "shift_labels",
]

#: Relative difference between packed and separate documents above which a model is said to leak.
PACKING_TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-8}
LOW_PRECISION_PACKING_TOLERANCE = 3e-2


def check_label_format(batch: Mapping[str, Any], label_format: LabelFormat, ignore_index: int = -100) -> bool:
    """Raise a `ConfigError` when the labels evidently follow the other convention.

    ``next_token``: labels equal to ``input_ids`` at every labelled position are aligned labels.
    ``input_aligned``: labels equal to the *next* input id at every labelled position are already shifted.

    Returns:
        Whether the batch had labelled positions to judge by (a batch without is not evidence).

    Example:
        >>> import torch
        >>> batch = {"input_ids": torch.tensor([[5, 6, 7]]), "labels": torch.tensor([[5, 6, 7]])}
        >>> check_label_format(batch, "input_aligned")
        True
        >>> check_label_format(batch, "next_token")
        Traceback (most recent call last):
        ...
        lit_losses.errors.ConfigError: batch['labels'] equal batch['input_ids'] at every labelled ...
    """
    labels, input_ids = batch["labels"], batch["input_ids"]
    valid = labels != ignore_index
    if not bool(valid.any()):
        return False
    aligned = bool((labels[valid] == input_ids[valid]).all())
    if label_format == "next_token" and aligned:
        raise ConfigError(
            "batch['labels'] equal batch['input_ids'] at every labelled position: these are Hugging Face "
            "labels aligned with input_ids (the model shifts them), but model.label_format='next_token' "
            "expects labels[t] = input_ids[t + 1]; set model.init_args.label_format: input_aligned"
        )
    ahead = valid[:, :-1]
    shifted = bool(ahead.any()) and bool((labels[:, :-1][ahead] == input_ids[:, 1:][ahead]).all())
    if label_format == "input_aligned" and not aligned and shifted:
        raise ConfigError(
            "batch['labels'] are already next-token labels (labels[t] = input_ids[t + 1] at every "
            "labelled position), but model.label_format='input_aligned' would shift them once more; "
            "set model.init_args.label_format: next_token"
        )
    return True


def segment_positions(segments: Tensor) -> Tensor:
    """Position ids restarting at 0 at the start of every segment.

    Example:
        >>> import torch
        >>> segment_positions(torch.tensor([[1, 1, 1, 2, 2, 0]])).tolist()
        [[0, 1, 2, 0, 1, 0]]
    """
    T = segments.shape[-1]
    index = torch.arange(T, device=segments.device).expand_as(segments)
    starts = torch.ones_like(segments, dtype=torch.bool)
    starts[:, 1:] = segments[:, 1:] != segments[:, :-1]
    return index - torch.where(starts, index, 0).cummax(-1).values


def packed_attention_mask(
    segments: Tensor, attn_implementation: str, dtype: torch.dtype, padding: Tensor | None = None
) -> Tensor:
    """The ``[B, 1, T, T]`` mask of packed rows: query ``i`` sees key ``j ≤ i`` of its own segment (and not a
    padding key). Boolean (True: attend) for ``sdpa``, additive (0 or the dtype's minimum) otherwise, the
    two forms Hugging Face passes through as a prepared 4-D mask. Every query sees at least itself."""
    T = segments.shape[-1]
    allowed = torch.ones(T, T, dtype=torch.bool, device=segments.device).tril()
    allowed = allowed & (segments[:, :, None] == segments[:, None, :])
    if padding is not None:
        allowed = allowed & padding.bool()[:, None, :]
    allowed = (allowed | torch.eye(T, dtype=torch.bool, device=segments.device))[:, None]
    if attn_implementation == "sdpa":
        return allowed
    return torch.zeros(allowed.shape, dtype=dtype, device=segments.device).masked_fill(
        ~allowed, torch.finfo(dtype).min
    )


def body_inputs(batch: Mapping[str, Any], attn_implementation: str, dtype: torch.dtype) -> dict[str, Any]:
    """Keyword arguments of the Hugging Face base model for ``batch`` (``input_ids``, masks, positions).

    Rows holding one sequence pass ``attention_mask`` and ``position_ids`` as they are (the model's own
    causal path). Packed rows get restarting ``position_ids`` and, except for FlashAttention (which reads
    them as variable-length sequences), a `packed_attention_mask` in ``dtype``.
    """
    inputs: dict[str, Any] = {"input_ids": batch["input_ids"], "use_cache": False}
    segments = batch_segment_ids(batch)
    padding, positions = batch.get("attention_mask"), batch.get("position_ids")
    if segments is None or not bool((segments != segments[:, :1]).any()):
        inputs.update(
            {k: v for k, v in (("attention_mask", padding), ("position_ids", positions)) if v is not None}
        )
        return inputs
    inputs["position_ids"] = segment_positions(segments) if positions is None else positions
    if not attn_implementation.startswith("flash_attention"):
        inputs["attention_mask"] = packed_attention_mask(
            segments, attn_implementation, dtype, padding=padding
        )
    return inputs


@torch.no_grad()
def packing_leak(body: nn.Module, vocab_size: int, attn_implementation: str, dtype: torch.dtype) -> float:
    """Relative difference between the hidden states of two documents packed in one row and the same
    documents alone (0 up to rounding when the model keeps packed documents apart).

    ``body`` (the base model, returning ``last_hidden_state``) runs in eval mode on 3 + 5 random tokens.
    """
    device = next(body.parameters()).device
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(0, vocab_size, (n,), generator=g).to(device) for n in (3, 5)]
    segments = torch.tensor([[0] * 3 + [1] * 5], device=device)
    packed = {"input_ids": torch.cat(docs)[None], "segment_ids": segments}
    training = body.training
    body.eval()
    try:
        together = body(**body_inputs(packed, attn_implementation, dtype)).last_hidden_state[0].float()
        alone = torch.cat(
            [body(input_ids=d[None], use_cache=False).last_hidden_state[0] for d in docs]
        ).float()
    finally:
        body.train(training)
    return float((together - alone).abs().max() / alone.abs().max().clamp_min(1e-12))


def packing_tolerance(body: nn.Module) -> float:
    """The largest `packing_leak` of ``body`` that is rounding: by its parameters' dtype, looser in a low
    precision or under autocast."""
    param = next(body.parameters())
    low = param.dtype not in PACKING_TOLERANCE or torch.is_autocast_enabled(param.device.type)
    return LOW_PRECISION_PACKING_TOLERANCE if low else PACKING_TOLERANCE[param.dtype]
