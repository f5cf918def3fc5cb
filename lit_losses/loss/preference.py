"""`PreferenceLoss`: the loss of one micro-batch of paired preference data (``model.dpo``, ``model.cpo``,
``model.orpo``), normalized by the pairs of the whole optimizer step.

The micro-batch holds the chosen completions of pairs ``0..P-1`` in rows ``0..P-1`` and their rejected
completions in rows ``P..2P-1`` (TRL's concatenated layout, `lit_losses.data.PreferenceDataModule`), with
next-token ``labels`` on the completion tokens. One step of the loss:

1. the fused head gives the per-token log-probabilities of the labels (no logits);
2. the preset turns them into one value per row (`DPOPreset.sequence_logps`: sums, means, LD-DPO's), the
   chosen and the rejected value of each pair;
3. the reference's values (DPO): the batch's ``ref_chosen_logps``/``ref_rejected_logps``
   (``precompute_ref_log_probs``), else the frozen reference's per-token log-probabilities of the same
   labels through the same reduction (a `lit_losses.models.FrozenModel`: a reference model, or the
   policy's base with its adapters disabled); none with ``reference_free``;
4. the preset's loss gives one value per pair ``ℓ_i`` (with DPO's ``use_weighting``, WPO's: times the
   pair's weight ``w_i``, no gradient, from the policy's ``log Σ_v p_v²`` at its completion tokens:
   `lit_losses.heads.log_sum_sq_probs`, one more forward pass of the head without logits); the
   micro-batch's share of the step's loss is ``Σ_i ℓ_i / P_g``, ``P_g`` the number of pairs of the whole
   step (every micro-batch on every rank: `GlobalStatsLoader` counts the rows with a label, ``2 P_g``),
   times ``loss_scale`` in the module.

The NLL terms (DPO's ``sft``, CPO's ``cpo_alpha``, ORPO's) are TRL's token means over the chosen
sequences; here over those of the whole step: the loader also counts the tokens of the mask key
``chosen_mask`` (the chosen rows' completion tokens) or ``chosen_sequence_mask`` (ORPO: the chosen rows'
prompt and completion tokens), which the data module provides. Whatever the split of the pairs over
micro-batches and ranks, the step's loss and gradient are those of one micro-batch holding every pair;
TRL averages per micro-batch and process instead, which equals this only when every micro-batch holds
as many pairs and NLL tokens. ``aot`` and ``aot_unpaired`` are the exception: they sort the pairs of
one call, here one micro-batch (TRL: one process's micro-batch).

The telemetry carries TRL's names (``rewards/chosen``, ``rewards/rejected``, ``rewards/accuracies``,
``rewards/margins``, ``logps/chosen``, ``logps/rejected``; CPO and ORPO also ``nll_loss``; ORPO
``log_odds_ratio``, ``log_odds_chosen``), each the micro-batch's share of the step's mean over its pairs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import WarningCache, rank_zero_warn
from torch import Tensor

from lit_losses.aggregation import LABELS_KEY, GlobalStats
from lit_losses.errors import BatchKeyError, ConfigError
from lit_losses.heads import FusedLMHead, HeadOutput, log_sum_sq_probs
from lit_losses.loss.context import logprobs_first
from lit_losses.objectives import KTOPreset, PreferencePreset
from lit_losses.objectives.inputs import check_provided
from lit_losses.objectives.options import first_set_option
from lit_losses.objectives.preference_sequences import sequence_logps, wpo_weights

CHOSEN_MASK = "chosen_mask"
"""Mask key of the chosen rows' completion tokens (``labels != -100`` in rows ``0..P-1``)."""
CHOSEN_SEQUENCE_MASK = "chosen_sequence_mask"
"""Mask key of the chosen rows' every target, prompt tokens included (ORPO's NLL)."""
REF_KEYS = ("ref_chosen_logps", "ref_rejected_logps")
"""The batch keys of precomputed reference sequence log-probabilities ``[P]``."""
REWARD_METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)
"""TRL's reward and log-probability metrics, logged by every paired preset."""
EXTRA_METRICS = {"dpo": (), "cpo": ("nll_loss",), "orpo": ("nll_loss", "log_odds_ratio", "log_odds_chosen")}
"""The further fields of each trainer's loss that TRL logs, under the field's name."""

