"""``model.cpo`` (CPO, SimPO, AlphaPO) and ``model.orpo`` against TRL's own ``CPOTrainer`` and
``ORPOTrainer`` (``trl.experimental``, 1.16): on the token ids of the trainer's collated batch and the same
float64 weights, `HFCausalLM` with the ``CPOConfig``/``ORPOConfig`` fields a TRL user writes gives
``trainer.compute_loss``'s loss, every parameter's gradient and the metrics TRL logs, for every loss type
and option ``model.cpo`` accepts. The ``model.kto``/``cpo``/``orpo`` fields are those of TRL's configs,
with their defaults; the configs' other fields are refused."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch
from transformers import TrainingArguments
from trl import KTOConfig
from trl.experimental.cpo import CPOConfig, CPOTrainer
from trl.experimental.orpo import ORPOConfig, ORPOTrainer

from lit_losses import ConfigError, CPOPreset, KTOPreset, ORPOPreset, PreferenceDataModule, cpo_loss
from lit_losses.trl_fields import TRL_FIELDS
from tests.objectives.peer_trainers import (
    PAIRED,
    TOKENIZER,
    assert_same_grads,
    first_batch,
    our_loss,
    our_module,
    paired_batch,
    tiny_llama,
    tokenizer,
    trl_loss,
    trl_trainer,
)

CPO_CASES = {
    "sigmoid-smoothing": {"loss_type": "sigmoid", "beta": 0.2, "label_smoothing": 0.1},
    "sigmoid-alpha": {"loss_type": "sigmoid", "beta": 0.1, "alpha": 0.05, "cpo_alpha": 0.5},
    "hinge-alpha": {"loss_type": "hinge", "beta": 0.3, "cpo_alpha": 0.7, "alpha": 0.1},
    "ipo": {"loss_type": "ipo", "beta": 0.4},
    "ipo-alpha": {"loss_type": "ipo", "beta": 0.4, "alpha": -0.3, "cpo_alpha": 0.0},
    "simpo": {
        "loss_type": "simpo",
        "beta": 2.0,
        "simpo_gamma": 0.7,
        "cpo_alpha": 0.0,
        "label_smoothing": 0.05,
    },
    "cpo-simpo": {"loss_type": "simpo", "beta": 1.5, "cpo_alpha": 0.3},
    "alphapo": {"loss_type": "alphapo", "beta": 2.5, "alpha": 0.4, "simpo_gamma": 0.6},
}
NOT_LOGGED = {"logits/chosen", "logits/rejected"}
"""TRL's metrics that `model.cpo`/`model.orpo` do not log: means over every position of the materialized
logits (padding included), which the fused head never forms."""


@pytest.fixture(scope="module")
def policy():
    tok = tokenizer()
    return tiny_llama(len(tok), tok.pad_token_id, seed=1)


def run(trainer_cls, config_cls, fields, policy, out_dir):
    """TRL's loss, gradients and metrics on its first batch, and our batch of the same token ids."""
    trainer = trl_trainer(
        trainer_cls, config_cls, records=PAIRED, model=copy.deepcopy(policy), out_dir=out_dir, **fields
    )
    batch = first_batch(trainer)
    return trl_loss(trainer, batch), paired_batch(batch)


def check(ours, theirs, rtol: float, atol: float) -> None:
    """Loss, gradients and metrics (each one TRL logs, but the logits' means) agree."""
    (loss, grads, logged), (our_total, our_grads, metrics) = theirs, ours
    torch.testing.assert_close(our_total, loss, rtol=rtol, atol=atol)
    assert_same_grads(our_grads, grads, rtol=rtol, atol=atol)
    assert set(logged) - set(metrics) == NOT_LOGGED and set(metrics) <= set(logged)
    for key, value in metrics.items():
        tolerance = 1e-7 if key == "rewards/accuracies" else atol  # TRL's fraction is a float32 mean
        assert value == pytest.approx(logged[key], rel=rtol, abs=tolerance), key


@pytest.mark.parametrize("name", list(CPO_CASES))
def test_cpo_gives_trls_loss_gradients_and_metrics(name, policy, tmp_path):
    fields = CPO_CASES[name]
    theirs, batch = run(CPOTrainer, CPOConfig, fields, policy, tmp_path)
    ours = our_loss(our_module(policy, cpo=fields), batch)
    check(ours, theirs, rtol=1e-9, atol=1e-12)  # float64 on both sides: TRL materializes the logits
    if fields.get("cpo_alpha", 1.0) != 0 and fields["loss_type"] != "alphapo":
        assert theirs[2]["nll_loss"] > 1  # the NLL term is in the loss


