"""Frozen auxiliary models (`lit_losses.models.frozen`): each source gives its model's log-probabilities
(against float64 log-softmax of that model's own logits), without gradient, in eval mode, outside the
optimizer and the checkpoint, on the policy's device and dtype."""

from __future__ import annotations

import lightning as L
import pytest
import torch

pytest.importorskip("peft")

from torch.utils.data import DataLoader
from transformers import AutoConfig, AutoModelForCausalLM

from lit_losses import HFCausalLM, TinyLM
from lit_losses.errors import ConfigError
from lit_losses.models.frozen import FrozenModel
from tests.models.hf_models import V, hf_config

LORA = {
    "r": 4,
    "lora_alpha": 8,
    "target_modules": ["q_proj", "v_proj"],
    "lora_dropout": 0.3,  # train mode would be random
    "init_lora_weights": False,  # random B: the adapters change the outputs
}


def reference_logprobs(lm, batch) -> torch.Tensor:
    """``log p(label)`` from the model's own full logits, float64, eval mode; 0 where unlabelled."""
    training = lm.training
    lm.eval()
    with torch.no_grad():
        logits = lm(input_ids=batch["input_ids"]).logits.double()
    lm.train(training)
    labels = batch["labels"]
    picked = torch.log_softmax(logits, -1).gather(-1, labels.clamp_min(0)[..., None])[..., 0]
    return picked.masked_fill(labels == -100, 0.0)


def token_batch(rows=3, length=9, seed=0) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, V, (rows, length), generator=g)
    labels = torch.cat([ids[:, 1:], torch.full((rows, 1), -100)], 1)
    labels[0, :3] = -100  # a prompt
    return {"input_ids": ids, "labels": labels}


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    """A tiny Llama with dropout (train mode would be random) saved with ``save_pretrained``."""
    torch.manual_seed(0)
    config = hf_config("llama", attention_dropout=0.3)
    model_type = config.pop("model_type")
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **config))
    path = tmp_path_factory.mktemp("base")
    model.save_pretrained(path)
    return str(path)


def test_disabled_adapters_give_the_base_models_logprobs_without_a_copy(base_dir):
    policy = HFCausalLM(model_name_or_path=base_dir, lora=LORA)
    policy.add_frozen_model("reference", "disabled_adapters", where="model.dpo.ref_model")
    policy.train()
    batch = token_batch()
    frozen = policy.frozen_model("reference")
    got = frozen.logprobs(batch, batch["labels"])

    base = AutoModelForCausalLM.from_pretrained(base_dir)
    expected = reference_logprobs(base, batch)
    torch.testing.assert_close(got.double(), expected, rtol=0, atol=2e-5)
    assert frozen.runner is policy and frozen.shared  # no second copy
    assert not got.requires_grad
    # afterwards the adapters are on again and every module is back in train mode
    assert all(m.training for m in policy.modules())
    adapted = reference_logprobs(policy.model, batch)
    assert (adapted - expected).abs().max() > 1e-2


def test_a_checkpoint_directory_and_the_initial_policy_give_their_models_logprobs(base_dir):
    policy = HFCausalLM(model_name_or_path=base_dir, lora=LORA)
    policy.add_frozen_model("hf", base_dir, where="model.teacher")
    policy.add_frozen_model("initial", "initial_policy", where="model.dpo.ref_model")
    batch = token_batch(seed=1)
    before = reference_logprobs(policy.model, batch)  # the policy with its adapters, as built
    initial = policy.frozen_model("initial")
    with torch.no_grad():  # the policy trains on; the copy keeps the weights it was built with
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.add_(0.5)
    torch.testing.assert_close(initial.logprobs(batch, batch["labels"]).double(), before, rtol=0, atol=2e-5)
    assert (reference_logprobs(policy.model, batch) - before).abs().max() > 1e-2
    hf = policy.frozen_model("hf").logprobs(batch, batch["labels"])
    expected = reference_logprobs(AutoModelForCausalLM.from_pretrained(base_dir), batch)
    torch.testing.assert_close(hf.double(), expected, rtol=0, atol=2e-5)


def tiny(**kwargs) -> TinyLM:
    return TinyLM(vocab_size=V, d_model=16, n_layers=1, n_heads=2, **kwargs)


