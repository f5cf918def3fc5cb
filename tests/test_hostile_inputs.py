"""A TRL user's inputs on the preference, distillation, rollout-correction and checkpoint paths, run the
user's way: ``lit-losses fit`` with a config file (in this process, `cli_main`), ``lit-losses checkpoint``
(`checkpoint_main`) and the same calls from Python.

A ``null`` given on the command line to an option nested in a class's option arrives as null (it
arrived as the string ``'None'``); every refused input is one ``lit-losses: error:`` line naming the value
and where it came from, with exit code 2, before training.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from lit_losses import TinyLM
from lit_losses.cli.app import cli_main
from lit_losses.cli.checkpoint import checkpoint_main
from lit_losses.data.distill_records import parse_distill_record
from lit_losses.errors import ConfigError
from lit_losses.models.frozen import check_frozen_source
from lit_losses.objectives import DPOPreset
from tests.loss.distill_step import save_teacher

pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI.s args parameter")

M, D = "--model.init_args.", "--data.init_args."
TRAINER = {
    "accelerator": "cpu",
    "max_steps": 1,
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
}
TINY = {"d_model": 16, "n_layers": 1, "n_heads": 2}
PAIRS = [
    {"prompt": f"What is {i} + {i}?", "chosen": f" {2 * i}.", "rejected": f" {2 * i + 1}."} for i in range(6)
]
TOPK = {
    "tokens": [2, 5, 6, 3],
    "teacher_topk_ids": [None, [5, 1], [6, 2], [3, 4]],
    "teacher_topk_logprobs": [None, [-0.7, -2.0], [-0.25, -2.5], [-0.1, -3.0]],
}
NULL_ID = [None, None, [6, 2], [3, 4]]  # position 1: no top-k ids, but log-probabilities
TEACHER = {  # a transformers config as the recipe gives it (random weights, nothing downloaded)
    "model_type": "llama",
    "vocab_size": 8,
    "hidden_size": 8,
    "intermediate_size": 16,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
}


def write_jsonl(path: Path, records: list) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def dpo_config(tmp_path: Path, pairs: list | None = None) -> str:
    """A DPO recipe (TRL's field names) on a tiny TinyLM, as a user writes it."""
    config = {
        "trainer": {**TRAINER, "default_root_dir": str(tmp_path / "run")},
        "model": {
            "class_path": "lit_losses.TinyLM",
            "init_args": {
                **TINY,
                "dpo": {"loss_type": "sigmoid", "beta": 0.1},
                "ref_model": "initial_policy",
            },
        },
        "data": {
            "class_path": "lit_losses.PreferenceDataModule",
            "init_args": {
                "paths": [write_jsonl(tmp_path / "pairs.jsonl", PAIRS if pairs is None else pairs)],
                "vocab_size": 300,
                "max_length": 32,
                "tokens_per_batch": 64,
                "cache_dir": str(tmp_path / "cache"),
            },
        },
    }
    (tmp_path / "dpo.yaml").write_text(yaml.safe_dump(config))
    return str(tmp_path / "dpo.yaml")


def distill_config(tmp_path: Path, records: list | None = None) -> str:
    """Offline distillation from top-k records, on top of a config that names a teacher model (as a user
    who switches ``configs/distill.yaml`` to offline data from the command line)."""
    config = {
        "trainer": {**TRAINER, "default_root_dir": str(tmp_path / "run")},
        "model": {
            "class_path": "lit_losses.TinyLM",
            "init_args": {**TINY, "distillation": {"teacher": TEACHER, "loss": "jsd", "beta": 0.5}},
        },
        "data": {
            "class_path": "lit_losses.data.DistillationDataModule",
            "init_args": {
                "paths": [write_jsonl(tmp_path / "topk.jsonl", [TOPK] * 8 if records is None else records)],
                "vocab_size": 8,
                "seq_len": 4,
                "tokens_per_batch": 8,
            },
        },
    }
    (tmp_path / "distill.yaml").write_text(yaml.safe_dump(config))
    return str(tmp_path / "distill.yaml")


def refused(args: list[str], capsys) -> str:
    """The one error line of ``lit-losses <args>`` (exit code 2, no traceback)."""
    with pytest.raises(SystemExit) as exit_info:
        cli_main(args)
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("lit-losses") or "Traceback" in ln]
    assert exit_info.value.code == 2, err
    assert len(lines) == 1 and lines[0].startswith("lit-losses: error: "), err
    return lines[0].removeprefix("lit-losses: error: ")


