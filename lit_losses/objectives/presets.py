"""`GRPOPreset`: TRL's ``GRPOTrainer`` loss (``loss_type`` and its arguments) as lit_losses options.

``model.grpo`` takes the loss fields of TRL's ``GRPOConfig`` under their names and sets ``base_loss``,
``base_loss_args``, ``loss_agg``, ``loss_agg_norm``, with ``beta > 0`` a ``kl_reference`` term and with
``entropy_coef > 0`` an ``entropy`` bonus together. Each TRL loss is a per-token loss ``L_t`` plus
``β · KL_t`` aggregated by one rule; here the rule is an aggregation mode over the *global* counts of the
optimizer step:

============  ================================  =============================
``loss_type``  ``base_loss``                    ``loss_agg``
============  ================================  =============================
``grpo``      ``ppo``                           ``seq-mean-token-mean``
``bnpo``      ``ppo``                           ``token-mean``
``dr_grpo``   ``ppo``                           ``seq-mean-token-sum-norm``, ``C = max_completion_length``
``dapo``      ``ppo``                           ``token-mean``
``luspo``     ``ppo``                           ``seq-mean-token-sum``
``cispo``     ``cispo`` (``lo = 0``, ``hi = ε_high``)  ``token-mean``
``sapo``      ``sapo``                          ``seq-mean-token-mean``
``vespo``     ``vespo``                         ``token-mean``
============  ================================  =============================

TRL normalizes ``grpo``, ``sapo``, ``bnpo``, ``dr_grpo`` and ``luspo`` by what one process sees in one
micro-batch (its sequences, its tokens), then divides by the accumulation steps and lets DDP average the
processes; that is the global value only when every micro-batch holds as many sequences and tokens. Here
every split gives the global batch's value. ``dapo``, ``cispo`` and ``vespo`` divide by
``num_items_in_batch / num_processes``, which summed over the step is the global token count when the
generation batch is the optimizer step's: ``num_items_in_batch`` becomes the step's global number of
valid tokens.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from lit_losses.aggregation.modes import AggMode
from lit_losses.choices import check_choice
from lit_losses.errors import ConfigError
from lit_losses.objectives.correction import RolloutCorrectionOptions, check_given_fields
from lit_losses.objectives.options import NumberBound, check_number, coerce_fields, first_set_option
from lit_losses.objectives.ratios import ImportanceSamplingLevel
from lit_losses.trl_fields import TRLLossType

LOSS_AGG: dict[str, AggMode] = {
    "grpo": "seq-mean-token-mean",
    "sapo": "seq-mean-token-mean",
    "bnpo": "token-mean",
    "dapo": "token-mean",
    "cispo": "token-mean",
    "vespo": "token-mean",
    "dr_grpo": "seq-mean-token-sum-norm",
    "luspo": "seq-mean-token-sum",
}
"""The aggregation mode whose global value each TRL ``loss_type`` approximates."""

CLIPPED = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
"""The loss types whose per-token loss is PPO's clipped objective (TRL's ``coef_1``/``coef_2`` branch)."""

WHERE = "model.grpo"
CLIP_FIELDS = ("epsilon", "epsilon_high", "delta", "importance_sampling_level")
READS: dict[str, tuple[str, ...]] = {
    "grpo": CLIP_FIELDS,
    "bnpo": CLIP_FIELDS,
    "dr_grpo": (*CLIP_FIELDS, "max_completion_length"),
    "dapo": CLIP_FIELDS,
    "luspo": CLIP_FIELDS,
    "cispo": ("epsilon", "epsilon_high", "importance_sampling_level"),
    "sapo": ("importance_sampling_level", "sapo_temperature_pos", "sapo_temperature_neg"),
    "vespo": ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"),
}
"""The fields of `GRPOPreset` that each loss type reads, beside ``loss_type``, ``beta`` and
``use_bias_correction_kl`` (every type's; the bias-corrected KL also reads ``importance_sampling_level``)."""
CORRECTION_FIELDS = tuple(f.name for f in fields(RolloutCorrectionOptions))
"""The rollout-correction fields (`RolloutCorrectionOptions`), which every loss type reads."""
POSITIVE = ("delta", "sapo_temperature_pos", "sapo_temperature_neg", "vespo_lambda_pos", "vespo_lambda_neg")
NON_NEGATIVE = ("epsilon_high", "beta", "entropy_coef", "vespo_k_pos", "vespo_k_neg")
ALWAYS_READ = ("loss_type", "beta", "use_bias_correction_kl", "entropy_coef")
"""The fields every loss type reads."""


@dataclass(frozen=True)
class GRPOPreset(RolloutCorrectionOptions):
    """TRL's GRPO loss by its ``GRPOConfig`` fields; `options` are the lit_losses options it sets.

    The rollout-correction fields (`RolloutCorrectionOptions`: TRL's ``vllm_importance_sampling_*`` and
    ``off_policy_mask_threshold``, verl's ``rollout_is``/``rollout_rs``) pass on to ``base_loss_args``.

    Attributes:
        loss_type: TRL's ``loss_type`` (default ``dapo``, as TRL's).
        epsilon: ``ε_low``: the ratio's lower bound is ``1 − ε``.
        epsilon_high: ``ε_high`` (default ``epsilon``): the upper bound ``1 + ε_high``; for ``cispo``
            the cap of the ratio itself (TRL's and Liger-Kernel's meaning; ScaleRL uses 5.0).
        delta: INTELLECT-2's two-sided clipping, the unclipped ratio capped at ``δ`` (clipped types).
        beta: weight of the k3 KL to the reference (``batch["ref_logprobs"]``); 0: no KL term.
        use_bias_correction_kl: the KL times the importance ratio (DeepSeek-V3.2; default on, as TRL's;
            without a KL term, ``beta = 0``, it has no effect).
        importance_sampling_level: ``token``, or ``sequence`` (GSPO): the ratio of a sequence is
            ``exp(mean_t (ℓ_t − q_t))`` over its valid tokens (``luspo``'s paper uses ``sequence``).
        max_completion_length: ``dr_grpo``'s constant (required by it).
        sapo_temperature_pos: SAPO's temperature where ``A > 0``.
        sapo_temperature_neg: SAPO's temperature where ``A ≤ 0``.
        vespo_k_pos: VESPO's gamma shape where ``A ≥ 0``.
        vespo_lambda_pos: VESPO's gamma rate where ``A ≥ 0``.
        vespo_k_neg: VESPO's gamma shape where ``A < 0``.
        vespo_lambda_neg: VESPO's gamma rate where ``A < 0``.
        entropy_coef: weight of TRL's entropy bonus, ``−entropy_coef · H̄``, ``H̄`` the mean entropy of the
            policy over the step's completion tokens (an ``entropy`` term, ``mode: bonus``, ``token-mean``,
            whatever the loss type's aggregation); 0: none.

    Raises:
        ConfigError: naming ``model.grpo.<field>``: an unknown choice, ``dr_grpo`` without
            ``max_completion_length``, an option the loss type ignores, a bad rollout correction
            (`RolloutCorrectionOptions.resolve`).

    Example:
        >>> options = GRPOPreset("dr_grpo", epsilon_high=0.28, beta=0.04, max_completion_length=256).options()
        >>> options["base_loss"], options["base_loss_args"]["epsilon_high"], options["loss_agg"]
        ('ppo', 0.28, 'seq-mean-token-sum-norm')
        >>> options["loss_agg_norm"], [(r["name"], r["weight"]) for r in options["regularizers"]]
        (256.0, [('kl_reference', 0.04)])
        >>> GRPOPreset("sapo", delta=2.0)
        Traceback (most recent call last):
        ...
        lit_losses.errors.ConfigError: model.grpo.delta=2.0: loss_type 'sapo' ignores it (it applies to ...
    """

    loss_type: TRLLossType = "dapo"
    epsilon: float = 0.2
    epsilon_high: float | None = None
    delta: float | None = None
    beta: float = 0.0
    use_bias_correction_kl: bool = True
    importance_sampling_level: ImportanceSamplingLevel = "token"
    max_completion_length: int | None = None
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    entropy_coef: float = 0.0

    def __post_init__(self) -> None:
        check_choice(self.loss_type, TRLLossType, f"{WHERE}.loss_type")
        level = self.importance_sampling_level
        check_choice(level, ImportanceSamplingLevel, f"{WHERE}.importance_sampling_level")
        if self.loss_type == "dr_grpo" and self.max_completion_length is None:
            raise ConfigError(
                f"{WHERE}.max_completion_length is required by loss_type 'dr_grpo' (its constant)"
            )
        if self.max_completion_length is not None and self.max_completion_length < 1:
            raise ConfigError(f"{WHERE}.max_completion_length must be >= 1, got {self.max_completion_length}")
        self.check_numbers()
        self.check_ignored()
        correction = self.resolve(WHERE)
        if self.loss_type == "vespo" and correction is not None and correction.level == "sequence":
            field_name = "vllm_importance_sampling_mode" if correction.vllm_mode else "rollout_is"
            raise ConfigError(
                f"{WHERE}.{field_name}={getattr(self, field_name)!r}: loss_type 'vespo' takes the importance "
                "weight into its sequence ratio token by token (TRL requires token_truncate or token_mask)"
            )

    def fields_read(self) -> tuple[str, ...]:
        """The fields this loss type reads (`READS`, and every type the rollout-correction fields):
        ``cispo`` reads ``epsilon`` only as the default of ``epsilon_high``, and the bias-corrected KL reads
        ``importance_sampling_level`` for every type (when ``beta > 0``).

        Example:
            >>> [f for f in GRPOPreset("cispo", epsilon_high=5.0).fields_read() if f not in CORRECTION_FIELDS]
            ['beta', 'entropy_coef', 'epsilon_high', 'importance_sampling_level', 'loss_type', ...]
        """
        read = {*ALWAYS_READ, *READS[self.loss_type], *CORRECTION_FIELDS}
        if self.bias_corrected_kl:
            read.add("importance_sampling_level")
        if self.loss_type == "cispo" and self.epsilon_high is not None:
            read.discard("epsilon")
        return tuple(sorted(read))

    def check_ignored(self) -> None:
        """Refuse a field set (other than its default) that this loss type ignores (TRL ignores it too).

        Raises:
            ConfigError: ``model.grpo.<field>=<value>: loss_type '<t>' ignores it; …`` with the loss types
                that read it.
        """
        read = self.fields_read()
        for field in fields(self):
            value = getattr(self, field.name)
            if field.name in read or value == field.default:
                continue
            readers = tuple(t for t, names in READS.items() if field.name in names)
            why = (
                f"it applies to loss_type {readers[0]!r}" if len(readers) == 1 else f"it applies to {readers}"
            )
            if field.name == "epsilon" and self.loss_type == "cispo":
                why = f"its ratio cap is epsilon_high={self.epsilon_high!r}"
            elif field.name == "importance_sampling_level":
                why += ", and to the bias-corrected KL (beta > 0)"
            raise ConfigError(
                f"{WHERE}.{field.name}={value!r}: loss_type {self.loss_type!r} ignores it ({why}); remove it "
                "or choose a loss_type that reads it"
            )

    def check_numbers(self) -> None:
        """``0 ≤ epsilon ≤ 1``, the temperatures, rates and ``delta`` ``> 0``, the rest ``≥ 0`` (finite)."""
        bounds: dict[str, NumberBound] = (
            {"epsilon": "in [0, 1]"} | dict.fromkeys(POSITIVE, "> 0") | dict.fromkeys(NON_NEGATIVE, ">= 0")
        )
        for name, rule in bounds.items():
            value = getattr(self, name)
            if value is None and name in ("delta", "epsilon_high"):
                continue
            check_number(value, f"{WHERE}.{name}", rule)

    @classmethod
    def coerce(cls, value: GRPOPreset | Mapping[str, Any] | None) -> GRPOPreset | None:
        """``value`` as a `GRPOPreset` (a mapping of its fields, e.g. from a checkpoint), or ``None``.

        The rollout-correction fields of a mapping are checked as given first (`check_given_fields`: its
        keys tell a field given at its default from one left out), unless it holds every field: a preset
        written out whole (a checkpoint's hyper-parameters), whose keys do not tell what was given.
        """
        if isinstance(value, Mapping) and not {f.name for f in fields(cls)} <= set(value):
            check_given_fields(value, WHERE)
        return coerce_fields(cls, value, WHERE, expected="GRPOConfig fields")

    @property
    def bias_corrected_kl(self) -> bool:
        """A KL term (``beta > 0``) with ``use_bias_correction_kl``."""
        return self.use_bias_correction_kl and self.beta > 0

    @property
    def upper_epsilon(self) -> float:
        """``ε_high``, TRL's default ``epsilon``."""
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    def base_loss(self) -> tuple[str, dict[str, Any]]:
        """``(base_loss, base_loss_args)`` of the loss type (with the rollout-correction fields given)."""
        name, args = self.loss_args()
        return name, {**args, **self.correction_args()}

    def correction_args(self) -> dict[str, Any]:
        """The rollout-correction fields that differ from their defaults (the deprecated cap as
        ``vllm_importance_sampling_clip_max``, its current name)."""
        given = RolloutCorrectionOptions.given(self)
        if "vllm_importance_sampling_cap" in given:
            given["vllm_importance_sampling_clip_max"] = given.pop("vllm_importance_sampling_cap")
        return given

    def uses_old(self) -> bool:
        """The rollout correction reads π_old (`RolloutCorrection.uses_old`)."""
        correction = RolloutCorrectionOptions.from_mapping(self.correction_args()).resolve(WHERE)
        return correction is not None and correction.uses_old

    def loss_args(self) -> tuple[str, dict[str, Any]]:
        """``(base_loss, base_loss_args)`` of the loss type, without a rollout correction."""
        level = self.importance_sampling_level
        if self.loss_type in CLIPPED:
            args = {"epsilon_low": self.epsilon, "epsilon_high": self.upper_epsilon, "delta": self.delta}
            return "ppo", {**args, "importance_sampling_level": level}
        if self.loss_type == "cispo":
            args = {"clip_low_threshold": 0.0, "clip_high_threshold": self.upper_epsilon}
            return "cispo", {**args, "importance_sampling_level": level}
        if self.loss_type == "sapo":
            args = {
                "temperature_pos": self.sapo_temperature_pos,
                "temperature_neg": self.sapo_temperature_neg,
            }
            return "sapo", {**args, "importance_sampling_level": level}
        return "vespo", {
            "k_pos": self.vespo_k_pos,
            "lambda_pos": self.vespo_lambda_pos,
            "k_neg": self.vespo_k_neg,
            "lambda_neg": self.vespo_lambda_neg,
        }

    def kl_term(self) -> dict[str, Any]:
        """The ``kl_reference`` regularizer of ``beta``: TRL adds ``β · KL_t`` to each token's loss before
        aggregating, so the term takes the base loss's mode and weight ``β``."""
        level = self.importance_sampling_level
        return {
            "name": "kl_reference",
            "weight": self.beta,
            "agg": LOSS_AGG[self.loss_type],
            "pointwise": not (self.bias_corrected_kl and level == "sequence"),
            "args": {
                "estimator": "k3",
                "bias_correction": self.use_bias_correction_kl,
                "importance_sampling_level": level,
                # TRL's ratio: π_old, the current policy detached when a correction has no old_logprobs
                "old_detached": self.bias_corrected_kl and self.uses_old(),
            },
        }

    def entropy_term(self) -> dict[str, Any]:
        """The ``entropy`` bonus of ``entropy_coef``: TRL subtracts ``entropy_coef`` times the mean entropy
        over the completion tokens whatever the loss type, so the term is a ``token-mean`` whatever the
        base loss's mode."""
        return {
            "name": "entropy",
            "weight": self.entropy_coef,
            "agg": "token-mean",
            "args": {"mode": "bonus"},
        }

    def terms(self) -> list[dict[str, Any]]:
        """The regularizer specs the preset adds: the KL term (``beta > 0``), the entropy bonus
        (``entropy_coef > 0``)."""
        return [
            *([self.kl_term()] if self.beta > 0 else []),
            *([self.entropy_term()] if self.entropy_coef > 0 else []),
        ]

    def options(self) -> dict[str, Any]:
        """The `Objective` options: ``base_loss``, ``base_loss_args``, ``loss_agg``, ``loss_agg_norm`` (for
        ``dr_grpo``) and ``regularizers`` (`terms`, when there are any)."""
        base_loss, args = self.base_loss()
        out: dict[str, Any] = {
            "base_loss": base_loss,
            "base_loss_args": args,
            "loss_agg": LOSS_AGG[self.loss_type],
        }
        if self.loss_type == "dr_grpo":
            out["loss_agg_norm"] = float(self.max_completion_length)
        if self.terms():
            out["regularizers"] = self.terms()
        return out


def apply_preset(
    preset: GRPOPreset,
    *,
    base_loss: str,
    base_loss_args: Mapping[str, Any] | None,
    loss_agg: str,
    loss_agg_norm: float | None,
    terms: Sequence[Any] | None,
) -> dict[str, Any]:
    """`Objective.from_options`'s options with ``preset``'s: it sets ``base_loss``, ``base_loss_args``,
    ``loss_agg``, ``loss_agg_norm`` (so they must keep their defaults) and appends its KL term to the
    regularizer specs ``terms`` (which must not have one) as ``regularizers``, and its entropy bonus.

    Raises:
        ConfigError: one of those options is set too, ``beta > 0`` beside a ``kl_reference`` term, or
            ``entropy_coef > 0`` beside an ``entropy`` term.
    """
    name = first_set_option(
        base_loss=base_loss, base_loss_args=base_loss_args, loss_agg=loss_agg, loss_agg_norm=loss_agg_norm
    )
    if name is not None:
        raise ConfigError(
            f"{WHERE} (loss_type {preset.loss_type!r}) sets model.base_loss, model.base_loss_args, "
            f"model.loss_agg and model.loss_agg_norm; remove model.{name} or {WHERE}"
        )
    terms = list(terms or ())
    names = [t.get("name") if isinstance(t, Mapping) else getattr(t, "name", None) for t in terms]
    if preset.beta > 0 and "kl_reference" in names:
        raise ConfigError(
            f"{WHERE}.beta={preset.beta} adds the kl_reference term and model.regularizers has one "
            "already; remove one of them"
        )
    if preset.entropy_coef > 0 and "entropy" in names:
        raise ConfigError(
            f"{WHERE}.entropy_coef={preset.entropy_coef} adds the entropy term and model.regularizers has "
            "one already; remove one of them"
        )
    options = preset.options()
    return {
        "loss_agg_norm": None,
        **options,
        "regularizers": [*terms, *options.get("regularizers", ())],
    }
