"""``lit-losses from-trl``: TRL configs (as ``trl sft|dpo|kto|grpo --config`` reads them) become
``lit-losses fit`` configs that train as TRL's trainers would.

TRL 1.16 is the peer here: its dataclasses are the reference of every field, kind and default the converter
knows (the drift guard), its ``DPOTrainer`` built from the same YAML the reference of the optimizer, the
schedule, the clipping, the loss fields and the dropout; the converted configs of TRL-style files run with
``lit-losses fit`` on the "Coming from TRL" page's stand-in model and data.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import json
import runpy
import types
import typing
import warnings
from pathlib import Path
from typing import Any, get_args

import pytest
import trl
import yaml

from lit_losses.cli.from_trl import from_trl_main
from lit_losses.cli.trl_config import read_trl_config
from lit_losses.cli.trl_convert import PRESETS, VLLM_CORRECTION, convert
from lit_losses.cli.trl_schema import (
    ACCELERATE_LAUNCH,
    CONFIG_CLASSES,
    LOSS_TYPES,
    TRLTrainer,
    trainer_fields,
)
from lit_losses.trl_fields import TRL_FIELDS, TRL_OPTIONS, trl_hint
from tests.docs_blocks import DOCS, write_titled_blocks

TRAINERS: tuple[str, ...] = get_args(TRLTrainer)
KIND_NAMES = {
    bool: "bool",
    int: "int",
    float: "float",
    str: "str",
    list: "list",
    dict: "dict",
    type(None): "none",
}


def trl_config_class(trainer: str) -> type:
    """TRL's config class of ``trainer`` (the experimental ones imported quietly)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from trl.experimental.cpo import CPOConfig
        from trl.experimental.gkd import GKDConfig
        from trl.experimental.orpo import ORPOConfig
    own = {"CPOConfig": CPOConfig, "ORPOConfig": ORPOConfig, "GKDConfig": GKDConfig}
    return own.get(CONFIG_CLASSES[trainer]) or getattr(trl, CONFIG_CLASSES[trainer])


def kinds(annotation: Any) -> tuple[str, ...]:
    """The YAML kinds of value of a dataclass field's annotation, as the converter's table names them."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return tuple(dict.fromkeys(k for arg in typing.get_args(annotation) for k in kinds(arg)))
    if origin is typing.Literal:
        return tuple(dict.fromkeys(KIND_NAMES[type(arg)] for arg in typing.get_args(annotation)))
    if origin in (list, dict):
        return (KIND_NAMES[origin],)
    if annotation in KIND_NAMES:
        return (KIND_NAMES[annotation],)
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return ("str",)
    return ("any",)


def default(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        value = field.default
    elif field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
    else:
        value = None
    return value.value if isinstance(value, enum.Enum) else value


def trl_fields_of(trainer: str) -> dict[str, tuple[tuple[str, ...], Any]]:
    """Every field of ``trl <trainer> --config``: the script's dataclasses, by TRL's own parser's list."""
    from trl import DatasetMixtureConfig, ModelConfig, ScriptArguments
    from trl.scripts.grpo import GRPOScriptArguments

    script = GRPOScriptArguments if trainer == "grpo" else ScriptArguments
    found = {}
    for cls in (script, ModelConfig, DatasetMixtureConfig, trl_config_class(trainer)):
        found |= {f.name: (kinds(f.type), default(f)) for f in dataclasses.fields(cls) if f.init}
    return found


@pytest.mark.parametrize("trainer", TRAINERS)
def test_the_fields_kinds_and_defaults_are_trl_s(trainer):
    """The drift guard: the converter's table of each trainer's fields, their kinds and defaults is TRL
    1.16's dataclasses (``ScriptArguments``, ``ModelConfig``, ``DatasetMixtureConfig``, the trainer's
    config over transformers' ``TrainingArguments``), field for field."""
    ours = {name: spec for name, spec in trainer_fields(trainer).items() if name not in ACCELERATE_LAUNCH}
    theirs = trl_fields_of(trainer)
    assert sorted(ours) == sorted(theirs)
    for name, (field_kinds, value) in theirs.items():
        assert ours[name][0] == field_kinds, name
        assert ours[name][1] == value and type(ours[name][1]) is type(value), name


