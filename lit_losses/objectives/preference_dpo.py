"""`dpo_loss`: every ``loss_type`` of TRL's ``DPOTrainer``, per pair, from sequence log-probabilities.

TRL computes these inside ``DPOTrainer._compute_loss`` from full logits; here they are functions of the
per-pair values a fused head gives (`preference_sequences`): the policy's and the reference's sums of
completion-token log-probabilities ``π_w, π_l, ρ_w, ρ_l`` of the chosen (``w``) and rejected (``l``)
completions, through the log-ratios ``r = π − ρ`` and the f-divergence scores ``s = f'(e^r)``
(``f_divergence_type``; ``reverse_kl``: ``s = r``; only the types of `F_DIVERGENCE_TYPES` take another
one, as in TRL). `dpo_loss`'s table gives each loss type.

Several types at once are summed with ``loss_weights`` (TRL's MPO combinations); ``use_weighting``
(WPO) multiplies each pair's loss by ``w_w · w_l`` (`wpo_weights`, no gradient). The rewards are
``β r_w`` and ``β r_l``, detached, as TRL logs them. ``bco_pair`` has no running reward mean in TRL's
current ``DPOTrainer`` (its older version subtracted one); it has none here either. ``aot`` and
``aot_unpaired`` sort over the pairs of one call: a pair's loss depends on the other pairs given with it
(TRL: those of one process's micro-batch). LD-DPO's ``ld_alpha`` changes the sequence values, not the
loss: `ld_sequence_logps` computes them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple, get_args

import torch
import torch.nn.functional as F
from torch import Tensor

from lit_losses.choices import check_choice
from lit_losses.errors import ConfigError
from lit_losses.objectives.options import check_number
from lit_losses.objectives.preference_checks import check_numbers
from lit_losses.objectives.preference_sequences import nll_shares
from lit_losses.trl_fields import DPOLossType

FDivergenceType = Literal["reverse_kl", "forward_kl", "js_divergence", "alpha_divergence"]
"""TRL's ``DPOConfig.f_divergence_type`` (f-DPO): the scores ``f'(e^r)`` of the log-ratios ``r``."""

LENGTH_NORMALIZED: tuple[str, ...] = ("ipo", "sigmoid_norm")
"""The loss types that divide the scores by the completions' token counts."""

SORTING: tuple[str, ...] = ("aot", "aot_unpaired")
"""The loss types whose per-pair value depends on the other pairs of the call (they sort)."""

SMOOTHED: tuple[str, ...] = ("exo_pair", "robust", "aot", "aot_unpaired")
"""The loss types that read ``label_smoothing``."""

F_DIVERGENCE_TYPES: tuple[str, ...] = (
    "sigmoid",
    "sigmoid_norm",
    "hinge",
    "ipo",
    "exo_pair",
    "robust",
    "discopop",
    "sft",
)
"""The loss types that take an ``f_divergence_type`` other than ``reverse_kl`` (TRL's list): those built on
the chosen-minus-rejected score, where f-DPO's ``β log Z(x)`` cancels (``sft`` reads no score)."""


class DPOLoss(NamedTuple):
    """`dpo_loss`'s per-pair values ``[P]``; their mean over the pairs is TRL's loss and metrics."""

    losses: Tensor
    """The weighted sum of the loss types' per-pair losses (with gradient)."""
    chosen_rewards: Tensor
    """``β (π_w − ρ_w)``, detached (TRL's ``rewards/chosen``)."""
    rejected_rewards: Tensor
    """``β (π_l − ρ_l)``, detached (TRL's ``rewards/rejected``)."""