Reference = Callable[[Mapping[str, Any], Tensor], Tensor]
"""``(batch, labels) → log p_ref(labels)`` ``[rows, T]`` without gradient (0 where unlabelled)."""


@dataclass
class PreferenceStep:
    """What `PreferenceLoss` gives for one micro-batch.

    Attributes:
        base: ``Σ_i ℓ_i / P_g`` (with gradient).
        head: the head's outputs ``[2P, T]`` (``logprobs`` and what the regularizers need).
        metrics: TRL's metrics (`REWARD_METRICS`, `EXTRA_METRICS`), each ``Σ_i v_i / P_g``.
    """

    base: Tensor
    head: HeadOutput
    metrics: dict[str, Tensor] = field(default_factory=dict)


class PreferenceLoss:
    """The paired preference loss of a micro-batch (see the module docstring) for ``preset``.

    Args:
        preset: a `DPOPreset`, `CPOPreset` (SimPO, AlphaPO) or `ORPOPreset`.
        ignore_index: the label value of positions without a target.

    Raises:
        ConfigError: an unpaired preset (KTO).

    Example:
        >>> import torch
        >>> from lit_losses.aggregation import GlobalStats
        >>> from lit_losses.heads import FusedLMHead
        >>> from lit_losses.objectives import DPOPreset
        >>> loss = PreferenceLoss(DPOPreset(beta=0.5, precompute_ref_log_probs=True))
        >>> batch = {"labels": torch.tensor([[-100, 1, 2], [-100, 3, -100]]),  # 1 pair: chosen, rejected
        ...          "ref_chosen_logps": torch.tensor([-2.0]), "ref_rejected_logps": torch.tensor([-1.0])}
        >>> head = FusedLMHead(torch.zeros(4, 2))  # uniform over 4 tokens: log p = −log 4 each
        >>> step = loss(head, torch.randn(2, 3, 2), batch, GlobalStats.local_only(batch), reference=None)
        >>> margin = 0.5 * ((-2 * 1.3863 + 2.0) - (-1.3863 + 1.0))  # β (r_w − r_l)
        >>> round(float(step.base), 4), round(-float(torch.nn.functional.logsigmoid(torch.tensor(margin))), 4)
        (0.7944, 0.7944)
        >>> sorted(step.metrics)[:3]
        ['logps/chosen', 'logps/rejected', 'rewards/accuracies']
    """

    def __init__(self, preset: PreferencePreset, ignore_index: int = -100) -> None:
        if isinstance(preset, KTOPreset) or not preset.paired:
            raise ConfigError(f"{preset.where}: unpaired data; its loss is `UnpairedPreferenceLoss`")
        self.preset = preset
        self.ignore_index = ignore_index
        self._warnings = WarningCache()

    @property
    def where(self) -> str:
        """The option: ``model.dpo``, ``model.cpo`` or ``model.orpo``."""
        return self.preset.where

    @property
    def uses_reference_model(self) -> bool:
        """The reference comes from a frozen model (not the data, not ``reference_free``)."""
        return self.preset.needs_reference and not self.preset.precompute_ref_log_probs

    def nll_mask_key(self) -> str | None:
        """The mask key whose global token count the NLL term divides by (`CHOSEN_MASK`,
        `CHOSEN_SEQUENCE_MASK`), or ``None`` without one."""
        tokens = self.preset.nll_tokens
        return None if tokens is None else CHOSEN_MASK if tokens == "completion" else CHOSEN_SEQUENCE_MASK

    def mask_keys(self) -> tuple[str, ...]:
        """``labels`` (its rows count the pairs) and the NLL term's mask key."""
        key = self.nll_mask_key()
        return (LABELS_KEY,) if key is None else (LABELS_KEY, key)

    def batch_keys(self) -> tuple[str, ...]:
        """The batch keys this loss reads."""
        keys = ("input_ids", *self.mask_keys())
        return (*keys, *REF_KEYS) if self.preset.needs_reference and not self.uses_reference_model else keys

    def metric_names(self) -> tuple[str, ...]:
        """The telemetry names (TRL's), logged as ``<stage>/<name>``."""
        return (*REWARD_METRICS, *EXTRA_METRICS[self.preset.trainer])

    def units(self, local: int) -> int:
        """The validation weight of a micro-batch with ``local`` labelled rows: its pairs."""
        return local // 2

    def check_data(self, provided: Iterable[str], source: str) -> None:
        """`check_preference_data`."""
        check_preference_data(self, provided, source)

    def pairs(self, stats: GlobalStats, local: bool = False) -> int:
        """The pairs of the step (``local``: of this micro-batch): half the rows with a label."""
        counts = stats.get_local(LABELS_KEY) if local else stats.get(LABELS_KEY)
        return counts.num_sequences // 2

    def targets(self, batch: Mapping[str, Any], labels: Tensor) -> Tensor:
        """The head's targets: ``labels``, and for ORPO's NLL also the chosen rows' prompt tokens
        (``chosen_sequence_mask``: the next input token at each of its positions)."""
        if self.nll_mask_key() != CHOSEN_SEQUENCE_MASK:
            return labels
        sequence = batch_tensor(batch, CHOSEN_SEQUENCE_MASK, self.where).bool()
        next_ids = torch.cat([batch["input_ids"][:, 1:], batch["input_ids"][:, -1:]], dim=1)
        return torch.where(sequence & (labels == self.ignore_index), next_ids, labels)

    def __call__(
        self,
        head: FusedLMHead,
        hidden: Tensor,
        batch: Mapping[str, Any],
        stats: GlobalStats,
        reference: Reference | None,
        needed: tuple[str, ...] = ("logprobs",),
        policy: Any = None,
    ) -> PreferenceStep:
        """The `PreferenceStep` of one micro-batch (before ``stats.loss_scale``).

        Args:
            head: the output head of the policy.
            hidden: the policy's hidden states ``[2P, T, D]``.
            batch: the micro-batch (``labels``, and the keys of `batch_keys`).
            stats: the counts of the step (`GlobalStats`; ``local_only`` outside training).
            reference: the frozen reference's log-probabilities (`Reference`), when `uses_reference_model`.
            needed: the head outputs to compute (``logprobs`` and the regularizers' needs).
            policy: unused (the unpaired loss reads the policy's log-probabilities of its KL rows).
        """
        labels = batch_tensor(batch, LABELS_KEY, self.where)
        mask = labels != self.ignore_index
        pairs = self.check_rows(labels, mask, stats)
        outputs = logprobs_first(needed)
        head_out = head(hidden, self.targets(batch, labels), outputs)
        logprobs = head_out.logprobs
        values = self.preset.sequence_logps(logprobs, mask)
        chosen, rejected = values[:pairs], values[pairs:]
        options = self.loss_options(batch, logprobs=logprobs, mask=mask, stats=stats)
        if self.preset.needs_wpo_weights:
            options |= self.wpo_options(head, hidden, labels=labels, logprobs=logprobs)
        if self.preset.trainer == "dpo":
            ref_chosen, ref_rejected = self.reference_values(batch, mask, reference, like=values)
            out = self.preset.loss(
                chosen, rejected, ref_chosen_logps=ref_chosen, ref_rejected_logps=ref_rejected, **options
            )
        else:
            out = self.preset.loss(chosen, rejected, **options)
        total_pairs = max(self.pairs(stats), 1)
        if self.preset.couples_pairs and stats.window * stats.loss_scale > 1:
            self._warnings.warn(
                f"{self.where}: loss_type {self.preset.loss_types} sorts the pairs of each micro-batch, so "
                "the step's loss depends on how its pairs are split into micro-batches and ranks (as in TRL)"
            )
        metrics = self.metrics(out, chosen=chosen.detach(), rejected=rejected.detach())
        return PreferenceStep(
            base=out.losses.sum() / total_pairs,
            head=head_out,
            metrics={name: value / total_pairs for name, value in metrics.items()},
        )

    def check_rows(self, labels: Tensor, mask: Tensor, stats: GlobalStats) -> int:
        """The micro-batch's number of pairs ``P``: ``labels`` has ``2P`` rows, each with a label."""
        rows = labels.shape[0]
        if labels.dim() != 2 or rows % 2 or not bool(mask.any(-1).all()):
            raise ValueError(
                f"{self.where}: a paired micro-batch has 2P rows (the chosen completions, then the rejected "
                f"ones), each with at least one label; got labels of shape {tuple(labels.shape)} with "
                f"{int(mask.any(-1).sum())} labelled rows"
            )
        return rows // 2

    def loss_options(
        self, batch: Mapping[str, Any], *, logprobs: Tensor, mask: Tensor, stats: GlobalStats
    ) -> dict[str, Any]:
        """The loss function's per-pair options: the token counts (length-normalized types) and the
        chosen NLL with the step's mean NLL tokens per pair (the global token mean)."""
        pairs = mask.shape[0] // 2
        options: dict[str, Any] = {}
        if self.preset.needs_lengths:
            lengths = mask.sum(-1).to(logprobs.dtype)
            options |= {"chosen_lengths": lengths[:pairs], "rejected_lengths": lengths[pairs:]}
        key = self.nll_mask_key()
        if key is not None:
            nll_mask = batch_tensor(batch, key, self.where).bool()[:pairs]
            options["chosen_nll"] = -sequence_logps(logprobs[:pairs], nll_mask)
            options["chosen_nll_tokens"] = stats.get(key).num_tokens / max(self.pairs(stats), 1)
        return options

    def wpo_options(
        self, head: FusedLMHead, hidden: Tensor, *, labels: Tensor, logprobs: Tensor
    ) -> dict[str, Tensor]:
        """WPO's ``chosen_weights`` and ``rejected_weights`` ``[P]`` (`wpo_weights`, no gradient): the
        policy's ``log Σ_v p_v²`` at the completion tokens from one more forward pass of its head
        (`log_sum_sq_probs`: no logits, no gradient)."""
        mask = labels != self.ignore_index
        log_sum_sq = log_sum_sq_probs(head, hidden, labels).to(logprobs.dtype)
        weights = wpo_weights(logprobs.detach(), log_sum_sq, mask)
        pairs = mask.shape[0] // 2
        return {"chosen_weights": weights[:pairs], "rejected_weights": weights[pairs:]}

    def reference_values(
        self, batch: Mapping[str, Any], mask: Tensor, reference: Reference | None, like: Tensor
    ) -> tuple[Tensor | None, Tensor | None]:
        """``(ρ_w, ρ_l)`` ``[P]``: from the batch (``precompute_ref_log_probs``) or the frozen reference
        through the preset's reduction; ``(None, None)`` when the loss reads none."""
        if not self.preset.needs_reference:
            return None, None
        pairs = mask.shape[0] // 2
        if not self.uses_reference_model:
            chosen, rejected = (batch_tensor(batch, key, self.where) for key in REF_KEYS)
            for key, value in zip(REF_KEYS, (chosen, rejected), strict=True):
                if value.shape != (pairs,):
                    raise ValueError(
                        f"batch[{key!r}] has shape {tuple(value.shape)}; {self.where} needs one value per "
                        f"pair ({pairs})"
                    )
            return chosen.to(like), rejected.to(like)
        if reference is None:
            raise ValueError(f"{self.where}: reads a reference model's log-probabilities; none was given")
        ref_values = self.preset.sequence_logps(reference(batch, batch[LABELS_KEY]).to(like), mask)
        return ref_values[:pairs], ref_values[pairs:]

    def metrics(self, out: Any, *, chosen: Tensor, rejected: Tensor) -> dict[str, Tensor]:
        """TRL's metrics as sums over the micro-batch's pairs."""
        margins = out.chosen_rewards - out.rejected_rewards
        sums = {
            "rewards/chosen": out.chosen_rewards.sum(),
            "rewards/rejected": out.rejected_rewards.sum(),
            "rewards/accuracies": (margins > 0).to(margins.dtype).sum(),
            "rewards/margins": margins.sum(),
            "logps/chosen": chosen.sum(),
            "logps/rejected": rejected.sum(),
        }
        for name in EXTRA_METRICS[self.preset.trainer]:
            sums[name] = getattr(out, name).detach().sum()
        return sums


