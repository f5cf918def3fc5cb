"""Resuming on another topology on the users' path: ``lit-losses fit --config configs/hf_causal_lm.yaml``
with LoRA (peft; `tests.checkpoint.runs.MODELS` ``hf_lora``: a tiny Llama, adapters on q/v, trainable
copies of the norms), trained under FSDP2 on 2 processes and checkpointed mid-epoch after step 2 of 4.

The sharded step-2 folder resumes on 1 process and on 2 DDP processes; each resumed run ends with the
uninterrupted run of its own topology: the same logged losses, weights (frozen ones bit for bit: nothing
writes them), optimizer and scheduler states, loops and data position. ``lit-losses checkpoint convert``
makes the folder one file, which ``checkpoint verify`` accepts, holds what the 1-process run wrote at step
2, and loads with ``HFCausalLM.load_from_checkpoint`` as it was saved.

Tolerances: the weights are float64, and the topologies differ only in the order of the gradient sums
(over micro-batches and ranks) and of the norm of gradient clipping, so that states agree to ~1e-15
relative; 1e-9 of each tensor's largest magnitude leaves six orders of margin while one micro-batch trained
twice or skipped, or a moment given to another parameter, is a difference of order 1 (the states of step 2
and step 4 themselves differ by more than 1e-3, checked). Lightning logs in float32 (the default dtype):
losses agree to its rounding (rel 1e-6).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from lit_losses.checkpoint.reshard import PARAM_NAMES_KEY, read_sharded
from lit_losses.checkpoint.topology import Topology, follow_topology
from lit_losses.cli.checkpoint import checkpoint_main
from tests.checkpoint.runs import STEPS, fit_process

pytest.importorskip("transformers")
pytest.importorskip("peft")

CKPT_STEP = 2
MODEL = "hf_lora"
RTOL = 1e-9  # of a tensor's largest magnitude (float64; see above)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Per topology: its uninterrupted run's checkpoint folder and logged losses (run once, on demand)."""
    runs: dict[str, tuple[Path, dict[int, float]]] = {}

    def get(topology: str) -> tuple[Path, dict[int, float]]:
        if topology not in runs:
            root = tmp_path_factory.mktemp(f"hf-{topology}") / "run"
            losses = fit_process(root, topology, model=MODEL)[1]
            assert sorted(losses) == list(range(STEPS)), losses
            runs[topology] = root / "checkpoints", losses
        return runs[topology]

    return get


def load(path: Path) -> dict[str, Any]:
    """A checkpoint file, or a sharded folder read whole (as a 1-process run restores it)."""
    return read_sharded(path) if path.is_dir() else torch.load(path, map_location="cpu", weights_only=True)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, what
    scale = float(expected.abs().max()) if expected.numel() else 0.0
    error = float((actual - expected).abs().max()) if expected.numel() else 0.0
    assert error <= RTOL * scale, f"{what}: max |difference| {error:.3e}, largest |value| {scale:.3e}"


def assert_same_training_state(actual: dict[str, Any], expected: dict[str, Any]) -> None:
    """Weights (frozen ones equal, trainable ones within `RTOL`), optimizer and scheduler states."""
    trainable = expected[PARAM_NAMES_KEY][0]
    assert actual[PARAM_NAMES_KEY] == expected[PARAM_NAMES_KEY]
    assert any(".lora_A." in n for n in trainable) and any(".modules_to_save." in n for n in trainable)
    weights, reference = actual["state_dict"], expected["state_dict"]
    assert weights.keys() == reference.keys()
    for name, value in reference.items():
        if name in trainable:
            assert_close(weights[name], value, name)
        else:
            assert torch.equal(weights[name], value), name
    (optimizer,), (reference_optimizer,) = actual["optimizer_states"], expected["optimizer_states"]
    assert optimizer["param_groups"] == reference_optimizer["param_groups"]  # lr, groups, indices
    assert [len(g["params"]) for g in optimizer["param_groups"]] == [8, 5]  # decayed adapters, norms
    assert optimizer["state"].keys() == reference_optimizer["state"].keys() == set(range(len(trainable)))
    for index, state in reference_optimizer["state"].items():
        assert state.keys() == optimizer["state"][index].keys() == {"step", "exp_avg", "exp_avg_sq"}
        assert torch.equal(optimizer["state"][index]["step"], state["step"])
        for key in ("exp_avg", "exp_avg_sq"):
            assert_close(optimizer["state"][index][key], state[key], f"{trainable[index]} {key}")
    assert actual["lr_schedulers"] == expected["lr_schedulers"]
    assert actual["lit_losses_regularizers"] == expected["lit_losses_regularizers"]


