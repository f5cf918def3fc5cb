"""The unpaired preference path (``model.kto``): TRL's KTO loss against a float64 computation from
materialized logits (the KL estimate from the mismatched rows, the reference on the fly or in the batch),
its metrics, the step's mean over all sequences under a split, and its data checks."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lit_losses import PreferenceDataModule, TinyLM
from lit_losses.aggregation import GlobalStats, count_masks, sum_counts
from lit_losses.data.preference_batches import RecordRows, collate_records
from lit_losses.errors import BatchKeyError, ConfigError
from lit_losses.loss.preference_unpaired import UnpairedPreferenceLoss, check_unpaired_data
from lit_losses.objectives import KTOPreset
from tests.loss.preference_ddp_worker import VOCAB, row
from tests.loss.test_preference import naive_sequence_logps, perturb, tiny

LABELS = (True, False, True, True, False, False, True)


def records(seed: int = 0) -> list[RecordRows]:
    """Unpaired rows (a prompt and its completion) and KL rows (the prompt with the previous record's
    completion, TRL's rotation)."""
    g = torch.Generator().manual_seed(seed)
    prompts = [
        torch.randint(3, VOCAB, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist()
        for _ in LABELS
    ]
    rows = [row(g, p) for p in prompts]
    completions = [ids[len(p) :] for (ids, _), p in zip(rows, prompts, strict=True)]
    out = []
    for i, (prompt, label) in enumerate(zip(prompts, LABELS, strict=True)):
        partner = completions[i - 1]
        kl = (prompt + partner, [-100] * (len(prompt) - 1) + partner + [-100])
        out.append(RecordRows(f"unpaired:{i}", rows[i], kl, ref={}, label=label))
    return out


def batch_of(items: list[RecordRows]) -> dict:
    return collate_records(items, pad_id=0)


def naive_kto(policy, reference, batch, beta: float, weights=(1.0, 1.33)) -> torch.Tensor:
    """TRL's KTO loss (``kto``) of the batch from full logits, float64."""
    kl_batch = {"input_ids": batch["kl_input_ids"], "labels": batch["kl_labels"]}
    with torch.no_grad():
        kl = naive_sequence_logps(policy, kl_batch) - naive_sequence_logps(reference, kl_batch)
        z = kl.mean().clamp_min(0)
        ref = naive_sequence_logps(reference, batch)
    ratio = naive_sequence_logps(policy, batch) - ref
    desirable = weights[0] * (1 - torch.sigmoid(beta * (ratio - z)))
    undesirable = weights[1] * (1 - torch.sigmoid(beta * (z - ratio)))
    return torch.where(batch["kto_label"], desirable, undesirable).mean()


def test_kto_equals_trls_formula_from_full_logits_with_the_reference_on_the_fly_or_given():
    preset = {"beta": 0.3, "undesirable_weight": 1.33}
    batch = batch_of(records())
    on_the_fly = tiny(kto=preset)
    on_the_fly.reference_model()
    initial = tiny()
    with torch.no_grad():
        ref = naive_sequence_logps(initial, batch)
        kl_rows = {"input_ids": batch["kl_input_ids"], "labels": batch["kl_labels"]}
        ref_kl = naive_sequence_logps(initial, kl_rows)
    given = tiny(kto={**preset, "precompute_ref_log_probs": True})
    naive = tiny()
    perturb(on_the_fly, given, naive, seed=10, scale=0.1)  # a policy whose KL estimate is > 0
    expected = naive_kto(naive, initial, batch, beta=0.3)
    expected.backward()
    for model, data in ((on_the_fly, batch), (given, {**batch, "ref_logps": ref, "ref_kl_logps": ref_kl})):
        model.zero_grad()
        out = model.compute_loss(data)
        out.total.backward()
        torch.testing.assert_close(out.total, expected.detach(), rtol=1e-12, atol=1e-12)
        assert float(out.metrics["kl"]) > 0  # the estimate is not clamped here: it matters
        grads = {name: p.grad for name, p in model.named_parameters()}
        for name, p in naive.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-10, atol=1e-12, msg=name)


def test_kto_metrics_are_means_over_the_desirable_and_undesirable_sequences():
    batch = batch_of(records())
    model = tiny(kto={"loss_type": "apo_zero_unpaired", "beta": 0.5})
    model.reference_model()
    naive = tiny()
    perturb(model, naive)
    out = model.compute_loss(batch)
    with torch.no_grad():
        policy = naive_sequence_logps(naive, batch)
        rewards = 0.5 * (policy - naive_sequence_logps(tiny(), batch))
    label = batch["kto_label"]
    expected = {
        "rewards/chosen": rewards[label].mean(),
        "rewards/rejected": rewards[~label].mean(),
        "rewards/margins": rewards[label].mean() - rewards[~label].mean(),
        "logps/chosen": policy[label].mean(),
        "logps/rejected": policy[~label].mean(),
        "kl": torch.tensor(0.0, dtype=torch.float64),
    }
    for name, value in expected.items():
        torch.testing.assert_close(out.metrics[name], value, rtol=1e-10, atol=1e-12, msg=name)


def test_without_the_kl_estimate_a_split_step_is_the_mean_over_all_its_sequences():
    """``apo_zero_unpaired``: 2 ranks × 2 micro-batches of different sizes, counted as the loader counts
    them, give the whole batch's loss and gradient (KTO's ``z`` is a per-micro-batch estimate, as TRL's)."""
    items = records()
    grid = [[batch_of(items[:1]), batch_of(items[1:3])], [batch_of(items[3:6]), batch_of(items[6:])]]
    model = tiny(kto={"loss_type": "apo_zero_unpaired", "beta": 0.5})
    model.reference_model()
    perturb(model)
    keys = model.mask_keys()
    local = [[count_masks(b, keys) for b in r] for r in grid]
    totals = sum_counts(c for r in local for c in r)
    split = 0.0
    for d, r in enumerate(grid):
        for a, b in enumerate(r):
            stats = GlobalStats(totals, loss_scale=4, local=local[d][a], position=a, window=2)
            split = split + model.compute_loss({**b, "global_stats": stats}).total  # × 4 ÷ A ÷ D = × 1
    (grad,) = torch.autograd.grad(split, model.output_projection()[0])
    whole = model.compute_loss(batch_of(items)).total
    (whole_grad,) = torch.autograd.grad(whole, model.output_projection()[0])
    torch.testing.assert_close(split, whole, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, whole_grad, rtol=1e-10, atol=1e-12)


def test_kto_trains_on_the_shipped_unpaired_records(tmp_path):
    data = PreferenceDataModule(
        paths=["data/preference/unpaired.jsonl"],
        vocab_size=300,
        max_length=48,
        tokens_per_batch=256,
        cache_dir=str(tmp_path),
    )
    model = TinyLM(
        vocab_size=300,
        d_model=16,
        n_layers=1,
        n_heads=2,
        kto={"beta": 0.1},
        optimizer={"warmup_steps": 0, "lr": 0.01},
    )
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=2,
        accumulate_grad_batches=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, data)
    metrics = model.telemetry["metrics"]
    assert set(metrics) == {
        "rewards/chosen",
        "rewards/rejected",
        "rewards/margins",
        "logps/chosen",
        "logps/rejected",
        "kl",
    }
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values())


