"""The rollout-correction options: TRL's and verl's names in ``model.base_loss_args`` and ``model.grpo``,
verl's presets, and every bad value one line naming its option path — from Python and through the CLI
(exit 2, before training), with the records' ``old_logprobs`` errors naming ``file:line``."""

from __future__ import annotations

import json

import pytest

from lit_losses import GRPOPreset
from lit_losses.cli import cli_main
from lit_losses.errors import ConfigError
from lit_losses.hparams import plain_data
from lit_losses.loss.objective import Objective
from lit_losses.objectives.correction import PRESETS, RolloutCorrectionOptions
from tests.objectives import rollout_reference

pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI.s args parameter")

VLLM = {"vllm_importance_sampling_correction": True}
A = "model.base_loss_args."
BAD_ARGS = [
    (
        {**VLLM, "vllm_importance_sampling_clip_max": 0},
        f"{A}vllm_importance_sampling_clip_max=0 must be a finite number > 0",
    ),
    (
        {**VLLM, "vllm_importance_sampling_clip_min": -0.5},
        f"{A}vllm_importance_sampling_clip_min=-0.5 must be a finite number >= 0",
    ),
    (
        {**VLLM, "vllm_importance_sampling_clip_min": 2.0, "vllm_importance_sampling_clip_max": 1.5},
        f"{A}vllm_importance_sampling_clip_min=2.0 must be less than vllm_importance_sampling_clip_max=1.5",
    ),
    (
        {
            **VLLM,
            "vllm_importance_sampling_mode": "token_truncate",
            "vllm_importance_sampling_clip_max": None,
        },
        f"{A}vllm_importance_sampling_mode='token_truncate' truncates the ratio",
    ),
    (
        {**VLLM, "vllm_importance_sampling_mode": "token_trunc"},
        f"{A}vllm_importance_sampling_mode 'token_trunc' is not one of",
    ),
    ({**VLLM, "vllm_importance_sampling_mode": "token_trunc"}, "; did you mean 'token_truncate'?"),
    (
        {"vllm_importance_sampling_mod": "token_mask"},
        f"{A}vllm_importance_sampling_mod: base loss 'ppo' has no parameter 'vllm_importance_sampling_mod'; "
        "did you mean 'vllm_importance_sampling_mode'?",
    ),
    (
        {"vllm_importance_sampling_mode": "token_mask"},
        f"{A}vllm_importance_sampling_mode='token_mask' has no effect: "
        "vllm_importance_sampling_correction is false",
    ),
    (
        {**VLLM, "vllm_importance_sampling_cap": -1.0},
        f"{A}vllm_importance_sampling_cap=-1.0 must be a finite number > 0",
    ),
    (
        {**VLLM, "vllm_importance_sampling_cap": 2.0, "vllm_importance_sampling_clip_max": 4.0},
        f"{A}vllm_importance_sampling_cap=2.0 and vllm_importance_sampling_clip_max=4.0 both set C_max",
    ),
    (
        {**VLLM, "rollout_is": "token"},
        f"{A}rollout_is='token' and vllm_importance_sampling_correction=True both",
    ),
    ({"off_policy_mask_threshold": 0.0}, f"{A}off_policy_mask_threshold=0.0 must be a finite number > 0"),
    (
        {"rollout_is": "tokens"},
        f"{A}rollout_is 'tokens' is not one of ('token', 'sequence'); did you mean 'token'?",
    ),
    (
        {"rollout_is": "token", "rollout_is_threshold": 0},
        f"{A}rollout_is_threshold=0 must be a finite number > 0",
    ),
    ({"rollout_is_threshold": 3.0}, f"{A}rollout_is_threshold=3.0 has no effect: rollout_is is null"),
    (
        {"rollout_rs": "seq_mean_k4", "rollout_rs_threshold": 0.1},
        f"{A}rollout_rs: 'seq_mean_k4' is not one of",
    ),
    ({"rollout_rs": "seq_max_k1", "rollout_rs_threshold": 0.1}, "; did you mean 'seq_max_k"),
    ({"rollout_rs": "seq_mean_k3"}, f"{A}rollout_rs_threshold is required by rollout_rs"),
    (
        {"rollout_rs": "token_k1,token_k2", "rollout_rs_threshold": "0.5_2,0.1,0.3"},
        f"{A}rollout_rs_threshold='0.5_2,0.1,0.3' gives 3 thresholds for 2 rollout_rs options",
    ),
    (
        {"rollout_rs": "token_k2", "rollout_rs_threshold": "0.1_0.2"},
        f"{A}rollout_rs_threshold: '0.1_0.2' for 'token_k2' must be a single upper bound",
    ),
    (
        {"rollout_rs": "token_k1", "rollout_rs_threshold": "-0.5_2"},
        f"{A}rollout_rs_threshold: '-0.5_2' for 'token_k1' must be positive",
    ),
    (
        {"rollout_rs": "token_k1", "rollout_rs_threshold": 0.52},  # YAML's reading of an unquoted 0.5_2
        f"{A}rollout_rs_threshold: '0.52' for 'token_k1' gives the ratio band [1.92308, 0.52], which keeps",
    ),
    (
        {"rollout_rs": "token_k3", "rollout_rs_threshold": "high"},
        f"{A}rollout_rs_threshold: 'high' for 'token_k3' is not a number",
    ),
    (
        {"rollout_correction_preset": "decoupled_k3_rs", "rollout_rs": "token_k2"},
        f"{A}rollout_rs='token_k2': rollout_correction_preset 'decoupled_k3_rs' sets it",
    ),
    ({"rollout_correction_preset": "decoupled_k3"}, "; did you mean 'decoupled_k3_rs'?"),
]