def test_the_loss_fields_and_loss_types_are_trl_s_and_the_presets():
    """Each preset's TRL fields are the loss fields the converter writes under ``model.<trainer>``; the loss
    types are TRL's choices (the presets' for DPO and GRPO, whose TRL fields list none)."""
    from lit_losses.objectives import (
        CPOPreset,
        DPOLossType,
        DPOPreset,
        GRPOPreset,
        KTOPreset,
        ORPOPreset,
        TRLLossType,
    )

    presets = {"dpo": DPOPreset, "kto": KTOPreset, "cpo": CPOPreset, "orpo": ORPOPreset, "grpo": GRPOPreset}
    for trainer, preset in presets.items():
        shared = {f.name for f in dataclasses.fields(preset)} & set(trl_fields_of(trainer))
        special = set(VLLM_CORRECTION) | {"max_completion_length"} if trainer == "grpo" else set()
        assert set(PRESETS[trainer]) == shared - special, trainer
    for trainer in ("sft", "gkd", "kto", "cpo"):
        (field,) = [f for f in dataclasses.fields(trl_config_class(trainer)) if f.name == "loss_type"]
        assert LOSS_TYPES[trainer] == tuple(field.metadata["choices"]), trainer
    assert LOSS_TYPES["dpo"] == get_args(DPOLossType) and LOSS_TYPES["grpo"] == get_args(TRLLossType)


def minimal(tmp_path: Path, trainer: str, **fields: Any) -> dict[str, Any]:
    """The converted config of a TRL config of ``fields`` (a model only, by default)."""
    source = tmp_path / f"{trainer}.yaml"
    source.write_text(yaml.safe_dump({"model_name_or_path": "Qwen/Qwen2.5-0.5B", **fields}))
    return convert(read_trl_config(str(source), trainer=trainer)).config.values()


@pytest.mark.parametrize("trainer", TRAINERS)
def test_trl_s_defaults_are_written_where_ours_differ(trainer, tmp_path):
    """A config that gives a model only trains with TRL's defaults: transformers' AdamW, its linear decay
    to 0 without warmup, the trainer's learning rate, clipping, bf16, logging, epochs, seed, dropout,
    gradient checkpointing, the rows' length; each differs from this package's own default."""
    from lightning.pytorch import Trainer

    from lit_losses import HFCausalLM, PreferenceDataModule
    from lit_losses.data.hf_text import HFTextDataModule
    from lit_losses.optim import OptimizerConfig

    trl_default = {f.name: default(f) for f in dataclasses.fields(trl_config_class(trainer))}
    ours = minimal(tmp_path, trainer)
    optimizer = ours["model"]["init_args"]["optimizer"]
    assert optimizer == {
        "lr": trl_default["learning_rate"],
        "betas": [trl_default["adam_beta1"], trl_default["adam_beta2"]],
        "eps": trl_default["adam_epsilon"],
        "weight_decay": trl_default["weight_decay"],
        "schedule": trl_default["lr_scheduler_type"],
        "min_lr_ratio": 0.0,
        "warmup_steps": trl_default["warmup_steps"],
    }
    assert OptimizerConfig(**optimizer) != OptimizerConfig().resolved()
    assert ours["seed_everything"] == trl_default["seed"]
    assert ours["trainer"] == {
        "max_epochs": trl_default["num_train_epochs"],
        "precision": "bf16-mixed",  # TRL's bf16: true unless fp16
        "gradient_clip_val": trl_default["max_grad_norm"],
        "log_every_n_steps": trl_default["logging_steps"],
    }
    import inspect

    lightning = inspect.signature(Trainer.__init__).parameters
    for option in ("precision", "gradient_clip_val", "log_every_n_steps", "max_epochs"):
        assert ours["trainer"][option] != lightning[option].default, option
    model = ours["model"]["init_args"]
    assert (
        model["dtype"] == "float32"
        and model["gradient_checkpointing"] is trl_default["gradient_checkpointing"]
    )
    assert model.get("disable_dropout", False) is trl_default.get("disable_dropout", False)
    assert inspect.signature(HFCausalLM).parameters["disable_dropout"].default is False
    data = ours["data"]["init_args"]
    if trainer in ("dpo", "kto", "cpo", "orpo"):
        assert data["max_length"] == trl_default["max_length"] == 1024
        assert data["tokens_per_batch"] == 2 * trl_default["per_device_train_batch_size"] * 1024
        assert (
            inspect.signature(PreferenceDataModule).parameters["tokens_per_batch"].default
            != data["tokens_per_batch"]
        )
    elif trainer in ("sft", "gkd"):
        assert (
            data["seq_len"] == trl_default["max_length"] == 1024 and data["packing"] is trl_default["packing"]
        )
        assert (
            data["val_fraction"] == 0.0
            and data["tokens_per_batch"] == trl_default["per_device_train_batch_size"] * 1024
        )
        text = inspect.signature(HFTextDataModule.__mro__[1]).parameters
        assert text["seq_len"].default != 1024 and text["packing"].default is True


