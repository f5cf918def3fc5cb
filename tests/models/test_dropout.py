"""``HFCausalLM(disable_dropout=True)``: TRL's ``disable_dropout`` (its own function is the reference)."""

from __future__ import annotations

import copy

import pytest
import torch
from trl.trainer.utils import disable_dropout_in_model

from lit_losses import HFCausalLM
from lit_losses.errors import ConfigError
from tests.models.hf_models import batch_of, hf_config, next_token

GPT2 = hf_config("gpt2", resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)  # every dropout module active


def train_losses(model: HFCausalLM, batch: dict, times: int = 2) -> list[float]:
    model.train()
    return [float(model.compute_loss(batch).total) for _ in range(times)]


def test_disable_dropout_zeroes_what_trl_zeroes_and_training_is_deterministic():
    torch.manual_seed(0)
    ours = HFCausalLM(config=GPT2, disable_dropout=True)
    torch.manual_seed(0)
    kept = HFCausalLM(config=GPT2)
    trl = copy.deepcopy(kept.model)
    disable_dropout_in_model(trl)  # TRL's own function on the same model
    p_ours = {n: m.p for n, m in ours.model.named_modules() if isinstance(m, torch.nn.Dropout)}
    p_trl = {n: m.p for n, m in trl.named_modules() if isinstance(m, torch.nn.Dropout)}
    assert p_ours == p_trl and set(p_ours.values()) == {0.0} and len(p_ours) >= 4

    batch = batch_of()
    batch["labels"] = next_token(batch["labels"])
    first, second = train_losses(ours, batch)
    ours.eval()
    assert first == second == pytest.approx(float(ours.compute_loss(batch).total), abs=0)
    noisy = train_losses(kept, batch)  # the default keeps the config's dropout: two draws differ
    assert noisy[0] != noisy[1]


def test_trl_s_disable_dropout_field_in_a_preset_points_to_the_model_option():
    with pytest.raises(ConfigError, match=r"disable_dropout.*model\.init_args\.disable_dropout here"):
        HFCausalLM(config=GPT2, dpo={"beta": 0.1, "disable_dropout": True})


def test_a_checkpoint_from_before_the_option_resumes_at_its_default_and_not_at_another():
    from lit_losses.checkpoint.resume import option_changes

    saved = {"config": GPT2, "label_format": "next_token"}  # written before disable_dropout existed
    assert option_changes(saved, {**saved, "disable_dropout": False}, model_class=HFCausalLM) == []
    (change,) = option_changes(saved, {**saved, "disable_dropout": True}, model_class=HFCausalLM)
    assert str(change) == "model.init_args.disable_dropout: added (True)" and not change.changeable
