"""Rollout–training mismatch corrections: the options (TRL's and verl's names) and what they resolve to.

A sampled completion token carries three log-probabilities: ``q_t`` the inference engine's (batch key
``sampling_logprobs``, π_rollout: what vLLM or SGLang returned), ``o_t`` the trainer's at the time of
sampling (``old_logprobs``, π_old, recomputed by the training code) and ``ℓ_t`` the current policy's. The
engine's numbers differ from the trainer's (other kernels, precision, quantized weights); these options
correct the policy gradient for it with the ratio ``ρ_t = exp(o_t − q_t)``, per token or per sequence
(``ρ_s = exp Σ_{t∈s} (o_t − q_t)``):

- TRL's ``GRPOConfig`` fields: ``vllm_importance_sampling_correction`` turns on the importance weight of
  ``vllm_importance_sampling_mode`` — ``token_truncate`` / ``sequence_truncate``: ``w = clip(ρ, C_min,
  C_max)``; ``token_mask`` / ``sequence_mask``: ``w = ρ`` inside ``[C_min, C_max]``, else 0 (IcePop's
  masking, its ``[α, β]`` band being ``[C_min, C_max]``) — with ``C_max =
  vllm_importance_sampling_clip_max`` (its deprecated name ``vllm_importance_sampling_cap``) and ``C_min
  = vllm_importance_sampling_clip_min``; ``off_policy_mask_threshold`` ``δ`` masks, in the loss, the
  sequences with a negative advantage whose mean ``q_t − ℓ_t`` exceeds ``δ`` (DeepSeek-V3.2).
- verl's ``algorithm.rollout_correction`` fields: ``rollout_is`` (``token`` / ``sequence``) weighs by
  ``min(exp(clip(log ρ, ±20)), rollout_is_threshold)``; ``rollout_rs`` rejects tokens or whole sequences
  whose divergence exceeds ``rollout_rs_threshold`` (``token_k1`` … ``seq_max_k3``, comma-separated,
  all must pass); ``rollout_correction_preset`` names one of verl's decoupled presets (or ``icepop``).

`RolloutCorrectionOptions` holds the fields as users write them (``model.base_loss_args`` of an RL base
loss, or ``model.grpo``); `RolloutCorrectionOptions.resolve` checks them and gives the `RolloutCorrection`
the loss applies (`lit_losses.objectives.mismatch` computes its weights and masks).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any, Literal, get_args

from lit_losses.choices import check_choice
from lit_losses.errors import ConfigError
from lit_losses.registry import closest

VLLMImportanceSamplingMode = Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]
"""TRL's ``vllm_importance_sampling_mode``: truncate (clip) or mask, per token or per sequence."""
RolloutISLevel = Literal["token", "sequence"]
"""verl's ``rollout_is``: the importance weight per token or per sequence."""
RolloutRSOption = Literal[
    "token_k1",
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
]
"""verl's ``rollout_rs`` options: a divergence (``k1 = −log ρ``, ``k2 = ½ (log ρ)²``, ``k3 = ρ − 1 −
log ρ``) per token, or its sum, mean or max over the sequence."""
RolloutCorrectionPreset = Literal[
    "decoupled_token_is",
    "decoupled_seq_is",
    "decoupled_seq_is_rs",
    "decoupled_geo_rs",
    "decoupled_geo_rs_seq_tis",
    "decoupled_geo_rs_token_tis",
    "decoupled_k3_rs",
    "decoupled_k3_rs_seq_tis",
    "decoupled_k3_rs_token_tis",
    "icepop",
]
"""verl's ``RolloutCorrectionConfig`` presets of decoupled mode (three policies), and ``icepop``: TRL's
``token_mask`` with IcePop's band ``[0.5, 5.0]``."""

