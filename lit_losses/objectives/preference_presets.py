"""The preference presets: TRL's ``DPOConfig``, ``KTOConfig``, ``CPOConfig`` and ``ORPOConfig`` loss fields.

One option per TRL trainer, each a frozen dataclass whose fields are the loss fields of that trainer's
config under their TRL names: ``model.dpo`` (`DPOPreset`), ``model.kto`` (`KTOPreset`), ``model.cpo``
(`CPOPreset`: CPO, SimPO with ``loss_type: simpo`` and ``cpo_alpha: 0``, AlphaPO with ``alphapo``) and
``model.orpo`` (`ORPOPreset`); at most one of them is set (`select_preset`). Each checks its fields with
one `ConfigError` naming ``model.<trainer>.<field>``, refusing a field that its loss type ignores, and
tells the module what its loss reads, through the same properties:

- ``paired``: paired records (chosen rows then rejected rows) or unpaired ones (KTO);
- ``needs_reference``: reference log-probabilities (precomputed in the data when
  ``precompute_ref_log_probs``, else from a frozen reference model);
- ``reduction`` and `sequence_logps`: how per-token log-probabilities become sequence values (``sum``,
  ``mean``, or LD-DPO's length-desensitized sum);
- ``needs_lengths``: the completions' token counts (``chosen_lengths``, ``rejected_lengths``);
- ``nll_tokens``: the tokens of the chosen NLL term (``completion``, ``prompt_and_completion``, or
  ``None``: no NLL term), passed as ``chosen_nll`` (plain sums of ``−ℓ_t``, never LD-DPO's) and
  ``chosen_nll_tokens`` (per-pair counts, or the global tokens per pair for a global token mean);
- ``needs_kl_rows``: KTO's mismatched pairs (``kl_logps``, ``ref_kl_logps`` or the estimate ``kl``);
- ``needs_wpo_weights``: WPO's ``chosen_weights``/``rejected_weights`` (`wpo_weights`);
- ``couples_pairs``: a pair's loss depends on the other pairs of the call (``aot``, ``aot_unpaired``),
  so its value depends on how the pairs are split into micro-batches;
- `loss_kwargs` and ``loss``: the loss function's keyword arguments, and the function applied.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, get_args

from torch import Tensor

from lit_losses.choices import check_choice
from lit_losses.errors import ConfigError
from lit_losses.objectives.options import check_flag, check_number, coerce_fields, is_number
from lit_losses.objectives.preference_checks import check_numbers
from lit_losses.objectives.preference_cpo import CPOLoss, cpo_loss
from lit_losses.objectives.preference_dpo import (
    LENGTH_NORMALIZED,
    SMOOTHED,
    SORTING,
    DPOLoss,
    FDivergenceType,
    check_dpo_numbers,
    check_f_divergence,
    dpo_loss,
    loss_types_of,
)
from lit_losses.objectives.preference_kto import KTOLoss, kto_loss
from lit_losses.objectives.preference_orpo import ORPOLoss, orpo_loss
from lit_losses.objectives.preference_sequences import SequenceReduction, ld_sequence_logps, sequence_logps
from lit_losses.registry import closest
from lit_losses.trl_fields import CPOConfigLossType, DPOLossType, KTOLossType

PreferenceTrainer = Literal["dpo", "kto", "cpo", "orpo"]
"""The TRL trainers whose losses the presets give, and the option names ``model.<trainer>``."""

NLLTokens = Literal["completion", "prompt_and_completion"]
"""The tokens of a chosen sequence that a preset's NLL term averages over."""


def coerce_preset(cls: type, value: Any) -> Any:
    """``value`` as a ``cls`` preset (a mapping of its fields: YAML, a checkpoint), or ``None``
    (`coerce_fields` under ``cls.where``, naming ``cls.trl_config``'s fields)."""
    return coerce_fields(cls, value, cls.where, expected=f"{cls.trl_config} fields")


def refuse_ignored(where: str, ignored: Mapping[str, str]) -> None:
    """A `ConfigError` for the first field of ``ignored`` (``{field: why it is ignored}``)."""
    for name, why in ignored.items():
        raise ConfigError(f"{where}.{name} is set but {why}; remove it")


