"""``lit-losses fit --config configs/hf_causal_lm.yaml --config configs/dpo.yaml`` (shortened): a tiny HF
model with LoRA trains with DPO on the shipped pairs, its reference the base model with the adapters
disabled; the checkpoint holds no reference weights and reloads; bad preference options are one line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("peft")

from lit_losses import HFCausalLM
from lit_losses.cli import cli_main

pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI.s args parameter")

REPO = Path(__file__).resolve().parents[2]
CONFIGS = ["--config", str(REPO / "configs/hf_causal_lm.yaml"), "--config", str(REPO / "configs/dpo.yaml")]
M, D = "--model.init_args.", "--data.init_args."
FAST = [
    "--trainer.max_steps=2",
    "--trainer.limit_val_batches=1",
    "--trainer.check_val_every_n_epoch=1",
    f"{M}config.num_hidden_layers=1",
    f"{M}config.hidden_size=48",
    f"{M}config.intermediate_size=64",
    f"{D}vocab_size=320",
    f"{D}max_records=12",
    f"{D}tokens_per_batch=256",
]


def roots(tmp_path: Path) -> list[str]:
    return [
        f"--trainer.default_root_dir={tmp_path / 'run'}",
        f"--trainer.logger.init_args.save_dir={tmp_path / 'run'}",
        f"{D}cache_dir={tmp_path / 'cache'}",
    ]


@pytest.mark.slow
def test_dpo_with_lora_trains_from_the_shipped_configs_and_its_checkpoint_has_no_reference(tmp_path, capsys):
    cli = cli_main(["fit", *CONFIGS, *FAST, *roots(tmp_path)])
    model = cli.model
    assert isinstance(model, HFCausalLM) and model.has_adapters() and cli.trainer.global_step == 2
    reference = model.frozen_models["reference"]
    assert reference.runner is model and reference.source == "disabled_adapters"
    metrics = model.telemetry["metrics"]
    assert set(metrics) == {f"rewards/{k}" for k in ("chosen", "rejected", "accuracies", "margins")} | {
        "logps/chosen",
        "logps/rejected",
    }
    assert "last step:    rewards/chosen" in capsys.readouterr().out  # the end-of-run summary
    ckpt = next((tmp_path / "run").rglob("*.ckpt"))
    checkpoint = torch.load(ckpt, weights_only=True, map_location="cpu")
    assert set(checkpoint["state_dict"]) == set(model.state_dict())
    assert checkpoint["hyper_parameters"]["ref_model"] == "disabled_adapters"
    assert checkpoint["hyper_parameters"]["dpo"]["loss_type"] == "sigmoid"
    reloaded = HFCausalLM.load_from_checkpoint(ckpt)
    batch = next(iter(cli.datamodule.val_dataloader()))
    expected = model.compute_loss(batch, "val").total
    torch.testing.assert_close(reloaded.compute_loss(batch, "val").total, expected)


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        (f"{M}dpo.loss_type=sigmod", "model.init_args.dpo.loss_type: 'sigmod' is not one of ("),
        (f"{M}dpo.loss_type=sigmod", "; did you mean 'sigmoid'?"),
        (f"{M}dpo.beta=0", "model.dpo.beta must be a finite number > 0, got 0"),
        (f"{M}dpo.label_smoothing=0.1", "model.dpo.label_smoothing is set but loss_type ('sigmoid',)"),
        (f"{M}ref_model=no/such/model", "model.ref_model='no/such/model': no such file or directory"),
        (f"{M}grpo.loss_type=dapo", "model.dpo replaces the base loss and its aggregation"),
        (f"{M}dpo.precompute_ref_log_probs=true", "model.dpo reads batch key 'ref_chosen_logps', which"),
    ],
)
def test_bad_preference_options_fail_with_one_line(override, expected, tmp_path, capsys):
    ref_model = [f"{M}ref_model=null"] if "precompute" in override else []
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["fit", *CONFIGS, *FAST, *roots(tmp_path), "--trainer.logger=false", *ref_model, override])
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert exit_info.value.code == 2, err
    assert len(lines) == 1 and lines[0].startswith("lit-losses: error: "), err
    assert expected in lines[0], lines[0]


@pytest.mark.slow
def test_wpo_trains_from_the_shipped_configs_with_one_override(tmp_path):
    """``--model.dpo.use_weighting=true``: the trained model's loss of a batch is TRL's WPO-weighted DPO
    loss from the full logits of the policy and of its reference (the adapters disabled)."""
    from tests.loss.test_preference_wpo import full_logits, trl_inputs
    from tests.objectives import preference_reference as trl

    args = [*CONFIGS, *FAST, *roots(tmp_path), "--trainer.logger=false", "--model.dpo.use_weighting=true"]
    cli = cli_main(["fit", *args])
    model = cli.model.eval()
    assert cli.trainer.global_step == 2 and model.objective.preference.preset.use_weighting
    batch = next(iter(cli.datamodule.val_dataloader()))
    with torch.no_grad():
        loss = model.compute_loss(batch, "val").total
        logits = full_logits(model, batch)
        with model.adapters_disabled("reference")():
            ref_logits = full_logits(model, batch)
    fields = {"loss_type": ["sigmoid"], "beta": 0.1}
    expected, _ = trl.trl_dpo(logits, ref_logits, *trl_inputs(batch), {**fields, "use_weighting": True})
    unweighted, _ = trl.trl_dpo(logits, ref_logits, *trl_inputs(batch), fields)
    assert abs(float(expected - unweighted)) > 5e-3 * float(unweighted)  # 50× the tolerance below
    torch.testing.assert_close(loss.double(), expected, rtol=1e-4, atol=1e-6)