PRESETS: dict[str, dict[str, Any]] = {
    "decoupled_token_is": {"rollout_is": "token", "rollout_is_threshold": 2.0},
    "decoupled_seq_is": {"rollout_is": "sequence", "rollout_is_threshold": 2.0},
    "decoupled_seq_is_rs": {
        "rollout_is": "sequence",
        "rollout_is_threshold": 2.0,
        "rollout_rs": "seq_sum_k1",
        "rollout_rs_threshold": "0.5_2.0",
    },
    "decoupled_geo_rs": {"rollout_rs": "seq_mean_k1", "rollout_rs_threshold": "0.999_1.001"},
    "decoupled_geo_rs_seq_tis": {
        "rollout_is": "sequence",
        "rollout_is_threshold": 2.0,
        "rollout_rs": "seq_mean_k1",
        "rollout_rs_threshold": "0.999_1.001",
    },
    "decoupled_geo_rs_token_tis": {
        "rollout_is": "token",
        "rollout_is_threshold": 2.0,
        "rollout_rs": "seq_mean_k1",
        "rollout_rs_threshold": "0.999_1.001",
    },
    "decoupled_k3_rs": {"rollout_rs": "seq_mean_k3", "rollout_rs_threshold": 0.01},
    "decoupled_k3_rs_seq_tis": {
        "rollout_is": "sequence",
        "rollout_is_threshold": 2.0,
        "rollout_rs": "seq_mean_k3",
        "rollout_rs_threshold": 0.01,
    },
    "decoupled_k3_rs_token_tis": {
        "rollout_is": "token",
        "rollout_is_threshold": 2.0,
        "rollout_rs": "seq_mean_k3",
        "rollout_rs_threshold": 0.01,
    },
    "icepop": {
        "vllm_importance_sampling_correction": True,
        "vllm_importance_sampling_mode": "token_mask",
        "vllm_importance_sampling_clip_min": 0.5,
        "vllm_importance_sampling_clip_max": 5.0,
    },
}
"""Each preset's fields (verl's defaults of its factory arguments; IcePop's paper band for ``icepop``).
Fields given beside a preset override its thresholds; giving a mode it sets is an error."""

TRL_DEFAULT_CLIP_MAX = 3.0
RS_THRESHOLD_HINT = "e.g. 0.01 for a k2/k3 option, '0.5_2.0' (lower_upper ratio bounds) for a k1 option"


@dataclass(frozen=True)
class RejectionCriterion:
    """One option of verl's ``rollout_rs`` with its thresholds (verl's ``_parse_rollout_rs_thresholds``):
    a ``k1`` option keeps ``log lower ≤ statistic ≤ log upper``, the others ``statistic ≤ upper``."""

    option: str
    upper: float
    lower: float | None = None

    @property
    def level(self) -> Literal["token", "seq_sum", "seq_mean", "seq_max"]:
        """Where the statistic is taken: the token's own, or the sum, mean or max over its sequence."""
        return self.option.rsplit("_", 1)[0]  # type: ignore[return-value]

    @property
    def divergence(self) -> Literal["k1", "k2", "k3"]:
        return self.option.rsplit("_", 1)[1]  # type: ignore[return-value]