def check_reference(preset: Any) -> None:
    """``reference_free`` and ``precompute_ref_log_probs`` are booleans and not both true."""
    for name in ("reference_free", "precompute_ref_log_probs"):
        check_flag(getattr(preset, name, False), f"{preset.where}.{name}")
    if getattr(preset, "reference_free", False) and preset.precompute_ref_log_probs:
        raise ConfigError(
            f"{preset.where}.precompute_ref_log_probs=True reads reference log-probabilities that "
            f"{preset.where}.reference_free=True does not use; set one of them"
        )


@dataclass(frozen=True)
class DPOPreset:
    """TRL's DPO loss by its ``DPOConfig`` fields (``model.dpo``); `dpo_loss` computes it.

    Attributes:
        loss_type: one of TRL's DPO loss types, or a list of them combined with ``loss_weights``.
        beta: ``β > 0`` (IPO's ``τ``).
        label_smoothing: ``ε`` in ``[0, 0.5)``: read by ``exo_pair`` (``> 0``), ``robust``, ``aot``,
            ``aot_unpaired``.
        loss_weights: one weight per loss type (default 1 each).
        reference_free: no reference model (``ρ = 0``; TRL's ``DPOConfig`` had this field before its
            DPO refactor).
        precompute_ref_log_probs: the reference log-probabilities come with the data
            (``ref_chosen_logps``, ``ref_rejected_logps``) instead of from a reference model.
        use_weighting: WPO's weights (`wpo_weights`; not with ``aot``, ``aot_unpaired`` or ``sft``).
        ld_alpha: LD-DPO's ``α`` in ``[0, 1]`` for the tokens past the pair's shared length
            (`ld_sequence_logps`), or ``None``.
        discopop_tau: DiscoPOP's temperature (``discopop``).
        f_divergence_type: the f-divergence of f-DPO (`f_divergence_scores`).
        f_alpha_divergence_coef: its ``α`` (``alpha_divergence``).

    Raises:
        ConfigError: naming ``model.dpo.<field>``: an unknown loss type (with the closest name), a
            field the loss types ignore, ``beta ≤ 0``, ``label_smoothing`` outside ``[0, 0.5)``,
            ``loss_weights`` of another length than ``loss_type``, ...

    Example:
        >>> preset = DPOPreset(loss_type=["sigmoid", "sft"], loss_weights=[1.0, 0.2], beta=0.05)
        >>> preset.loss_types, preset.needs_reference, preset.nll_tokens, preset.reduction
        (('sigmoid', 'sft'), True, 'completion', 'sum')
        >>> DPOPreset(loss_type="hinge", label_smoothing=0.1)
        Traceback (most recent call last):
        ...
        lit_losses.errors.ConfigError: model.dpo.label_smoothing is set but loss_type ('hinge',) does ...
        >>> DPOPreset(loss_type="ipo0")
        Traceback (most recent call last):
        ...
        lit_losses.errors.ConfigError: model.dpo.loss_type 'ipo0' is not one of (...); did you mean 'ipo'?
    """

    loss_type: DPOLossType | list[DPOLossType] = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0
    loss_weights: list[float] | None = None
    reference_free: bool = False
    precompute_ref_log_probs: bool = False
    use_weighting: bool = False
    ld_alpha: float | None = None
    discopop_tau: float = 0.05
    f_divergence_type: FDivergenceType = "reverse_kl"
    f_alpha_divergence_coef: float = 0.5

    trainer: ClassVar[str] = "dpo"
    where: ClassVar[str] = "model.dpo"
    trl_config: ClassVar[str] = "DPOConfig"
    paired: ClassVar[bool] = True
    needs_kl_rows: ClassVar[bool] = False

    def __post_init__(self) -> None:
        types = self.loss_types
        if self.loss_weights is not None:
            listed = isinstance(self.loss_weights, list | tuple)  # a string is no list of its characters
            weights = list(self.loss_weights) if listed else self.loss_weights
            if not listed or len(weights) != len(types) or not all(is_number(w) for w in weights):
                raise ConfigError(
                    f"{self.where}.loss_weights={weights!r}: one finite weight per loss type, "
                    f"{len(types)} for {types}"
                )
        where = f"{self.where}."
        check_dpo_numbers(
            types,
            beta=self.beta,
            label_smoothing=self.label_smoothing,
            discopop_tau=self.discopop_tau,
            where=where,
        )
        check_f_divergence(types, self.f_divergence_type, where=where)
        check_number(self.f_alpha_divergence_coef, f"{where}f_alpha_divergence_coef")
        if self.ld_alpha is not None and not (is_number(self.ld_alpha) and 0 <= self.ld_alpha <= 1):
            raise ConfigError(f"{where}ld_alpha must lie in [0, 1] (or be null), got {self.ld_alpha!r}")
        check_reference(self)
        check_flag(self.use_weighting, f"{where}use_weighting")
        refuse_ignored(self.where, self.ignored())

    @property
    def loss_types(self) -> tuple[str, ...]:
        """``loss_type`` as a tuple of names."""
        return loss_types_of(self.loss_type, f"{self.where}.loss_type")

    def ignored(self) -> dict[str, str]:
        """The fields set away from their defaults that the loss types do not read, with the reason."""
        types = self.loss_types
        ignored = {}
        if self.label_smoothing != 0 and not set(types) & set(SMOOTHED):
            ignored["label_smoothing"] = f"loss_type {types} does not read it (only {SMOOTHED} do)"
        if self.discopop_tau != 0.05 and "discopop" not in types:
            ignored["discopop_tau"] = f"loss_type {types} does not read it (only 'discopop' does)"
        if self.f_divergence_type != "reverse_kl" and set(types) == {"sft"}:
            ignored["f_divergence_type"] = f"loss_type {types} reads no f-divergence scores"
        if self.f_alpha_divergence_coef != 0.5 and self.f_divergence_type != "alpha_divergence":
            ignored["f_alpha_divergence_coef"] = "only f_divergence_type 'alpha_divergence' reads it"
        if self.use_weighting and set(types) & {*SORTING, "sft"}:
            ignored["use_weighting"] = (
                f"WPO weights do not apply to loss_type {types}: 'aot'/'aot_unpaired' sort the pairs, 'sft' "
                "is one token mean"
            )
        return ignored

    @property
    def needs_reference(self) -> bool:
        """Reference log-probabilities are read (not ``reference_free``; with ``sft`` alone only by the
        rewards TRL logs)."""
        return not self.reference_free

    @property
    def reduction(self) -> SequenceReduction:
        """Sums over completion tokens (LD-DPO: `sequence_logps` weighs the tail by ``ld_alpha``)."""
        return "sum"

    def sequence_logps(self, token_logps: Tensor, mask: Tensor) -> Tensor:
        """The sequence values of paired rows ``[2P, T]``: sums, or LD-DPO's with ``ld_alpha``."""
        if self.ld_alpha is None:
            return sequence_logps(token_logps, mask)
        return ld_sequence_logps(token_logps, mask, self.ld_alpha)

    @property
    def needs_lengths(self) -> bool:
        """``chosen_lengths``/``rejected_lengths`` are read (``ipo``, ``sigmoid_norm``)."""
        return bool(set(self.loss_types) & set(LENGTH_NORMALIZED))

    @property
    def nll_tokens(self) -> NLLTokens | None:
        """``completion`` with ``sft`` (the chosen completions' token-mean NLL), else ``None``."""
        return "completion" if "sft" in self.loss_types else None

    @property
    def needs_wpo_weights(self) -> bool:
        """``use_weighting``."""
        return self.use_weighting

    @property
    def couples_pairs(self) -> bool:
        """``aot`` or ``aot_unpaired`` (they sort the pairs of the call)."""
        return bool(set(self.loss_types) & set(SORTING))

    def loss_kwargs(self) -> dict[str, Any]:
        """`dpo_loss`'s keyword arguments of these fields."""
        return {
            "loss_type": list(self.loss_types),
            "beta": self.beta,
            "label_smoothing": self.label_smoothing,
            "loss_weights": None if self.loss_weights is None else list(self.loss_weights),
            "discopop_tau": self.discopop_tau,
            "f_divergence_type": self.f_divergence_type,
            "f_alpha_divergence_coef": self.f_alpha_divergence_coef,
        }

    def loss(
        self,
        chosen_logps: Tensor,
        rejected_logps: Tensor,
        ref_chosen_logps: Tensor | None = None,
        ref_rejected_logps: Tensor | None = None,
        **values: Any,
    ) -> DPOLoss:
        """`dpo_loss` with these fields (the references are ignored when not ``needs_reference``)."""
        if not self.needs_reference:
            ref_chosen_logps = ref_rejected_logps = None
        return dpo_loss(
            chosen_logps,
            rejected_logps,
            ref_chosen_logps=ref_chosen_logps,
            ref_rejected_logps=ref_rejected_logps,
            **self.loss_kwargs(),
            **values,
        )

    @classmethod
    def coerce(cls, value: DPOPreset | Mapping[str, Any] | None) -> DPOPreset | None:
        """``value`` as a `DPOPreset` (a mapping of its fields), or ``None``."""
        return coerce_preset(cls, value)