@dataclass(frozen=True)
class DPOTerms:
    """The per-pair quantities that every DPO loss type is a function of."""

    chosen_logps: Tensor
    rejected_logps: Tensor
    ref_chosen_logps: Tensor
    ref_rejected_logps: Tensor
    chosen_scores: Tensor
    rejected_scores: Tensor
    beta: float
    label_smoothing: float
    discopop_tau: float
    chosen_lengths: Tensor | None
    rejected_lengths: Tensor | None
    sft: Tensor | None

    @property
    def chosen_logratios(self) -> Tensor:
        return self.chosen_logps - self.ref_chosen_logps

    @property
    def rejected_logratios(self) -> Tensor:
        return self.rejected_logps - self.ref_rejected_logps

    @property
    def logits(self) -> Tensor:
        """``βΔ``."""
        return self.beta * (self.chosen_scores - self.rejected_scores)

    def normalized_delta(self) -> Tensor:
        """``s_w/|y_w| − s_l/|y_l|`` (token counts at least 1)."""
        chosen = self.chosen_scores / self.chosen_lengths.clamp_min(1)
        return chosen - self.rejected_scores / self.rejected_lengths.clamp_min(1)

    def smoothed(self, delta: Tensor) -> Tensor:
        """``−(1−ε) log σ(βd) − ε log σ(−βd)``."""
        eps = self.label_smoothing
        return -F.logsigmoid(self.beta * delta) * (1 - eps) - F.logsigmoid(-self.beta * delta) * eps


def _exo_pair(t: DPOTerms) -> Tensor:
    eps = torch.tensor(t.label_smoothing, dtype=t.logits.dtype, device=t.logits.device)
    log_qw, log_ql = F.logsigmoid(t.logits), F.logsigmoid(-t.logits)
    return log_qw.exp() * (log_qw - torch.log1p(-eps)) + log_ql.exp() * (log_ql - torch.log(eps))


def _robust(t: DPOTerms) -> Tensor:
    eps = t.label_smoothing
    return (-(1 - eps) * F.logsigmoid(t.logits) + eps * F.logsigmoid(-t.logits)) / (1 - 2 * eps)


def _nca_pair(t: DPOTerms) -> Tensor:
    chosen, rejected = t.beta * t.chosen_logratios, t.beta * t.rejected_logratios
    return -F.logsigmoid(chosen) - 0.5 * F.logsigmoid(-chosen) - 0.5 * F.logsigmoid(-rejected)


def _sppo_hard(t: DPOTerms) -> Tensor:
    return (t.chosen_logratios - 0.5 / t.beta) ** 2 + (t.rejected_logratios + 0.5 / t.beta) ** 2


def _aot(t: DPOTerms) -> Tensor:
    logratios = torch.sort(t.chosen_logps - t.rejected_logps, dim=0).values
    ref_logratios = torch.sort(t.ref_chosen_logps - t.ref_rejected_logps, dim=0).values
    return t.smoothed(logratios - ref_logratios)


def _aot_unpaired(t: DPOTerms) -> Tensor:
    chosen = torch.sort(t.chosen_logratios, dim=0).values
    return t.smoothed(chosen - torch.sort(t.rejected_logratios, dim=0).values)


def _discopop(t: DPOTerms) -> Tensor:
    modulation = torch.sigmoid(t.logits / t.discopop_tau)
    return -F.logsigmoid(t.logits) * (1 - modulation) + torch.exp(-t.logits) * modulation


LOSS_TYPES: dict[str, Callable[[DPOTerms], Tensor]] = {
    "sigmoid": lambda t: -F.logsigmoid(t.logits),
    "hinge": lambda t: torch.relu(1 - t.logits),
    "ipo": lambda t: (t.normalized_delta() - 1 / (2 * t.beta)) ** 2,
    "exo_pair": _exo_pair,
    "nca_pair": _nca_pair,
    "robust": _robust,
    "bco_pair": lambda t: (
        -F.logsigmoid(t.beta * t.chosen_logratios) - F.logsigmoid(-t.beta * t.rejected_logratios)
    ),
    "sppo_hard": _sppo_hard,
    "aot": _aot,
    "aot_unpaired": _aot_unpaired,
    "apo_zero": lambda t: (
        1 - torch.sigmoid(t.beta * t.chosen_logratios) + torch.sigmoid(t.beta * t.rejected_logratios)
    ),
    "apo_down": lambda t: (
        torch.sigmoid(t.beta * t.chosen_logratios)
        + 1
        - torch.sigmoid(t.beta * (t.chosen_logratios - t.rejected_logratios))
    ),
    "discopop": _discopop,
    "sft": lambda t: t.sft,
    "sigmoid_norm": lambda t: -F.logsigmoid(t.beta * t.normalized_delta()),
}
"""Each loss type's per-pair loss, as a function of `DPOTerms`."""