@dataclass(frozen=True)
class RolloutCorrection:
    """A checked rollout correction (from `RolloutCorrectionOptions.resolve`).

    Attributes:
        vllm_mode: TRL's importance-sampling mode, ``None`` when TRL's correction is off.
        clip_min: TRL's ``C_min`` (``None``: no lower bound).
        clip_max: TRL's ``C_max`` (``None``: no upper bound).
        rollout_is: verl's importance-weight level, ``None`` when off.
        rollout_is_threshold: verl's truncation of the weight.
        rejection: verl's ``rollout_rs`` criteria (empty: no rejection).
        off_policy_mask_threshold: TRL's off-policy sequence mask ``δ`` (``None``: off).

    Example:
        >>> options = RolloutCorrectionOptions(rollout_is="token", rollout_rs="seq_mean_k3,token_k1",
        ...                                    rollout_rs_threshold="0.01,0.5_2.0")
        >>> correction = options.resolve("model.base_loss_args")
        >>> correction.weighted, correction.rejects, correction.pointwise
        (True, True, True)
        >>> [(c.option, c.lower, c.upper) for c in correction.rejection]
        [('seq_mean_k3', None, 0.01), ('token_k1', 0.5, 2.0)]
    """

    vllm_mode: VLLMImportanceSamplingMode | None = None
    clip_min: float | None = None
    clip_max: float | None = None
    rollout_is: RolloutISLevel | None = None
    rollout_is_threshold: float = 2.0
    rejection: tuple[RejectionCriterion, ...] = ()
    off_policy_mask_threshold: float | None = None

    @property
    def weighted(self) -> bool:
        """An importance weight ``w`` multiplies each token's loss (TRL's or verl's)."""
        return self.vllm_mode is not None or self.rollout_is is not None

    @property
    def rejects(self) -> bool:
        """verl's rejection sampling: rejected tokens leave the labels before the step is counted."""
        return bool(self.rejection)

    @property
    def uses_old(self) -> bool:
        """The correction reads ``π_old``: without ``old_logprobs`` in the batch it is the current policy,
        detached (TRL's ``old_per_token_logps`` when each generation is used once)."""
        return self.weighted or self.rejects

    @property
    def level(self) -> RolloutISLevel | None:
        """The importance weight's level (``None``: no weight)."""
        if self.vllm_mode is not None:
            return "sequence" if self.vllm_mode.startswith("sequence") else "token"
        return self.rollout_is

    @property
    def pointwise(self) -> bool:
        """Token ``t``'s weight depends on token ``t`` alone whatever the batch holds (no sequence-level
        weight, no off-policy sequence mask): the fused pointwise path may apply it."""
        return self.level != "sequence" and self.off_policy_mask_threshold is None

    @property
    def metric_names(self) -> tuple[str, ...]:
        """The telemetry keys the correction adds to its base loss's (`lit_losses.objectives.mismatch`)."""
        names: list[str] = []
        if self.uses_old:
            names += ["rollout_logprob_diff_mean", "rollout_logprob_diff_max", "rollout_k3_kl"]
        if self.weighted:
            names += ["rollout_is_weight_mean", "rollout_is_truncated_fraction", "rollout_is_masked_fraction"]
        if self.rejects:
            names.append("rollout_rs_masked_fraction")
        if self.off_policy_mask_threshold is not None:
            names.append("off_policy_masked_fraction")
        return tuple(names)


