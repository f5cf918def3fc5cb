"""`lit-losses fit --config configs/hf_causal_lm.yaml` (shortened), a checkpoint round trip, one-line
configuration errors, and `examples/hf_lora.py`."""

import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from lit_losses import HFCausalLM
from lit_losses.cli.app import cli_main

REPO = Path(__file__).resolve().parents[2]
CONFIG = str(REPO / "configs" / "hf_causal_lm.yaml")
FAST = [
    "--trainer.max_steps=3",
    "--trainer.val_check_interval=3",
    "--trainer.limit_val_batches=1",
    "--data.init_args.max_documents=20",
    "--data.init_args.vocab_size=512",
    "--model.init_args.config.num_hidden_layers=1",
]


def test_fit_from_the_shipped_config_trains_a_llama_and_its_checkpoint_reloads(tmp_path):
    root = tmp_path / "run"
    cli = cli_main(
        [
            "fit",
            "--config",
            CONFIG,
            f"--trainer.default_root_dir={root}",
            f"--trainer.logger.init_args.save_dir={root}",
            *FAST,
        ]
    )
    model = cli.model
    assert isinstance(model, HFCausalLM) and type(model.model).__name__ == "LlamaForCausalLM"
    assert cli.trainer.global_step == 3 and model.output_projection()[0].shape[0] == 512  # linked vocab
    assert torch.isfinite(torch.tensor(model.telemetry["loss_total"]))
    ckpt = next(root.rglob("*.ckpt"))
    reloaded = HFCausalLM.load_from_checkpoint(ckpt)
    batch = next(iter(cli.datamodule.val_dataloader()))
    torch.testing.assert_close(
        reloaded.compute_loss(batch, "val").total, model.compute_loss(batch, "val").total
    )


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        (
            "--model.init_args.config.model_type=lamma",
            "'lamma' is not a transformers model type; did you mean",
        ),
        ("--model.init_args.label_format=aligned", "label_format: 'aligned' is not one of"),
        # refusals of transformers and peft, mapped to the option that caused them
        ("--model.init_args.config.num_attention_heads=5", "model.init_args.config: Class validation error"),
        (
            "--model.init_args.lora={r: 4, target_modules: [nope]}",
            "model.init_args.lora: Target modules {'nope'}",
        ),
        (
            "--model.init_args.attn_implementation=flash_attention_9",
            "model.init_args.attn_implementation=flash_attention_9: Spec",
        ),
    ],
)
def test_bad_hf_settings_fail_with_one_line(override, expected, tmp_path):
    roots = [f"--trainer.default_root_dir={tmp_path}", f"--trainer.logger.init_args.save_dir={tmp_path}"]
    cmd = [sys.executable, "-m", "lit_losses.cli", "fit", "--config", CONFIG, *FAST, override, *roots]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("lit-losses: error:")]
    assert proc.returncode == 2 and len(lines) == 1 and expected in lines[0], proc.stderr[-2000:]


@pytest.mark.slow
def test_lora_example_trains_the_adapters_only(tmp_path):
    telemetry = runpy.run_path(str(REPO / "examples" / "hf_lora.py"))["main"](steps=2, workdir=str(tmp_path))
    assert telemetry["base_unchanged"]
    assert set(telemetry["regularizers"]) == {"z_loss", "entropy"}
    assert telemetry["regularizers"]["entropy"]["value"] < 0 < telemetry["regularizers"]["z_loss"]["value"]
