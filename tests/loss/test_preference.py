"""The preference loss path of `RegularizedLM` (``model.dpo``/``cpo``/``orpo`` with ``model.ref_model``):
against a float64 computation from materialized logits, with the reference computed on the fly or given in
the batch; the frozen reference outside the optimizer and the checkpoint; no ``[tokens × V]`` tensor in a
DPO step; the configuration and batch errors that belong to the module."""

from __future__ import annotations

import copy
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from lit_losses import GlobalStatsLoader, TinyLM
from lit_losses.errors import BatchKeyError, ConfigError
from lit_losses.loss.preference import PreferenceLoss, check_preference_data
from lit_losses.objectives import DPOPreset
from tests.loss.preference_ddp_worker import VOCAB, micro_batches, whole_batch

pytest.importorskip("peft")


def tiny(**kwargs) -> TinyLM:
    """The same float64 TinyLM at every call (seeded)."""
    torch.manual_seed(0)
    return TinyLM(vocab_size=VOCAB, d_model=16, n_layers=1, n_heads=2, **kwargs).double()


def naive_sequence_logps(model, batch) -> torch.Tensor:
    """Each row's sum of ``log softmax(logits)[label]`` over its completion tokens, from full logits."""
    logits = F.linear(model.forward_hidden(batch), model.output_projection()[0]).double()
    labels = batch["labels"]
    picked = torch.log_softmax(logits, -1).gather(-1, labels.clamp_min(0)[..., None])[..., 0]
    return torch.where(labels != -100, picked, 0.0).sum(-1)


def perturb(*models, seed: int = 1, scale: float = 0.3) -> None:
    """The same random change of every model's weights (the policy after some training)."""
    for model in models:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(scale * torch.randn(p.shape, generator=g, dtype=p.dtype))


def loss_and_grads(model, batch) -> tuple[torch.Tensor, dict]:
    model.zero_grad()
    loss = model.compute_loss(batch).total
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_a_reference_on_the_fly_equals_the_precomputed_one_and_the_full_logits_loss(loss_type):
    batch = whole_batch()
    pairs = batch["labels"].shape[0] // 2
    preset = {"loss_type": loss_type, "beta": 0.3}
    on_the_fly = tiny(dpo=preset)
    on_the_fly.reference_model()  # the copy of the initial policy is taken here
    with torch.no_grad():
        ref = naive_sequence_logps(tiny(), batch)  # the initial weights, float64, full logits
    precomputed = tiny(dpo={**preset, "precompute_ref_log_probs": True})
    given = {**batch, "ref_chosen_logps": ref[:pairs], "ref_rejected_logps": ref[pairs:]}
    naive = tiny()
    perturb(on_the_fly, precomputed, naive)

    loss, grads = loss_and_grads(on_the_fly, batch)
    loss_given, grads_given = loss_and_grads(precomputed, given)
    policy = naive_sequence_logps(naive, batch)
    ratios = policy - ref
    lengths = (batch["labels"] != -100).sum(-1).double()
    if loss_type == "sigmoid":
        expected = -F.logsigmoid(0.3 * (ratios[:pairs] - ratios[pairs:])).mean()
    else:  # IPO: per-token log-ratios, target margin 1 / (2β)
        norm = ratios / lengths
        expected = ((norm[:pairs] - norm[pairs:] - 1 / (2 * 0.3)) ** 2).mean()
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(loss_given, loss, rtol=1e-12, atol=1e-12)
    for name, p in naive.named_parameters():
        assert p.grad.abs().max() > 0, name
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-10, atol=1e-12, msg=name)
        torch.testing.assert_close(grads_given[name], p.grad, rtol=1e-10, atol=1e-12, msg=name)


