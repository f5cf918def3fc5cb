"""`UnpairedPreferenceLoss`: the loss of one micro-batch of unpaired preference data (``model.kto``),
normalized by the sequences of the whole optimizer step.

Each row is a prompt with one completion, desirable (``kto_label``) or not; each has a KL row, its prompt
with another record's completion (`lit_losses.data.PreferenceDataModule`). One step of the loss:

1. the fused head gives the policy's per-token log-probabilities of the labels; their sums over each
   row's completion tokens are ``π``;
2. the reference's sums ``ρ``: the batch's ``ref_logps`` (``precompute_ref_log_probs``) or the frozen
   reference's (`lit_losses.models.FrozenModel`: a reference model, or the base with adapters disabled);
3. ``kto``'s reference point ``z = max(0, mean(π_KL − ρ_KL))`` over the micro-batch's KL rows on every
   data-parallel rank (one all-reduce of a sum and a count), without gradient: the policy's and the
   reference's log-probabilities of the KL rows computed without gradient;
4. `kto_loss` gives each row's loss ``ℓ_i``; the micro-batch's share of the step's loss is
   ``Σ_i ℓ_i / B_g``, ``B_g`` the sequences of the whole step (every micro-batch on every rank,
   `GlobalStatsLoader`), times ``loss_scale`` in the module.

Given ``z``, the step's loss is the mean over all its sequences whatever their split. ``z`` itself is, as in
TRL, an estimate per micro-batch (TRL: each process's micro-batch mean, averaged over the processes; here
the mean over the micro-batch's KL rows of every process), so the loss depends on the split through it.

The telemetry carries TRL's names: ``rewards/chosen`` and ``logps/chosen`` (means over the step's
desirable sequences: the loader counts the mask key ``desirable_mask``), ``rewards/rejected`` and
``logps/rejected`` (over the undesirable ones), ``rewards/margins`` (their difference, per step) and
``kl`` (the micro-batches' estimates, weighted by their rows).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor

from lit_losses.aggregation import LABELS_KEY, GlobalStats
from lit_losses.distributed import all_reduce
from lit_losses.errors import ConfigError
from lit_losses.heads import FusedLMHead
from lit_losses.loss.context import logprobs_first
from lit_losses.loss.preference import PreferenceStep, Reference, batch_tensor
from lit_losses.objectives import KTOPreset
from lit_losses.objectives.inputs import check_provided
from lit_losses.objectives.preference_sequences import sequence_logps

DESIRABLE_MASK = "desirable_mask"
"""Mask key of the desirable rows' completion tokens (its sequences count the step's desirable rows)."""
KL_KEYS = {"input_ids": "kl_input_ids", "attention_mask": "kl_attention_mask", "labels": "kl_labels"}
"""The KL rows' keys, by the key they stand for."""
REF_KEYS = {"logps": "ref_logps", "kl": "ref_kl_logps"}
"""The batch keys of precomputed reference sequence log-probabilities ``[B]``."""
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected", "kl")
"""TRL's KTO metrics (``chosen``: desirable, ``rejected``: undesirable)."""

PolicyNoGrad = Callable[[Mapping[str, Any], Tensor], Tensor]
"""``(batch, labels) → log p_policy(labels)`` ``[rows, T]`` without gradient (KTO's KL rows)."""