@pytest.mark.parametrize(("args", "message"), BAD_ARGS, ids=[m[:60] for _, m in BAD_ARGS])
def test_bad_correction_arguments_are_one_error_naming_the_option(args, message):
    with pytest.raises(ConfigError) as info:
        Objective.from_options(base_loss="ppo", base_loss_args=args)
    assert message in str(info.value) and "\n" not in str(info.value), str(info.value)


BAD_LOSSES = [
    (
        "cross_entropy",
        {"rollout_is": "token"},
        f"{A}rollout_is: base loss 'cross_entropy' reads no sampling log-probabilities",
    ),
    ("vespo", {**VLLM}, f"{A}vllm_importance_sampling_mode='sequence_mask': base loss 'vespo' takes"),
    ("vespo", {"rollout_is": "sequence"}, f"{A}rollout_is='sequence': base loss 'vespo' takes"),
]


@pytest.mark.parametrize(("base_loss", "args", "message"), BAD_LOSSES)
def test_a_correction_the_base_loss_cannot_take_is_refused(base_loss, args, message):
    with pytest.raises(ConfigError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        Objective.from_options(base_loss=base_loss, base_loss_args=args)


BAD_GRPO = [
    (
        {"vllm_importance_sampling_cap": 0, **VLLM},
        "model.grpo.vllm_importance_sampling_cap=0 must be a finite",
    ),
    (
        {"loss_type": "vespo", **VLLM},
        "model.grpo.vllm_importance_sampling_mode='sequence_mask': loss_type 'vespo'",
    ),
    ({"rollout_rs": "seq_mean_k3"}, "model.grpo.rollout_rs_threshold is required by rollout_rs"),
    ({"vllm_importance_sampling_clipmax": 2.0}, "did you mean 'vllm_importance_sampling_clip_max'?"),
]


@pytest.mark.parametrize(("cfg", "message"), BAD_GRPO)
def test_bad_grpo_correction_fields_name_model_grpo(cfg, message):
    with pytest.raises(ConfigError) as info:
        Objective.from_options(grpo=cfg)
    assert message in str(info.value) and "\n" not in str(info.value), str(info.value)


def test_grpo_passes_the_correction_to_the_base_loss_and_the_deprecated_cap_as_clip_max():
    with pytest.warns(FutureWarning, match="vllm_importance_sampling_cap is deprecated"):
        preset = GRPOPreset(
            "dapo", vllm_importance_sampling_cap=2.5, **VLLM, rollout_rs="token_k3", rollout_rs_threshold=0.1
        )
    args = preset.options()["base_loss_args"]
    assert args["vllm_importance_sampling_clip_max"] == 2.5 and "vllm_importance_sampling_cap" not in args
    correction = Objective.from_options(grpo=preset).base_loss.correction
    assert (correction.vllm_mode, correction.clip_max) == ("sequence_mask", 2.5)
    assert [c.option for c in correction.rejection] == ["token_k3"]
    assert GRPOPreset("dapo").options()["base_loss_args"].keys() == GRPOPreset("dapo").loss_args()[1].keys()


def test_verl_s_presets_are_verl_s_factories():
    for name, fields in rollout_reference.VERL_PRESETS.items():
        assert PRESETS[name] == fields, name
        resolved = RolloutCorrectionOptions(rollout_correction_preset=name).resolve("x")
        assert resolved.rollout_is == fields.get("rollout_is")
    assert set(PRESETS) == {*rollout_reference.VERL_PRESETS, "icepop"}
    # a preset's thresholds give way to the fields given beside it (verl's factory arguments)
    custom = RolloutCorrectionOptions(
        rollout_correction_preset="decoupled_k3_rs_token_tis",
        rollout_is_threshold=5.0,
        rollout_rs_threshold=0.2,
    ).resolve("x")
    assert custom.rollout_is_threshold == 5.0 and custom.rejection[0].upper == 0.2


# ---- the CLI: exit 2 and one line, before training ---------------------------------------------------------
GOOD = {"tokens": [7, 3, 9, 4, 5, 1], "logprobs": [None, None, None, -0.5, -1.25, -2.0], "advantage": 0.5}
WITH_OLD = {**GOOD, "old_logprobs": [None, None, None, -0.625, -1.0, -2.5]}
M = "--model.init_args."
CLI_CASES = [
    (
        "cap_zero",
        [f"{M}grpo.vllm_importance_sampling_correction=true", f"{M}grpo.vllm_importance_sampling_cap=0"],
        [WITH_OLD],
        "model.grpo.vllm_importance_sampling_cap=0.0 must be a finite number > 0",
    ),
    (
        "mode_typo",
        [
            f"{M}base_loss=ppo",
            f"{M}base_loss_args={{vllm_importance_sampling_correction: true, vllm_importance_sampling_mode: "
            "token_trunc}",
        ],
        [WITH_OLD],
        "did you mean 'token_truncate'?",
    ),
    (
        "old_in_some_records",
        [f"{M}base_loss=ppo"],
        [WITH_OLD, GOOD],
        "r.jsonl:2: missing field 'old_logprobs', which {path}:1 has",
    ),
    (
        "old_other_length",
        [f"{M}base_loss=ppo"],
        [WITH_OLD, {**WITH_OLD, "old_logprobs": [None, -1.0]}],
        "r.jsonl:2: field 'old_logprobs' has 2 entries but 'logprobs' has 6",
    ),
    (
        "old_positive",
        [f"{M}base_loss=ppo"],
        [{**WITH_OLD, "old_logprobs": [None, None, None, -0.5, 0.5, -1.0]}],
        "r.jsonl:1: old_logprobs[4]=0.5 is > 0, not a log-probability",
    ),
    (
        "rs_without_old",
        [f"{M}base_loss=ppo", f"{M}base_loss_args={{rollout_rs: seq_mean_k3, rollout_rs_threshold: 0.01}}"],
        [GOOD],
        "reads batch key 'old_logprobs', which RLDataModule never provides",
    ),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("args", "records", "expected"), [c[1:] for c in CLI_CASES], ids=[c[0] for c in CLI_CASES]
)
def test_cli_bad_input_is_one_line_and_exit_2(tmp_path, capsys, args, records, expected):
    path = tmp_path / "r.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    base = [
        "fit",
        "--data=lit_losses.data.RLDataModule",
        f"--data.init_args.paths=[{path}]",
        "--data.init_args.vocab_size=10",
        "--data.init_args.seq_len=8",
        "--data.init_args.tokens_per_batch=16",
        f"{M}d_model=16",
        f"{M}n_heads=2",
        f"{M}n_layers=1",
        "--trainer.max_steps=1",
        "--trainer.logger=false",
        "--trainer.enable_checkpointing=false",
        f"--trainer.default_root_dir={tmp_path}",
    ]
    with pytest.raises(SystemExit) as exit_info:
        cli_main([*base, *args])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert exit_info.value.code == 2 and len(err) == 1, err
    assert err[0].startswith("lit-losses: error: ") and expected.replace("{path}", str(path)) in err[0], err[
        0
    ]