def test_the_telemetry_is_trls_metrics_over_all_pairs():
    batch = whole_batch()
    pairs = batch["labels"].shape[0] // 2
    model = tiny(dpo={"beta": 0.5})
    model.reference_model()
    naive = tiny()
    perturb(model, naive)
    out = model.compute_loss(batch)
    with torch.no_grad():
        ref, policy = naive_sequence_logps(tiny(), batch), naive_sequence_logps(naive, batch)
    chosen, rejected = 0.5 * (policy - ref)[:pairs], 0.5 * (policy - ref)[pairs:]
    expected = {
        "rewards/chosen": chosen.mean(),
        "rewards/rejected": rejected.mean(),
        "rewards/accuracies": (chosen > rejected).double().mean(),
        "rewards/margins": (chosen - rejected).mean(),
        "logps/chosen": policy[:pairs].mean(),
        "logps/rejected": policy[pairs:].mean(),
    }
    assert 0 < float(expected["rewards/accuracies"]) < 1
    assert set(out.metrics) == set(expected)
    for name, value in expected.items():
        torch.testing.assert_close(out.metrics[name], value, rtol=1e-10, atol=1e-12, msg=name)
    assert set(out.logged_values("train")) >= {f"train/{name}" for name in expected}


def test_a_lora_policy_starts_at_its_reference_the_base_with_adapters_disabled():
    from lit_losses import HFCausalLM
    from tests.models.hf_models import hf_config

    torch.manual_seed(0)
    lora = {"r": 4, "target_modules": ["v_proj", "up_proj", "down_proj"]}
    model = HFCausalLM(config=hf_config("llama", vocab_size=VOCAB), lora=lora, dpo={"beta": 0.1})
    batch = whole_batch()
    out = model.compute_loss(batch)  # adapters start at B = 0: the policy is its reference
    torch.testing.assert_close(out.total, torch.tensor(2.0).log(), rtol=0, atol=1e-6)
    assert float(out.metrics["rewards/margins"].abs()) < 1e-6
    assert model.frozen_models["reference"].runner is model  # no second copy
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 1.0)
    trained = model.compute_loss(batch)  # the reference stays the base model: β (mean π − mean ρ)
    moved = trained.metrics["logps/chosen"] - out.metrics["logps/chosen"]
    assert abs(float(moved)) > 1e-3
    torch.testing.assert_close(trained.metrics["rewards/chosen"], 0.1 * moved, rtol=1e-4, atol=1e-6)
    _, grads = loss_and_grads(model, batch)
    assert grads and all("lora_" in n for n, p in model.named_parameters() if p.requires_grad)
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)


