"""``model.dpo`` against TRL's own ``DPOTrainer.compute_loss`` (TRL 1.16, `trl_dpo`): on one micro-batch of
TRL's data pipeline and the same weights, ``HFCausalLM.compute_loss`` gives TRL's loss, the gradient of
every trainable parameter (full fine-tuning and LoRA) and the metrics TRL logs under the same names, for
every ``loss_type``, several at once with ``loss_weights``, and the options ``beta``, ``label_smoothing``,
``discopop_tau``, ``f_divergence_type``/``f_alpha_divergence_coef``, ``ld_alpha``, ``use_weighting``,
``precompute_ref_log_probs`` and ``reference_free`` (TRL: its precomputed path with zero references).

TRL's fused head accumulates the softmax statistics in float32 whatever the model's dtype; the models are
float64 here (float32 in `test_float32_models_are_trl_s_float32_step`), so the agreement is to float32
precision: about 1e-7 relative in the loss, where a wrong constant in f-DPO's scores made 1e-3. The
configurations TRL refuses are refused here; those TRL takes and this package refuses are listed with the
reason (`TAKEN_BY_TRL_ONLY`). The hand-written float64 copy of TRL's loss (`preference_reference.trl_dpo`,
the reference of `test_preference_dpo`) is held to TRL's own loss on every case too.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from typing import get_args

import pytest
import torch
from trl import DPOConfig

from lit_losses import ConfigError, DPOPreset
from lit_losses.objectives import DPOLossType
from lit_losses.objectives.preference_dpo import F_DIVERGENCE_TYPES
from tests.objectives import preference_reference, trl_dpo

pytestmark = pytest.mark.filterwarnings(  # transformers' renaming, raised inside TRL's trainer
    "ignore:`(is_)?gradient_checkpointing` is deprecated:FutureWarning"
)

LS = {"exo_pair": 1e-3, "robust": 0.1, "aot": 0.2}
CASES: dict[str, dict] = {
    name: {"loss_type": [name], "beta": 0.3, **({"label_smoothing": LS[name]} if name in LS else {})}
    for name in get_args(DPOLossType)
}
CASES |= {
    "sigmoid-beta1.5": {"loss_type": ["sigmoid"], "beta": 1.5},
    "exo_pair-ls0.2": {"loss_type": ["exo_pair"], "label_smoothing": 0.2},
    "discopop-tau0.2": {"loss_type": ["discopop"], "discopop_tau": 0.2, "beta": 0.5},
    "ipo-js": {"loss_type": ["ipo"], "f_divergence_type": "js_divergence"},
    "sigmoid_norm-forward_kl": {"loss_type": ["sigmoid_norm"], "f_divergence_type": "forward_kl"},
    "sigmoid_norm-alpha0.3": {
        "loss_type": ["sigmoid_norm"],
        "f_divergence_type": "alpha_divergence",
        "f_alpha_divergence_coef": 0.3,
    },
    "sigmoid-alpha1.5": {
        "loss_type": ["sigmoid"],
        "f_divergence_type": "alpha_divergence",
        "f_alpha_divergence_coef": 1.5,
    },
    "hinge+exo+robust+discopop-js": {
        "loss_type": ["hinge", "exo_pair", "robust", "discopop"],
        "label_smoothing": 0.05,
        "f_divergence_type": "js_divergence",
    },
    "sigmoid+sft-forward_kl": {"loss_type": ["sigmoid", "sft"], "f_divergence_type": "forward_kl"},
    "sigmoid-ld0.5": {"loss_type": ["sigmoid"], "ld_alpha": 0.5},
    "ipo-ld0": {"loss_type": ["ipo"], "ld_alpha": 0.0},
    "aot-ld0.3": {"loss_type": ["aot"], "ld_alpha": 0.3},
    "mpo": {"loss_type": ["sigmoid", "bco_pair", "sft"], "loss_weights": [0.8, 0.2, 1.0]},
    "rpo": {"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, 0.3], "ld_alpha": 0.5},
    "wpo-sigmoid": {"loss_type": ["sigmoid"], "use_weighting": True, "beta": 0.5},
    "wpo-ipo+sigmoid_norm-ld": {"loss_type": ["ipo", "sigmoid_norm"], "use_weighting": True, "ld_alpha": 0.5},
    "precomputed": {"loss_type": ["sigmoid"], "precompute_ref_log_probs": True},
    "precomputed-ld-robust": {
        "loss_type": ["robust"],
        "label_smoothing": 0.1,
        "precompute_ref_log_probs": True,
        "ld_alpha": 0.5,
    },
}
LORA_CASES = {
    "lora-sigmoid": {"loss_type": ["sigmoid"]},
    "lora-wpo-mpo": {"loss_type": ["sigmoid", "bco_pair"], "loss_weights": [1.0, 0.5], "use_weighting": True},
}
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins")
METRICS += ("logps/chosen", "logps/rejected")


@pytest.fixture(scope="module")
def weights() -> Iterator[trl_dpo.Weights]:
    """The models' weights; one thread for these tiny models (the threads' overhead is most of a step)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield trl_dpo.Weights()
    torch.set_num_threads(threads)


