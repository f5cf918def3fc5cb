"""``model.kto`` against TRL's own ``KTOTrainer`` (1.16): on the token ids of the trainer's collated batch
(its rows, its mismatched KL rows, its labels) and the same float64 weights, `HFCausalLM` with the
``KTOConfig`` fields a TRL user writes gives ``trainer.compute_loss``'s loss, every parameter's gradient
and the metrics TRL logs, for each loss type, with the reference model or precomputed reference values."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from peft import LoraConfig
from trl import KTOConfig, KTOTrainer

from lit_losses import PreferenceDataModule
from tests.objectives.peer_trainers import (
    TOKENIZER,
    UNPAIRED,
    assert_same_grads,
    first_batch,
    our_loss,
    our_module,
    perturbed,
    tiny_llama,
    tokenizer,
    trl_loss,
    trl_trainer,
    unpaired_batch,
)

CASES = {
    "kto-weights": {"loss_type": "kto", "beta": 0.3, "desirable_weight": 0.8, "undesirable_weight": 1.3},
    "kto-precomputed": {"loss_type": "kto", "beta": 0.2, "precompute_ref_log_probs": True},
    "apo_zero_unpaired": {"loss_type": "apo_zero_unpaired", "beta": 0.5, "undesirable_weight": 1.2},
}
RTOL, ATOL = 1e-6, 1e-7
"""TRL's fused head computes the log-probabilities in float32 (the bodies here are float64)."""
METRIC_ATOL = 1e-5
"""The rewards ``β (π − ρ)`` are differences of float32 sums of about 60 nats."""
NOT_LOGGED = {"entropy", "num_tokens", "logits/chosen", "logits/rejected"}
"""TRL's KTO metrics that `model.kto` logs only with ``token_metrics`` (`test_trl_token_metrics`)."""


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The reference (random weights, saved as a Hugging Face directory) and the policy: a perturbed copy
    whose KL estimate on the records is > 0 (not clamped)."""
    tok = tokenizer()
    reference = tiny_llama(len(tok), tok.pad_token_id)
    policy = perturbed(reference, seed=3, scale=0.05)
    ref_dir = tmp_path_factory.mktemp("kto_ref")
    reference.save_pretrained(ref_dir)
    return policy, reference, str(ref_dir)


@pytest.fixture(scope="module")
def runs(models, tmp_path_factory):
    """Each case: TRL's loss, gradients and metrics, and our batch built from TRL's collated batch."""
    policy, reference, _ = models
    out = {}
    for name, fields in CASES.items():
        trainer = trl_trainer(
            KTOTrainer,
            KTOConfig,
            records=UNPAIRED,
            model=copy.deepcopy(policy),
            ref_model=copy.deepcopy(reference),
            out_dir=tmp_path_factory.mktemp(name),
            **fields,
        )
        batch = first_batch(trainer)
        out[name] = (
            trl_loss(trainer, batch),
            unpaired_batch(batch, ref=fields.get("precompute_ref_log_probs", False)),
        )
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_kto_gives_trls_loss_gradients_and_metrics(name, models, runs):
    policy, _, ref_dir = models
    (loss, grads, logged), batch = runs[name]
    fields = CASES[name]
    options = {"kto": fields}
    if not fields.get("precompute_ref_log_probs"):
        options["ref_model"] = ref_dir
    ours, our_grads, metrics = our_loss(our_module(policy, **options), batch)

    torch.testing.assert_close(ours, loss.double(), rtol=RTOL, atol=ATOL)
    assert_same_grads(our_grads, grads, rtol=10 * RTOL, atol=ATOL)
    assert set(logged) - set(metrics) == NOT_LOGGED and set(metrics) <= set(logged)
    for key, value in metrics.items():
        assert value == pytest.approx(logged[key], rel=RTOL, abs=METRIC_ATOL), key
    if fields["loss_type"] == "kto":
        assert logged["kl"] > 0.01  # the estimate enters the loss unclamped
    else:
        assert logged["kl"] == 0


def test_the_kl_rows_are_trls_rotation_of_the_batch(runs):
    """KTOTrainer pairs each prompt with the completion of the record before it in the batch (the first
    with the last); our KL rows of TRL's batch are those rows, row for row."""
    (_, _, _), batch = runs["kto-weights"]
    prompts = [r["prompt"] for r in UNPAIRED]
    tok = tokenizer()
    rows = batch["kl_input_ids"]
    for i, prompt in enumerate(prompts):
        partner = UNPAIRED[i - 1]["completion"] + tok.eos_token
        text = tok.decode(rows[i][batch["kl_attention_mask"][i].bool()])
        assert text == prompt + partner