@dataclass(frozen=True)
class KTOPreset:
    """TRL's KTO loss by its ``KTOConfig`` fields (``model.kto``); `kto_loss` computes it.

    Attributes:
        loss_type: ``kto`` (with the KL estimate from mismatched pairs) or ``apo_zero_unpaired``.
        beta: ``β > 0``.
        desirable_weight: the weight of desirable sequences' losses (``> 0``).
        undesirable_weight: the weight of undesirable sequences' losses (``> 0``).
        precompute_ref_log_probs: the reference log-probabilities come with the data (``ref_logps``,
            ``ref_kl_logps``).

    Example:
        >>> KTOPreset(undesirable_weight=1.33).needs_kl_rows, KTOPreset("apo_zero_unpaired").needs_kl_rows
        (True, False)
        >>> KTOPreset(beta=-1.0)
        Traceback (most recent call last):
        ...
        lit_losses.errors.ConfigError: model.kto.beta must be a finite number > 0, got -1.0
    """

    loss_type: KTOLossType = "kto"
    beta: float = 0.1
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0
    precompute_ref_log_probs: bool = False

    trainer: ClassVar[str] = "kto"
    where: ClassVar[str] = "model.kto"
    trl_config: ClassVar[str] = "KTOConfig"
    paired: ClassVar[bool] = False
    needs_reference: ClassVar[bool] = True
    reduction: ClassVar[SequenceReduction] = "sum"
    needs_lengths: ClassVar[bool] = False
    nll_tokens: ClassVar[NLLTokens | None] = None
    needs_wpo_weights: ClassVar[bool] = False
    couples_pairs: ClassVar[bool] = False

    def __post_init__(self) -> None:
        check_choice(self.loss_type, KTOLossType, f"{self.where}.loss_type")
        check_numbers(beta=self.beta, label_smoothing=0.0, where=f"{self.where}.")
        for name in ("desirable_weight", "undesirable_weight"):
            check_number(getattr(self, name), f"{self.where}.{name}", "> 0")
        check_reference(self)

    @property
    def needs_kl_rows(self) -> bool:
        """``kto``: its KL estimate from mismatched pairs (``kl_input_ids``, ... in the data)."""
        return self.loss_type == "kto"

    def sequence_logps(self, token_logps: Tensor, mask: Tensor) -> Tensor:
        """Sums over each row's completion tokens."""
        return sequence_logps(token_logps, mask)

    def loss_kwargs(self) -> dict[str, Any]:
        """`kto_loss`'s keyword arguments of these fields."""
        return {
            "loss_type": self.loss_type,
            "beta": self.beta,
            "desirable_weight": self.desirable_weight,
            "undesirable_weight": self.undesirable_weight,
        }

    def loss(self, logps: Tensor, ref_logps: Tensor, label: Tensor, **values: Any) -> KTOLoss:
        """`kto_loss` with these fields."""
        return kto_loss(logps, ref_logps, label, **self.loss_kwargs(), **values)

    @classmethod
    def coerce(cls, value: KTOPreset | Mapping[str, Any] | None) -> KTOPreset | None:
        """``value`` as a `KTOPreset` (a mapping of its fields), or ``None``."""
        return coerce_preset(cls, value)