def assert_float32_close(ours: torch.Tensor, theirs: torch.Tensor, name: str, rel: float = 1e-4) -> None:
    """Within ``rel`` of the largest entry of TRL's value (float32 arithmetic in TRL's head)."""
    theirs = theirs.to(ours.dtype)
    error = float((ours - theirs).abs().max())
    scale = float(theirs.abs().max())
    assert error <= rel * scale + 1e-9, f"{name}: |ours − TRL| = {error:.3e}, |TRL| = {scale:.3e}"


def compare(theirs: tuple, ours: tuple, grad_rel: float = 1e-4) -> None:
    """The loss, every trainable parameter's gradient and TRL's reward and log-probability metrics."""
    (loss, grads, metrics), (our_loss, our_grads, our_metrics) = theirs, ours
    torch.testing.assert_close(our_loss, loss.to(our_loss.dtype), rtol=1e-5, atol=1e-6)
    assert sorted(our_grads) == sorted(grads)
    for name, grad in grads.items():
        assert_float32_close(our_grads[name], grad, name, rel=grad_rel)
    for name in METRICS:  # rewards are β·(π − ρ) of sums near −60: a float32 difference of sums
        assert our_metrics[name] == pytest.approx(metrics[name], rel=1e-5, abs=2e-5), name


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_loss_gradients_and_metrics_are_trl_s_dpo_trainer_s(weights, name):
    fields = CASES[name]
    trainer = trl_dpo.trl_trainer(weights, **fields)
    batch = trl_dpo.trl_batch(trainer)
    model = trl_dpo.lit_model(weights, fields)
    grad_rel = 1e-3 if name == "discopop" else 1e-4  # its τ = 0.05 magnifies float32 errors 20 times
    theirs = trl_dpo.trl_step(trainer, batch)
    compare(theirs, trl_dpo.lit_step(model, trl_dpo.lit_batch(batch)), grad_rel=grad_rel)
    hand_copy = hand_written_reference(weights, fields, batch)  # the float64 tests' reference
    torch.testing.assert_close(hand_copy, theirs[0].double(), rtol=1e-5, atol=1e-6)


def hand_written_reference(weights, fields: dict, batch: dict) -> torch.Tensor:
    """`preference_reference.trl_dpo` (TRL's loss written again, float64 from full logits) on the batch:
    it must stay TRL's current loss, since `test_preference_dpo` checks ``dpo_loss`` against it to 1e-10."""
    cfg = {key: value for key, value in fields.items() if key != "precompute_ref_log_probs"}
    ids, completion = batch["input_ids"], batch["completion_mask"]
    with torch.no_grad():
        logits = weights.model("policy")(input_ids=ids, attention_mask=batch["attention_mask"]).logits
        ref_logits = weights.model("reference")(input_ids=ids, attention_mask=batch["attention_mask"]).logits
    refs = None
    if fields.get("precompute_ref_log_probs"):
        refs = (batch["ref_chosen_logps"].double(), batch["ref_rejected_logps"].double())
    loss, _ = preference_reference.trl_dpo(logits, ref_logits, ids, completion, cfg, ref_logps=refs)
    return loss


