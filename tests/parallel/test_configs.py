"""``configs/fsdp2.yaml`` and ``configs/tensor_parallel.yaml`` on top of the main job: they parse into the
strategy and `ParallelConfig` they document, bad values stop the CLI with one line, and each trains
through ``lit-losses fit`` on 2 CPU processes."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from lit_losses import TinyLM
from lit_losses.cli.app import cli_main
from tests.parallel.launch import REPO

MAIN = str(REPO / "configs" / "tiny_lm.yaml")
CONFIGS = {"fsdp2": (2, 1), "tensor_parallel": (1, 2)}  # (data_parallel_size, tensor_parallel_size)
FAST = [
    "--trainer.max_steps=2",
    "--trainer.val_check_interval=2",
    "--trainer.limit_val_batches=1",
    "--trainer.accelerator=cpu",
    "--trainer.enable_progress_bar=false",
    "--data.init_args.max_documents=30",
    "--model.init_args.n_layers=1",
]


def config(name: str) -> str:
    return str(REPO / "configs" / f"{name}.yaml")


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_config_parses_into_model_parallel_strategy_and_plan(name, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["fit", "--config", MAIN, "--config", config(name), "--print_config"])
    assert exit_info.value.code == 0
    parsed = yaml.safe_load(capsys.readouterr().out)
    strategy = parsed["trainer"]["strategy"]
    assert strategy["class_path"] == "lightning.pytorch.strategies.ModelParallelStrategy"
    sizes = (strategy["init_args"]["data_parallel_size"], strategy["init_args"]["tensor_parallel_size"])
    assert sizes == CONFIGS[name] and parsed["trainer"]["devices"] == sizes[0] * sizes[1]
    parallel = parsed["model"]["init_args"]["parallel"]
    if name == "fsdp2":
        # the stock config works for any model: null takes the model's own units (TinyLM: its blocks)
        assert parallel["fsdp_modules"] is None and parallel["reshard_after_forward"] is True
        assert TinyLM.fsdp_modules == ("body.blocks.*",)
    else:
        assert parallel["tensor_parallel_plan"] == {"lm_head": "colwise"}
        assert parsed["model"]["init_args"]["tie_embeddings"] is False


def test_a_bad_parallel_option_stops_the_cli_with_one_line(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli_main(
            [
                "fit",
                "--config",
                MAIN,
                "--config",
                config("fsdp2"),
                "--model.init_args.parallel.param_dtype=bf16",
                "--print_config",
            ]
        )
    assert exit_info.value.code == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("lit-losses: error: model.init_args.parallel.param_dtype: 'bf16'")
    assert "did you mean 'bfloat16'" in line


@pytest.mark.slow
@pytest.mark.ddp
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_two_process_cli_run_of_the_config(name, tmp_path):
    root = tmp_path / name
    paths = [f"--trainer.default_root_dir={root}", f"--trainer.logger.init_args.save_dir={root}"]
    cmd = [sys.executable, "-m", "lit_losses.cli", "fit", "--config", MAIN, "--config", config(name), *paths]
    cmd += FAST
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "max_steps=2" in proc.stderr + proc.stdout
    checkpoints = [p for p in root.rglob("*.ckpt") if p.is_dir()]
    assert checkpoints, "no sharded checkpoint folder"
    assert len(list(checkpoints[0].glob("*.distcp"))) == 2  # one shard file per rank