@dataclass(frozen=True)
class CPOPreset:
    """TRL's CPO loss by its ``CPOConfig`` fields (``model.cpo``; SimPO, AlphaPO); `cpo_loss` computes it.

    SimPO is ``loss_type: simpo`` with ``cpo_alpha: 0`` (TRL has no SimPO trainer: its docs set these two
    fields of ``CPOConfig``); ``alphapo`` is ``simpo`` with ``cpo_alpha`` 0, as TRL's config maps it.

    Attributes:
        loss_type: ``sigmoid``, ``hinge``, ``ipo``, ``simpo`` or ``alphapo``.
        beta: ``β > 0``.
        label_smoothing: ``ε`` in ``[0, 0.5)`` (``sigmoid``, ``simpo``, ``alphapo``).
        cpo_alpha: the weight of the chosen NLL term (``None``: TRL's default, 1, or 0 for ``alphapo``).
        simpo_gamma: SimPO's target margin (``simpo``, ``alphapo``).
        alpha: AlphaPO's reward shape ``a`` (0: log-probabilities), any loss type.

    Example:
        >>> simpo = CPOPreset(loss_type="simpo", cpo_alpha=0.0, beta=2.0, simpo_gamma=1.0)
        >>> simpo.reduction, simpo.nll_tokens, CPOPreset().nll_tokens, CPOPreset("alphapo").loss_kwargs()
        ('mean', None, 'completion', {'loss_type': 'simpo', 'beta': 0.1, ..., 'cpo_alpha': 0.0})
        >>> CPOPreset(loss_type="hinge", simpo_gamma=1.0)
        Traceback (most recent call last):
        ...
        lit_losses.errors.ConfigError: model.cpo.simpo_gamma is set but loss_type 'hinge' does not read ...
    """

    loss_type: CPOConfigLossType = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0
    cpo_alpha: float | None = None
    simpo_gamma: float = 0.5
    alpha: float = 0.0

    trainer: ClassVar[str] = "cpo"
    where: ClassVar[str] = "model.cpo"
    trl_config: ClassVar[str] = "CPOConfig"
    paired: ClassVar[bool] = True
    needs_reference: ClassVar[bool] = False
    needs_lengths: ClassVar[bool] = False
    needs_kl_rows: ClassVar[bool] = False
    needs_wpo_weights: ClassVar[bool] = False
    couples_pairs: ClassVar[bool] = False

    def __post_init__(self) -> None:
        check_choice(self.loss_type, CPOConfigLossType, f"{self.where}.loss_type")
        check_numbers(beta=self.beta, label_smoothing=self.label_smoothing, where=f"{self.where}.")
        if self.cpo_alpha is not None:
            check_number(self.cpo_alpha, f"{self.where}.cpo_alpha", ">= 0")
        for name in ("simpo_gamma", "alpha"):
            check_number(getattr(self, name), f"{self.where}.{name}")
        ignored = {}
        if self.loss_type == "alphapo" and self.cpo_alpha not in (None, 0):
            ignored["cpo_alpha"] = "loss_type 'alphapo' sets cpo_alpha to 0 (TRL's AlphaPO has no NLL term)"
        if self.label_smoothing != 0 and self.loss_type in ("hinge", "ipo"):
            ignored["label_smoothing"] = f"loss_type {self.loss_type!r} does not read it"
        if self.simpo_gamma != 0.5 and self.loss_type not in ("simpo", "alphapo"):
            ignored["simpo_gamma"] = f"loss_type {self.loss_type!r} does not read it (only 'simpo'/'alphapo')"
        refuse_ignored(self.where, ignored)

    @property
    def cpo_loss_type(self) -> str:
        """The loss type of `cpo_loss` (``alphapo`` is ``simpo``)."""
        return "simpo" if self.loss_type == "alphapo" else self.loss_type

    @property
    def nll_weight(self) -> float:
        """``cpo_alpha`` with TRL's defaults: 1, or 0 for ``alphapo``."""
        if self.cpo_alpha is not None:
            return float(self.cpo_alpha)
        return 0.0 if self.loss_type == "alphapo" else 1.0

    @property
    def reduction(self) -> SequenceReduction:
        """``mean`` for ``ipo``, ``simpo``, ``alphapo`` (TRL's ``average_log_prob``), else ``sum``."""
        return "mean" if self.cpo_loss_type in ("ipo", "simpo") else "sum"

    def sequence_logps(self, token_logps: Tensor, mask: Tensor) -> Tensor:
        """Sums or means over each row's completion tokens (``reduction``)."""
        return sequence_logps(token_logps, mask, reduction=self.reduction)

    @property
    def nll_tokens(self) -> NLLTokens | None:
        """``completion`` when the NLL term's weight is not 0 (TRL's labels mask the prompt)."""
        return "completion" if self.nll_weight != 0 else None

    def loss_kwargs(self) -> dict[str, Any]:
        """`cpo_loss`'s keyword arguments of these fields."""
        return {
            "loss_type": self.cpo_loss_type,
            "beta": self.beta,
            "label_smoothing": self.label_smoothing,
            "simpo_gamma": self.simpo_gamma,
            "alpha": self.alpha,
            "cpo_alpha": self.nll_weight,
        }

    def loss(self, chosen_logps: Tensor, rejected_logps: Tensor, **values: Any) -> CPOLoss:
        """`cpo_loss` with these fields."""
        return cpo_loss(chosen_logps, rejected_logps, **self.loss_kwargs(), **values)

    @classmethod
    def coerce(cls, value: CPOPreset | Mapping[str, Any] | None) -> CPOPreset | None:
        """``value`` as a `CPOPreset` (a mapping of its fields), or ``None``."""
        return coerce_preset(cls, value)