def batch_tensor(batch: Mapping[str, Any], key: str, reader: str) -> Tensor:
    """``batch[key]``, or a `BatchKeyError` naming the key, its reader and the keys the batch has."""
    if key not in batch:
        raise BatchKeyError(
            f"{reader} reads batch[{key!r}], which is missing; the batch has keys {sorted(batch)}"
        )
    return batch[key]


def check_preference_options(
    preset: PreferencePreset,
    *,
    base_loss: str,
    base_loss_args: Mapping[str, Any] | None,
    loss_agg: str,
    loss_agg_norm: float | None,
    grpo: Any,
) -> None:
    """Refuse the options a preference preset replaces: the base loss (``model.base_loss``,
    ``model.base_loss_args``, ``model.grpo``) and its aggregation (``model.loss_agg``,
    ``model.loss_agg_norm``: the preference loss is a mean over the step's pairs). Regularizers stay
    available, each with its own ``agg`` (default ``token-mean``).

    Raises:
        ConfigError: naming the option set beside the preset.

    Example:
        >>> from lit_losses.objectives import DPOPreset
        >>> check_preference_options(DPOPreset(), base_loss="ppo", base_loss_args=None, loss_agg="token-mean",
        ...                          loss_agg_norm=None, grpo=None)
        Traceback (most recent call last):
        ...
        lit_losses.errors.ConfigError: model.dpo replaces the base loss and its aggregation (a mean over ...
    """
    name = first_set_option(
        grpo=grpo,
        base_loss=base_loss,
        base_loss_args=base_loss_args,
        loss_agg=loss_agg,
        loss_agg_norm=loss_agg_norm,
    )
    if name is not None:
        raise ConfigError(
            f"{preset.where} replaces the base loss and its aggregation (a mean over the step's pairs); "
            f"remove model.{name} or {preset.where} (a regularizer aggregates with its own agg)"
        )