def test_values_given_as_trl_s_parser_reads_them(tmp_path):
    """Strings of numbers and booleans (TRL's parser converts them), LoRA, a cosine schedule with a floor,
    a warmup fraction, fp16, a DPO loss list, TRL's former ``warmup_ratio`` and ``torch_dtype``."""
    ours = minimal(
        tmp_path,
        "dpo",
        learning_rate="5e-7",
        fp16="true",
        use_peft=True,
        lora_r=8,
        lora_target_modules=["q_proj", "v_proj"],
        lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr_rate": 0.1},
        warmup_ratio=0.1,
        torch_dtype="bfloat16",
        loss_type=["sigmoid", "sft"],
        loss_weights=[1.0, 0.5],
        max_steps=100,
    )
    init = ours["model"]["init_args"]
    assert init["optimizer"]["lr"] == 5e-7 and ours["trainer"]["precision"] == "16-mixed"
    assert init["optimizer"]["warmup_ratio"] == 0.1
    assert (init["optimizer"]["schedule"], init["optimizer"]["min_lr_ratio"]) == ("cosine", 0.1)
    assert init["optimizer"]["warmup_start_ratio"] == 0.0 and "warmup_steps" not in init["optimizer"]
    assert init["lora"] == {
        "r": 8,
        "lora_alpha": 32,
        "lora_dropout": 0.05,
        "target_modules": ["q_proj", "v_proj"],
    }
    assert init["dtype"] == "bfloat16" and init["dpo"]["loss_type"] == ["sigmoid", "sft"]
    assert ours["trainer"]["max_steps"] == 100 and "max_epochs" not in ours["trainer"]


def run_from_trl(args: list[str], capsys) -> tuple[int, str, str]:
    """``lit-losses from-trl ARGS``: exit code, stdout, stderr."""
    code = 0
    try:
        from_trl_main(args)
    except SystemExit as exit_:
        code = exit_.code
    out, err = capsys.readouterr()
    return code, out, err


BAD = {
    "not YAML": (
        "beta: 0.1\nloss_type: sigmoid: hinge\n",
        r"bad\.yaml:2: not YAML \(mapping values are not allowed",
    ),
    "not a mapping": ("- beta\n- 0.1\n", r"bad\.yaml: expected a mapping of TRL config fields .* got list"),
    "unknown field": (
        "betta: 0.1\n",
        r"bad\.yaml: betta is not a field of TRL's DPOConfig .*did you mean 'beta'\?",
    ),
    "other trainer's field": (
        "lmbda: 0.5\n",
        r"lmbda is not a field of TRL's DPOConfig .*it is a field of GKDConfig",
    ),
    "wrong type": (
        "learning_rate: fast\n",
        r"bad\.yaml: learning_rate: expected a number \(float\), got 'fast'",
    ),
    "wrong list": ("use_peft: [1]\n", r"bad\.yaml: use_peft: expected true or false, got \[1\]"),
    "not a mapping's JSON": (
        "model_init_kwargs: '{dtype: bfloat16'\n",
        r"model_init_kwargs: expected a mapping \(or its JSON text\)",
    ),
    "no step": (
        "num_train_epochs: 0\n",
        r"bad\.yaml: num_train_epochs=0 with max_steps=-1 trains no step in TRL",
    ),
    "no record": (
        "per_device_train_batch_size: 0\n",
        r"bad\.yaml: per_device_train_batch_size=0 must be >= 1",
    ),
    "loss type": (
        "loss_type: sigmod\n",
        r"loss_type 'sigmod' is not one of DPOConfig's: .*did you mean 'sigmoid'\?",
    ),
}


@pytest.mark.parametrize("case", BAD, ids=list(BAD))
def test_bad_input_is_one_line_exit_2_and_nothing_written(case, tmp_path, capsys):
    import re

    text, expected = BAD[case]
    (tmp_path / "bad.yaml").write_text(text)
    target = tmp_path / "ours.yaml"
    code, out, err = run_from_trl([str(tmp_path / "bad.yaml"), "--trainer", "dpo", "-o", str(target)], capsys)
    assert code == 2 and out == "" and not target.exists()
    assert len(err.splitlines()) == 1 and err.startswith("lit-losses: error: from-trl: "), err
    assert re.search(expected, err), err