@dataclass(frozen=True)
class ORPOPreset:
    """TRL's ORPO loss by its ``ORPOConfig`` field ``beta`` (``model.orpo``); `orpo_loss` computes it.

    Attributes:
        beta: ``β > 0``, the weight of the odds-ratio term.

    Example:
        >>> ORPOPreset(beta=0.25).reduction, ORPOPreset().nll_tokens
        ('mean', 'prompt_and_completion')
    """

    beta: float = 0.1

    trainer: ClassVar[str] = "orpo"
    where: ClassVar[str] = "model.orpo"
    trl_config: ClassVar[str] = "ORPOConfig"
    paired: ClassVar[bool] = True
    needs_reference: ClassVar[bool] = False
    reduction: ClassVar[SequenceReduction] = "mean"
    needs_lengths: ClassVar[bool] = False
    nll_tokens: ClassVar[NLLTokens | None] = "prompt_and_completion"
    needs_kl_rows: ClassVar[bool] = False
    needs_wpo_weights: ClassVar[bool] = False
    couples_pairs: ClassVar[bool] = False

    def __post_init__(self) -> None:
        check_numbers(beta=self.beta, label_smoothing=0.0, where=f"{self.where}.")

    def sequence_logps(self, token_logps: Tensor, mask: Tensor) -> Tensor:
        """Means over each row's completion tokens."""
        return sequence_logps(token_logps, mask, reduction="mean")

    def loss_kwargs(self) -> dict[str, Any]:
        """`orpo_loss`'s keyword arguments of these fields."""
        return {"beta": self.beta}

    def loss(self, chosen_logps: Tensor, rejected_logps: Tensor, **values: Any) -> ORPOLoss:
        """`orpo_loss` with these fields."""
        return orpo_loss(chosen_logps, rejected_logps, **self.loss_kwargs(), **values)

    @classmethod
    def coerce(cls, value: ORPOPreset | Mapping[str, Any] | None) -> ORPOPreset | None:
        """``value`` as an `ORPOPreset` (a mapping of its fields), or ``None``."""
        return coerce_preset(cls, value)