if set(LOSS_TYPES) != set(get_args(DPOLossType)):  # pragma: no cover - a maintenance error
    raise RuntimeError(f"DPOLossType lists {get_args(DPOLossType)}; implemented: {sorted(LOSS_TYPES)}")


def f_divergence_scores(logratios: Tensor, f_divergence_type: str, f_alpha_divergence_coef: float) -> Tensor:
    """The scores ``f'(u)`` at the ratios ``u = e^r`` of log-ratios ``r`` (f-DPO), as TRL computes them.

    ``reverse_kl``: ``r``; ``forward_kl``: ``1 − e^{−r}``; ``js_divergence``: ``log 2 + log σ(r)``;
    ``alpha_divergence``: ``(e^{(α−1) r} − 1) / (α − 1)`` with the exponent capped at 80 (11 in
    float16), as TRL caps it, computed in float32 at least (TRL: in float32, then cast back) and ``r``
    when ``|α − 1| < 10⁻⁶``. The constants cancel in ``s_w − s_l`` but not in the length-normalized
    ``s_w/|y_w| − s_l/|y_l|`` of ``ipo`` and ``sigmoid_norm``.

    Example:
        >>> import torch
        >>> f_divergence_scores(torch.tensor([0.0, 1.0]), "js_divergence", 0.5)
        tensor([0.0000, 0.3799])
    """
    if f_divergence_type == "reverse_kl":
        return logratios
    if f_divergence_type == "forward_kl":
        return -torch.expm1(-logratios)
    if f_divergence_type == "js_divergence":
        return math.log(2.0) + F.logsigmoid(logratios)
    if f_divergence_type != "alpha_divergence":
        check_choice(f_divergence_type, FDivergenceType, "f_divergence_type")
    alpha = f_alpha_divergence_coef
    if abs(alpha - 1.0) < 1e-6:
        return logratios
    exponent = (alpha - 1.0) * logratios
    compute = torch.promote_types(exponent.dtype, torch.float32)
    cap = 11.0 if exponent.dtype == torch.float16 else 80.0
    return (torch.expm1(exponent.to(compute).clamp(max=cap)) / (alpha - 1.0)).to(exponent.dtype)


def check_f_divergence(types: Sequence[str], f_divergence_type: str, where: str) -> None:
    """A `ConfigError` naming ``<where>f_divergence_type`` for a type that is not ``reverse_kl`` with a
    loss type outside `F_DIVERGENCE_TYPES` (its f-DPO form keeps a ``β log Z(x)`` term; TRL refuses it
    too).

    Example:
        >>> check_f_divergence(["sigmoid", "bco_pair"], "js_divergence", "model.dpo.")
        Traceback (most recent call last):
        ...
        lit_losses.errors.ConfigError: model.dpo.f_divergence_type='js_divergence' applies only to ...
    """
    check_choice(f_divergence_type, FDivergenceType, f"{where}f_divergence_type")
    others = [name for name in types if name not in F_DIVERGENCE_TYPES]
    if f_divergence_type != "reverse_kl" and others:
        raise ConfigError(
            f"{where}f_divergence_type={f_divergence_type!r} applies only to loss types "
            f"{F_DIVERGENCE_TYPES} (where f-DPO's log-partition term cancels); loss_type {tuple(others)} "
            "has no f-divergence form: use f_divergence_type 'reverse_kl' with it"
        )


def loss_types_of(loss_type: str | Sequence[str], where: str) -> tuple[str, ...]:
    """``loss_type`` as a non-empty tuple of known `DPOLossType` names (`ConfigError` naming ``where``)."""
    types = (loss_type,) if isinstance(loss_type, str) else tuple(loss_type)
    if not types:
        raise ConfigError(f"{where} is empty; give one of {get_args(DPOLossType)} or several")
    for name in types:
        check_choice(name, DPOLossType, where)
    return types