def check_preference_data(loss: PreferenceLoss, provided: Iterable[str], source: str) -> None:
    """Before training: refuse data whose micro-batches lack a key ``loss`` reads (`check_provided`: the
    precomputed reference values with ``precompute_ref_log_probs``, the NLL term's mask key, KTO's keys
    in paired data), and warn when the data's precomputed reference values go unused.

    Raises:
        BatchKeyError: one line naming the key, the option that reads it and the data.

    Example:
        >>> from lit_losses.objectives import DPOPreset
        >>> loss = PreferenceLoss(DPOPreset(precompute_ref_log_probs=True))
        >>> check_preference_data(loss, ["input_ids", "labels"], "PreferenceDataModule")
        Traceback (most recent call last):
        ...
        lit_losses.errors.BatchKeyError: model.dpo reads batch key 'ref_chosen_logps', which ...
    """
    provided = tuple(provided)
    if "kto_label" in provided:
        raise ConfigError(
            f"{loss.where} trains on paired records (prompt/chosen/rejected), but {source} holds unpaired "
            "ones (prompt/completion/label: KTO's)"
        )
    check_provided(reads=loss.batch_keys(), provided=provided, reader=loss.where, source=source)
    if loss.uses_reference_model and set(REF_KEYS) <= set(provided):
        rank_zero_warn(
            f"{source} carries precomputed reference log-probabilities ({', '.join(REF_KEYS)}), but "
            f"{loss.where}.precompute_ref_log_probs is false: the reference model computes them instead "
            "(set it true to use the data's)"
        )
