"""`DistillationConfig`: logit distillation from a teacher as the base loss of a `RegularizedLM`
(``model.distillation``).

The loss of a step is ``weight · D + ce_weight · CE``, both aggregated by ``model.loss_agg`` with the
step's global counts of labelled positions: ``D = Σ_t a_t d_t``, ``d_t`` the divergence between the
student's and the teacher's next-token distributions at position ``t``
(`lit_losses.heads.linear_distillation`: ``forward_kl``, ``reverse_kl``, TRL's generalized ``jsd``, both
tempered by ``temperature``, no ``T²``), and ``CE = Σ_t a_t (−log p_t[y_t])`` the hard-label
cross-entropy of the untempered student. The teacher is

- a frozen model (``teacher``: a Hugging Face checkpoint directory, a ``transformers`` config dict, a
  `RegularizedLM` checkpoint file, or ``initial_policy``; `lit_losses.models.frozen`), run under
  ``no_grad`` on the same micro-batch; or
- the batch's offline top-k log-probabilities (``teacher: null``): the keys ``teacher_topk_ids`` and
  ``teacher_topk_logprobs`` ``[B, T, k]`` (`lit_losses.heads.topk_distillation`, the rest of the vocabulary
  as one bin with ``tail``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from lit_losses.choices import check_choice
from lit_losses.errors import ConfigError
from lit_losses.heads.divergence import DistillationLoss, check_beta
from lit_losses.objectives.options import check_flag, check_number, coerce_fields, first_set_option

WHERE = "model.distillation"
IMPLIED_BETA = {"forward_kl": 0.0, "reverse_kl": 1.0}
"""The ``β`` of TRL's generalized JSD that each KL is (TRL's ``beta`` selects the divergence)."""


@dataclass(frozen=True)
class DistillationConfig:
    """Logit distillation as the base loss (the module docstring).

    Attributes:
        teacher: the frozen teacher (a Hugging Face checkpoint directory, a ``transformers`` config dict
            with ``model_type``, a `RegularizedLM` checkpoint file, ``initial_policy``), or ``None`` for
            offline top-k log-probabilities in the batches. Its vocabulary must be the student's size.
        loss: ``forward_kl`` (KL(teacher ‖ student)), ``reverse_kl`` or ``jsd`` (TRL's generalized JSD).
        beta: ``β ∈ [0, 1]`` of ``jsd`` (TRL's ``GKDConfig.beta``; 0 is ``forward_kl``, 1 ``reverse_kl``);
            beside ``forward_kl`` or ``reverse_kl`` only their own ``β`` (0 or 1) is taken: TRL's ``beta``
            alone selects a divergence, so a ``beta`` that ``loss`` would drop is an error.
        temperature: ``T > 0`` dividing both models' logits (the offline teacher's log-probabilities are
            used as given); no ``T²`` factor (multiply ``weight`` by ``T²`` for Hinton's).
        weight: the divergence's weight (``≥ 0``).
        ce_weight: the hard-label cross-entropy's weight (``≥ 0``; 0: pure distillation, as TRL's GKD).
        tail: offline top-k only: compare the rest of the vocabulary as one bin (else renormalize both
            over the ids).

    Raises:
        ConfigError: naming ``model.distillation.<field>`` (a ``beta`` that ``loss`` ignores among them).

    Example:
        >>> DistillationConfig(teacher=None, loss="jsd", beta=0.5, temperature=0.9).offline
        True
        >>> DistillationConfig(loss="jsd", beta=1.5)
        Traceback (most recent call last):
        ...
        lit_losses.errors.ConfigError: model.distillation.beta must be in [0, 1], got 1.5
    """

    teacher: str | dict[str, Any] | None = None
    loss: DistillationLoss = "forward_kl"
    beta: float = 0.5
    temperature: float = 1.0
    weight: float = 1.0
    ce_weight: float = 0.0
    tail: bool = True

    def __post_init__(self) -> None:
        check_choice(self.loss, DistillationLoss, f"{WHERE}.loss")
        check_beta(self.beta, f"{WHERE}.beta")
        if self.beta != 0.5:  # the default: given or not, only `coerce` can tell
            check_beta_read(self.loss, self.beta)
        check_number(self.temperature, f"{WHERE}.temperature", "> 0")
        check_number(self.weight, f"{WHERE}.weight", ">= 0")
        check_number(self.ce_weight, f"{WHERE}.ce_weight", ">= 0")
        if self.weight == 0 and self.ce_weight == 0:
            raise ConfigError(f"{WHERE}.weight and {WHERE}.ce_weight are both 0: nothing to optimize")
        check_flag(self.tail, f"{WHERE}.tail")
        if self.teacher is not None and not isinstance(self.teacher, str | Mapping):
            raise ConfigError(f"{WHERE}.teacher={self.teacher!r} must be a path, a config dict or null")

    @property
    def offline(self) -> bool:
        """The teacher comes as top-k log-probabilities in the batches (no ``teacher`` model)."""
        return self.teacher is None

    @classmethod
    def coerce(cls, value: DistillationConfig | Mapping[str, Any] | None) -> DistillationConfig | None:
        """``value`` as a `DistillationConfig` (a mapping of its fields, e.g. a checkpoint's), or ``None``.

        A ``beta`` given in a mapping is checked against its ``loss`` (`check_beta_read`) even at its
        default, unless the mapping holds every field (written out whole: a checkpoint's).
        """
        if isinstance(value, Mapping) and "beta" in value and not {f.name for f in fields(cls)} <= set(value):
            check_beta_read(value.get("loss", cls.loss), value["beta"])
        return coerce_fields(cls, value, WHERE)


def check_beta_read(loss: Any, beta: Any) -> None:
    """Refuse a ``beta`` beside a ``loss`` that ignores it (``forward_kl`` is ``β = 0``, ``reverse_kl``
    ``β = 1``; ``jsd`` reads any ``β``).

    Raises:
        ConfigError: ``model.distillation.beta=<β>: loss '<loss>' ignores it; …``.

    Example:
        >>> check_beta_read("forward_kl", 0.0)
        >>> check_beta_read("forward_kl", 0.3)
        Traceback (most recent call last):
        ...
        lit_losses.errors.ConfigError: model.distillation.beta=0.3: loss 'forward_kl' ignores it; ...
    """
    if loss in IMPLIED_BETA and beta != IMPLIED_BETA[loss]:
        raise ConfigError(
            f"{WHERE}.beta={beta!r}: loss {loss!r} ignores it; TRL's beta selects the generalized JSD: give "
            f"{WHERE}.loss: jsd for it (beta 0 is forward_kl, 1 reverse_kl), or remove {WHERE}.beta"
        )


def check_distillation_options(
    *, base_loss: str, base_loss_args: Mapping[str, Any] | None, grpo: Any, preference: Any
) -> None:
    """Refuse the options ``model.distillation`` replaces (``model.base_loss``, ``model.base_loss_args``,
    ``model.grpo``) or cannot be combined with (a preference preset). ``model.loss_agg`` stays: it
    aggregates the divergence and the hard cross-entropy.

    Raises:
        ConfigError: naming the option set beside it.

    Example:
        >>> check_distillation_options(base_loss="ppo", base_loss_args=None, grpo=None, preference=None)
        Traceback (most recent call last):
        ...
        lit_losses.errors.ConfigError: model.distillation replaces the base loss; remove model.base_loss ...
    """
    name = first_set_option(base_loss=base_loss, base_loss_args=base_loss_args, grpo=grpo)
    if name is not None:
        raise ConfigError(
            f"{WHERE} replaces the base loss; remove model.{name} or {WHERE} (its hard-label "
            f"cross-entropy is {WHERE}.ce_weight)"
        )
    if preference is not None:
        raise ConfigError(f"{WHERE} and {preference.where} are two base losses; keep one")


__all__ = ["DistillationConfig", "check_distillation_options"]