def test_the_data_module_gives_trls_batch_kl_rows_included(models, runs, tmp_path):
    """`PreferenceDataModule` (the CLI's) on the same records as JSONL, one micro-batch: TRL's rows and KL
    rows (row order aside), hence TRL's loss, gradients and KL estimate."""
    policy, _, ref_dir = models
    (loss, grads, logged), _ = runs["kto-weights"]
    path = tmp_path / "unpaired.jsonl"
    path.write_text("".join(json.dumps(record) + "\n" for record in UNPAIRED))
    data = PreferenceDataModule(paths=[str(path)], tokenizer=str(TOKENIZER), tokens_per_batch=4096)
    data.setup("fit")
    assert len(data.train_set) == 1
    module = our_module(policy, kto=CASES["kto-weights"], ref_model=ref_dir)
    ours, our_grads, metrics = our_loss(module, data.train_set[0])
    torch.testing.assert_close(ours, loss.double(), rtol=RTOL, atol=ATOL)
    assert_same_grads(our_grads, grads, rtol=10 * RTOL, atol=ATOL)
    assert metrics["kl"] == pytest.approx(logged["kl"], rel=RTOL, abs=METRIC_ATOL)


def test_kto_with_lora_gives_trls_with_its_peft_config(models, tmp_path):
    """``lora`` here, ``peft_config`` there: the reference is the base model with the adapters disabled in
    both (the KL rows' too), and the adapters' gradients agree (their random initial weights copied)."""
    _, base, _ = models
    lora = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "init_lora_weights": False}
    fields = {"beta": 0.5, "undesirable_weight": 1.2}
    trainer = trl_trainer(
        KTOTrainer,
        KTOConfig,
        records=UNPAIRED,
        model=copy.deepcopy(base),
        out_dir=tmp_path,
        peft_config=LoraConfig(**lora),
        **fields,
    )
    batch = first_batch(trainer)
    loss, grads, logged = trl_loss(trainer, batch)
    module = our_module(base, kto=fields, lora=lora)
    adapters = dict(trainer.model.named_parameters())
    with torch.no_grad():
        for name, p in module.model.named_parameters():
            if p.requires_grad:
                p.copy_(adapters[name])
    ours, our_grads, metrics = our_loss(module, unpaired_batch(batch))
    assert len(our_grads) == 8  # the adapters' A and B of q_proj and v_proj in both layers, nothing else
    torch.testing.assert_close(ours, loss.double(), rtol=RTOL, atol=ATOL)
    assert_same_grads(our_grads, grads, rtol=10 * RTOL, atol=ATOL)
    assert logged["kl"] > 0.01 and abs(logged["rewards/chosen"]) > 1e-4  # the adapters move the policy
    for key, value in metrics.items():
        assert value == pytest.approx(logged[key], rel=RTOL, abs=METRIC_ATOL), key


def test_kto_with_desirable_records_only(models, tmp_path):
    """TRL's empty undesirable branch: the same loss and gradients; TRL logs no undesirable means and no
    margin for the step, here they are 0 and the desirable mean (documented)."""
    policy, reference, ref_dir = models
    records = [record for record in UNPAIRED if record["label"]]
    trainer = trl_trainer(
        KTOTrainer,
        KTOConfig,
        records=records,
        model=copy.deepcopy(policy),
        ref_model=copy.deepcopy(reference),
        out_dir=tmp_path,
        beta=0.3,
    )
    batch = first_batch(trainer)
    loss, grads, logged = trl_loss(trainer, batch)
    ours, our_grads, metrics = our_loss(
        our_module(policy, kto={"beta": 0.3}, ref_model=ref_dir), unpaired_batch(batch)
    )
    torch.testing.assert_close(ours, loss.double(), rtol=RTOL, atol=ATOL)
    assert_same_grads(our_grads, grads, rtol=10 * RTOL, atol=ATOL)
    absent = {"rewards/rejected", "logps/rejected", "rewards/margins"}
    assert set(metrics) - set(logged) == absent
    assert metrics["rewards/rejected"] == metrics["logps/rejected"] == 0
    assert metrics["rewards/margins"] == metrics["rewards/chosen"]
    for key in set(metrics) - absent:
        assert metrics[key] == pytest.approx(logged[key], rel=RTOL, abs=METRIC_ATOL), key