def test_a_fit_keeps_the_reference_out_of_the_optimizer_and_the_checkpoint(tmp_path):
    model = tiny(dpo={"beta": 0.2}, optimizer={"warmup_steps": 0})
    plain_keys = set(tiny().state_dict())
    trainer = L.Trainer(
        accelerator="cpu",
        precision="64-true",
        max_steps=2,
        accumulate_grad_batches=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(model, GlobalStatsLoader(micro_batches(), batch_size=None))
    reference = model.frozen_models["reference"]
    frozen = list(reference.runner.parameters())
    assert reference.source == "initial_policy" and frozen
    assert all(not p.requires_grad and p.grad is None for p in frozen)
    in_optimizer = {id(p) for group in trainer.optimizers[0].param_groups for p in group["params"]}
    assert in_optimizer == {id(p) for p in model.parameters()} and not in_optimizer & {id(p) for p in frozen}
    trainer.save_checkpoint(tmp_path / "dpo.ckpt")
    checkpoint = torch.load(tmp_path / "dpo.ckpt", weights_only=True)
    assert set(checkpoint["state_dict"]) == plain_keys
    hparams = checkpoint["hyper_parameters"]
    assert hparams["dpo"]["beta"] == 0.2 and hparams["ref_model"] is None
    assert set(model.telemetry["metrics"]) >= {"rewards/accuracies", "logps/rejected"}


class LargestFloatTensor(TorchDispatchMode):
    """The element count of the largest floating-point tensor any op produced."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("use_weighting", [False, True], ids=["dpo", "wpo"])
def test_one_dpo_step_with_a_32k_vocabulary_never_materializes_the_logits(use_weighting):
    from lit_losses import HFCausalLM
    from tests.models.hf_models import hf_config

    vocab, chunk = 32000, 16
    torch.manual_seed(0)
    config = hf_config(
        "llama",
        vocab_size=vocab,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    model = HFCausalLM(
        config=config, dpo={"beta": 0.1, "use_weighting": use_weighting}, head_chunk_size=chunk
    )
    model.reference_model()  # a copy of the initial policy (full fine-tuning)
    batch = whole_batch()
    tokens = batch["input_ids"].numel()
    with LargestFloatTensor() as seen:
        model.compute_loss(batch).total.backward()
    weight = model.output_projection()[0]
    assert weight.grad is not None and weight.grad.shape == (vocab, 16)
    assert seen.largest <= max(weight.numel(), 2 * chunk * vocab), seen.largest  # [V, D], [~chunk, V] only
    assert seen.largest < tokens * vocab / 4, (seen.largest, tokens * vocab)
    with LargestFloatTensor() as naive:  # the counter sees materialized logits
        F.linear(model.forward_hidden(batch), weight).log_softmax(-1)
    assert naive.largest >= tokens * vocab


# ---------------------------------------------------------------------------------------------------
# Bad inputs that belong to the module: one clear line naming the option or the batch key
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"dpo": {}, "grpo": {"loss_type": "dapo"}}, "model.dpo replaces the base loss and its aggregation"),
        ({"dpo": {}, "base_loss": "ppo"}, "remove model.base_loss or model.dpo"),
        ({"orpo": {}, "loss_agg": "token-sum"}, "remove model.loss_agg or model.orpo"),
        ({"cpo": {}, "ref_model": "initial_policy"}, "model.cpo reads no reference model"),
        ({"dpo": {"reference_free": True}, "ref_model": "initial_policy"}, "model.dpo reads no reference"),
        ({"ref_model": "initial_policy"}, "model.ref_model='initial_policy' is set but no preference loss"),
        ({"dpo": {}, "ref_model": "no/such/dir"}, "model.ref_model='no/such/dir': no such file or directory"),
        ({"kto": {"precompute_ref_log_probs": True}, "ref_model": "initial_policy"}, "model.kto reads no"),
        ({"dpo": {}, "cpo": {}}, "model.dpo, model.cpo are set together"),
    ],
)
def test_bad_options_are_one_line_naming_the_option(options, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        tiny(**options)


def test_disabled_adapters_without_adapters_are_refused_before_training():
    model = tiny(dpo={}, ref_model="disabled_adapters")
    with pytest.raises(ConfigError, match=r"ref_model='disabled_adapters': TinyLM has no PEFT adapters"):
        model.reference_model()  # what setup("fit") builds, before training


def test_data_without_the_keys_the_preset_reads_is_refused_before_training():
    keys = ("input_ids", "attention_mask", "labels", "chosen_mask", "chosen_sequence_mask")
    precomputed = PreferenceLoss(DPOPreset(precompute_ref_log_probs=True))
    with pytest.raises(BatchKeyError, match=r"model.dpo reads batch key 'ref_chosen_logps', which MyData"):
        check_preference_data(precomputed, keys, source="MyData")
    with pytest.raises(BatchKeyError, match=r"model.dpo reads batch key 'chosen_mask'"):
        check_preference_data(PreferenceLoss(DPOPreset(loss_type="sft")), keys[:3], source="MyData")
    unpaired = ("input_ids", "labels", "kto_label", "kl_input_ids")
    with pytest.raises(ConfigError, match=r"model.dpo trains on paired records .* holds unpaired ones"):
        check_preference_data(PreferenceLoss(DPOPreset()), unpaired, source="MyData")
    with_refs = (*keys, "ref_chosen_logps", "ref_rejected_logps")
    with pytest.warns(UserWarning, match=r"precompute_ref_log_probs is false: the reference model computes"):
        check_preference_data(PreferenceLoss(DPOPreset()), with_refs, source="MyData")


def test_a_batch_that_is_not_paired_is_refused_naming_the_layout():
    model = tiny(dpo={}, ref_model="initial_policy")
    batch = whole_batch()
    odd = {k: v[:-1] for k, v in batch.items()}
    with pytest.raises(ValueError, match=r"model.dpo: a paired micro-batch has 2P rows .* got labels of"):
        model.compute_loss(odd)
    missing = {k: v for k, v in batch.items() if k != "chosen_mask"}
    sft = tiny(dpo={"loss_type": "sft"})
    with pytest.raises(KeyError, match=r"mask key 'chosen_mask' is missing from the batch"):
        sft.compute_loss(missing)  # counted by the loader (here: for the micro-batch's own counts)
    pre = tiny(dpo={"precompute_ref_log_probs": True})
    with pytest.raises(BatchKeyError, match=r"model.dpo reads batch\['ref_chosen_logps'\], which is missing"):
        pre.compute_loss(batch)


def test_the_copy_of_the_initial_policy_is_not_the_trained_weights():
    model = tiny(dpo={})
    initial = copy.deepcopy(model.state_dict())
    model.reference_model()
    perturb(model)
    copied = model.frozen_models["reference"].runner.state_dict()
    assert all(torch.equal(copied[k], v) for k, v in initial.items() if k in copied)


def test_a_resumed_dpo_run_rebuilds_the_same_initial_policy_reference(tmp_path):
    """The reference is built at ``setup``, before the checkpoint's weights are restored: a run resumed
    from its step-2 checkpoint ends with the uninterrupted run's weights at step 4."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lit_losses import PreferenceDataModule

    pairs = str(Path(__file__).resolve().parents[2] / "data" / "preference" / "pairs.jsonl")

    def fit(root: Path, ckpt_path=None) -> TinyLM:
        torch.manual_seed(0)  # the constructor's weights: the initial policy of both runs
        model = TinyLM(
            vocab_size=300,
            d_model=16,
            n_layers=1,
            n_heads=2,
            dpo={"beta": 0.5},
            optimizer={"warmup_steps": 0, "lr": 0.05},
        )
        data = PreferenceDataModule(
            paths=[pairs],
            vocab_size=300,
            max_length=48,
            tokens_per_batch=192,
            cache_dir=str(tmp_path / "cache"),
        )
        every = ModelCheckpoint(dirpath=root, every_n_train_steps=2, save_top_k=-1, filename="{step}")
        trainer = L.Trainer(
            accelerator="cpu",
            max_steps=4,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=root,
            callbacks=[every],
            limit_val_batches=0,
        )
        torch.manual_seed(123 if ckpt_path else 0)  # a resumed run must not depend on the global RNG
        trainer.fit(model, data, ckpt_path=ckpt_path)
        return model

    whole = fit(tmp_path / "whole")
    initial = whole.frozen_models["reference"].runner.state_dict()
    resumed = fit(tmp_path / "resumed", ckpt_path=str(tmp_path / "whole" / "step=2.ckpt"))
    reference = resumed.frozen_models["reference"].runner.state_dict()
    assert all(torch.equal(reference[k], v) for k, v in initial.items())
    final = resumed.state_dict()
    for name, p in whole.state_dict().items():
        torch.testing.assert_close(final[name], p, rtol=0, atol=0, msg=name)
    assert any((final[k] - v).abs().max() > 1e-3 for k, v in initial.items())


class Unrebuildable(TinyLM):
    """A model whose hyper-parameters leave out an argument its constructor needs."""

    def __init__(self, width: int, **kwargs) -> None:
        super().__init__(vocab_size=VOCAB, d_model=width, n_layers=1, n_heads=2, **kwargs)
        self.save_hyperparameters(ignore=["width"])


def test_an_initial_policy_that_cannot_be_rebuilt_is_one_line_before_training():
    model = Unrebuildable(16, dpo={})
    model.hparams.pop("width", None)
    with pytest.raises(ConfigError, match=r"'initial_policy': Unrebuildable cannot be rebuilt from its"):
        model.reference_model()  # what setup("fit") builds, before training


def test_the_reference_computes_with_the_policys_head_precision():
    """A bf16 policy with ``head_matmul_precision="low_logits"`` and its initial copy as reference: the
    reference's log-probabilities come from the same bf16-rounded logits, so the first margins are 0
    exactly (a reference computed with fp32 operands would differ by the rounding)."""
    from lit_losses import HFCausalLM
    from tests.models.hf_models import hf_config

    torch.manual_seed(0)
    model = HFCausalLM(
        config=hf_config("llama", vocab_size=VOCAB),
        dpo={"beta": 0.1},
        ref_model="initial_policy",
        head_matmul_precision="low_logits",
    ).to(torch.bfloat16)
    out = model.compute_loss(whole_batch())
    assert float(out.metrics["rewards/margins"]) == 0.0
    torch.testing.assert_close(out.total.float(), torch.tensor(2.0).log(), rtol=0, atol=1e-6)
