"""`TokenMetrics`: TRL's per-token metrics (``entropy``, ``mean_token_accuracy``, ``num_tokens``,
``logits/chosen``, ``logits/rejected``) of a micro-batch, as its share of the optimizer step's value.

Each trainer of TRL logs its own set (`TRAINER_METRICS`), with TRL's definitions, over the positions with a
label (``labels != ignore_index``: the completion tokens of preference data, the trained tokens of SFT):

- ``entropy``: the mean over those tokens of the entropy ``−Σ_v p_v log p_v`` of the predicted distribution;
- ``mean_token_accuracy``: the fraction of them whose label is the most likely token (``argmax``, the first
  on a tie); DPO: over the chosen completions' tokens only;
- ``logits/chosen``, ``logits/rejected``: the mean over the chosen (KTO: desirable) and the rejected
  (undesirable) completions' tokens of the mean logit over the vocabulary, ``Σ_v z_v / V``;
- ``num_tokens``: the cumulative number of input tokens trained on (padding excluded: ``attention_mask``,
  else ``segment_ids != 0``, else every position), summed over the step's micro-batches and ranks
  (training only).

The statistics come from one more no-grad pass of the head over the valid tokens
(`lit_losses.heads.token_stats`: one forward matmul, no ``[tokens × V]`` logits); CPO's and ORPO's
``logits/*`` alone need none (``Σ_v z_v = h · Σ_v W_v + Σ_v b_v``). A mean is the micro-batch's numerator
divided by the step's global count of its tokens (the loader counts ``labels`` and the chosen key), so
the step's telemetry (`lit_losses.loss.telemetry.StepTelemetry`) adds the shares up to the exact mean over
every micro-batch and rank of the step; TRL averages per micro-batch means (each exact over the ranks)
over the accumulation steps and logging interval, which is the same only when the micro-batches hold as
many tokens. In validation the count is the micro-batch's own and is its weight (`weights`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import torch
from torch import Tensor

from lit_losses.aggregation import LABELS_KEY, GlobalStats
from lit_losses.errors import BatchKeyError
from lit_losses.heads import FusedLMHead, TokenStatistic, token_stats

TrainerName = Literal["sft", "grpo", "dpo", "kto", "cpo", "orpo"]
TRAINER_METRICS: dict[str, tuple[str, ...]] = {
    "sft": ("entropy", "mean_token_accuracy", "num_tokens"),
    "grpo": ("entropy", "num_tokens"),
    "dpo": ("entropy", "num_tokens", "logits/chosen", "logits/rejected", "mean_token_accuracy"),
    "kto": ("entropy", "num_tokens", "logits/chosen", "logits/rejected"),
    "cpo": ("logits/chosen", "logits/rejected"),
    "orpo": ("logits/chosen", "logits/rejected"),
}
"""The metrics each TRL trainer logs besides its loss's own (SFT's for every loss but GRPO and the preference
presets: plain cross-entropy and distillation, as TRL's ``GKDTrainer``, an ``SFTTrainer``)."""
NEEDS: dict[str, TokenStatistic] = {
    "entropy": "entropy",
    "mean_token_accuracy": "is_top1",
    "logits/chosen": "mean_logit",
    "logits/rejected": "mean_logit",
}
"""The per-token statistic each metric averages."""
NUM_TOKENS = "num_tokens"