def test_frozen_model_has_no_gradient_no_optimizer_state_no_checkpoint_keys_and_follows_the_dtype(tmp_path):
    torch.manual_seed(0)
    policy = tiny(optimizer={"warmup_steps": 0})
    plain_keys = set(policy.state_dict())
    policy.add_frozen_model("reference", "initial_policy", where="model.dpo.ref_model")
    batch = token_batch(rows=2, seed=2)
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        precision="64-true",
    )
    trainer.fit(policy, train_dataloaders=DataLoader([batch, batch], batch_size=None))
    frozen = policy.frozen_models["reference"]
    frozen_params = list(frozen.runner.parameters())
    assert frozen_params and all(not p.requires_grad and p.grad is None for p in frozen_params)
    assert not frozen.runner.training
    in_optimizer = {id(p) for group in trainer.optimizers[0].param_groups for p in group["params"]}
    assert in_optimizer == {id(p) for p in policy.parameters()}
    assert not in_optimizer & {id(p) for p in frozen_params}
    assert all(id(p) not in {id(q) for q in policy.parameters()} for p in frozen_params)
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    checkpoint = torch.load(tmp_path / "last.ckpt", weights_only=True)
    assert set(checkpoint["state_dict"]) == plain_keys
    # the policy trained in float64: the frozen copy follows it there, and kept the initial weights
    logprobs = policy.frozen_model("reference").logprobs(batch, batch["labels"])
    assert all(p.dtype == torch.float64 for p in frozen.runner.parameters())
    assert logprobs.dtype == torch.float64
    trained = policy.predict_step(batch, 0).detach()
    assert (logprobs - trained).abs().max() > 1e-4


def test_a_regularizedlm_checkpoint_file_is_its_trained_model(tmp_path):
    torch.manual_seed(0)
    trained = tiny(optimizer={"warmup_steps": 0, "lr": 0.05})
    batch = token_batch(rows=2, seed=3)
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(trained, train_dataloaders=DataLoader([batch, batch], batch_size=None))
    trainer.save_checkpoint(tmp_path / "sft.ckpt")
    policy = tiny()
    policy.add_frozen_model("reference", str(tmp_path / "sft.ckpt"), where="model.dpo.ref_model")
    got = policy.frozen_model("reference").logprobs(batch, batch["labels"])
    torch.testing.assert_close(got, trained.predict_step(batch, 0).detach(), rtol=0, atol=1e-6)
    assert (got - policy.predict_step(batch, 0).detach()).abs().max() > 1e-3  # not the new policy


def test_sources_that_cannot_be_loaded_are_refused_naming_the_option(tmp_path):
    policy = tiny()
    (tmp_path / "empty").mkdir()
    (tmp_path / "junk.ckpt").write_text("not a checkpoint")
    cases = {
        "no/such/dir": "model.x.ref_model='no/such/dir': no such file or directory",
        str(tmp_path / "empty"): "is a directory without config.json",
        7: "must be a path, a transformers config dict",
    }
    for source, message in cases.items():
        with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
            policy.add_frozen_model("reference", source, where="model.x.ref_model")
    with pytest.raises(ConfigError, match="a config dict needs model_type"):
        policy.add_frozen_model("reference", {"hidden_size": 8}, where="model.x.ref_model")
    policy.add_frozen_model("reference", "disabled_adapters", where="model.x.ref_model")
    with pytest.raises(ConfigError, match="'disabled_adapters': TinyLM has no PEFT adapters"):
        policy.frozen_model("reference")
    policy.add_frozen_model("junk", str(tmp_path / "junk.ckpt"), where="model.x.teacher")
    with pytest.raises(ConfigError, match=r"model.x.teacher=.*junk.ckpt' is not a readable checkpoint"):
        policy.frozen_model("junk")
    policy.add_frozen_model("lama", {"model_type": "lama"}, where="model.x.teacher")
    with pytest.raises(ConfigError, match="'lama' is not a transformers model type; did you mean 'llama'"):
        policy.frozen_model("lama")


def test_a_config_source_runs_in_eval_mode_with_the_policy_in_train_mode():
    policy = tiny()
    config = hf_config("llama", attention_dropout=0.5)
    policy.add_frozen_model("teacher", config, where="model.distillation.teacher")
    policy.train()
    batch = token_batch(seed=4)
    teacher = policy.frozen_model("teacher")
    first = teacher.logprobs(batch, batch["labels"])
    assert isinstance(teacher, FrozenModel) and teacher.source == "config(model_type='llama')"
    torch.testing.assert_close(first, teacher.logprobs(batch, batch["labels"]), rtol=0, atol=0)
    expected = reference_logprobs(teacher.runner.lm, batch)
    torch.testing.assert_close(first.double(), expected, rtol=0, atol=2e-5)
    hidden = teacher.hidden_states(batch)
    weight, bias = teacher.output_projection()
    assert hidden.shape == (*batch["input_ids"].shape, 32) and weight.shape == (V, 32) and bias is None
    assert not hidden.requires_grad and not weight.requires_grad