def test_kto_refuses_paired_data_and_data_without_its_keys():
    loss = UnpairedPreferenceLoss(KTOPreset())
    paired = (
        r"model.kto trains on unpaired records .* holds paired ones .* KTOTrainer splits each pair in two"
    )
    with pytest.raises(ConfigError, match=paired):
        check_unpaired_data(loss, ("input_ids", "labels", "chosen_mask"), source="PreferenceDataModule")
    keys = ("input_ids", "labels", "kto_label", "desirable_mask")
    with pytest.raises(BatchKeyError, match=r"model.kto reads batch key 'kl_input_ids', which MyData never"):
        check_unpaired_data(loss, keys, source="MyData")
    given = UnpairedPreferenceLoss(KTOPreset("apo_zero_unpaired", precompute_ref_log_probs=True))
    with pytest.raises(BatchKeyError, match=r"model.kto reads batch key 'ref_logps'"):
        check_unpaired_data(given, keys, source="MyData")
    with pytest.raises(ConfigError, match=r"model.dpo trains on paired records"):
        tiny(dpo={}).objective.preference.check_data((*keys, "kl_input_ids"), source="MyData")


def test_the_kl_rows_run_without_gradient():
    batch = batch_of(records())
    model = tiny(kto={"beta": 0.3})
    seen = []
    policy_logprobs = model.policy_logprobs

    def spy(rows, labels):
        out = policy_logprobs(rows, labels)
        seen.append(out.requires_grad)
        return out

    model.policy_logprobs = spy
    model.compute_loss(batch).total.backward()
    assert seen == [False]