def test_the_output_is_never_the_trl_config_itself(tmp_path, capsys, monkeypatch):
    """``-o`` naming the TRL config (by another spelling too) is one line, exit 2, the file unchanged."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "dpo.yaml").write_text("beta: 0.1\n")
    code, out, err = run_from_trl(["dpo.yaml", "--trainer", "dpo", "-o", "./dpo.yaml"], capsys)
    assert code == 2 and out == "" and (tmp_path / "dpo.yaml").read_text() == "beta: 0.1\n"
    expected = "-o ./dpo.yaml is the TRL config itself; write the conversion elsewhere"
    assert err == f"lit-losses: error: from-trl: {expected}\n"


def test_the_trainer_is_inferred_when_the_fields_tell_it(tmp_path, capsys):
    """Fields (and values: a loss type, a list) that one trainer's config takes give the trainer; fields
    that several take are one line naming them; a trainer that is not TRL's gets the closest name."""
    cases = {
        "grpo.yaml": ({"num_generations": 4, "reward_funcs": ["accuracy_reward"]}, "GRPOConfig"),
        "kto.yaml": ({"loss_type": "apo_zero_unpaired", "desirable_weight": 1.0}, "KTOConfig"),
        "dpo.yaml": ({"loss_type": ["sigmoid"], "beta": 0.1}, "DPOConfig"),
        "gkd.yaml": ({"lmbda": 0.5, "seq_kd": False}, "GKDConfig"),
    }
    for name, (fields, config_class) in cases.items():
        (tmp_path / name).write_text(yaml.safe_dump(fields))
        code, out, err = run_from_trl([str(tmp_path / name)], capsys)
        assert code == 0 and f"({config_class}) converted" in out, (name, err)
    (tmp_path / "both.yaml").write_text("beta: 0.1\nloss_type: sigmoid\n")
    code, _, err = run_from_trl([str(tmp_path / "both.yaml")], capsys)
    assert code == 2 and "several TRL trainers (dpo, cpo); give --trainer dpo|cpo" in err, err
    code, _, err = run_from_trl([str(tmp_path / "both.yaml"), "--trainer", "dop"], capsys)
    assert code == 2 and err.count("\n") == 1 and "did you mean 'dpo'?" in err, err


def test_each_line_names_its_trl_field_and_the_rest_is_a_note(tmp_path, capsys):
    """Every written option's comment names the TRL field(s) it came from; a field without counterpart
    at a value other than TRL's default is one stderr line with the hint of `lit_losses.trl_fields`
    (the same text as an unknown option's hint); at TRL's default it is silent."""
    fields = {
        "model_name_or_path": "my-model",
        "dataset_name": "trl-lib/ultrafeedback_binarized",
        "beta": 0.05,
        "sync_ref_model": True,
        "push_to_hub": False,
        "report_to": "wandb",
        "per_device_train_batch_size": 4,
        "max_length": 512,
    }
    (tmp_path / "dpo.yaml").write_text(yaml.safe_dump(fields))
    code, out, err = run_from_trl([str(tmp_path / "dpo.yaml"), "--trainer", "dpo"], capsys)
    assert code == 0
    notes = err.splitlines()
    sync = f"sync_ref_model=True not converted: TRL's sync_ref_model {TRL_FIELDS['sync_ref_model']}"
    assert f"lit-losses: from-trl: {sync}" in notes
    assert any(
        line.startswith("lit-losses: from-trl: report_to='wandb'") and trl_hint("report_to")[2:] in line
        for line in notes
    )
    assert not any("push_to_hub" in line for line in notes)
    hub = [line for line in notes if "dataset_name=" in line]
    assert (
        len(hub) == 1 and "datasets.load_dataset('trl-lib/ultrafeedback_binarized', split='train')" in hub[0]
    )
    assert ".to_json('ultrafeedback_binarized.jsonl')" in hub[0]
    ours = yaml.safe_load(out)
    assert ours["data"]["init_args"]["paths"] == ["ultrafeedback_binarized.jsonl"]
    assert ours["data"]["init_args"]["tokens_per_batch"] == 2 * 4 * 512
    lines = {
        line.split(":")[0].strip(): line
        for line in out.splitlines()
        if "#" in line and not line.startswith("#")
    }
    assert lines["beta"].endswith("# beta") and lines["lr"].endswith("# learning_rate (TRL's default)")
    assert "a token budget, 4 records × 2 rows × 512 tokens" in lines["tokens_per_batch"]
    (tmp_path / "sft.yaml").write_text("eos_token: <|im_end|>\n")
    code, out, err = run_from_trl([str(tmp_path / "sft.yaml"), "--trainer", "sft"], capsys)
    assert f"eos_token='<|im_end|>' not converted: TRL's eos_token {TRL_FIELDS['eos_token']}" in err
    assert "data.init_args.append_eos" in TRL_FIELDS["eos_token"]
    for name, field in TRL_OPTIONS.items():  # the converter's options are the hints' options
        if field.option is not None:
            assert field.text.startswith(f"is {field.option} here"), name