@dataclass(frozen=True, kw_only=True)
class RolloutCorrectionOptions:
    """The rollout-correction fields as TRL's ``GRPOConfig`` and verl's ``rollout_correction`` name them.

    Attributes:
        vllm_importance_sampling_correction: apply TRL's importance weight (default off: records always
            carry the sampler's log-probabilities here; TRL's default ``True`` acts only with vLLM).
        vllm_importance_sampling_mode: ``token_truncate``, ``token_mask``, ``sequence_truncate`` or
            ``sequence_mask`` (TRL's default).
        vllm_importance_sampling_clip_max: ``C_max`` (TRL's default 3.0; ``None``: no upper bound).
        vllm_importance_sampling_clip_min: ``C_min`` (default none).
        vllm_importance_sampling_cap: TRL's deprecated name of ``vllm_importance_sampling_clip_max``: give
            one of the two. Both given is an error; where only the values are known (this class's
            constructor), a ``vllm_importance_sampling_clip_max`` given at its default 3.0 cannot be told
            from one left out, and the cap sets ``C_max``.
        off_policy_mask_threshold: ``δ`` of DeepSeek-V3.2's off-policy sequence mask (default off).
        rollout_is: verl's importance weight, ``token`` or ``sequence`` (default off).
        rollout_is_threshold: its truncation (verl's default 2.0).
        rollout_rs: verl's rejection options, comma-separated (``seq_mean_k3``, ``token_k1,seq_max_k2``).
        rollout_rs_threshold: one threshold per option or one for all (comma-separated; ``lower_upper``
            ratio bounds for ``k1`` options, a single upper ratio bound giving ``lower = 1/upper``).
        rollout_correction_preset: one of verl's decoupled presets, or ``icepop``.

    Example:
        >>> RolloutCorrectionOptions(rollout_correction_preset="decoupled_k3_rs").resolve("x").rejection
        (RejectionCriterion(option='seq_mean_k3', upper=0.01, lower=None),)
        >>> RolloutCorrectionOptions(vllm_importance_sampling_mode="token_msk").resolve("model.grpo")
        Traceback (most recent call last):
        ...
        lit_losses.errors.ConfigError: model.grpo.vllm_importance_sampling_mode 'token_msk' is not one of ...
    """

    vllm_importance_sampling_correction: bool = False
    vllm_importance_sampling_mode: VLLMImportanceSamplingMode = "sequence_mask"
    vllm_importance_sampling_clip_max: float | None = TRL_DEFAULT_CLIP_MAX
    vllm_importance_sampling_clip_min: float | None = None
    vllm_importance_sampling_cap: float | None = None
    off_policy_mask_threshold: float | None = None
    rollout_is: RolloutISLevel | None = None
    rollout_is_threshold: float | None = None
    rollout_rs: str | None = None
    rollout_rs_threshold: str | float | None = None
    rollout_correction_preset: RolloutCorrectionPreset | None = None

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The field names (the keys ``model.base_loss_args`` takes for the correction)."""
        return tuple(f.name for f in fields(RolloutCorrectionOptions))

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], where: str | None = None) -> RolloutCorrectionOptions:
        """The options of ``values`` (the correction's keys of ``base_loss_args``); with ``where`` (the
        option path they were given under), the fields given together are checked first
        (`check_given_fields`): the keys tell a field given at its default from one left out."""
        if where is not None:
            check_given_fields(values, where)
        return cls(**{name: values[name] for name in cls.names() if name in values})

    def given(self) -> dict[str, Any]:
        """The fields that differ from their defaults (what a preset passes on to ``base_loss_args``)."""
        default = RolloutCorrectionOptions()
        return {n: getattr(self, n) for n in self.names() if getattr(self, n) != getattr(default, n)}

    def resolve(self, where: str) -> RolloutCorrection | None:
        """The checked correction (``None`` when every field keeps its default).

        Args:
            where: the option path the fields sit under, for messages (``model.base_loss_args``).

        Raises:
            ConfigError: one line naming ``<where>.<field>``: a mode or option with a typo (the closest
                name), a bound ≤ 0 where the source needs a positive one, ``C_min ≥ C_max``, a truncate mode
                without bounds, a threshold string verl cannot parse, an option without effect (a mode set
                while its correction is off), two spellings of one bound, a mode its preset sets.
        """
        options = RolloutCorrectionOptions(**{name: getattr(self, name) for name in self.names()})
        options._check_types(where)
        options = options._with_cap(where)._with_preset(where)
        trl = options._trl(where)
        verl_is = options._verl_is(where)
        if trl is not None and verl_is is not None:
            raise ConfigError(
                f"{where}.rollout_is={options.rollout_is!r} and vllm_importance_sampling_correction=True "
                "both weight the loss by π_old/π_rollout; give one of them (TRL's or verl's)"
            )
        rejection = options._rejection(where)
        threshold = options.off_policy_mask_threshold
        if threshold is not None and not (math.isfinite(threshold) and threshold > 0):
            raise ConfigError(
                f"{where}.off_policy_mask_threshold={threshold!r} must be a finite number > 0 (the mean "
                "KL of a sequence above which its negative-advantage tokens are masked)"
            )
        if trl is None and verl_is is None and not rejection and threshold is None:
            return None
        level, threshold_is = verl_is if verl_is is not None else (None, 2.0)
        clip_min, clip_max, mode = trl if trl is not None else (None, None, None)
        return RolloutCorrection(
            vllm_mode=mode,
            clip_min=clip_min,
            clip_max=clip_max,
            rollout_is=level,
            rollout_is_threshold=threshold_is,
            rejection=rejection,
            off_policy_mask_threshold=threshold,
        )

    # ---- one check each ---------------------------------------------------------------------------
    def _with_preset(self, where: str) -> RolloutCorrectionOptions:
        name = self.rollout_correction_preset
        if name is None:
            return self
        check_choice(name, RolloutCorrectionPreset, f"{where}.rollout_correction_preset")
        preset = PRESETS[name]
        for key in ("rollout_is", "rollout_rs", "vllm_importance_sampling_mode"):
            if key in preset and key in self.given():
                raise ConfigError(
                    f"{where}.{key}={getattr(self, key)!r}: rollout_correction_preset {name!r} sets it "
                    f"({key}={preset[key]!r}); remove one of them"
                )
        values = {**preset, **{k: v for k, v in self.given().items() if k != "rollout_correction_preset"}}
        return replace(RolloutCorrectionOptions(), **values)

    def _with_cap(self, where: str) -> RolloutCorrectionOptions:
        cap = self.vllm_importance_sampling_cap
        if cap is None:
            return self
        if not (math.isfinite(cap) and cap > 0):
            raise ConfigError(
                f"{where}.vllm_importance_sampling_cap={cap!r} must be a finite number > 0 (an upper bound "
                "of the ratio π_old/π_rollout; TRL's current name: vllm_importance_sampling_clip_max)"
            )
        if self.vllm_importance_sampling_clip_max != TRL_DEFAULT_CLIP_MAX:
            raise ConfigError(
                f"{where}.vllm_importance_sampling_cap={cap!r} and vllm_importance_sampling_clip_max="
                f"{self.vllm_importance_sampling_clip_max!r} both set C_max; give vllm_importance_sampling_"
                "clip_max only (TRL's current name; vllm_importance_sampling_cap is deprecated)"
            )
        warnings.warn(
            f"{where}.vllm_importance_sampling_cap is deprecated (as in TRL): use "
            "vllm_importance_sampling_clip_max",
            FutureWarning,
            stacklevel=2,
        )
        return replace(self, vllm_importance_sampling_cap=None, vllm_importance_sampling_clip_max=cap)

    def _check_types(self, where: str) -> None:
        if not isinstance(self.vllm_importance_sampling_correction, bool):
            raise ConfigError(
                f"{where}.vllm_importance_sampling_correction="
                f"{self.vllm_importance_sampling_correction!r} must be true or false"
            )
        numbers = (
            "vllm_importance_sampling_cap",
            "vllm_importance_sampling_clip_max",
            "vllm_importance_sampling_clip_min",
            "off_policy_mask_threshold",
            "rollout_is_threshold",
        )
        for name in numbers:
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
                raise ConfigError(f"{where}.{name}={value!r} must be a number or null")
        value = self.rollout_rs
        if value is not None and not isinstance(value, str):
            raise ConfigError(f"{where}.rollout_rs={value!r} must be a string of options ('seq_mean_k3')")

    def _trl(self, where: str) -> tuple[float | None, float | None, str] | None:
        """``(C_min, C_max, mode)`` of TRL's correction (TRL's ``GRPOConfig.__post_init__`` checks)."""
        mode = check_choice(
            self.vllm_importance_sampling_mode,
            VLLMImportanceSamplingMode,
            f"{where}.vllm_importance_sampling_mode",
        )
        low, high = self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max
        if not self.vllm_importance_sampling_correction:
            unused = [
                n
                for n in ("vllm_importance_sampling_mode", "vllm_importance_sampling_clip_min")
                if n in self.given()
            ]
            if high != TRL_DEFAULT_CLIP_MAX:
                unused.append("vllm_importance_sampling_clip_max")
            if unused:
                raise ConfigError(
                    f"{where}.{unused[0]}={getattr(self, unused[0])!r} has no effect: "
                    "vllm_importance_sampling_correction is false (set it to true)"
                )
            return None
        if high is not None and not (math.isfinite(high) and high > 0):
            raise ConfigError(
                f"{where}.vllm_importance_sampling_clip_max={high!r} must be a finite number > 0 (an upper "
                "bound of the ratio π_old/π_rollout) or null"
            )
        if low is not None and not (math.isfinite(low) and low >= 0):
            raise ConfigError(
                f"{where}.vllm_importance_sampling_clip_min={low!r} must be a finite number >= 0 (a lower "
                "bound of the ratio π_old/π_rollout) or null"
            )
        if low is not None and high is not None and low >= high:
            raise ConfigError(
                f"{where}.vllm_importance_sampling_clip_min={low!r} must be less than "
                f"vllm_importance_sampling_clip_max={high!r}"
            )
        if mode.endswith("truncate") and low is None and high is None:
            raise ConfigError(
                f"{where}.vllm_importance_sampling_mode={mode!r} truncates the ratio: set "
                "vllm_importance_sampling_clip_min or vllm_importance_sampling_clip_max"
            )
        return low, high, mode

    def _verl_is(self, where: str) -> tuple[str, float] | None:
        threshold = self.rollout_is_threshold
        if self.rollout_is is None:
            if threshold is not None:
                raise ConfigError(
                    f"{where}.rollout_is_threshold={threshold!r} has no effect: rollout_is is null (set it "
                    "to 'token' or 'sequence')"
                )
            return None
        level = check_choice(self.rollout_is, RolloutISLevel, f"{where}.rollout_is")
        threshold = 2.0 if threshold is None else threshold
        if not (math.isfinite(threshold) and threshold > 0):
            raise ConfigError(
                f"{where}.rollout_is_threshold={threshold!r} must be a finite number > 0 (the truncation of "
                "the weight π_old/π_rollout, e.g. 2.0)"
            )
        return level, float(threshold)

    def _rejection(self, where: str) -> tuple[RejectionCriterion, ...]:
        spec = self.rollout_rs_threshold
        if self.rollout_rs is None:
            if spec is not None:
                raise ConfigError(
                    f"{where}.rollout_rs_threshold={spec!r} has no effect: rollout_rs is null (set it to "
                    "an option, e.g. 'seq_mean_k3')"
                )
            return ()
        allowed = get_args(RolloutRSOption)
        options: list[str] = []
        for option in (part.strip() for part in self.rollout_rs.split(",")):
            if option not in allowed:
                raise ConfigError(
                    f"{where}.rollout_rs: {option!r} is not one of {allowed}{closest(option, allowed)}"
                )
            if option not in options:
                options.append(option)
        return rs_thresholds(options, spec, f"{where}.rollout_rs_threshold")


NULL_IS_UNSET = ("vllm_importance_sampling_cap", "rollout_is_threshold", "rollout_rs_threshold")
"""The fields whose ``null`` means "not given" (the default applies), not a value of their own."""


def check_given_fields(values: Mapping[str, Any], where: str) -> None:
    """Refuse fields given together that disagree when one of them is given at its default value, which
    `RolloutCorrectionOptions` alone cannot tell from a field left out (so that the other would win
    silently): ``vllm_importance_sampling_cap`` beside ``vllm_importance_sampling_clip_max`` (at its
    default 3.0 too: two names of one bound), and a field that ``rollout_correction_preset`` sets, given at
    its default beside the preset with another value than the preset's (``vllm_importance_sampling_mode:
    sequence_mask`` beside ``icepop``). Fields given with another value than their default are checked by
    `RolloutCorrectionOptions.resolve`.

    Args:
        values: the fields as given (the keys of a mapping, the options a config writes).
        where: the option path they were given under (``model.grpo``), for messages.

    Raises:
        ConfigError: one line naming both fields and their values.

    Example:
        >>> given = {"vllm_importance_sampling_cap": 5.0, "vllm_importance_sampling_clip_max": 3.0}
        >>> check_given_fields(given, "model.grpo")
        Traceback (most recent call last):
        ...
        lit_losses.errors.ConfigError: model.grpo.vllm_importance_sampling_cap=5.0 and vllm_importance_sam...
        >>> check_given_fields({"vllm_importance_sampling_cap": 5.0}, "model.grpo")  # one name: accepted
    """
    cap = values.get("vllm_importance_sampling_cap")
    if cap is not None and "vllm_importance_sampling_clip_max" in values:
        raise ConfigError(
            f"{where}.vllm_importance_sampling_cap={cap!r} and vllm_importance_sampling_clip_max="
            f"{values['vllm_importance_sampling_clip_max']!r} both set C_max; give vllm_importance_sampling_"
            "clip_max only (TRL's current name; vllm_importance_sampling_cap is deprecated)"
        )
    name = values.get("rollout_correction_preset")
    preset = PRESETS.get(name, {}) if isinstance(name, str) else {}
    defaults = {f.name: f.default for f in fields(RolloutCorrectionOptions)}
    for key, value in preset.items():
        spelled = key
        if key == "vllm_importance_sampling_clip_max" and key not in values and cap is not None:
            spelled = "vllm_importance_sampling_cap"
        given = values.get(spelled, defaults[spelled])
        if spelled not in values or given != defaults[key] or given == value:
            continue
        if given is None and spelled in NULL_IS_UNSET:
            continue
        raise ConfigError(
            f"{where}.{spelled}={given!r} beside rollout_correction_preset {name!r}, which sets {key}="
            f"{value!r}: remove one of them"
        )


def rs_thresholds(options: list[str], spec: Any, where: str) -> tuple[RejectionCriterion, ...]:
    """verl's ``_parse_rollout_rs_thresholds``: one threshold per option or one for all; a ``k1`` option
    takes ``lower_upper`` (or ``upper``, then ``lower = 1/upper``), the others one upper bound, each > 0.

    Example:
        >>> rs_thresholds(["token_k1", "seq_max_k2"], "0.5_1.5,0.3", "rollout_rs_threshold")
        (RejectionCriterion(option='token_k1', upper=1.5, lower=0.5), RejectionCriterion(option='seq_max_k2', upper=0.3, lower=None))
    """  # noqa: E501
    if spec is None:
        raise ConfigError(f"{where} is required by rollout_rs ({RS_THRESHOLD_HINT})")
    if isinstance(spec, bool) or not isinstance(spec, str | int | float):
        raise ConfigError(f"{where}={spec!r} must be a number or a string ({RS_THRESHOLD_HINT})")
    parts = [str(spec)] if not isinstance(spec, str) else [p.strip() for p in spec.split(",") if p.strip()]
    if len(parts) not in (1, len(options)):
        raise ConfigError(
            f"{where}={spec!r} gives {len(parts)} thresholds for {len(options)} rollout_rs options "
            f"{options}: give one for all or one per option"
        )
    parts = parts * len(options) if len(parts) == 1 else parts
    return tuple(_criterion(option, part, where) for option, part in zip(options, parts, strict=True))


def _criterion(option: str, part: str, where: str) -> RejectionCriterion:
    k1 = option.endswith("k1")
    if "_" in part and not k1:
        raise ConfigError(
            f"{where}: {part!r} for {option!r} must be a single upper bound without '_' (a lower_upper pair "
            "is for k1 options)"
        )
    lower_text, upper_text = part.split("_", 1) if "_" in part else (None, part)
    try:
        upper = float(upper_text)
        lower = float(lower_text) if lower_text is not None else (1.0 / upper if k1 and upper else None)
    except ValueError:
        raise ConfigError(f"{where}: {part!r} for {option!r} is not a number ({RS_THRESHOLD_HINT})") from None
    for value in (upper, lower):
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ConfigError(f"{where}: {part!r} for {option!r} must be positive and finite")
    if k1 and lower is not None and lower >= upper:
        raise ConfigError(
            f"{where}: {part!r} for {option!r} gives the ratio band [{lower:g}, {upper:g}], which keeps no "
            "token (YAML reads an unquoted 0.5_2 as the number 0.52: quote 'lower_upper')"
        )
    return RejectionCriterion(option, upper=upper, lower=lower if k1 else None)