# ---- fields given together: the keys tell a field given at its default from one left out ---------------
CAP, CLIP_MAX, MODE = (
    "vllm_importance_sampling_cap",
    "vllm_importance_sampling_clip_max",
    "vllm_importance_sampling_mode",
)
ICEPOP = {"rollout_correction_preset": "icepop"}
GIVEN_AT_DEFAULT = {  # fields as a config writes them → the line (after "<where>.")
    "cap_beside_clip_max_at_its_default": (
        {**VLLM, CAP: 5.0, CLIP_MAX: 3.0},
        f"{CAP}=5.0 and {CLIP_MAX}=3.0 both set C_max; give {CLIP_MAX} only",
    ),
    "mode_at_its_default_beside_icepop": (
        {**ICEPOP, MODE: "sequence_mask"},
        f"{MODE}='sequence_mask' beside rollout_correction_preset 'icepop', which sets {MODE}='token_mask'",
    ),
    "clip_max_at_its_default_beside_icepop": (
        {**ICEPOP, CLIP_MAX: 3.0},
        f"{CLIP_MAX}=3.0 beside rollout_correction_preset 'icepop', which sets {CLIP_MAX}=5.0",
    ),
    "cap_at_the_default_bound_beside_icepop": (
        {**ICEPOP, CAP: 3.0},
        f"{CAP}=3.0 beside rollout_correction_preset 'icepop', which sets {CLIP_MAX}=5.0",
    ),
    "no_lower_bound_beside_icepop": (
        {**ICEPOP, "vllm_importance_sampling_clip_min": None},
        "vllm_importance_sampling_clip_min=None beside rollout_correction_preset 'icepop', which sets "
        "vllm_importance_sampling_clip_min=0.5",
    ),
    "correction_off_beside_icepop": (
        {**ICEPOP, "vllm_importance_sampling_correction": False},
        "vllm_importance_sampling_correction=False beside rollout_correction_preset 'icepop', which sets "
        "vllm_importance_sampling_correction=True",
    ),
    "no_weight_beside_a_weighting_preset": (
        {"rollout_correction_preset": "decoupled_token_is", "rollout_is": None},
        "rollout_is=None beside rollout_correction_preset 'decoupled_token_is', which sets "
        "rollout_is='token'",
    ),
}