def printed_config(args: list[str], capsys) -> dict:
    """The config ``lit-losses fit … --print_config`` prints (parsed, nothing built)."""
    with pytest.raises(SystemExit) as exit_info:
        cli_main([*args, "--print_config"])
    assert exit_info.value.code == 0
    return yaml.safe_load(capsys.readouterr().out)


# ---------------------------------------------------------------------------------------------------
# null from the command line
# ---------------------------------------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_teacher_null_from_the_command_line_trains_on_the_offline_top_k(tmp_path):
    cli = cli_main(["fit", "--config", distill_config(tmp_path), f"{M}distillation.teacher=null"])
    distillation = cli.model.objective.distillation.config
    assert distillation.teacher is None and distillation.offline
    assert (distillation.loss, distillation.beta) == ("jsd", 0.5)  # the file's other fields are kept
    assert cli.trainer.global_step == 1 and "teacher" not in cli.model.frozen_sources


@pytest.mark.parametrize(
    ("args", "path", "expected"),
    [
        ([f"{M}distillation.teacher=null"], ("distillation", "teacher"), None),
        (["--model.distillation.teacher=null"], ("distillation", "teacher"), None),
        ([f"{M}distillation.teacher", "null"], ("distillation", "teacher"), None),
        ([f"{M}distillation.teacher=~"], ("distillation", "teacher"), None),
        (
            [f"{M}distillation.teacher={json.dumps({**TEACHER, 'rope_scaling': None})}"],
            ("distillation", "teacher"),
            {**TEACHER, "rope_scaling": None},
        ),
        ([f"{M}base_loss_args.rollout_is_threshold=null"], ("base_loss_args", "rollout_is_threshold"), None),
        ([f"{M}optimizer.total_steps=null"], ("optimizer", "total_steps"), None),
        ([f"{M}distillation.teacher=runs/teacher"], ("distillation", "teacher"), "runs/teacher"),
    ],
    ids=[
        "equals",
        "short_path",
        "two_tokens",
        "tilde",
        "null_inside_a_mapping",
        "dict_option",
        "int",
        "path",
    ],
)
def test_a_nested_option_reads_null_as_null(args, path, expected, tmp_path, capsys):
    base = ["fit", "--config", distill_config(tmp_path), f"{M}base_loss_args={{rollout_is_threshold: 2.0}}"]
    options = printed_config([*base, f"{M}optimizer.total_steps=10", *args], capsys)["model"]["init_args"]
    assert options[path[0]][path[1]] == expected
    if path[0] == "distillation":
        assert options["distillation"]["loss"] == "jsd"  # set in the file, not replaced


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("option", "expected"),
    [
        (
            f"{D}tokens_per_batch",
            "data.init_args.tokens_per_batch=null: expected int; remove the option for its default (4096)",
        ),
        (
            f"{D}val_fraction",
            "data.init_args.val_fraction=null: expected float; remove the option for its default",
        ),
        (
            f"{D}truncation_mode",
            "data.init_args.truncation_mode=null: expected one of ('keep_start', 'keep_end')",
        ),
        (
            f"{M}tie_embeddings",
            "model.init_args.tie_embeddings=null: expected bool; remove the option for its default (True)",
        ),
        (f"{M}dpo.loss_type", "model.init_args.dpo.loss_type=null: expected one of ('sigmoid', 'hinge',"),
        (
            f"{M}optimizer",
            "model.init_args.optimizer=null: expected OptimizerConfig; remove the option for its default",
        ),
        (
            f"{M}vocab_size",
            "model.init_args.vocab_size=null: model.init_args.vocab_size is set from "
            "data.init_args.vocab_size when the data module is built",
        ),
    ],
    ids=["int", "float", "choice", "bool_read_as_false", "dataclass_field", "dataclass", "linked"],
)
def test_null_for_an_option_without_null_is_refused_before_anything_is_built(
    option, expected, tmp_path, capsys
):
    line = refused(["fit", "--config", dpo_config(tmp_path), f"{option}=null"], capsys)
    assert line.startswith(expected), line