def test_wpo_with_hinge_is_trl_s_forward_loss(weights):
    """TRL multiplies ``relu``'s output by the WPO weights in place, so its backward fails for ``hinge``
    with ``use_weighting`` (``RuntimeError``: modified by an inplace operation); its forward is the
    reference for the loss and the metrics, our gradient is that of the same formula."""
    fields = {"loss_type": ["hinge"], "use_weighting": True, "beta": 0.3}
    trainer = trl_dpo.trl_trainer(weights, **fields)
    batch = trl_dpo.trl_batch(trainer)
    trainer._metrics["train"].clear()
    with torch.no_grad():
        loss = trainer.compute_loss(trainer.model.train(), batch)
    metrics = {name: values[-1] for name, values in trainer._metrics["train"].items()}
    our_loss, _, our_metrics = trl_dpo.lit_step(trl_dpo.lit_model(weights, fields), trl_dpo.lit_batch(batch))
    torch.testing.assert_close(our_loss, loss.to(our_loss.dtype), rtol=1e-5, atol=1e-6)
    for name in METRICS:
        assert our_metrics[name] == pytest.approx(metrics[name], rel=1e-5, abs=2e-5), name


@pytest.mark.parametrize("name", ["mpo", "sigmoid_norm-alpha0.3", "wpo-sigmoid"])
def test_float32_models_are_trl_s_float32_step(weights, name):
    fields = CASES[name]
    trainer = trl_dpo.trl_trainer(weights, dtype=torch.float32, **fields)
    batch = trl_dpo.trl_batch(trainer)
    model = trl_dpo.lit_model(weights, fields, dtype=torch.float32)
    theirs = trl_dpo.trl_step(trainer, batch)
    compare(theirs, trl_dpo.lit_step(model, trl_dpo.lit_batch(batch)), grad_rel=1e-4)


@pytest.mark.parametrize("name", sorted(LORA_CASES))
def test_a_lora_policy_against_its_disabled_adapters_is_trl_s_peft_dpo(weights, name):
    fields = LORA_CASES[name]
    trainer = trl_dpo.trl_trainer(weights, lora=True, **fields)
    batch = trl_dpo.trl_batch(trainer)
    model = trl_dpo.lit_model(weights, fields, lora=True)
    trl_dpo.same_lora_weights(trainer, model)  # B ≠ 0: the policy is not its reference
    theirs = trl_dpo.trl_step(trainer, batch)
    assert theirs[1] and all("lora_" in name for name in theirs[1])
    assert abs(theirs[2]["rewards/margins"]) > 1e-3
    compare(theirs, trl_dpo.lit_step(model, trl_dpo.lit_batch(batch)))


def test_reference_free_is_trl_s_loss_with_zero_reference_log_probabilities(weights):
    """TRL 1.16 has no ``reference_free``; its precomputed path with ``ρ = 0`` is the same loss."""
    fields = {"loss_type": ["sigmoid", "apo_zero"], "beta": 0.05}
    trainer = trl_dpo.trl_trainer(weights, precompute_ref_log_probs=True, **fields)
    batch = trl_dpo.trl_batch(trainer)
    batch["ref_chosen_logps"] = torch.zeros_like(batch["ref_chosen_logps"])
    batch["ref_rejected_logps"] = torch.zeros_like(batch["ref_rejected_logps"])
    model = trl_dpo.lit_model(weights, {**fields, "reference_free": True})
    ours = {k: v for k, v in trl_dpo.lit_batch(batch).items() if not k.startswith("ref_")}
    compare(trl_dpo.trl_step(trainer, batch), trl_dpo.lit_step(model, ours))