def test_orpo_gives_trls_loss_gradients_and_metrics(policy, tmp_path):
    theirs, batch = run(ORPOTrainer, ORPOConfig, {"beta": 0.25}, policy, tmp_path)
    ours = our_loss(our_module(policy, orpo={"beta": 0.25}), batch)
    check(ours, theirs, rtol=1e-6, atol=1e-7)  # TRL casts the log-probabilities to float32 for the odds


@pytest.mark.parametrize(
    ("trainer", "fields"),
    [("orpo", {"beta": 0.25}), ("cpo", CPO_CASES["cpo-simpo"])],
)
def test_the_data_module_gives_trls_batch(trainer, fields, policy, tmp_path):
    """`PreferenceDataModule` (the CLI's) on the same records as JSONL, one micro-batch: TRL's rows (row
    order aside), hence TRL's loss and gradients (ORPO's NLL over prompt and completion tokens included)."""
    classes = {"orpo": (ORPOTrainer, ORPOConfig), "cpo": (CPOTrainer, CPOConfig)}[trainer]
    (loss, grads, _), _ = run(*classes, fields, policy, tmp_path)
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(record) + "\n" for record in PAIRED))
    data = PreferenceDataModule(paths=[str(path)], tokenizer=str(TOKENIZER), tokens_per_batch=4096)
    data.setup("fit")
    assert len(data.train_set) == 1
    ours, our_grads, _ = our_loss(our_module(policy, **{trainer: fields}), data.train_set[0])
    torch.testing.assert_close(ours, loss, rtol=1e-6, atol=1e-7)
    assert_same_grads(our_grads, grads, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    ("preset", "config"),
    [(KTOPreset, KTOConfig), (CPOPreset, CPOConfig), (ORPOPreset, ORPOConfig)],
    ids=["kto", "cpo", "orpo"],
)
def test_the_presets_take_trls_loss_fields_with_trls_defaults_and_refuse_the_others(preset, config):
    """Each preset field is a field of TRL's config with TRL's default (CPO's ``cpo_alpha``: ``None``
    stands for TRL's 1, or 0 for ``alphapo``); every other field TRL's config adds to
    ``TrainingArguments`` is refused with one error naming it (and where it is set here, if anywhere)."""
    trl_fields = {f.name: f for f in dataclasses.fields(config)}
    ours = preset()
    for field in dataclasses.fields(preset):
        assert field.name in trl_fields, field.name
        default = getattr(ours, field.name)
        if (preset, field.name) == (CPOPreset, "cpo_alpha"):
            default = ours.nll_weight
        assert default == trl_fields[field.name].default, field.name
    own = {name for name in trl_fields} - {f.name for f in dataclasses.fields(TrainingArguments)}
    for name in sorted(own - {f.name for f in dataclasses.fields(preset)}):
        with pytest.raises(ConfigError) as info:
            preset.coerce({name: 1})
        message = str(info.value)
        assert message.startswith(f"{preset.where}.{name}: not a field of {preset.where}"), message
        if name in TRL_FIELDS:
            assert f"TRL's {name} {TRL_FIELDS[name]}" in message


def test_alphapo_on_long_sums_is_finite_where_trls_underflows(policy, tmp_path):
    """AlphaPO's reward ``(1 − p^{−a}) / a`` of a summed log-probability ``π = −200`` in float32: TRL forms
    ``p = e^π``, which underflows to 0 (an infinite reward, a NaN loss); `cpo_loss` gets the float64 value
    from ``expm1`` without forming ``p``."""
    fields = {"loss_type": "sigmoid", "beta": 0.1, "alpha": 0.05, "cpo_alpha": 0.0}
    trainer = trl_trainer(
        CPOTrainer, CPOConfig, records=PAIRED, model=copy.deepcopy(policy), out_dir=tmp_path, **fields
    )
    chosen, rejected = torch.tensor([-200.0]), torch.tensor([-210.0])
    theirs, _, _ = trainer.cpo_loss(chosen, rejected)
    assert not torch.isfinite(theirs).all()
    ours = cpo_loss(chosen, rejected, **{k: v for k, v in fields.items() if k != "loss_type"})
    rewards = (1 - torch.exp(-0.05 * torch.cat([chosen, rejected]).double())) / 0.05
    expected = -torch.nn.functional.logsigmoid(0.1 * (rewards[:1] - rewards[1:]))
    torch.testing.assert_close(ours.losses.double(), expected, rtol=1e-6, atol=0)