def rl_run(tmp_path, grpo: dict) -> list[str]:
    """``lit-losses fit`` arguments of a one-step GRPO run whose ``model.grpo`` a config file writes."""
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps(WITH_OLD) + "\n")
    config = {
        "model": {"init_args": {"d_model": 16, "n_heads": 2, "n_layers": 1, "grpo": grpo}},
        "data": {
            "class_path": "lit_losses.data.RLDataModule",
            "init_args": {"paths": [str(path)], "vocab_size": 10, "seq_len": 8, "tokens_per_batch": 16},
        },
        "trainer": {"max_steps": 1, "logger": False, "enable_checkpointing": False},
    }
    (tmp_path / "grpo.yaml").write_text(json.dumps(config))  # JSON is YAML
    return ["fit", "--config", str(tmp_path / "grpo.yaml"), f"--trainer.default_root_dir={tmp_path}"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", list(GIVEN_AT_DEFAULT))
def test_fields_given_together_that_disagree_are_one_line_through_the_cli(name, tmp_path, capsys):
    """``model.grpo`` in a config file: a field given at its default beside one that sets it otherwise is
    refused before anything is built (the dataclass alone would let the other win silently)."""
    fields, expected = GIVEN_AT_DEFAULT[name]
    with pytest.raises(SystemExit) as exit_info:
        cli_main(rl_run(tmp_path, fields))
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert exit_info.value.code == 2 and len(err) == 1, err
    assert err[0] == f"lit-losses: error: model.grpo.{expected}" or f"model.grpo.{expected}" in err[0], err[0]


@pytest.mark.parametrize("name", list(GIVEN_AT_DEFAULT))
def test_fields_given_together_that_disagree_are_refused_from_a_mapping(name):
    fields, expected = GIVEN_AT_DEFAULT[name]
    with pytest.raises(ConfigError) as info:
        Objective.from_options(grpo=fields)
    assert f"model.grpo.{expected}" in str(info.value)
    with pytest.raises(ConfigError) as info:
        Objective.from_options(base_loss="ppo", base_loss_args=fields)
    assert f"{A}{expected}" in str(info.value)


@pytest.mark.filterwarnings("ignore:.*vllm_importance_sampling_cap is deprecated")
def test_a_field_given_alone_or_overriding_a_preset_is_taken():
    """One name of ``C_max``; a preset's threshold replaced by another value (the deprecated name too); a
    preset written out whole (a checkpoint's hyper-parameters: every field) loads as it ran."""
    alone = Objective.from_options(grpo={**VLLM, CAP: 5.0}).base_loss.correction
    assert (alone.vllm_mode, alone.clip_min, alone.clip_max) == ("sequence_mask", None, 5.0)
    for name in (CLIP_MAX, CAP):
        tighter = Objective.from_options(grpo={**ICEPOP, name: 2.0}).base_loss.correction
        assert (tighter.vllm_mode, tighter.clip_min, tighter.clip_max) == ("token_mask", 0.5, 2.0), name
    whole = plain_data(GRPOPreset(**VLLM, vllm_importance_sampling_cap=5.0))
    assert whole[CAP] == 5.0 and whole[CLIP_MAX] == 3.0  # every field, the bound at its default
    assert Objective.from_options(grpo=whole).base_loss.correction.clip_max == 5.0


@pytest.mark.timeout(120)
@pytest.mark.filterwarnings("ignore:.*vllm_importance_sampling_cap is deprecated")
def test_the_deprecated_bound_alone_trains_through_the_cli(tmp_path):
    cli = cli_main([*rl_run(tmp_path, {**VLLM, CAP: 5.0}), "--trainer.enable_progress_bar=false"])
    assert cli.trainer.global_step == 1 and cli.model.objective.base_loss.correction.clip_max == 5.0