def test_null_where_the_option_takes_it_is_taken(tmp_path, capsys):
    args = ["fit", "--config", dpo_config(tmp_path), f"{D}max_length=null", f"{M}dpo.ld_alpha=null"]
    options = printed_config(args, capsys)
    assert (
        options["data"]["init_args"]["max_length"] is None
        and options["model"]["init_args"]["dpo"]["ld_alpha"] is None
    )
    cli = cli_main([*args, f"{D}tokens_per_batch=256"])  # no truncation: the longest pair must fit
    assert cli.trainer.global_step == 1 and cli.datamodule.hparams.max_length is None


# ---------------------------------------------------------------------------------------------------
# refused inputs, each one line naming the value and where it came from
# ---------------------------------------------------------------------------------------------------
def pairs_without_prompt(tmp_path: Path) -> list[str]:
    return [f"{D}paths=[{write_jsonl(tmp_path / 'bad.jsonl', [*PAIRS[:2], {**PAIRS[2], 'prompt': None}])}]"]


def reference_of_another_vocabulary(tmp_path: Path) -> list[str]:
    save_teacher(str(tmp_path / "other.ckpt"), vocab_size=301)
    return [f"{M}ref_model={tmp_path / 'other.ckpt'}"]


DPO_CASES = {
    "dpo_field_misspelled": (
        lambda tmp: [f"{M}dpo.betta=0.1"],
        "model.init_args.dpo.betta: not an option of DPOPreset; did you mean 'beta'?",
    ),
    "dpo_trl_max_length": (
        lambda tmp: [f"{M}dpo.max_length=512"],
        "model.init_args.dpo.max_length: not an option of DPOPreset; TRL's max_length is "
        "data.init_args.max_length here",
    ),
    "dpo_trl_rpo_alpha": (
        lambda tmp: [f"{M}dpo.rpo_alpha=0.5"],
        "TRL's rpo_alpha is model.dpo.loss_type: [sigmoid, sft] with model.dpo.loss_weights: "
        "[1.0, <rpo_alpha>]",
    ),
    "trl_learning_rate": (
        lambda tmp: [f"{M}optimizer.learning_rate=1e-5"],
        "model.init_args.optimizer.learning_rate: not an option of OptimizerConfig; TRL's learning_rate is "
        "model.init_args.optimizer.lr here",
    ),
    "trl_gradient_accumulation_steps": (
        lambda tmp: ["--trainer.gradient_accumulation_steps=4"],
        "trainer.gradient_accumulation_steps: not an option of Trainer; TRL's gradient_accumulation_steps is "
        "trainer.accumulate_grad_batches here",
    ),
    "trainer_option_misspelled": (
        lambda tmp: ["--trainer.max_stepz=4"],
        "trainer.max_stepz: not an option of Trainer; did you mean 'max_steps'?",
    ),
    "packing_of_preference_data": (
        lambda tmp: [f"{D}packing=true"],
        "data.init_args.packing: not an option of PreferenceDataModule; its options: paths, tokenizer,",
    ),
    "dpo_given_a_loss_type_alone": (
        lambda tmp: [f"{M}dpo=sigmoid"],
        "model.init_args.dpo: expected a mapping of DPOPreset's fields (loss_type, beta,",
    ),
    "dpo_beta_null": (
        lambda tmp: [f"{M}dpo.beta=null"],
        "model.init_args.dpo.beta=null: expected float; remove the option for its default (0.1)",
    ),
    "reference_keyword_misspelled": (
        lambda tmp: [f"{M}ref_model=initial-policy"],
        "model.ref_model='initial-policy': no such file or directory; did you mean 'initial_policy'?",
    ),
    "reference_python_none": (
        lambda tmp: [f"{M}ref_model=None"],
        "model.ref_model='None': no such file or directory; for none write null, not the string 'None'",
    ),
    "reference_of_another_vocabulary": (
        reference_of_another_vocabulary,
        "other.ckpt' has a vocabulary of 301 tokens and the policy (TinyLM) 300: the reference scores the "
        "policy's tokens (the same tokenizer)",
    ),
    "preference_prompt_null": (
        pairs_without_prompt,
        "bad.jsonl:3: field 'prompt' is a NoneType, not a string or a list of messages",
    ),
    "preference_records_as_sft_data": (
        lambda tmp: [
            "--data=lit_losses.TextDataModule",
            f"{D}paths=[{tmp / 'pairs.jsonl'}]",
            f"{D}seq_len=32",
            f"{D}tokens_per_batch=64",
            f"{D}vocab_size=300",
        ],
        "pairs.jsonl:1: a preference record (chosen/rejected): train it with data.class_path: "
        "PreferenceDataModule",
    ),
    "hub_dataset_name_as_path": (
        lambda tmp: [f"{D}paths=[trl-lib/ultrafeedback_binarized]"],
        "data.paths entry 'trl-lib/ultrafeedback_binarized' matches no file (a Hugging Face Hub dataset "
        "name? nothing is downloaded",
    ),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", list(DPO_CASES))
def test_refused_preference_input_is_one_line(name, tmp_path, capsys):
    extra, expected = DPO_CASES[name]
    config = dpo_config(tmp_path)
    line = refused(["fit", "--config", config, *extra(tmp_path)], capsys)
    assert expected.replace("{tmp}", str(tmp_path)) in line, line
    assert not (tmp_path / "run" / "checkpoints").exists()


DISTILL_CASES = {
    "trl_gkd_lmbda": (
        lambda tmp: [f"{M}distillation.lmbda=0.5"],
        "model.init_args.distillation.lmbda: not an option of DistillationConfig; TRL's lmbda has no "
        "counterpart: nothing is generated during training",
    ),
    "teacher_model_beside_offline_top_k": (
        lambda tmp: [],
        "model.distillation.teacher=config(model_type='llama') computes the teacher's distributions, but "
        "DistillationDataModule carries an offline teacher's (teacher_topk_ids, teacher_topk_logprobs), "
        "which would go unused; set model.distillation.teacher: null",
    ),
    "top_k_id_null_beside_log_probabilities": (
        lambda tmp: [
            f"{M}distillation.teacher=null",
            f"{D}paths=[{write_jsonl(tmp / 'x.jsonl', [TOPK, {**TOPK, 'teacher_topk_ids': NULL_ID}])}]",
        ],
        "x.jsonl:2: teacher_topk_ids[1] is null but teacher_topk_logprobs[1] is not; give both or neither",
    ),
    "trl_prompt_completion_as_top_k_records": (
        lambda tmp: [
            f"{M}distillation.teacher=null",
            f"{D}paths=[{write_jsonl(tmp / 'x.jsonl', [{'prompt': 'hi', 'completion': ' there'}])}]",
        ],
        "x.jsonl:1: missing field 'tokens' (a record holds token ids: tokens, teacher_topk_ids, "
        "teacher_topk_logprobs, completion_mask); it has ['completion', 'prompt']",
    ),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", list(DISTILL_CASES))
def test_refused_distillation_input_is_one_line(name, tmp_path, capsys):
    extra, expected = DISTILL_CASES[name]
    line = refused(["fit", "--config", distill_config(tmp_path), *extra(tmp_path)], capsys)
    assert expected in line, line


@pytest.mark.timeout(60)
def test_a_run_refused_at_set_up_prints_its_line_only_and_leaves_no_run_folder(tmp_path, capsys):
    pairs = [*PAIRS[:2], {"prompt": "2 + 2 =", "chosen": " 4"}]  # no rejected completion
    root = tmp_path / "root"
    args = ["fit", "--config", dpo_config(tmp_path, pairs), "--trainer.logger=true"]
    with pytest.raises(SystemExit) as exit_info:
        cli_main([*args, f"--trainer.default_root_dir={root}"])
    captured = capsys.readouterr()
    assert exit_info.value.code == 2
    assert "pairs.jsonl:3: missing field 'rejected'" in captured.err
    assert "fit ended" not in captured.out and "tensorboard --logdir" not in captured.out, captured.out
    assert not list(root.rglob("run_end.json")) and not list(root.rglob("version_*"))


# ---------------------------------------------------------------------------------------------------
# lit-losses checkpoint
# ---------------------------------------------------------------------------------------------------
def checkpoint_error(args: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        checkpoint_main(args)
    captured = capsys.readouterr()
    lines = [ln for ln in captured.err.splitlines() if ln.strip()]
    assert exit_info.value.code == 2, captured
    assert len(lines) == 1 and lines[0].startswith("lit-losses: error: "), captured
    assert not captured.out.strip(), captured.out  # no "unverifiable" verdict beside the error
    return lines[0]


def test_checkpoint_verify_refuses_what_is_no_checkpoint(tmp_path, capsys):
    save_teacher(str(tmp_path / "whole.ckpt"))
    data = (tmp_path / "whole.ckpt").read_bytes()
    (tmp_path / "cut.ckpt").write_bytes(data[: len(data) // 2])  # no manifest: plain Lightning's, truncated
    (tmp_path / "empty").mkdir()
    line = checkpoint_error(["verify", str(tmp_path / "cut.ckpt")], capsys)
    assert f"lit-losses checkpoint verify: {tmp_path / 'cut.ckpt'} is not a readable checkpoint (" in line
    line = checkpoint_error(["verify", str(tmp_path / "empty")], capsys)
    assert f"{tmp_path / 'empty'}: a folder without meta.pt, not a sharded checkpoint" in line
    checkpoint_main(["verify", str(tmp_path / "whole.ckpt")])  # readable, no manifest: a warning
    captured = capsys.readouterr()
    assert captured.out.strip() == f"lit-losses: {tmp_path / 'whole.ckpt'}: unverifiable"
    assert "has no manifest" in captured.err


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (
            ["verfy", "x.ckpt"],
            "checkpoint: argument command: invalid choice: 'verfy' (choose from 'convert', ",
        ),
        ([], "checkpoint: the following arguments are required: command"),
        (["convert", "a.ckpt"], "checkpoint convert: the following arguments are required: DST"),
    ],
    ids=["misspelled", "no_command", "no_target"],
)
def test_checkpoint_argument_errors_are_one_line(args, expected, capsys):
    line = checkpoint_error(args, capsys)
    assert expected in line, line
    if args[:1] == ["verfy"]:
        assert line.endswith("did you mean 'verify'?")


# ---------------------------------------------------------------------------------------------------
# the same from Python
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("call", "expected"),
    [
        (
            lambda: TinyLM(vocab_size=300, **TINY, dpo={"max_length": 512}),
            "model.dpo.max_length: not a field of model.dpo; TRL's max_length is data.init_args.max_length "
            "here",
        ),
        (
            lambda: TinyLM(vocab_size=300, **TINY, distillation={"seq_kd": True}),
            "model.distillation.seq_kd: not a field of model.distillation; TRL's seq_kd has no counterpart",
        ),
        (
            lambda: DPOPreset(loss_type=["sigmoid", "sft"], loss_weights="1,0.2"),
            "model.dpo.loss_weights='1,0.2': one finite weight per loss type, 2 for ('sigmoid', 'sft')",
        ),
        (
            lambda: check_frozen_source("disabled-adapters", "model.ref_model"),
            "model.ref_model='disabled-adapters': no such file or directory; did you mean "
            "'disabled_adapters'?",
        ),
        (
            lambda: parse_distill_record(
                {**TOPK, "teacher_topk_logprobs": [None, None, *TOPK["teacher_topk_logprobs"][2:]]}, "r[0]"
            ),
            "r[0]: teacher_topk_logprobs[1] is null but teacher_topk_ids[1] is not; give both or neither",
        ),
    ],
    ids=[
        "dpo_trl_field",
        "distillation_trl_field",
        "loss_weights_string",
        "keyword_misspelled",
        "top_k_null",
    ],
)
def test_python_api_names_the_value(call, expected):
    with pytest.raises(ConfigError) as info:
        call()
    assert str(info.value) == expected or expected in str(info.value), str(info.value)
    assert "\n" not in str(info.value)


def test_a_path_is_never_taken_for_a_misspelled_keyword(tmp_path):
    with pytest.raises(ConfigError) as info:
        check_frozen_source(str(tmp_path / "initial_polcy"), "model.ref_model")
    assert "did you mean" not in str(info.value) and "give a Hugging Face checkpoint directory" in str(
        info.value
    )