class UnpairedPreferenceLoss:
    """The KTO loss of a micro-batch of unpaired records (see the module docstring).

    Args:
        preset: a `KTOPreset`.
        ignore_index: the label value of positions without a target.

    Example:
        >>> import torch
        >>> from lit_losses.aggregation import GlobalStats
        >>> from lit_losses.heads import FusedLMHead
        >>> preset = KTOPreset("apo_zero_unpaired", beta=1.0, precompute_ref_log_probs=True)
        >>> loss = UnpairedPreferenceLoss(preset)
        >>> labels = torch.tensor([[-100, 1, 2], [-100, 3, -100]])  # a desirable and an undesirable row
        >>> batch = {"labels": labels, "desirable_mask": torch.tensor([[0, 1, 1], [0, 0, 0]]).bool(),
        ...          "kto_label": torch.tensor([True, False]), "ref_logps": torch.tensor([-3.0, -1.0])}
        >>> head = FusedLMHead(torch.zeros(4, 2))  # uniform over 4 tokens: log p = −log 4 each
        >>> step = loss(head, torch.randn(2, 3, 2), batch, GlobalStats.local_only(batch, loss.mask_keys()),
        ...             reference=None, policy=None)
        >>> r = torch.tensor([-2 * 1.3863 + 3.0, -1.3863 + 1.0])  # β (π − ρ)
        >>> expected = ((1 - torch.sigmoid(r[0])) + torch.sigmoid(r[1])) / 2
        >>> round(float(step.base), 4), round(float(expected), 4)
        (0.424, 0.424)
        >>> round(float(step.metrics["rewards/chosen"]), 4), round(float(step.metrics["rewards/rejected"]), 4)
        (0.2274, -0.3863)
    """

    def __init__(self, preset: KTOPreset, ignore_index: int = -100) -> None:
        self.preset = preset
        self.ignore_index = ignore_index

    @property
    def where(self) -> str:
        """The option: ``model.kto``."""
        return self.preset.where

    @property
    def uses_reference_model(self) -> bool:
        """The reference comes from a frozen model (not ``precompute_ref_log_probs``)."""
        return not self.preset.precompute_ref_log_probs

    def mask_keys(self) -> tuple[str, ...]:
        """``labels`` (its rows count the sequences) and `DESIRABLE_MASK` (the desirable ones)."""
        return (LABELS_KEY, DESIRABLE_MASK)

    def batch_keys(self) -> tuple[str, ...]:
        """The batch keys this loss reads."""
        keys = ["input_ids", *self.mask_keys(), "kto_label"]
        if self.preset.needs_kl_rows:
            keys += list(KL_KEYS.values())
        if not self.uses_reference_model:
            keys += [REF_KEYS["logps"], *([REF_KEYS["kl"]] if self.preset.needs_kl_rows else [])]
        return tuple(keys)

    def metric_names(self) -> tuple[str, ...]:
        """The telemetry names (TRL's), logged as ``<stage>/<name>``."""
        return METRICS

    def check_data(self, provided: Iterable[str], source: str) -> None:
        """`check_unpaired_data`."""
        check_unpaired_data(self, provided, source)

    def units(self, local: int) -> int:
        """The validation weight of a micro-batch with ``local`` labelled rows: its sequences."""
        return local

    def __call__(
        self,
        head: FusedLMHead,
        hidden: Tensor,
        batch: Mapping[str, Any],
        stats: GlobalStats,
        reference: Reference | None,
        needed: tuple[str, ...] = ("logprobs",),
        policy: PolicyNoGrad | None = None,
    ) -> PreferenceStep:
        """The `PreferenceStep` of one micro-batch (before ``stats.loss_scale``).

        Args:
            head: the output head of the policy.
            hidden: the policy's hidden states ``[B, T, D]``.
            batch: the micro-batch (the keys of `batch_keys`).
            stats: the counts of the step (`GlobalStats`; ``local_only`` outside training).
            reference: the frozen reference's log-probabilities, when `uses_reference_model`.
            needed: the head outputs to compute (``logprobs`` and the regularizers' needs).
            policy: the policy's log-probabilities without gradient (the KL rows of ``kto``).
        """
        labels = batch_tensor(batch, LABELS_KEY, self.where)
        mask = labels != self.ignore_index
        desirable = batch_tensor(batch, "kto_label", self.where).bool()
        outputs = logprobs_first(needed)
        head_out = head(hidden, labels, outputs)
        logps = sequence_logps(head_out.logprobs, mask)
        ref_logps = self.reference_values(batch, key="logps", labels=labels, reference=reference, like=logps)
        kl = None
        if self.preset.needs_kl_rows:
            kl = self.kl(batch, reference=reference, policy=policy, like=logps)
        out = self.preset.loss(logps, ref_logps, desirable, kl=kl)
        sequences = max(stats.get(LABELS_KEY).num_sequences, 1)
        return PreferenceStep(
            base=out.losses.sum() / sequences,
            head=head_out,
            metrics=self.metrics(out, logps=logps.detach(), desirable=desirable, stats=stats),
        )

    def reference_values(
        self, batch: Mapping[str, Any], *, key: str, labels: Tensor, reference: Reference | None, like: Tensor
    ) -> Tensor:
        """``ρ`` ``[B]`` of the rows (``key="logps"``) or of the KL rows (``"kl"``): from the batch, or the
        frozen reference's sums over the rows' completion tokens."""
        if not self.uses_reference_model:
            values = batch_tensor(batch, REF_KEYS[key], self.where)
            if values.shape != like.shape:
                raise ValueError(
                    f"batch[{REF_KEYS[key]!r}] has shape {tuple(values.shape)}; {self.where} needs one value "
                    f"per row {tuple(like.shape)}"
                )
            return values.to(like)
        if reference is None:
            raise ValueError(f"{self.where} reads a reference model's log-probabilities; none was given")
        rows = batch if key == "logps" else kl_rows(batch, self.where)
        return sequence_logps(reference(rows, labels).to(like), labels != self.ignore_index)

    def kl(
        self,
        batch: Mapping[str, Any],
        *,
        reference: Reference | None,
        policy: PolicyNoGrad | None,
        like: Tensor,
    ) -> Tensor:
        """``mean(π_KL − ρ_KL)`` over the micro-batch's KL rows on every rank (no gradient; `kto_loss`
        clamps it at 0)."""
        if policy is None:
            raise ValueError(f"{self.where}: loss_type 'kto' needs the policy's log-probabilities of KL rows")
        rows = kl_rows(batch, self.where)
        kl_labels = rows["labels"]
        with torch.no_grad():
            policy_kl = sequence_logps(policy(rows, kl_labels).to(like), kl_labels != self.ignore_index)
            ref_kl = self.reference_values(
                batch, key="kl", labels=kl_labels, reference=reference, like=policy_kl
            )
            totals = torch.stack([(policy_kl - ref_kl).sum(), like.new_tensor(float(policy_kl.numel()))])
            totals = all_reduce(totals.double())
        return (totals[0] / totals[1].clamp_min(1)).to(like)

    def metrics(self, out: Any, *, logps: Tensor, desirable: Tensor, stats: GlobalStats) -> dict[str, Tensor]:
        """TRL's metrics as this micro-batch's shares of the step's means: over the step's desirable
        sequences (``chosen``), its undesirable ones (``rejected``), and ``kl``: each micro-batch's estimate
        weighted by its rows."""
        total = stats.get(LABELS_KEY).num_sequences
        chosen_count = stats.get(DESIRABLE_MASK).num_sequences
        rejected_count = total - chosen_count
        rows = stats.get_local(LABELS_KEY).num_sequences

        def share(values: Tensor, where: Tensor, count: int) -> Tensor:
            return torch.where(where, values, 0.0).sum() / max(count, 1)

        chosen = share(out.rewards, desirable, chosen_count)
        rejected = share(out.rewards, ~desirable, rejected_count)
        return {
            "rewards/chosen": chosen,
            "rewards/rejected": rejected,
            "rewards/margins": chosen - rejected,
            "logps/chosen": share(logps, desirable, chosen_count),
            "logps/rejected": share(logps, ~desirable, rejected_count),
            "kl": out.kl.detach() * rows / max(total, 1),
        }