def check_dpo_numbers(
    types: Sequence[str], *, beta: float, label_smoothing: float, discopop_tau: float, where: str
) -> None:
    """``beta > 0``, ``label_smoothing`` in ``[0, 0.5)`` (``> 0`` for ``exo_pair``), ``discopop_tau > 0``.

    ``where`` prefixes the names (``"model.dpo."``, or ``""`` for the function's arguments).
    """
    check_numbers(beta=beta, label_smoothing=label_smoothing, where=where)
    if "exo_pair" in types and label_smoothing == 0:
        raise ConfigError(
            f"{where}label_smoothing must be > 0 with loss_type 'exo_pair' (log ε; the EXO paper uses 1e-3)"
        )
    check_number(discopop_tau, f"{where}discopop_tau", "> 0")


def _check_inputs(types: Sequence[str], values: dict[str, Tensor | None]) -> None:
    """The pair tensors share one shape ``[P]``; the options the loss types read are given."""
    shape = values["chosen_logps"].shape
    if len(shape) != 1:
        raise ValueError(f"dpo_loss takes one value per pair [P]; chosen_logps has shape {tuple(shape)}")
    for name, value in values.items():
        if value is not None and value.shape != shape:
            raise ValueError(f"dpo_loss: {name} has shape {tuple(value.shape)}, chosen_logps {tuple(shape)}")
    needed = {name: ("chosen_lengths", "rejected_lengths") for name in LENGTH_NORMALIZED}
    needed["sft"] = ("chosen_nll",)
    for name in types:
        for option in needed.get(name, ()):
            if values[option] is None:
                raise ValueError(f"dpo_loss: loss_type {name!r} needs {option}")
    if (values["chosen_weights"] is None) != (values["rejected_weights"] is None):
        raise ValueError("dpo_loss: give both chosen_weights and rejected_weights (WPO), or neither")
    if values["chosen_weights"] is not None and set(types) & {*SORTING, "sft"}:
        raise ValueError(
            "dpo_loss: WPO weights (chosen_weights) do not apply to 'aot'/'aot_unpaired' (they sort the "
            "pairs) nor to 'sft' (one token mean, not a per-pair value)"
        )