FORMER = {
    "max_prompt_length": 128,
    "rpo_alpha": 0.5,
    "use_logits_to_keep": True,
    "max_seq_length": 512,
    "warmup_ratio": 0.1,
    "torch_dtype": "bfloat16",
}
"""A value for each field of earlier TRL and transformers configs (`former_fields`)."""


@pytest.mark.parametrize("trainer", ["sft", "dpo"])
def test_former_fields_convert_or_are_one_note_each(trainer, tmp_path, capsys):
    """A config written for an earlier TRL (fields that TRL 1.16's configs renamed or dropped) converts:
    each former field is written at its option, commented with its own name, or is one note with its
    hint; none stops the command."""
    from lit_losses.cli.trl_config import former_fields

    assert set(FORMER) == former_fields()
    (tmp_path / "old.yaml").write_text(yaml.safe_dump({"model_name_or_path": "my-model", **FORMER}))
    code, out, err = run_from_trl([str(tmp_path / "old.yaml"), "--trainer", trainer], capsys)
    assert code == 0, err
    ours, notes = yaml.safe_load(out), err.splitlines()
    init = ours["model"]["init_args"]
    assert init["dtype"] == "bfloat16" and init["optimizer"]["warmup_ratio"] == 0.1
    noted = {
        name for name in FORMER if any(line.startswith(f"lit-losses: from-trl: {name}=") for line in notes)
    }
    if trainer == "sft":
        assert ours["data"]["init_args"]["seq_len"] == 512
        (line,) = [line for line in out.splitlines() if line.strip().startswith("seq_len:")]
        assert line.endswith("# max_seq_length"), line
        assert noted == {"max_prompt_length", "rpo_alpha", "use_logits_to_keep"}
    else:
        assert noted == {"max_prompt_length", "rpo_alpha", "use_logits_to_keep", "max_seq_length"}
    (rpo,) = [line for line in notes if "rpo_alpha=" in line]
    assert TRL_FIELDS["rpo_alpha"] in rpo


def test_grpo_s_kl_names_the_records_reference_log_probabilities(tmp_path, capsys):
    """GRPO's ``beta > 0`` reads each record's ``ref_logprobs`` (the records' sampler writes them): the
    conversion says so; at ``beta: 0`` (TRL's default) it does not."""
    for beta, expected in ((0.04, 1), (0.0, 0)):
        (tmp_path / "grpo.yaml").write_text(yaml.safe_dump({"num_generations": 4, "beta": beta}))
        code, out, err = run_from_trl([str(tmp_path / "grpo.yaml")], capsys)
        assert code == 0 and yaml.safe_load(out)["model"]["init_args"]["grpo"]["beta"] == beta
        assert sum("ref_logprobs" in line for line in err.splitlines()) == expected, err


def test_use_liger_kernel_is_hfcausallm_s_without_the_loss_patches(tmp_path, capsys):
    """``use_liger_kernel`` and ``liger_kernel_config`` go to `HFCausalLM`'s options of those names, the
    loss patches out (one note): the fused head computes the loss. Without ``use_liger_kernel`` TRL ignores
    ``liger_kernel_config``: a note, no option."""
    import inspect

    from liger_kernel.transformers import apply_liger_kernel_to_llama

    from lit_losses import HFCausalLM
    from lit_losses.cli.trl_convert import LIGER_LOSS_PATCHES
    from lit_losses.models.liger_decoder import LOSS_PATCHES

    assert LIGER_LOSS_PATCHES == LOSS_PATCHES
    liger = {"rope": False, "swiglu": True, "fused_linear_cross_entropy": True}
    (tmp_path / "sft.yaml").write_text(
        yaml.safe_dump({"use_liger_kernel": True, "liger_kernel_config": liger})
    )
    code, out, err = run_from_trl([str(tmp_path / "sft.yaml"), "--trainer", "sft"], capsys)
    model = yaml.safe_load(out)["model"]["init_args"]
    assert code == 0 and model["use_liger_kernel"] is True
    assert model["liger_kernel_config"] == {"rope": False, "swiglu": True}
    assert set(model["liger_kernel_config"]) <= set(inspect.signature(apply_liger_kernel_to_llama).parameters)
    assert {"use_liger_kernel", "liger_kernel_config"} <= set(inspect.signature(HFCausalLM).parameters)
    notes = [line for line in err.splitlines() if "liger" in line]
    assert len(notes) == 1 and "['fused_linear_cross_entropy'] not converted" in notes[0], err
    (tmp_path / "sft.yaml").write_text(yaml.safe_dump({"model_init_kwargs": {"use_kernels": True}}))
    code, out, err = run_from_trl([str(tmp_path / "sft.yaml"), "--trainer", "sft"], capsys)
    assert code == 0 and "use_kernels: model.init_args.use_liger_kernel applies Liger-Kernel's" in err
    (tmp_path / "sft.yaml").write_text(yaml.safe_dump({"liger_kernel_config": {"rope": False}}))
    code, out, err = run_from_trl([str(tmp_path / "sft.yaml"), "--trainer", "sft"], capsys)
    assert code == 0 and "liger" not in yaml.safe_dump(yaml.safe_load(out))
    assert "liger_kernel_config: not converted, as TRL ignores it without use_liger_kernel: true" in err