def kl_rows(batch: Mapping[str, Any], reader: str) -> dict[str, Tensor]:
    """The KL rows as a batch of their own (``input_ids``, ``attention_mask``, ``labels``)."""
    rows = {key: batch_tensor(batch, kl_key, reader) for key, kl_key in KL_KEYS.items() if kl_key in batch}
    if "input_ids" not in rows or "labels" not in rows:
        batch_tensor(batch, KL_KEYS["input_ids"] if "input_ids" not in rows else KL_KEYS["labels"], reader)
    return rows


def check_unpaired_data(loss: UnpairedPreferenceLoss, provided: Iterable[str], source: str) -> None:
    """Before training: refuse paired data and data whose micro-batches lack a key ``loss`` reads; warn
    when the data's precomputed reference values go unused.

    Raises:
        ConfigError: paired records; `BatchKeyError` naming a missing key.

    Example:
        >>> keys = ("input_ids", "labels", "chosen_mask")
        >>> check_unpaired_data(UnpairedPreferenceLoss(KTOPreset()), keys, "PreferenceDataModule")
        Traceback (most recent call last):
        ...
        lit_losses.errors.ConfigError: model.kto trains on unpaired records (prompt/completion/label), but ...
    """
    provided = tuple(provided)
    if "kto_label" not in provided:
        raise ConfigError(
            f"{loss.where} trains on unpaired records (prompt/completion/label), but {source} holds paired "
            "ones (prompt/chosen/rejected: the DPO family's); TRL's KTOTrainer splits each pair in two "
            "(unpair_preference_dataset): write the records so, the chosen completion with label true and "
            "the rejected one with label false"
        )
    check_provided(reads=loss.batch_keys(), provided=provided, reader=loss.where, source=source)
    if loss.uses_reference_model and REF_KEYS["logps"] in provided:
        rank_zero_warn(
            f"{source} carries precomputed reference log-probabilities (ref_logps), but "
            f"{loss.where}.precompute_ref_log_probs is false: the reference model computes them instead "
            "(set it true to use the data's)"
        )