def dpo_loss(
    chosen_logps: Tensor,
    rejected_logps: Tensor,
    ref_chosen_logps: Tensor | None,
    ref_rejected_logps: Tensor | None,
    *,
    loss_type: DPOLossType | Sequence[DPOLossType] = "sigmoid",
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    loss_weights: Sequence[float] | None = None,
    discopop_tau: float = 0.05,
    f_divergence_type: FDivergenceType = "reverse_kl",
    f_alpha_divergence_coef: float = 0.5,
    chosen_lengths: Tensor | None = None,
    rejected_lengths: Tensor | None = None,
    chosen_weights: Tensor | None = None,
    rejected_weights: Tensor | None = None,
    chosen_nll: Tensor | None = None,
    chosen_nll_tokens: Tensor | float | None = None,
) -> DPOLoss:
    """TRL's DPO loss of each pair, for every ``loss_type`` of its ``DPOTrainer``.

    With the log-ratios ``r = π − ρ``, the scores ``s = f'(e^r)`` (``reverse_kl``: ``s = r``; another
    ``f_divergence_type`` only with the types of `F_DIVERGENCE_TYPES`),
    ``Δ = s_w − s_l``, ``n_w, n_l`` the completions' token counts and ``ε`` the ``label_smoothing``:

    | ``loss_type`` | per-pair loss |
    | --- | --- |
    | ``sigmoid`` | ``−log σ(βΔ)`` |
    | ``hinge`` | ``relu(1 − βΔ)`` |
    | ``ipo`` | ``(s_w/n_w − s_l/n_l − 1/(2β))²`` |
    | ``exo_pair`` | ``σ(βΔ)(log σ(βΔ) − log(1−ε)) + σ(−βΔ)(log σ(−βΔ) − log ε)``, ``ε > 0`` |
    | ``nca_pair`` | ``−log σ(βr_w) − ½ log σ(−βr_w) − ½ log σ(−βr_l)`` |
    | ``robust`` | ``(−(1−ε) log σ(βΔ) + ε log σ(−βΔ)) / (1 − 2ε)`` |
    | ``bco_pair`` | ``−log σ(βr_w) − log σ(−βr_l)`` |
    | ``sppo_hard`` | ``(r_w − 1/(2β))² + (r_l + 1/(2β))²`` |
    | ``aot`` | ``−(1−ε) log σ(βd) − ε log σ(−βd)``, ``d`` = sorted ``π_w − π_l`` − sorted ``ρ_w − ρ_l`` |
    | ``aot_unpaired`` | the same with ``d`` = sorted ``r_w`` − sorted ``r_l`` |
    | ``apo_zero`` | ``1 − σ(βr_w) + σ(βr_l)`` |
    | ``apo_down`` | ``σ(βr_w) + 1 − σ(β(r_w − r_l))`` |
    | ``discopop`` | ``−log σ(βΔ)(1 − m) + e^{−βΔ} m``, ``m = σ(βΔ/τ)``, ``τ = discopop_tau`` |
    | ``sft`` | the chosen NLL, each pair's share of its token mean (`nll_shares`) |
    | ``sigmoid_norm`` | ``−log σ(β(s_w/n_w − s_l/n_l))`` |

    The mean of ``losses`` over the pairs is the loss TRL's ``DPOTrainer`` computes for a micro-batch
    of these pairs (to float64 precision; TRL's own arithmetic for ``alpha_divergence`` is float32).
    Options a loss type does not read are ignored (the ``model.dpo`` preset refuses them).

    Args:
        chosen_logps: ``[P]`` the policy's sequence log-probabilities ``π_w`` of the chosen
            completions (sums over completion tokens; `ld_sequence_logps` for LD-DPO).
        rejected_logps: ``[P]`` ``π_l``, likewise.
        ref_chosen_logps: ``[P]`` the reference's ``ρ_w``; ``None`` with ``ref_rejected_logps`` for
            reference-free DPO (``ρ = 0``).
        ref_rejected_logps: ``[P]`` ``ρ_l``, or ``None``.
        loss_type: one name, or several summed with ``loss_weights``.
        beta: ``β > 0`` (IPO's ``τ``).
        label_smoothing: ``ε`` in ``[0, 0.5)`` for ``exo_pair`` (``> 0``), ``robust``, ``aot``,
            ``aot_unpaired``.
        loss_weights: one weight per loss type (default 1 each).
        discopop_tau: DiscoPOP's temperature ``τ``.
        f_divergence_type: the scores ``f'(e^r)`` (`f_divergence_scores`).
        f_alpha_divergence_coef: ``α`` of ``alpha_divergence``.
        chosen_lengths: ``[P]`` completion-token counts ``|y_w|`` (``ipo``, ``sigmoid_norm``).
        rejected_lengths: ``[P]`` ``|y_l|``.
        chosen_weights: ``[P]`` WPO weights of the chosen completions (`wpo_weights`); with
            ``rejected_weights``, each pair's loss is multiplied by their product (no gradient).
        rejected_weights: ``[P]`` WPO weights of the rejected completions.
        chosen_nll: ``[P]`` the chosen completions' summed NLL ``Σ_t −ℓ_t`` (``sft``).
        chosen_nll_tokens: their token counts ``[P]``, or the mean count per pair of the whole batch
            (default ``chosen_lengths``; `nll_shares`).

    Returns:
        `DPOLoss` ``(losses, chosen_rewards, rejected_rewards)``, each ``[P]``.

    Raises:
        ConfigError: an unknown loss type (with the closest name), ``beta ≤ 0``, ``label_smoothing``
            outside ``[0, 0.5)`` (or 0 with ``exo_pair``), ``loss_weights`` of another length, an
            ``f_divergence_type`` other than ``reverse_kl`` with a type outside `F_DIVERGENCE_TYPES`.
        ValueError: tensors of different shapes, or an option a loss type needs is missing.

    Example:
        >>> import torch
        >>> chosen, rejected = torch.tensor([-5.0, -7.0]), torch.tensor([-6.0, -6.5])
        >>> ref_chosen, ref_rejected = torch.tensor([-5.5, -7.0]), torch.tensor([-5.5, -7.0])
        >>> out = dpo_loss(chosen, rejected, ref_chosen, ref_rejected, beta=0.5)
        >>> out.losses, out.chosen_rewards, out.rejected_rewards
        (tensor([0.4741, 0.8259]), tensor([0.2500, 0.0000]), tensor([-0.2500,  0.2500]))
        >>> dpo_loss(chosen, rejected, ref_chosen, ref_rejected, loss_type="sigmiod")
        Traceback (most recent call last):
        ...
        lit_losses.errors.ConfigError: loss_type 'sigmiod' is not one of (...); did you mean 'sigmoid'?
    """
    types = loss_types_of(loss_type, "loss_type")
    weights = [1.0] * len(types) if loss_weights is None else list(loss_weights)
    if len(weights) != len(types):
        raise ConfigError(f"loss_weights has {len(weights)} weights for {len(types)} loss types {types}")
    check_dpo_numbers(types, beta=beta, label_smoothing=label_smoothing, discopop_tau=discopop_tau, where="")
    check_f_divergence(types, f_divergence_type, where="")
    if (ref_chosen_logps is None) != (ref_rejected_logps is None):
        raise ValueError("dpo_loss: give both reference log-probabilities, or neither (reference-free)")
    if ref_chosen_logps is None:
        ref_chosen_logps, ref_rejected_logps = (
            torch.zeros_like(chosen_logps),
            torch.zeros_like(rejected_logps),
        )
    nll_tokens = chosen_lengths if chosen_nll_tokens is None else chosen_nll_tokens
    values = {
        "chosen_logps": chosen_logps,
        "rejected_logps": rejected_logps,
        "ref_chosen_logps": ref_chosen_logps,
        "ref_rejected_logps": ref_rejected_logps,
        "chosen_lengths": chosen_lengths,
        "rejected_lengths": rejected_lengths,
        "chosen_weights": chosen_weights,
        "rejected_weights": rejected_weights,
        "chosen_nll": chosen_nll,
    }
    _check_inputs(types, values)
    if "sft" in types and nll_tokens is None:
        raise ValueError("dpo_loss: loss_type 'sft' needs chosen_nll_tokens (or chosen_lengths)")
    ref_chosen_logps = ref_chosen_logps.detach()
    ref_rejected_logps = ref_rejected_logps.detach()
    terms = DPOTerms(
        chosen_logps=chosen_logps,
        rejected_logps=rejected_logps,
        ref_chosen_logps=ref_chosen_logps,
        ref_rejected_logps=ref_rejected_logps,
        chosen_scores=f_divergence_scores(
            chosen_logps - ref_chosen_logps, f_divergence_type, f_alpha_divergence_coef
        ),
        rejected_scores=f_divergence_scores(
            rejected_logps - ref_rejected_logps, f_divergence_type, f_alpha_divergence_coef
        ),
        beta=beta,
        label_smoothing=label_smoothing,
        discopop_tau=discopop_tau,
        chosen_lengths=None if chosen_lengths is None else chosen_lengths.to(chosen_logps.dtype),
        rejected_lengths=None if rejected_lengths is None else rejected_lengths.to(chosen_logps.dtype),
        sft=nll_shares(chosen_nll, nll_tokens) if "sft" in types else None,
    )
    losses = sum(weight * LOSS_TYPES[name](terms) for name, weight in zip(types, weights, strict=True))
    if chosen_weights is not None:
        losses = losses * (chosen_weights * rejected_weights).detach()
    return DPOLoss(
        losses=losses,
        chosen_rewards=beta * terms.chosen_logratios.detach(),
        rejected_rewards=beta * terms.rejected_logratios.detach(),
    )