def test_a_local_jsonl_dataset_name_stays_its_path(tmp_path, capsys, monkeypatch):
    """``dataset_name: data/train.jsonl`` (TRL reads a local JSON Lines file) is the data's path, whether
    or not the file exists yet (then one note says so), never a Hub data set to write out."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sft.yaml").write_text("dataset_name: data/train.jsonl\n")
    for exists in (False, True):
        if exists:
            (tmp_path / "data").mkdir()
            (tmp_path / "data" / "train.jsonl").write_text("{}\n")
        code, out, err = run_from_trl(["sft.yaml", "--trainer", "sft"], capsys)
        assert code == 0 and yaml.safe_load(out)["data"]["init_args"]["paths"] == ["data/train.jsonl"]
        assert "load_dataset" not in err
        assert ("dataset_name='data/train.jsonl' is no file here yet" in err) is not exists, err


def test_from_trl_starts_without_torch_or_trl(tmp_path):
    """``lit-losses from-trl`` (the console script's own entry, a fresh interpreter) reads YAML and writes
    YAML: it loads neither torch, Lightning, jsonargparse nor TRL."""
    from tests.test_architecture import HEAVY, loaded_packages

    (tmp_path / "grpo.yaml").write_text("num_generations: 4\nloss_type: dr_grpo\n")
    argv = ["lit-losses", "from-trl", str(tmp_path / "grpo.yaml"), "-o", str(tmp_path / "ours.yaml")]
    code = f"import sys\nsys.argv = {argv!r}\nfrom lit_losses.cli import main\nmain()"
    *printed, loaded = loaded_packages(code, (*HEAVY, "trl")).splitlines()
    assert loaded == "[]" and printed == [
        f"lit-losses: wrote {tmp_path / 'ours.yaml'} (from TRL's GRPOConfig)"
    ]
    grpo = yaml.safe_load((tmp_path / "ours.yaml").read_text())["model"]["init_args"]["grpo"]
    assert grpo == {"loss_type": "dr_grpo", "beta": 0.0, "max_completion_length": 512}


def test_the_docs_conversion_is_what_the_command_writes(tmp_path, monkeypatch, capsys):
    """ "Convert your TRL config" shows ``trl_dpo.yaml``, the command, the file it writes and its stderr
    lines: the command writes that file and those lines."""
    from tests.docs_blocks import blocks

    page = DOCS / "coming-from-trl.md"
    monkeypatch.chdir(tmp_path)
    write_titled_blocks(page, tmp_path)
    shown = (tmp_path / "dpo_from_trl.yaml").read_text()
    (command,) = [b.text for b in blocks(page, "bash") if "from-trl" in b.text]
    args = command.split("#")[0].split()
    assert args[:2] == ["lit-losses", "from-trl"]
    code, out, err = run_from_trl(args[2:], capsys)
    assert code == 0 and out == "lit-losses: wrote dpo_from_trl.yaml (from TRL's DPOConfig)\n"
    assert (tmp_path / "dpo_from_trl.yaml").read_text() == shown
    (notes,) = [b.text for b in blocks(page, "text") if "lit-losses: from-trl:" in b.text]
    assert err == notes


# -- the converted configs run ------------------------------------------------------------------------

TRL_CONFIGS = {  # as TRL's scripts' docstrings write them (trl/scripts/*.py), on the page's stand-ins
    "sft": """
model_name_or_path: my-model
dataset_name: trl-lib/Capybara
learning_rate: 2.0e-4
num_train_epochs: 1
packing: true
per_device_train_batch_size: 2
gradient_accumulation_steps: 2
eos_token: <|im_end|>
eval_strategy: steps
eval_steps: 100
use_peft: true
lora_r: 32
lora_alpha: 16
output_dir: Qwen2-0.5B-SFT
max_length: 64
""",
    "dpo": """
dataset_name: trl-lib/ultrafeedback_binarized
model_name_or_path: my-model
learning_rate: 5.0e-6
num_train_epochs: 1
per_device_train_batch_size: 2
max_steps: 1000
gradient_accumulation_steps: 2
eval_strategy: steps
eval_steps: 50
output_dir: Qwen2-0.5B-DPO
remove_unused_columns: false
use_peft: true
lora_r: 32
lora_alpha: 16
max_length: 64
loss_type: [sigmoid]
""",
    "kto": """
dataset_name: trl-lib/kto-mix-14k
model_name_or_path: my-model
per_device_train_batch_size: 16
num_train_epochs: 1
learning_rate: 5e-7
lr_scheduler_type: cosine
gradient_accumulation_steps: 1
eval_steps: 500
output_dir: kto-aligned-model
warmup_steps: 0.1
logging_first_step: true
max_length: 64
""",
    "grpo": """
model_name_or_path: my-model
dataset_name: trl-lib/DeepMath-103K
reward_funcs: [accuracy_reward]
learning_rate: 1.0e-6
per_device_train_batch_size: 8
num_generations: 4
max_completion_length: 256
loss_type: dapo
epsilon_high: 0.28
gradient_accumulation_steps: 2
output_dir: Qwen2-0.5B-GRPO
""",
}


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory) -> Path:
    """The "Coming from TRL" page's stand-ins: ``my-model``, ``sft.jsonl``, ``pairs.jsonl``,
    ``rollouts.jsonl``; and ``kto.jsonl``, the pairs as unpaired records."""
    folder = tmp_path_factory.mktemp("stand_in")
    write_titled_blocks(DOCS / "coming-from-trl.md", folder)
    with contextlib.chdir(folder):
        for script in ("make_stand_in.py", "sample_rollouts.py"):
            runpy.run_path(str(folder / script), run_name="__main__")
    pairs = [json.loads(line) for line in (folder / "pairs.jsonl").read_text().splitlines()]
    unpaired = [
        {"prompt": p["prompt"], "completion": p[which], "label": which == "chosen"}
        for p in pairs
        for which in ("chosen", "rejected")
    ]
    (folder / "kto.jsonl").write_text("".join(json.dumps(r) + "\n" for r in unpaired))
    return folder


DATA = {"sft": "sft.jsonl", "dpo": "pairs.jsonl", "kto": "kto.jsonl", "grpo": "rollouts.jsonl"}


@pytest.mark.slow
@pytest.mark.parametrize("trainer", list(TRL_CONFIGS))
def test_converted_trl_configs_run(trainer, stand_in, tmp_path, monkeypatch, capsys):
    """Each TRL-style config converts (``--trainer`` as ``trl <trainer>`` gives it) and the converted file
    trains 2 steps with ``lit-losses fit`` on the stand-in model and the records at its data path."""
    from lit_losses.cli.app import cli_main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "my-model").symlink_to(stand_in / "my-model")
    (tmp_path / "trl.yaml").write_text(TRL_CONFIGS[trainer])
    code, out, err = run_from_trl(["trl.yaml", "--trainer", trainer, "-o", "ours.yaml"], capsys)
    assert code == 0 and out.startswith("lit-losses: wrote ours.yaml"), err
    ours = yaml.safe_load((tmp_path / "ours.yaml").read_text())
    (path,) = ours["data"]["init_args"]["paths"]
    (tmp_path / path).write_text((stand_in / DATA[trainer]).read_text())
    args = [
        "--trainer.max_steps=2",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false",
    ]
    cli_main(["fit", "--config", "ours.yaml", *args])
    (record,) = tmp_path.rglob("run_end.json")
    run_end = json.loads(record.read_text())
    assert run_end["reason"] == "max_steps" and run_end["step"] == 2, run_end["detail"]
    assert Path(run_end["log_dir"]).is_relative_to(tmp_path / ours["trainer"]["default_root_dir"])


DPO_YAML = """
model_name_or_path: my-model
dataset_name: trl-lib/ultrafeedback_binarized
learning_rate: 5.0e-6
lr_scheduler_type: cosine
warmup_steps: 2
max_steps: 10
per_device_train_batch_size: 2
gradient_accumulation_steps: 2
beta: 0.05
loss_type: [sigmoid, sft]
loss_weights: [1.0, 0.5]
use_peft: true
lora_r: 8
lora_alpha: 16
lora_dropout: 0.1
lora_target_modules: [q_proj, v_proj]
max_length: 64
output_dir: dpo-out
"""


def trl_dpo_trainer(fields: dict[str, Any], folder: Path) -> Any:
    """TRL's ``DPOTrainer`` as ``trl dpo --config`` builds it from ``fields``: ``DPOConfig`` and
    ``ModelConfig`` of their fields (on the CPU: ``use_cpu``, no reporting), the stand-in model, the pairs."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer, ModelConfig, get_peft_config

    own = {f.name for f in dataclasses.fields(DPOConfig)}
    model_fields = {f.name for f in dataclasses.fields(ModelConfig)}
    args = DPOConfig(**{k: v for k, v in fields.items() if k in own}, use_cpu=True, report_to="none")
    model_args = ModelConfig(**{k: v for k, v in fields.items() if k in model_fields})
    records = [json.loads(line) for line in (folder / "pairs.jsonl").read_text().splitlines()]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return DPOTrainer(
            model=AutoModelForCausalLM.from_pretrained(str(folder / "my-model"), dtype=model_args.dtype),
            args=args,
            train_dataset=Dataset.from_list(records),
            processing_class=AutoTokenizer.from_pretrained(str(folder / "my-model")),
            peft_config=get_peft_config(model_args),
        )


@pytest.mark.slow
def test_the_converted_dpo_config_trains_with_trl_s_hyper_parameters(stand_in, tmp_path, monkeypatch, capsys):
    """TRL's ``DPOTrainer`` built from a DPO YAML, and the config converted from the same YAML: the same
    AdamW (learning rate, betas, eps, weight decay of every group), the same clipping, the same learning
    rate at every step of the warmup and cosine decay, the same loss fields (beta, loss types and weights),
    the same LoRA, the same dropout (every ``torch.nn.Dropout`` at 0), gradient checkpointing as TRL's
    ``train()`` turns it on."""
    import torch

    from lit_losses import HFCausalLM
    from lit_losses.optim import OptimizerConfig

    monkeypatch.chdir(stand_in)
    fields = yaml.safe_load(DPO_YAML)
    (tmp_path / "dpo.yaml").write_text(DPO_YAML)
    code, out, err = run_from_trl([str(tmp_path / "dpo.yaml"), "--trainer", "dpo"], capsys)
    assert code == 0, err
    ours = yaml.safe_load(out)
    theirs = trl_dpo_trainer(fields, stand_in)
    steps = theirs.args.max_steps
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs.create_optimizer_and_scheduler(num_training_steps=steps)
        their_lrs = []
        for _ in range(steps):
            their_lrs.append(theirs.lr_scheduler.get_last_lr()[0])
            theirs.optimizer.step()
            theirs.lr_scheduler.step()
    init = ours["model"]["init_args"]
    optimizer = OptimizerConfig(**init["optimizer"])
    our_lrs = [
        optimizer.lr * optimizer.lr_factor(step, total_steps=ours["trainer"]["max_steps"])
        for step in range(steps)
    ]
    assert our_lrs == pytest.approx(their_lrs, rel=1e-12, abs=1e-18) and their_lrs[0] == 0.0
    for group in theirs.optimizer.param_groups:
        assert group["initial_lr"] == optimizer.lr and tuple(group["betas"]) == optimizer.betas
        assert group["eps"] == optimizer.eps and group["weight_decay"] == optimizer.weight_decay
    assert ours["trainer"]["gradient_clip_val"] == theirs.args.max_grad_norm
    assert ours["trainer"]["accumulate_grad_batches"] == theirs.args.gradient_accumulation_steps
    assert ours["trainer"]["precision"] == ("bf16-mixed" if theirs.args.bf16 else "32-true")
    assert init["dpo"]["beta"] == theirs.beta and init["dpo"]["loss_type"] == theirs.loss_types
    assert init["dpo"]["loss_weights"] == theirs.loss_weights
    module = HFCausalLM(**{k: v for k, v in init.items() if k != "optimizer"})
    their_lora = theirs.model.peft_config["default"]
    our_lora = module.model.peft_config["default"]
    for name in ("r", "lora_alpha", "lora_dropout", "target_modules", "use_rslora", "use_dora"):
        assert getattr(our_lora, name) == getattr(their_lora, name), name

    def dropouts(model: torch.nn.Module) -> list[float]:
        return [m.p for m in model.modules() if isinstance(m, torch.nn.Dropout)]

    assert dropouts(theirs.model) and dropouts(module.model) == dropouts(theirs.model) == [0.0] * len(
        dropouts(theirs.model)
    )
    assert (
        module.model.is_gradient_checkpointing is theirs.args.gradient_checkpointing is True
    )  # TRL's: in train()