PreferencePreset = DPOPreset | KTOPreset | CPOPreset | ORPOPreset
"""Any of the preference presets."""

PREFERENCE_PRESETS: dict[str, type] = {
    "dpo": DPOPreset,
    "kto": KTOPreset,
    "cpo": CPOPreset,
    "orpo": ORPOPreset,
}
"""The preset class of each option ``model.<trainer>``."""

if set(PREFERENCE_PRESETS) != set(get_args(PreferenceTrainer)):  # pragma: no cover - a maintenance error
    raise RuntimeError(
        f"PreferenceTrainer lists {get_args(PreferenceTrainer)}; presets: {sorted(PREFERENCE_PRESETS)}"
    )


def select_preset(**options: Any) -> PreferencePreset | None:
    """The one preference preset among the options ``dpo``, ``kto``, ``cpo``, ``orpo`` that is set.

    Each value is ``None``, a preset, or a mapping of its fields (coerced); two set is a `ConfigError`.

    Example:
        >>> select_preset(dpo={"loss_type": "ipo", "beta": 0.5}, kto=None)
        DPOPreset(loss_type='ipo', beta=0.5, ...)
        >>> select_preset(dpo={}, orpo={"beta": 0.2})
        Traceback (most recent call last):
        ...
        lit_losses.errors.ConfigError: model.dpo, model.orpo are set together; a run trains one ...
    """
    unknown = sorted(set(options) - set(PREFERENCE_PRESETS))
    if unknown:
        hint = (
            " (SimPO is model.cpo with loss_type: simpo and cpo_alpha: 0, as in TRL)"
            if unknown[0] == "simpo"
            else closest(unknown[0], PREFERENCE_PRESETS)
        )
        raise ConfigError(
            f"model.{unknown[0]}: not a preference option{hint}; they are {sorted(PREFERENCE_PRESETS)}"
        )
    chosen = {
        name: PREFERENCE_PRESETS[name].coerce(value) for name, value in options.items() if value is not None
    }
    if len(chosen) > 1:
        names = ", ".join(f"model.{name}" for name in chosen)
        raise ConfigError(f"{names} are set together; a run trains one preference loss: keep one of them")
    return next(iter(chosen.values()), None)