REFUSED_BY_BOTH = {
    "f-DPO with a type that has no f-divergence form": (
        {"loss_type": ["sigmoid", "nca_pair"], "f_divergence_type": "js_divergence"},
        "f_divergence_type='js_divergence' applies only to loss types",
    ),
    "f-DPO with bco_pair": (
        {"loss_type": ["bco_pair"], "f_divergence_type": "forward_kl"},
        "has no f-divergence form",
    ),
    "WPO with aot": ({"loss_type": ["aot"], "use_weighting": True}, "WPO weights do not apply"),
    "exo_pair without smoothing": ({"loss_type": ["exo_pair"]}, "label_smoothing must be > 0"),
    "loss_weights of another length": (
        {"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0]},
        "loss_weights=[1.0]: one finite weight per loss type",
    ),
}


@pytest.mark.parametrize("name", sorted(REFUSED_BY_BOTH))
def test_what_trl_refuses_is_refused_before_training(weights, name):
    fields, message = REFUSED_BY_BOTH[name]
    with pytest.raises((ValueError, NotImplementedError)):
        trl_dpo.trl_trainer(weights, **fields)
    with pytest.raises(ConfigError, match=re.escape(message)):
        DPOPreset(**fields)


TAKEN_BY_TRL_ONLY = {
    # TRL's value is (mean of the pairs' weights) × (the token mean of the NLL): a product of two
    # micro-batch means, not a mean over pairs, so no global (split-independent) value exists.
    "WPO with sft": ({"loss_type": ["sigmoid", "sft"], "use_weighting": True}, "use_weighting is set"),
    # The fields below are read by no loss type given: TRL ignores them, this package names them.
    "f-DPO with sft alone": (
        {"loss_type": ["sft"], "f_divergence_type": "js_divergence"},
        "f_divergence_type is set but loss_type ('sft',) reads no f-divergence scores",
    ),
    "label_smoothing with hinge": (
        {"loss_type": ["hinge"], "label_smoothing": 0.1},
        "label_smoothing is set but loss_type ('hinge',) does not read it",
    ),
    "discopop_tau with sigmoid": ({"discopop_tau": 0.1}, "discopop_tau is set but"),
    "f_alpha_divergence_coef without alpha_divergence": (
        {"f_alpha_divergence_coef": 0.3},
        "only f_divergence_type 'alpha_divergence' reads it",
    ),
    # TRL only warns: the Robust DPO loss divides by 1 − 2ε.
    "robust with label_smoothing 0.5": (
        {"loss_type": ["robust"], "label_smoothing": 0.5},
        "label_smoothing must lie in [0, 0.5)",
    ),
}


@pytest.mark.parametrize("name", sorted(TAKEN_BY_TRL_ONLY))
def test_what_trl_takes_and_this_package_refuses_is_one_named_error(weights, name):
    fields, message = TAKEN_BY_TRL_ONLY[name]
    trl_dpo.trl_trainer(weights, **fields)  # TRL builds its trainer
    with pytest.raises(ConfigError, match=re.escape(message)):
        DPOPreset(**fields)


def quoted(text: str) -> set[str]:
    return set(re.findall(r"`'([a-z_]+)'`", text))


def test_the_loss_types_and_fields_are_trl_s():
    """Every ``DPOConfig.loss_type`` and every ``model.dpo`` field but ``reference_free`` (removed from
    ``DPOConfig`` by TRL's DPO refactor) is TRL's, and f-DPO applies to TRL's list of types."""
    trl_fields = {f.name: f for f in dataclasses.fields(DPOConfig)}
    help_of = {name: field.metadata.get("help", "") for name, field in trl_fields.items()}
    assert quoted(help_of["loss_type"]) == set(get_args(DPOLossType))
    f_help = help_of["f_divergence_type"].split("support a non-default value")[1].split(".")[0]
    assert quoted(f_help) == set(F_DIVERGENCE_TYPES)
    ours = {f.name for f in dataclasses.fields(DPOPreset)}
    assert ours - set(trl_fields) == {"reference_free"}
    assert DPOPreset().loss_types == tuple(trl_fields["loss_type"].default_factory())
    for name in ours - {"reference_free", "loss_type"}:
        assert getattr(DPOPreset(), name) == trl_fields[name].default, name


NOT_MAPPED = {"model_init_kwargs", "trust_remote_code", "router_aux_loss_coef", "dataset_num_proc"}
NOT_MAPPED |= {"activation_offloading", "pad_token"}  # model loading, MoE, preprocessing, deprecated


def test_a_dpo_config_field_that_is_no_loss_field_says_where_it_went():
    """``model.dpo.<field>`` for a field of ``DPOConfig`` (not of ``TrainingArguments``) that is not a
    loss field here: one error with the hint of `lit_losses.trl_fields` (where to set it, or why it has
    no counterpart)."""
    from transformers import TrainingArguments

    own = {f.name for f in dataclasses.fields(DPOConfig)} - {
        f.name for f in dataclasses.fields(TrainingArguments)
    }
    others = own - {f.name for f in dataclasses.fields(DPOPreset)} - NOT_MAPPED
    assert {"truncation_mode", "disable_dropout", "sync_ref_model", "max_length"} <= others
    for name in sorted(others):
        with pytest.raises(
            ConfigError, match=rf"model\.dpo\.{name}: not a field of model\.dpo; TRL's {name} "
        ):
            DPOPreset.coerce({name: 1})