@pytest.mark.slow
@pytest.mark.ddp
@pytest.mark.parametrize("target", ["single", "ddp"])
def test_an_fsdp2_lora_checkpoint_resumes_on_another_topology_as_that_topology_runs(
    target, uninterrupted, tmp_path
):
    source_dir, source_losses = uninterrupted("fsdp2")
    target_dir, expected = uninterrupted(target)
    for step, value in source_losses.items():  # the same global batches: the two topologies agree
        assert value == pytest.approx(expected[step], rel=1e-6), (step, source_losses, expected)
    ckpt = source_dir / f"step={CKPT_STEP}.ckpt"
    assert ckpt.is_dir()  # the stock configs/fsdp2.yaml: each rank writes its shards
    root = tmp_path / "run"
    resumed = fit_process(root, target, f"--ckpt_path={ckpt}", model=MODEL)[1]
    assert sorted(resumed) == list(range(CKPT_STEP, STEPS))
    for step, value in resumed.items():
        assert value == pytest.approx(expected[step], rel=1e-6), (step, resumed, expected)
    final = load(target_dir / f"step={STEPS}.ckpt")
    ended = load(root / "checkpoints" / f"step={STEPS}.ckpt")
    assert_same_training_state(ended, final)
    assert ended["loops"] == final["loops"]  # the data position and progress of that topology's run
    assert ended["lit_losses_topology"] == final["lit_losses_topology"]
    at_checkpoint = load(ckpt)  # the comparison above can fail: two steps move every trainable tensor
    for name in final[PARAM_NAMES_KEY][0]:
        change = (final["state_dict"][name] - at_checkpoint["state_dict"][name]).abs().max()
        assert change > 1e-3 * final["state_dict"][name].abs().max(), name


@pytest.mark.slow
@pytest.mark.ddp
def test_the_fsdp2_lora_folder_converts_to_the_file_one_process_writes(uninterrupted, tmp_path, capsys):
    """``checkpoint convert`` of the step-2 folder, ``checkpoint verify`` of the file; the file holds the
    1-process run's step-2 state (its data position counted over the 2 ranks that wrote it: recounted for
    1 process, it is the 1-process file's) and loads as the model it was."""
    from lit_losses import HFCausalLM

    source = uninterrupted("fsdp2")[0] / f"step={CKPT_STEP}.ckpt"
    one_process = load(uninterrupted("single")[0] / f"step={CKPT_STEP}.ckpt")
    target = tmp_path / "whole.ckpt"
    checkpoint_main(["convert", str(source), str(target)])
    assert capsys.readouterr().out.strip() == f"lit-losses: wrote {target}"
    checkpoint_main(["verify", str(target)])
    assert capsys.readouterr().out.strip() == f"lit-losses: {target}: verified (step {CKPT_STEP})"
    converted = torch.load(target, map_location="cpu", weights_only=True)
    assert converted["global_step"] == one_process["global_step"] == CKPT_STEP
    assert_same_training_state(converted, one_process)
    writer = Topology.from_record(converted["lit_losses_topology"])
    assert writer is not None and (writer.data_parallel_size, writer.sharded_model) == (2, True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same global batch: recounted silently
        assert follow_topology(converted, Topology(data_parallel_size=1, accumulate_grad_batches=4))
    fit_loop, expected_loop = converted["loops"]["fit_loop"], one_process["loops"]["fit_loop"]
    assert fit_loop["epoch_loop.batch_progress"] == expected_loop["epoch_loop.batch_progress"]
    (position,), (expected_position,) = (
        loop["state_dict"]["combined_loader"] for loop in (fit_loop, expected_loop)
    )
    assert position == {**expected_position, "length": None, "accumulate_grad_batches": 2}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = HFCausalLM.load_from_checkpoint(target, map_location="cpu")
    assert not [w for w in caught if "differ from the checkpoint" in str(w.message)], caught
    assert model.has_adapters()
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in converted["state_dict"].items())