class TokenMetrics:
    """TRL's per-token metrics of one trainer (see the module docstring).

    Args:
        trainer: whose set (`TRAINER_METRICS`): ``sft`` for a loss that is no preset of TRL's trainers.
        chosen_key: the mask key of the chosen (KTO: desirable) completions' tokens, for the ``logits/*``
            metrics and DPO's accuracy (``chosen_mask``, ``desirable_mask``); required by the preference
            trainers' sets.
        ignore_index: the label value of positions without a target.

    Example:
        >>> import torch
        >>> from lit_losses.aggregation import GlobalStats
        >>> from lit_losses.heads import FusedLMHead
        >>> metrics = TokenMetrics("sft")
        >>> batch = {"labels": torch.tensor([[1, 2, -100]]), "attention_mask": torch.tensor([[1, 1, 1]])}
        >>> head = FusedLMHead(torch.tensor([[0.0], [1.0], [2.0]]))  # logits (0, h, 2h)
        >>> values, weights = metrics(head, torch.tensor([[[1.0], [-1.0], [0.0]]]), batch,
        ...                           GlobalStats.local_only(batch), stage="train")
        >>> float(values["mean_token_accuracy"]), int(values["num_tokens"])  # label 1 at h=−1: not the top
        (0.0, 3)
        >>> round(float(values["entropy"]), 4)  # both tokens: entropy of softmax(0, ±1, ±2), the same
        0.8324
    """

    def __init__(self, trainer: TrainerName, chosen_key: str | None = None, ignore_index: int = -100) -> None:
        self.trainer = trainer
        self.names = TRAINER_METRICS[trainer]
        if self.reads_chosen and chosen_key is None:
            raise ValueError(f"the {trainer} metrics average over the chosen tokens: give their chosen_key")
        self.chosen_key = chosen_key
        self.ignore_index = ignore_index

    def metric_names(self, stage: str = "train") -> tuple[str, ...]:
        """The names logged as ``<stage>/<name>`` (``num_tokens`` in training only)."""
        return self.names if stage == "train" else tuple(n for n in self.names if n != NUM_TOKENS)

    @property
    def reads_chosen(self) -> bool:
        """A metric is a mean over the chosen tokens (``logits/*``, DPO's accuracy)."""
        return "logits/chosen" in self.names

    def mask_keys(self) -> tuple[str, ...]:
        """The mask keys whose global counts the means divide by."""
        return (LABELS_KEY, self.chosen_key) if self.reads_chosen else (LABELS_KEY,)

    def __call__(
        self, head: FusedLMHead, hidden: Tensor, batch: Mapping[str, Any], stats: GlobalStats, stage: str
    ) -> tuple[dict[str, Tensor], dict[str, float]]:
        """``(values, weights)`` of one micro-batch: each mean's numerator over the micro-batch divided by
        the step's count of its tokens (``stats``: global in training, the micro-batch's own otherwise) and
        that count as its validation weight; ``num_tokens`` the micro-batch's count (training)."""
        labels = batch[LABELS_KEY]
        valid = labels != self.ignore_index
        names = self.metric_names(stage)
        wanted = {NEEDS[name] for name in names if name in NEEDS}
        per_token = token_stats(head, hidden, labels, statistics=wanted)
        dtype = torch.promote_types(hidden.dtype, torch.float32)
        masks = {"all": valid}
        counts = {"all": stats.get(LABELS_KEY).num_tokens}
        if self.reads_chosen:
            chosen = self.chosen_mask(batch, valid)
            chosen_count = stats.get(self.chosen_key).num_tokens
            masks |= {"chosen": chosen, "rejected": valid & ~chosen}
            counts |= {"chosen": chosen_count, "rejected": counts["all"] - chosen_count}
        over = {
            "entropy": ("all", per_token.entropy),
            "mean_token_accuracy": ("chosen" if self.trainer == "dpo" else "all", per_token.is_top1),
            "logits/chosen": ("chosen", per_token.mean_logit),
            "logits/rejected": ("rejected", per_token.mean_logit),
        }
        values, weights = {}, {}
        for name in names:
            if name == NUM_TOKENS:
                values[name] = torch.tensor(input_tokens(batch), dtype=torch.float64, device=hidden.device)
                continue
            key, per = over[name]
            total = torch.where(masks[key], per.to(dtype), 0.0).sum()
            values[name] = total / max(counts[key], 1)
            weights[name] = float(counts[key])
        return values, weights

    def chosen_mask(self, batch: Mapping[str, Any], valid: Tensor) -> Tensor:
        """The chosen completions' tokens: ``batch[chosen_key]`` at the positions with a label."""
        if self.chosen_key not in batch:
            raise BatchKeyError(
                f"the token metrics read batch[{self.chosen_key!r}], which is missing; the batch has keys "
                f"{sorted(batch)}"
            )
        return batch[self.chosen_key].bool() & valid


def input_tokens(batch: Mapping[str, Any]) -> int:
    """The micro-batch's input tokens without padding: ``attention_mask``'s ones, else the positions of a
    sequence (``segment_ids != 0``), else every position of ``input_ids`` (TRL's ``num_tokens``).

    Example:
        >>> import torch
        >>> segments = torch.tensor([[1, 1, 2, 0], [1, 0, 0, 0]])  # 0: padding
        >>> input_tokens({"input_ids": torch.ones(2, 4), "segment_ids": segments})
        4
    """
    if "attention_mask" in batch:
        return int(batch["attention_mask"].sum())
    if "segment_ids" in batch:
        return int((batch["segment_ids"] != 0).sum())
    return int(batch["input_ids"].numel() if "input_ids" in batch else batch[LABELS_KEY].numel())
