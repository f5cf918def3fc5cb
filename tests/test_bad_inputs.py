"""Table-driven bad inputs: each one fails with one clear line naming the value and where it came from.

Every case runs under a timeout (none may hang). CLI cases run in-process through `cli_main` and assert
exit code 2 and exactly one ``lit-losses: error: …`` line on stderr (no traceback); Python-API, batch
and checkpoint cases assert the exception type and its one-line message.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import pytest
import torch

from lit_losses import PreemptionCheckpoint, TextDataModule, TinyLM, register_base_loss
from lit_losses.aggregation import GlobalStatsLoader, MaskStats, aggregate, count_masks
from lit_losses.checkpoint.resume import read_checkpoint
from lit_losses.choices import check_choice
from lit_losses.cli.app import cli_main, one_line
from lit_losses.cli.report import write_report
from lit_losses.controller import parse_config
from lit_losses.controller.reach import VALIDATION_EVENTS, unreachable
from lit_losses.data.rl import RLDataModule, rl_dataset
from lit_losses.errors import BatchKeyError, ConfigError
from lit_losses.heads import FusedLMHead, check_backend_runs
from lit_losses.optim import OptimizerConfig
from lit_losses.parallel import ParallelConfig, PipelineLoss
from lit_losses.regularizers import RegularizerSpec

pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI.s args parameter")

REPO = Path(__file__).resolve().parents[1]
CONFIG = str(REPO / "configs" / "tiny_lm.yaml")
TEXT = "the quick brown fox jumps over the lazy dog. " * 8


# ---------------------------------------------------------------------------------------------------
# CLI cases: (id, extra arguments, files to write into tmp_path, expected fragment of the one line)
# ``{tmp}`` in an argument is replaced by tmp_path. A file value of bytes is written as is.
# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CliCase:
    id: str
    args: tuple[str, ...]
    expected: str
    files: tuple[tuple[str, str | bytes], ...] = ()
    corpus: bool = True  # add a tiny valid corpus as data.paths


M, D, T, OPT = "--model.init_args.", "--data.init_args.", "--trainer.", "--model.init_args.optimizer."

CLI_CASES = [
    # model shape options (validated when the model is built, before any data is read)
    CliCase("d_model_zero", (f"{M}d_model=0",), "model.init_args.d_model=0 must be an integer >= 1"),
    CliCase("d_model_negative", (f"{M}d_model=-8",), "model.init_args.d_model=-8 must be an integer >= 1"),
    CliCase("d_model_text", (f"{M}d_model=wide",), "model.init_args.d_model: expected int, got 'wide'"),
    CliCase("d_model_float", (f"{M}d_model=1.5",), "model.init_args.d_model: expected int, got '1.5'"),
    CliCase("n_heads_zero", (f"{M}n_heads=0",), "model.init_args.n_heads=0 must be an integer >= 1"),
    CliCase("n_layers_zero", (f"{M}n_layers=0",), "model.init_args.n_layers=0 must be an integer >= 1"),
    CliCase("n_layers_negative", (f"{M}n_layers=-1",), "model.init_args.n_layers=-1 must be an integer >= 1"),
    CliCase(
        "n_heads_not_dividing",
        (f"{M}d_model=32", f"{M}n_heads=5"),
        "model.init_args.d_model=32 must be divisible by n_heads=5",
    ),
    CliCase(
        "odd_head_dim",
        (f"{M}d_model=30", f"{M}n_heads=2"),
        "model.init_args.d_model=30 / n_heads=2 gives head dimension 15",
    ),
    CliCase(
        "odd_head_dim_one_head",
        (f"{M}d_model=7", f"{M}n_heads=1"),
        "the rotary embedding needs an even head dimension",
    ),
    CliCase("d_ff_zero", (f"{M}d_ff=0",), "model.init_args.d_ff=0 must be an integer >= 1"),
    CliCase("d_ff_negative", (f"{M}d_ff=-64",), "model.init_args.d_ff=-64 must be an integer >= 1"),
    CliCase(
        "rope_base_zero", (f"{M}rope_base=0",), "model.init_args.rope_base=0.0 must be a finite number > 1"
    ),
    CliCase(
        "rope_base_one", (f"{M}rope_base=1",), "model.init_args.rope_base=1.0 must be a finite number > 1"
    ),
    CliCase("rope_base_inf", (f"{M}rope_base=inf",), "model.init_args.rope_base: expected float, got 'inf'"),
    CliCase("tie_embeddings_text", (f"{M}tie_embeddings=perhaps",), "model.init_args.tie_embeddings"),
    # RegularizedLM options
    CliCase(
        "head_backend_unknown", (f"{M}head_backend=cuda",), "model.init_args.head_backend: 'cuda' is not"
    ),
    CliCase("head_backend_typo", (f"{M}head_backend=chunkd",), "did you mean 'chunked'?"),
    CliCase("loss_agg_typo", (f"{M}loss_agg=token-maen",), "did you mean 'token-mean'?"),
    CliCase("loss_agg_empty", (f"{M}loss_agg=",), "model.init_args.loss_agg"),
    CliCase("head_chunk_size_zero", (f"{M}head_chunk_size=0",), "head_chunk_size=0 must be an integer >= 1"),
    CliCase(
        "head_chunk_size_negative", (f"{M}head_chunk_size=-5",), "head_chunk_size=-5 must be an integer >= 1"
    ),
    CliCase("head_chunk_size_text", (f"{M}head_chunk_size=big",), "model.init_args.head_chunk_size"),
    CliCase("check_finite_text", (f"{M}check_finite=maybe",), "model.init_args.check_finite"),
    CliCase("ignore_index_text", (f"{M}ignore_index=none",), "model.init_args.ignore_index"),
    CliCase("base_loss_weight_negative", (f"{M}base_loss_weight=-1",), "model.base_loss_weight must be >= 0"),
    CliCase(
        "base_loss_weight_nan", (f"{M}base_loss_weight=nan",), "base_loss_weight: expected float, got 'nan'"
    ),
    CliCase("base_loss_weight_text", (f"{M}base_loss_weight=heavy",), "model.init_args.base_loss_weight"),
    CliCase("regularizer_grad_norm_text", (f"{M}regularizer_grad_norm=sure",), "regularizer_grad_norm"),
    # base losses by name (lit_losses.objectives)
    CliCase(
        "base_loss_unknown",
        (f"{M}base_loss=ppoo",),
        "model.base_loss: unknown base loss 'ppoo'; did you mean 'ppo'?",
    ),
    CliCase(
        "base_loss_args_unknown",
        (f"{M}base_loss=ppo", f"{M}base_loss_args={{clip_low: 0.2}}"),
        "model.base_loss_args.clip_low: base loss 'ppo' has no parameter 'clip_low'; "
        "did you mean 'clip_low_threshold'?",
    ),
    CliCase(
        "base_loss_args_negative_clip",
        (f"{M}base_loss=cispo", f"{M}base_loss_args={{clip_low_threshold: -0.1}}"),
        "model.base_loss_args.clip_low_threshold=-0.1 must be >= 0",
    ),
    CliCase(
        "base_loss_args_text",
        (f"{M}base_loss=dro", f"{M}base_loss_args={{beta: strong}}"),
        "model.base_loss_args.beta='strong' must be a finite number (base loss 'dro')",
    ),
    CliCase("base_loss_dro_without_beta", (f"{M}base_loss=dro",), "model.base_loss_args.beta is required"),
    # TRL's GRPO losses (model.grpo)
    CliCase(
        "grpo_top_entropy_quantile",
        (f"{M}grpo.top_entropy_quantile=0.2",),
        "TRL's top_entropy_quantile has no counterpart",
    ),
    CliCase(
        "grpo_beside_loss_agg",
        (f"{M}grpo.loss_type=grpo", f"{M}loss_agg=token-sum"),
        "model.grpo (loss_type 'grpo') sets model.base_loss, model.base_loss_args, model.loss_agg and "
        "model.loss_agg_norm; remove model.loss_agg or model.grpo",
    ),
    CliCase(
        "base_loss_args_two_spellings",
        (f"{M}base_loss=ppo", f"{M}base_loss_args={{epsilon_high: 0.28, clip_high_threshold: 1.28}}"),
        "model.base_loss_args.epsilon_high=0.28 and clip_high_threshold=1.28 both set the same bound",
    ),
    CliCase(
        "loss_agg_norm_missing",
        (f"{M}loss_agg=seq-mean-token-sum-norm",),
        "model.loss_agg_norm is required by aggregation mode 'seq-mean-token-sum-norm'",
    ),
    CliCase(
        "loss_agg_norm_negative",
        (f"{M}loss_agg=seq-mean-token-sum-norm", f"{M}loss_agg_norm=-512"),
        "model.loss_agg_norm must be a finite number > 0",
    ),
    # optimizer
    CliCase("lr_zero", (f"{OPT}lr=0",), "optimizer.lr must be > 0, got 0"),
    CliCase("lr_negative", (f"{OPT}lr=-0.1",), "optimizer.lr must be > 0, got -0.1"),
    CliCase("lr_text", (f"{OPT}lr=fast",), "optimizer.lr"),
    CliCase("warmup_negative", (f"{OPT}warmup_steps=-1",), "optimizer.warmup_steps must be >= 0, got -1"),
    CliCase("min_lr_ratio_above_one", (f"{OPT}min_lr_ratio=2",), "optimizer.min_lr_ratio must be in [0, 1]"),
    CliCase(
        "min_lr_ratio_negative", (f"{OPT}min_lr_ratio=-0.5",), "optimizer.min_lr_ratio must be in [0, 1]"
    ),
    CliCase("total_steps_zero", (f"{OPT}total_steps=0",), "optimizer.total_steps must be >= 1, got 0"),
    CliCase("schedule_typo", (f"{OPT}schedule=cosin",), "did you mean 'cosine'?"),
    # data options (validated when the data module is built)
    CliCase("vocab_size_tiny", (f"{D}vocab_size=10",), "data.vocab_size=10 is smaller than the byte-level"),
    CliCase("vocab_size_text", (f"{D}vocab_size=big",), "data.init_args.vocab_size: expected int"),
    CliCase("seq_len_one", (f"{D}seq_len=1",), "data.seq_len=1 must be >= 2"),
    CliCase("seq_len_zero", (f"{D}seq_len=0",), "data.seq_len=0 must be >= 2"),
    CliCase("tokens_per_batch_small", (f"{D}tokens_per_batch=8",), "data.tokens_per_batch=8 is smaller"),
    CliCase("val_fraction_one", (f"{D}val_fraction=1.0",), "data.val_fraction=1.0 must be in [0, 1)"),
    CliCase("val_fraction_negative", (f"{D}val_fraction=-0.1",), "data.val_fraction=-0.1 must be in [0, 1)"),
    CliCase("max_documents_zero", (f"{D}max_documents=0",), "data.max_documents=0 must be >= 1"),
    CliCase("packing_text", (f"{D}packing=often",), "data.init_args.packing"),
    CliCase("paths_no_match", (f"{D}paths=[{{tmp}}/nothing/*.txt]",), "matches no file", corpus=False),
    # trainer options that would hang or do nothing
    CliCase(
        "accumulate_zero",
        (f"{T}accumulate_grad_batches=0",),
        "trainer.accumulate_grad_batches=0 must be >= 1",
    ),
    CliCase(
        "accumulate_negative",
        (f"{T}accumulate_grad_batches=-2",),
        "trainer.accumulate_grad_batches=-2 must be >= 1",
    ),
    CliCase("max_steps_text", (f"{T}max_steps=many",), "trainer.max_steps"),
    CliCase("resume_changes_typo", ("--resume_changes=aply",), "did you mean 'apply'?"),
    CliCase("unknown_option", (f"{M}dmodel=32",), "dmodel"),
    CliCase("model_class_unknown", ("--model.class_path=lit_losses.NoSuchLM",), "model"),
    CliCase("data_class_unknown", ("--data.class_path=lit_losses.NoSuchData",), "data"),
    # checkpoints named by --ckpt_path
    CliCase(
        "ckpt_missing", ("--ckpt_path={tmp}/missing.ckpt",), "missing.ckpt: no such checkpoint file or folder"
    ),
    CliCase(
        "ckpt_empty",
        ("--ckpt_path={tmp}/empty.ckpt",),
        "empty.ckpt is not a readable checkpoint",
        files=(("empty.ckpt", b""),),
    ),
    CliCase(
        "ckpt_text",
        ("--ckpt_path={tmp}/notes.ckpt",),
        "notes.ckpt is not a readable checkpoint",
        files=(("notes.ckpt", "this is not a checkpoint\n"),),
    ),
    CliCase(
        "ckpt_truncated",
        ("--ckpt_path={tmp}/cut.ckpt",),
        "cut.ckpt is not a readable checkpoint",
        files=(("cut.ckpt", "TRUNCATED"),),
    ),
    CliCase(
        "ckpt_not_lightning",
        ("--ckpt_path={tmp}/list.ckpt",),
        "list.ckpt is not a Lightning checkpoint",
        files=(("list.ckpt", "LIST"),),
    ),
    CliCase("ckpt_directory", ("--ckpt_path={tmp}",), "a folder without meta.pt, not a sharded checkpoint"),
    CliCase(
        "run_dir_reused",
        ("--trainer.enable_checkpointing=true",),
        "already holds another run's checkpoints",
        files=(("run/checkpoints/epoch=0-step=1.ckpt", "TRUNCATED"),),
    ),
    CliCase(  # documented safe behaviour: the user says so; the guard lets the run go on (to the next error)
        "run_dir_reused_on_request",
        ("--trainer.enable_checkpointing=true", "--reuse_run_dir=true", f"{M}d_model=0"),
        "model.init_args.d_model=0 must be an integer >= 1",
        files=(("run/checkpoints/epoch=0-step=1.ckpt", "TRUNCATED"),),
    ),
    CliCase("reuse_run_dir_text", ("--reuse_run_dir=often",), "reuse_run_dir: expected bool"),
    # corpus files (read before training: their name is in the error)
    CliCase(
        "corpus_binary",
        (f"{D}paths=[{{tmp}}/blob.bin]",),
        "blob.bin is a binary file",
        files=(("blob.bin", bytes(range(256)) * 4),),
        corpus=False,
    ),
    CliCase(
        "corpus_latin1",
        (f"{D}paths=[{{tmp}}/latin.txt]",),
        "latin.txt is not UTF-8 text",
        files=(("latin.txt", "caf\xe9 ".encode("latin-1") * 50),),
        corpus=False,
    ),
    CliCase(
        "corpus_empty_file",
        (f"{D}paths=[{{tmp}}/empty.txt]",),
        "the corpus is empty",
        files=(("empty.txt", ""),),
        corpus=False,
    ),
    CliCase(
        "corpus_blank_file",
        (f"{D}paths=[{{tmp}}/blank.txt]",),
        "data.paths: the corpus is empty: no non-blank document in {tmp}/blank.txt",
        files=(("blank.txt", "\n\n   \n"),),
        corpus=False,
    ),
    CliCase(
        "jsonl_bad_json",
        (f"{D}paths=[{{tmp}}/bad.jsonl]",),
        "bad.jsonl:2 is not valid JSON",
        files=(("bad.jsonl", '{"text": "ok"}\n{"text": oops}\n'),),
        corpus=False,
    ),
    CliCase(
        "jsonl_missing_field",
        (f"{D}paths=[{{tmp}}/nofield.jsonl]",),
        "nofield.jsonl:1 has no field data.text_field='text'",
        files=(("nofield.jsonl", '{"body": "hello"}\n'),),
        corpus=False,
    ),
    CliCase(
        "jsonl_other_field",
        (f"{D}paths=[{{tmp}}/a.jsonl]", f"{D}text_field=content"),
        "a.jsonl:1 has no field data.text_field='content'",
        files=(("a.jsonl", '{"text": "hello"}\n'),),
        corpus=False,
    ),
    CliCase(
        "jsonl_number_field",
        (f"{D}paths=[{{tmp}}/num.jsonl]",),
        "num.jsonl:1 field 'text' is a int",
        files=(("num.jsonl", '{"text": 42}\n'),),
        corpus=False,
    ),
    CliCase(
        "jsonl_null_field",
        (f"{D}paths=[{{tmp}}/null.jsonl]",),
        "null.jsonl:1 field 'text' is a NoneType",
        files=(("null.jsonl", '{"text": null}\n'),),
        corpus=False,
    ),
    CliCase(
        "jsonl_not_object",
        (f"{D}paths=[{{tmp}}/list.jsonl]",),
        "list.jsonl:1 has no field",
        files=(("list.jsonl", '["text", "hello"]\n'),),
        corpus=False,
    ),
    CliCase(
        "jsonl_binary",
        (f"{D}paths=[{{tmp}}/bin.jsonl]",),
        "bin.jsonl is a binary file",
        files=(("bin.jsonl", b'{"text": "a"}\n\x00\x01\x02'),),
        corpus=False,
    ),
    # YAML configuration files
    CliCase(
        "yaml_d_model_zero",
        ("--config={tmp}/zero.yaml",),
        "model.init_args.d_model=0 must be an integer >= 1",
        files=(("zero.yaml", "model:\n  init_args:\n    d_model: 0\n"),),
    ),
    CliCase(
        "yaml_loss_agg_typo",
        ("--config={tmp}/agg.yaml",),
        "did you mean 'token-sum'?",
        files=(("agg.yaml", "model:\n  init_args:\n    loss_agg: token-summ\n"),),
    ),
    CliCase(
        "yaml_accumulate_zero",
        ("--config={tmp}/acc.yaml",),
        "trainer.accumulate_grad_batches=0 must be >= 1",
        files=(("acc.yaml", "trainer:\n  accumulate_grad_batches: 0\n"),),
    ),
    CliCase(
        "yaml_regularizer_unknown_name",
        ("--config={tmp}/reg.yaml",),
        "z_los",
        files=(("reg.yaml", "model:\n  init_args:\n    regularizers:\n      - name: z_los\n"),),
    ),
    CliCase(
        "yaml_regularizer_unknown_field",
        ("--config={tmp}/reg.yaml",),
        "model.init_args.regularizers.wieght: not an option of RegularizerSpec; did you mean 'weight'?",
        files=(("reg.yaml", "model:\n  init_args:\n    regularizers:\n      - {name: z_loss, wieght: 1}\n"),),
    ),
    CliCase(
        "yaml_regularizer_nan_weight",
        ("--config={tmp}/reg.yaml",),
        "weight must be a finite number",
        files=(
            ("reg.yaml", "model:\n  init_args:\n    regularizers:\n      - {name: z_loss, weight: .nan}\n"),
        ),
    ),
    CliCase(
        "yaml_regularizer_args_not_mapping",
        ("--config={tmp}/reg.yaml",),
        "model.init_args.regularizers.args: expected dict, got '[1]'",
        files=(("reg.yaml", "model:\n  init_args:\n    regularizers:\n      - {name: z_loss, args: [1]}\n"),),
    ),
    CliCase(
        "yaml_regularizer_on_error_typo",
        ("--config={tmp}/reg.yaml",),
        "skp",
        files=(
            ("reg.yaml", "model:\n  init_args:\n    regularizers:\n      - {name: z_loss, on_error: skp}\n"),
        ),
    ),
    CliCase(
        "yaml_regularizer_bad_fn",
        ("--config={tmp}/reg.yaml",),
        "no_such_module",
        files=(
            (
                "reg.yaml",
                "model:\n  init_args:\n    regularizers:\n      - {name: m, fn: no_such_module.f}\n",
            ),
        ),
    ),
    CliCase(
        "yaml_malformed",
        ("--config={tmp}/broken.yaml",),
        "broken.yaml: not valid YAML (expected ',' or ']'",
        files=(("broken.yaml", "model: [unclosed\n"),),
    ),
    CliCase(
        "yaml_missing", ("--config={tmp}/absent.yaml",), "config: File does not exist: '{tmp}/absent.yaml'"
    ),
    CliCase(
        "yaml_base_loss_weight_nan",
        ("--config={tmp}/w.yaml",),
        "model.base_loss_weight must be >= 0 and finite",
        files=(("w.yaml", "model:\n  init_args:\n    base_loss_weight: .nan\n"),),
    ),
    CliCase(
        "yaml_tab_indent",
        ("--config={tmp}/tab.yaml",),
        "tab.yaml: not valid YAML",
        files=(("tab.yaml", "model:\n\tinit_args: {}\n"),),
    ),
    CliCase(
        "yaml_binary",
        ("--config={tmp}/bin.yaml",),
        "bin.yaml: not UTF-8 text",
        files=(("bin.yaml", b"\xff\xfe\x00model"),),
    ),
]

# issue #16, last gaps: trainer options Lightning checks when the run sets up, run folders, regularizer
# arguments, HFTextDataModule's tokenizer directory and files
HF = ("--data.class_path=lit_losses.data.hf_text.HFTextDataModule", f"{D}tokenizer={{tmp}}/tok")
WORDS = {"<unk>": 0, "</s>": 1, "the": 2, "quick": 3, "fox": 4, ".": 5}
TOKENIZER_JSON = {"version": "1.0", "pre_tokenizer": {"type": "Whitespace"}, "added_tokens": []}
TOKENIZER_JSON["model"] = {"type": "WordLevel", "unk_token": "<unk>", "vocab": WORDS}
TOKENIZER = (  # a 6-token word-level tokenizer directory, as save_pretrained writes it
    ("tok/tokenizer.json", json.dumps(TOKENIZER_JSON)),
    ("tok/tokenizer_config.json", '{"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "</s>"}'),
)
DOCS = ("a.jsonl", '{"text": "the fox"}\n')  # a corpus: the tokenizer loads once the paths matched files
REG = "model:\n  init_args:\n    regularizers:\n"

CLI_CASES += [
    CliCase(
        "val_check_interval_beyond_batches",
        (f"{T}val_check_interval=10000",),
        "trainer.val_check_interval=10000 is larger than the number of training batches per epoch (",
    ),
    CliCase(
        "val_check_interval_fraction_above_one",
        (f"{T}val_check_interval=1.5",),
        "trainer.val_check_interval=1.5: You have passed invalid value 1.5 for val_check_interval",
    ),
    CliCase("devices_zero", (f"{T}accelerator=cpu", f"{T}devices=0"), "trainer.devices=0: `Trainer(devices="),
    CliCase(
        "strategy_typo", (f"{T}strategy=dpp",), "trainer.strategy=dpp: You selected an invalid strategy name"
    ),
    CliCase("precision_typo", (f"{T}precision=bf17",), "did you mean 'bf16'?"),
    CliCase(
        "run_dir_config_taken",
        (),
        "run already holds another run's config.yaml; set another trainer.default_root_dir",
        files=(("run/config.yaml", "seed_everything: 1\n"),),
    ),
    CliCase(
        "logger_version_taken",
        (
            f"{T}logger=lightning.pytorch.loggers.TensorBoardLogger",
            f"{T}logger.init_args.save_dir={{tmp}}/tb",
            f"{T}logger.init_args.version=0",
        ),
        "version_0 already holds another run's config.yaml; set another logger version (now 0;",
        files=(("tb/lightning_logs/version_0/config.yaml", "seed_everything: 1\n"),),
    ),
    CliCase(
        "yaml_regularizer_args_unknown",
        ("--config={tmp}/reg.yaml",),
        "model.regularizers[0].args.mod: regularizer 'entropy' takes no argument 'mod'; did you mean "
        "'mode'? (its arguments: ['mode'])",
        files=(("reg.yaml", REG + "      - {name: entropy, args: {mod: bonus}}\n"),),
    ),
    CliCase(
        "yaml_regularizer_args_choice",
        ("--config={tmp}/reg.yaml",),
        "model.regularizers[0].args.mode='bonuss': regularizer 'entropy' takes one of ('penalty', 'bonus'); "
        "did you mean 'bonus'?",
        files=(("reg.yaml", REG + "      - {name: entropy, args: {mode: bonuss}}\n"),),
    ),
    CliCase(
        "yaml_regularizer_args_second_term",
        ("--config={tmp}/reg.yaml",),
        "model.regularizers[1].args.estimator='k4': regularizer 'kl_reference' takes one of ('k1', 'k2', "
        "'k3')",
        files=(
            (
                "reg.yaml",
                REG + "      - {name: z_loss}\n      - {name: kl_reference, args: {estimator: k4}}\n",
            ),
        ),
    ),
    CliCase(
        "yaml_regularizer_args_type",
        ("--config={tmp}/reg.yaml",),
        "model.regularizers[0].args.threshold='high': regularizer 'confidence_penalty' takes float or None, "
        "got str",
        files=(("reg.yaml", REG + "      - {name: confidence_penalty, args: {threshold: high}}\n"),),
    ),
    CliCase(
        "hf_tokenizer_missing",
        HF,
        "data.init_args.tokenizer '{tmp}/tok' is not a local directory",
    ),
    CliCase(
        "hf_tokenizer_empty_dir",
        HF,
        "data.init_args.tokenizer '{tmp}/tok' holds no tokenizer (none of tokenizer.json",
        files=(("tok/notes.txt", "not a tokenizer"),),
    ),
    CliCase(
        "hf_tokenizer_bad_json",
        HF,
        "data.init_args.tokenizer '{tmp}/tok': {tmp}/tok/tokenizer.json is not valid JSON (Expecting "
        "property name enclosed in double quotes, line 1 column 2)",
        files=(("tok/tokenizer.json", "{oops"), TOKENIZER[1]),
    ),
    CliCase(
        "hf_jsonl_bad_line",
        (*HF, f"{D}paths=[{{tmp}}/bad.jsonl]"),
        "data.paths: {tmp}/bad.jsonl:2 is not valid JSON",
        files=(*TOKENIZER, ("bad.jsonl", '{"text": "the fox"}\n{"text": fox}\n')),
        corpus=False,
    ),
    CliCase(
        "hf_jsonl_missing_field",
        (*HF, f"{D}paths=[{{tmp}}/a.jsonl]"),
        "data.paths: {tmp}/a.jsonl:1 has no field data.text_field='text'",
        files=(*TOKENIZER, ("a.jsonl", '{"body": "the fox"}\n')),
        corpus=False,
    ),
]


# issue #26: configuration errors that only a training step used to show (batch keys, controller rules and
# operations that can never work in this run), Lightning refusals without their option, and options
# that raised a raw error. ``NO_VAL``: the run has no validation batches (the cases reach training).
NO_VAL = f"{T}limit_val_batches=0"
CTRL = ("--trainer.callbacks+=lit_losses.TrainingController", "--trainer.callbacks.config={tmp}/ctl.yaml")
STATE = "controller-metrics:\n  - {name: s, class: TrainingState}\n"
HISTORY_OF_VAL = "controller-metrics:\n  - {name: h, class: HistoryBasedMetric, arguments: {key: val/loss}}\n"


def _controller(
    rule: str,
    triggers: str = "on_optimizer_step_end",
    head: str = STATE,
    ops: str = "lightning.should_training_stop",
) -> tuple:
    """A controller config file ``ctl.yaml`` with one controller ``c``."""
    body = f"controllers:\n  - {{name: c, triggers: [{triggers}], rule: '{rule}', operations: [{ops}]}}\n"
    return (("ctl.yaml", head + body),)


REGULARIZE = "model:\n  init_args:\n    regularizers:\n      - {name: kl_reference}\n"
ROLLBACK = "operations:\n  - {name: rec, class: SpikeRecovery, arguments: {source: checkpoint}}\n"
SET_WEIGHT = (
    STATE
    + "operations:\n  - {name: r, class: RegularizerControl, arguments: {regularizer: kl_reference%s}}\n"
)

CLI_CASES += [
    # a batch key that the configured loss reads and the data never provides: refused before training
    CliCase(
        "base_loss_key_not_in_data",
        (f"{M}base_loss=ppo", NO_VAL),
        "model.base_loss='ppo' reads batch key 'sampling_logprobs', which TextDataModule never provides; "
        "its micro-batches have keys ['input_ids', 'labels', 'position_ids', 'segment_ids']",
    ),
    CliCase(
        "base_loss_is_key_not_in_data",
        (f"{M}base_loss=importance_sampling", NO_VAL),
        "model.base_loss='importance_sampling' reads batch key 'sampling_logprobs', which TextDataModule",
    ),
    CliCase(
        "base_loss_dro_key_not_in_data",
        (f"{M}base_loss=dro", f"{M}base_loss_args={{beta: 0.1}}", NO_VAL),
        "model.base_loss='dro' reads batch key",
    ),
    CliCase(
        "regularizer_key_not_in_data",
        ("--config={tmp}/reg.yaml", NO_VAL),
        "kl_reference reads batch key 'ref_logprobs' (its argument key), which is missing",
        files=(("reg.yaml", REGULARIZE),),
    ),
    # controllers that can never act in this run: refused before training (on_error: raise, the default)
    CliCase(
        "controller_validation_trigger_without_validation",
        (*CTRL, NO_VAL),
        "controller 'c' can never act: its triggers ['on_validation_end'] never fire; this run has no "
        "validation batches (trainer.limit_val_batches=0",
        files=_controller('s["global_step"] > 0', triggers="on_validation_end"),
    ),
    CliCase(
        "controller_validation_metric_without_validation",
        (*CTRL, NO_VAL),
        "controller 'c' can never act: its rule reads metric(s) ['ev'], computed only on "
        "['on_validation_end']",
        files=_controller(
            'ev["val/loss_total"] > 9', head="controller-metrics:\n  - {name: ev, class: EvalMetrics}\n"
        ),
    ),
    CliCase(
        "controller_validates_without_validation",
        (*CTRL, NO_VAL),
        "controller 'c' can never act: its operation lightning.should_validate would validate; this run has "
        "no validation batches",
        files=_controller('s["global_step"] >= 1', ops="lightning.should_validate"),
    ),
    CliCase(
        "controller_history_of_val_key_without_validation",
        (*CTRL, NO_VAL),
        "its rule reads metric(s) ['h'], computed only on ['on_validation_end']",
        files=_controller('h["full"]', head=HISTORY_OF_VAL),
    ),
    # operations impossible at set-up: refused before training, not at the step they run
    CliCase(
        "operation_without_required_argument",
        (*CTRL, "--config={tmp}/reg.yaml", NO_VAL),
        "controllers[0] (c).operations: r.should_set_weight needs operations[0].arguments.value",
        files=(
            ("reg.yaml", REGULARIZE),
            *_controller("True", head=SET_WEIGHT % "", ops="r.should_set_weight"),
        ),
    ),
    CliCase(
        "operation_argument_not_a_number",
        (*CTRL, "--config={tmp}/reg.yaml", NO_VAL),
        "RegularizerControl: arguments.factor must be a finite number, got 'half'",
        files=(
            ("reg.yaml", REGULARIZE),
            *_controller("True", head=SET_WEIGHT % ", factor: half", ops="r.should_scale_weight"),
        ),
    ),
    CliCase(
        "rollback_to_checkpoint_without_checkpoints",
        (*CTRL, NO_VAL),
        "operation 'rec': source: checkpoint rolls back to the newest checkpoint of the trainer's "
        "ModelCheckpoint, but this run writes none (trainer.enable_checkpointing=false",
        files=_controller("True", head=STATE + ROLLBACK, ops="rec.should_roll_back"),
    ),
    CliCase(
        "exit_code_zero",
        (*CTRL, NO_VAL),
        "operations[0].arguments: exit_code=0 must be an integer in [1, 125]",
        files=_controller(
            's["global_step"] >= 1',
            head=STATE + "operations:\n  - {name: lightning, class: "
            "LightningOperations, arguments: {exit_code: 0}}\n",
        ),
    ),
    # a rule that fails at a step: one line (a RuleFailure is a ConfigError)
    CliCase(
        "rule_key_typo_at_run_time",
        (*CTRL, NO_VAL),
        "controller 'c': rule 's[\"global_stp\"] >= 1' raised KeyError: 'global_stp' at step 1",
        files=_controller('s["global_stp"] >= 1'),
    ),
    CliCase(
        "rule_not_boolean_at_run_time",
        (*CTRL, NO_VAL),
        "controller 'c': rule 's[\"global_step\"]' evaluated to 1 (int), not a boolean at step 1",
        files=_controller('s["global_step"]'),
    ),
    # trainer and data options that raised a raw error
    CliCase(
        "check_val_every_n_epoch_zero",
        (f"{T}check_val_every_n_epoch=0",),
        "trainer.check_val_every_n_epoch=0 must be >= 1",
    ),
    CliCase(
        "controller_config_file_empty",
        CTRL,
        "controller config file '{tmp}/ctl.yaml' must be a mapping with keys ('controller-metrics', "
        "'controller_metrics', 'operations', 'controllers'), got an empty document",
        files=(("ctl.yaml", ""),),
    ),
    CliCase(
        "controller_config_file_not_yaml",
        CTRL,
        "controller config file '{tmp}/ctl.yaml' is not valid YAML (expected ',' or ']', but got "
        "'<stream end>', line 2)",
        files=(("ctl.yaml", "controllers: [unclosed\n"),),
    ),
    CliCase(
        "ignore_index_other_than_the_data",
        (f"{M}ignore_index=5", NO_VAL),
        "model.init_args.ignore_index=5 differs from the label value TextDataModule gives positions "
        "without a target (-100)",
    ),
    CliCase("num_workers_negative", (f"{D}num_workers=-1",), "data.num_workers=-1 must be >= 0"),
    CliCase(
        "accelerator_absent",
        (f"{T}accelerator=mps",),
        "trainer.accelerator=mps: `MPSAccelerator` can not run",
    ),
]


# issue #34: options the configuration shows to be wrong that ran silently, late or as a raw traceback:
# fields a loss type ignores, torch's, Lightning's and transformers' refusals named by the option that
# caused them, the model's context against the data's rows, numeric trainer options, files and folders
HF_TINY = (
    "model:\n  class_path: lit_losses.HFCausalLM\n  init_args:\n    config: {model_type: llama, "
    "hidden_size: 16, intermediate_size: 32, num_hidden_layers: 1, num_attention_heads: 2, "
    "max_position_embeddings: %d}\n"
)
LOG_OP = 'operations:\n  - {name: lg, class: LogControl, arguments: {message: "step %s"}}\n'

CLI_CASES += [
    CliCase(
        "grpo_field_the_loss_type_ignores",
        (f"{M}grpo.loss_type=sapo", f"{M}grpo.epsilon_high=0.28"),
        "model.grpo.epsilon_high=0.28: loss_type 'sapo' ignores it (it applies to ('grpo', 'bnpo', "
        "'dr_grpo', 'dapo', 'luspo', 'cispo'))",
    ),
    CliCase(
        "grpo_dr_grpo_constant_elsewhere",
        (f"{M}grpo.loss_type=grpo", f"{M}grpo.max_completion_length=256"),
        "model.grpo.max_completion_length=256: loss_type 'grpo' ignores it (it applies to loss_type "
        "'dr_grpo')",
    ),
    CliCase(
        "optimizer_beta_one",
        (f"{OPT}betas=[0.9, 1.0]",),
        "optimizer.betas=(0.9, 1.0): torch.optim.AdamW refuses it (Invalid beta parameter at index 1: 1.0); "
        "betas must be two numbers, each in [0, 1)",
    ),
    CliCase(
        "optimizer_eps_negative",
        (f"{OPT}eps=-1e-8",),
        "optimizer.eps=-1e-08: torch.optim.AdamW refuses it (Invalid epsilon value: -1e-08)",
    ),
    CliCase(
        "gradient_clip_negative", (f"{T}gradient_clip_val=-1",), "trainer.gradient_clip_val=-1 must be >= 0"
    ),
    CliCase("min_steps_negative", (f"{T}min_steps=-5",), "trainer.min_steps=-5 must be >= 0"),
    CliCase(
        "devices_negative",
        (f"{T}accelerator=cpu", f"{T}devices=-2"),
        "trainer.devices=-2: `devices` selected with `CPUAccelerator` should be an int > 0.",
    ),
    CliCase(
        "tensor_parallel_config_on_one_device",
        (f"--config={REPO / 'configs' / 'tensor_parallel.yaml'}", f"{T}devices=1"),
        "trainer.strategy.init_args: data_parallel_size=1 × tensor_parallel_size=2 = 2 processes, but "
        "trainer.devices=1 × trainer.num_nodes=1 starts 1; set trainer.devices=2",
    ),
    CliCase(  # refused at set-up, before the sanity check's first validation batch
        "head_backend_cuda_only_on_cpu",
        (f"{M}head_backend=liger", f"{T}val_check_interval=1"),
        "model.init_args.head_backend='liger' runs on CUDA only and this run's device is cpu",
    ),
    CliCase(
        "regularizer_mask_key_not_in_data",
        ("--config={tmp}/reg.yaml", NO_VAL),
        "regularizer 'z_loss' aggregates over its mask_key 'completion_mask', which TextDataModule never "
        "provides; its micro-batches have keys ['input_ids', 'labels', 'position_ids', 'segment_ids']",
        files=(("reg.yaml", REG + "      - {name: z_loss, mask_key: completion_mask}\n"),),
    ),
    CliCase(
        "controller_log_format_spec",
        (*CTRL, NO_VAL),
        "arguments.message: {s['global_step']:.3q} has a format spec that fits no value",
        files=_controller("True", head=STATE + LOG_OP % "{s['global_step']:.3q}", ops="lg.should_log"),
    ),
    CliCase(
        "paths_folder",
        (f"{D}paths=[{{tmp}}/corpus]",),
        "data.paths entry '{tmp}/corpus' is a folder; name its files with a glob: '{tmp}/corpus/*.txt' or",
        files=(("corpus/a.txt", TEXT),),
        corpus=False,
    ),
    CliCase(
        "paths_glob_of_folders",
        (f"{D}paths=[{{tmp}}/c*]",),
        "data.paths entry '{tmp}/c*' matches only folders ({tmp}/corpus), no file",
        files=(("corpus/a.txt", TEXT),),
        corpus=False,
    ),
    CliCase(
        "hf_context_shorter_than_seq_len",
        ("--config={tmp}/hf.yaml", NO_VAL),
        "model.init_args.config.max_position_embeddings=8 is smaller than data.seq_len=16",
        files=(("hf.yaml", HF_TINY % 8),),
    ),
    CliCase(
        "hf_float16_weights_under_bf16_mixed",
        ("--config={tmp}/hf.yaml", f"{M}dtype=float16", f"{T}precision=bf16-mixed"),
        "model.init_args.dtype=float16: optimizer.eps=1e-08 rounds to 0 in torch.float16, the dtype of 12 "
        "trainable parameter(s)",
        files=(("hf.yaml", HF_TINY % 64),),
    ),
    CliCase(
        "hf_flash_attention_not_installed",
        ("--config={tmp}/hf.yaml", f"{M}attn_implementation=flash_attention_2"),
        "model.init_args.attn_implementation=flash_attention_2: FlashAttention2 has been toggled on",
        files=(("hf.yaml", HF_TINY % 64),),
    ),
]

# issue #32: preference records (PreferenceDataModule), refused at setup, before training
PREF = (
    "--data.class_path=lit_losses.PreferenceDataModule",
    f"{D}paths=[{{tmp}}/pref.jsonl]",
    f"{D}max_length=16",
)
PAIR = '{"prompt": "2 + 2 =", "chosen": " 4", "rejected": " 5"}'
CHAT_PAIR = json.dumps(
    {
        "prompt": [{"role": "user", "content": "2 + 2?"}],
        "chosen": [{"role": "assistant", "content": "4"}],
        "rejected": [{"role": "assistant", "content": "5"}],
    }
)
CLI_CASES += [
    CliCase(
        "preference_hf_context_shorter_than_max_length",
        (*PREF, "--config={tmp}/hf.yaml", NO_VAL),
        "model.init_args.config.max_position_embeddings=8 is smaller than data.max_length=16",
        files=(("hf.yaml", HF_TINY % 8), ("pref.jsonl", PAIR + "\n" + PAIR + "\n")),
        corpus=False,
    ),
    CliCase(
        "preference_record_missing_rejected",
        PREF,
        "pref.jsonl:2: missing field 'rejected' (a paired preference record has 'chosen' and 'rejected'",
        files=(("pref.jsonl", PAIR + '\n{"prompt": "3 + 3 =", "chosen": " 6"}\n'),),
        corpus=False,
    ),
    CliCase(
        "preference_conversational_without_chat_template",
        PREF,
        "pref.jsonl:1: a conversational record (message lists) is rendered with a chat template, and the "
        "built-in BPE tokenizer has none",
        files=(("pref.jsonl", CHAT_PAIR + "\n"),),
        corpus=False,
    ),
    CliCase(
        "preference_reference_in_some_records_only",
        PREF,
        "pref.jsonl:2: missing field 'ref_chosen_logps', which {tmp}/pref.jsonl:1 has; give the precomputed "
        "reference log-probabilities in every record or in none",
        files=(
            (
                "pref.jsonl",
                PAIR[:-1] + ', "ref_chosen_logps": -3.5, "ref_rejected_logps": -4.0}\n' + PAIR + "\n",
            ),
        ),
        corpus=False,
    ),
]


def _write(tmp_path: Path, name: str, content: str | bytes) -> None:
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    if content == "TRUNCATED":  # the first half of a real (tiny) checkpoint
        torch.save({"state_dict": {"w": torch.zeros(1000)}, "hyper_parameters": {}}, path)
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif content == "LIST":
        torch.save([1, 2, 3], path)
    elif isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", CLI_CASES, ids=[c.id for c in CLI_CASES])
def test_cli_bad_input_is_one_line(case: CliCase, tmp_path, capsys):
    for name, content in case.files:
        _write(tmp_path, name, content)
    args = [a.replace("{tmp}", str(tmp_path)) for a in case.args]
    expected = case.expected.replace("{tmp}", str(tmp_path))
    base = ["fit", "--config", CONFIG, "--trainer.logger=false", "--trainer.max_steps=1"]
    base += [f"--trainer.default_root_dir={tmp_path / 'run'}", "--trainer.enable_checkpointing=false"]
    base += [f"{M}d_model=16", f"{M}n_heads=2", f"{M}n_layers=1", f"{D}vocab_size=300", f"{D}seq_len=16"]
    base += [f"{D}tokens_per_batch=32", f"{D}cache_dir={tmp_path / 'cache'}"]
    if case.corpus:
        (tmp_path / "corpus.txt").write_text(TEXT)  # one document: no validation item to hold out
        base += [f"{D}paths=[{tmp_path / 'corpus.txt'}]", f"{D}val_fraction=0"]
    with pytest.raises(SystemExit) as exit_info:
        cli_main([*base, *args])
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert exit_info.value.code == 2, err
    assert len(lines) == 1 and lines[0].startswith("lit-losses: error: "), err
    assert "Traceback" not in err
    assert expected in lines[0], lines[0]


# ---------------------------------------------------------------------------------------------------
# Python API, batch and checkpoint cases: (id, where, call, exception type, expected fragment)
# ---------------------------------------------------------------------------------------------------
V = 50


def _model(**kwargs) -> TinyLM:
    return TinyLM(vocab_size=V, d_model=16, n_layers=1, n_heads=2, **kwargs)


def _batch(**override) -> dict:
    torch.manual_seed(0)
    batch = {"input_ids": torch.randint(0, V, (2, 6)), "labels": torch.randint(0, V, (2, 6))}
    batch.update(override)
    return {k: v for k, v in batch.items() if v is not None}


def _loss(batch: dict, **kwargs) -> None:
    _model(**kwargs).compute_loss(batch, "val")


def _nan_weight() -> None:
    model = _model()
    with torch.no_grad():
        model.body.embed.weight[3, 1] = float("nan")
    model.predict_step(_batch(), 0)


def _inf_lm_head() -> None:
    model = _model(tie_embeddings=False)
    with torch.no_grad():
        model.lm_head.weight[0, 0] = float("inf")
    model.compute_loss(_batch(), "val")


def _nan_hidden() -> None:
    head = FusedLMHead(torch.randn(V, 4))
    hidden = torch.randn(3, 4)
    hidden[1, 2] = float("nan")
    head(hidden, torch.tensor([1, 2, 3]), "logprobs")


def _ckpt(tmp_path: Path, content) -> str:
    path = tmp_path / "model.ckpt"
    if callable(content):
        content(path)
    else:
        _write(tmp_path, "model.ckpt", content)
    return str(path)


def _data(tmp_path: Path, **kwargs) -> TextDataModule:
    (tmp_path / "corpus.txt").write_text(TEXT)
    options = {"paths": [str(tmp_path / "corpus.txt")], "vocab_size": 300, "seq_len": 16}
    return TextDataModule(**{**options, "tokens_per_batch": 32, "cache_dir": str(tmp_path), **kwargs})


def _read(tmp_path: Path, name: str, content: str | bytes, **kwargs) -> None:
    _write(tmp_path, name, content)
    TextDataModule(paths=[str(tmp_path / name)], vocab_size=300, cache_dir=str(tmp_path), **kwargs).setup(
        "fit"
    )


def _state_dict_of_other_shape() -> None:
    _model().load_state_dict(TinyLM(vocab_size=V + 1, d_model=16, n_layers=1, n_heads=2).state_dict())


@dataclass(frozen=True)
class ApiCase:
    id: str
    where: str  # python | batch | checkpoint | file
    call: Callable[[Path], object]
    error: type[BaseException]
    expected: str


PY_CASES = [
    # constructors (Python API): the same checks as the CLI, naming the config path
    ApiCase("tinylm_d_model_zero", "python", lambda _: TinyLM(d_model=0), ConfigError, "d_model=0 must be"),
    ApiCase("tinylm_vocab_zero", "python", lambda _: TinyLM(vocab_size=0), ConfigError, "vocab_size=0 must"),
    ApiCase("tinylm_vocab_float", "python", lambda _: TinyLM(vocab_size=2.5), ConfigError, "vocab_size=2.5"),
    ApiCase("tinylm_n_heads_neg", "python", lambda _: TinyLM(n_heads=-2), ConfigError, "n_heads=-2 must"),
    ApiCase("tinylm_heads_bool", "python", lambda _: TinyLM(n_heads=True), ConfigError, "n_heads=True must"),
    ApiCase(
        "tinylm_not_dividing", "python", lambda _: TinyLM(d_model=64, n_heads=3), ConfigError, "divisible by"
    ),
    ApiCase(
        "tinylm_odd_head_dim",
        "python",
        lambda _: TinyLM(d_model=18, n_heads=2),
        ConfigError,
        "head dimension 9",
    ),
    ApiCase("tinylm_d_ff_zero", "python", lambda _: TinyLM(d_ff=0), ConfigError, "d_ff=0 must be"),
    ApiCase(
        "tinylm_rope_negative", "python", lambda _: TinyLM(rope_base=-5.0), ConfigError, "rope_base=-5.0"
    ),
    ApiCase(
        "tinylm_rope_nan", "python", lambda _: TinyLM(rope_base=float("nan")), ConfigError, "rope_base=nan"
    ),
    ApiCase("tinylm_rope_text", "python", lambda _: TinyLM(rope_base="big"), ConfigError, "rope_base='big'"),
    ApiCase(
        "head_chunk_zero", "python", lambda _: _model(head_chunk_size=0), ConfigError, "head_chunk_size=0"
    ),
    ApiCase(
        "head_chunk_float",
        "python",
        lambda _: _model(head_chunk_size=1.5),
        ConfigError,
        "head_chunk_size=1.5",
    ),
    ApiCase(
        "head_backend", "python", lambda _: _model(head_backend="gpu"), ConfigError, "'gpu' is not one of"
    ),
    ApiCase("base_loss_weight", "python", lambda _: _model(base_loss_weight=-2.0), ConfigError, ">= 0"),
    ApiCase(
        "optimizer_dict_lr", "python", lambda _: _model(optimizer={"lr": 0.0}), ConfigError, "lr must be > 0"
    ),
    ApiCase(
        "optimizer_unknown_key", "python", lambda _: _model(optimizer={"lrate": 1}), TypeError, "'lrate'"
    ),
    ApiCase("optimizer_warmup", "python", lambda _: OptimizerConfig(warmup_steps=-3), ConfigError, "-3"),
    ApiCase(
        "check_choice", "python", lambda _: check_choice("maen", ("mean",), "x.agg"), ConfigError, "'mean'"
    ),
    ApiCase("data_seq_len", "python", lambda p: _data(p, seq_len=0), ConfigError, "data.seq_len=0"),
    ApiCase("data_vocab", "python", lambda p: _data(p, vocab_size=100), ConfigError, "data.vocab_size=100"),
    ApiCase(
        "data_budget", "python", lambda p: _data(p, tokens_per_batch=4), ConfigError, "tokens_per_batch=4"
    ),
    ApiCase(
        "data_val_fraction", "python", lambda p: _data(p, val_fraction=2.0), ConfigError, "val_fraction=2.0"
    ),
    ApiCase(
        "data_no_match", "python", lambda p: _data(p, paths=[str(p / "x*")]), ConfigError, "matches no file"
    ),
    # batch contents: the batch key, the offending value and the model's expectation
    ApiCase(
        "input_ids_beyond_vocab",
        "batch",
        lambda _: _loss(_batch(input_ids=torch.full((2, 6), V))),
        ValueError,
        f"batch['input_ids'] holds token id {V}, beyond the model's vocab_size={V}",
    ),
    ApiCase(
        "input_ids_negative",
        "batch",
        lambda _: _loss(_batch(input_ids=torch.full((2, 6), -1))),
        ValueError,
        "batch['input_ids'] holds token id -1",
    ),
    ApiCase(
        "input_ids_float",
        "batch",
        lambda _: _loss(_batch(input_ids=torch.ones(2, 6))),
        ValueError,
        "batch['input_ids'] must be an integer [B, T] tensor, got dtype torch.float32",
    ),
    ApiCase(
        "input_ids_bool",
        "batch",
        lambda _: _loss(_batch(input_ids=torch.ones(2, 6, dtype=torch.bool))),
        ValueError,
        "got dtype torch.bool",
    ),
    ApiCase(
        "input_ids_1d",
        "batch",
        lambda _: _loss(_batch(input_ids=torch.ones(6, dtype=torch.long))),
        ValueError,
        "and shape (6,)",
    ),
    ApiCase(
        "input_ids_list",
        "batch",
        lambda _: _loss(_batch(input_ids=[[1, 2]])),
        ValueError,
        "batch['input_ids'] must be a tensor of token ids, got list",
    ),
    ApiCase(
        "input_ids_missing",
        "batch",
        lambda _: _model().predict_step({"labels": torch.ones(2, 6).long()}, 0),
        ValueError,
        "got NoneType",
    ),
    ApiCase(
        "segment_ids_shape",
        "batch",
        lambda _: _loss(_batch(segment_ids=torch.zeros(2, 5, dtype=torch.long))),
        ValueError,
        "batch['segment_ids'] has shape (2, 5); the model expects the shape of batch['input_ids'] (2, 6)",
    ),
    ApiCase(
        "position_ids_shape",
        "batch",
        lambda _: _loss(_batch(position_ids=torch.zeros(6, dtype=torch.long))),
        ValueError,
        "batch['position_ids'] has shape (6,)",
    ),
    ApiCase(
        "position_ids_negative",
        "batch",
        lambda _: _loss(_batch(position_ids=torch.full((2, 6), -3))),
        ValueError,
        "batch['position_ids'] holds -3",
    ),
    ApiCase(
        "labels_missing",
        "batch",
        lambda _: _loss(_batch(labels=None)),
        KeyError,
        "batch key 'labels' is missing",
    ),
    ApiCase(
        "advantages_missing",
        "batch",
        lambda _: _loss(_batch(sampling_logprobs=torch.zeros(2, 6)), base_loss="ppo"),
        KeyError,
        "base loss 'ppo' reads batch key 'advantages', which is missing; the batch has keys "
        "['input_ids', 'labels', 'sampling_logprobs']",
    ),
    ApiCase(
        "sampling_logprobs_shape",
        "batch",
        lambda _: _loss(
            _batch(sampling_logprobs=torch.zeros(2, 5), advantages=torch.ones(2, 6)), base_loss="cispo"
        ),
        ValueError,
        "batch['sampling_logprobs'] has shape (2, 5) but batch['labels'] has shape (2, 6)",
    ),
    ApiCase(
        "base_loss_args_python",
        "python",
        lambda _: _model(base_loss="ppo", base_loss_args={"clip_high_threshold": 0.5}),
        ConfigError,
        "model.base_loss_args.clip_high_threshold=0.5 must be >= clip_low_threshold=0.8 (base loss 'ppo')",
    ),
    ApiCase(
        "labels_beyond_vocab",
        "batch",
        lambda _: _loss(_batch(labels=torch.full((2, 6), V + 7))),
        ValueError,
        f"target {V + 7} is out of range for vocabulary size V={V}",
    ),
    ApiCase(
        "labels_float",
        "batch",
        lambda _: _loss(_batch(labels=torch.ones(2, 6))),
        ValueError,
        "got dtype torch.float32",
    ),
    ApiCase(
        "labels_shape",
        "batch",
        lambda _: _loss(_batch(labels=torch.ones(2, 5, dtype=torch.long))),
        ValueError,
        "does not match",
    ),
    ApiCase("nan_output_weight", "batch", lambda _: _nan_weight(), ValueError, "contains 1 non-finite value"),
    ApiCase(
        "inf_lm_head", "batch", lambda _: _inf_lm_head(), ValueError, "the output weight (shape (50, 16))"
    ),
    ApiCase("nan_hidden", "batch", lambda _: _nan_hidden(), ValueError, "hidden states contain 1 non-finite"),
    ApiCase(
        "head_width",
        "batch",
        lambda _: FusedLMHead(torch.randn(V, 4))(torch.randn(3, 5), torch.tensor([1, 2, 3])),
        ValueError,
        "hidden width 5",
    ),
    # per-token weights of the fused cross-entropy (were silent: a NaN weight made the loss NaN)
    ApiCase(
        "head_nan_token_weight",
        "batch",
        lambda _: FusedLMHead(torch.randn(V, 4)).weighted_ce(
            torch.randn(3, 4), torch.tensor([1, 2, 3]), torch.tensor([1.0, float("nan"), 1.0])
        ),
        ValueError,
        "token_weights hold 1 non-finite value(s) (NaN/Inf), e.g. at position (1,)",
    ),
    ApiCase(
        "head_token_weight_shape",
        "batch",
        lambda _: FusedLMHead(torch.randn(V, 4)).weighted_ce(
            torch.randn(3, 4), torch.tensor([1, 2, 3]), torch.ones(2)
        ),
        ValueError,
        "token_weights shape (2,) differs from the targets' shape (3,)",
    ),
    ApiCase(
        "head_inf_uniform_weight",
        "batch",
        lambda _: FusedLMHead(torch.randn(V, 4)).weighted_ce(
            torch.randn(3, 4), torch.tensor([1, 2, 3]), float("inf")
        ),
        ValueError,
        "token_weights=inf must be a finite number",
    ),
    # checkpoints, through the Python loader the CLI uses
    ApiCase(
        "ckpt_empty",
        "checkpoint",
        lambda p: read_checkpoint(_ckpt(p, b"")),
        ConfigError,
        "model.ckpt is not a",
    ),
    ApiCase(
        "ckpt_truncated",
        "checkpoint",
        lambda p: read_checkpoint(_ckpt(p, "TRUNCATED")),
        ConfigError,
        "is not a readable checkpoint",
    ),
    ApiCase(
        "ckpt_zeros",
        "checkpoint",
        lambda p: read_checkpoint(_ckpt(p, bytes(4096))),
        ConfigError,
        "is not a readable checkpoint",
    ),
    ApiCase(
        "ckpt_no_state_dict",
        "checkpoint",
        lambda p: read_checkpoint(_ckpt(p, lambda path: torch.save({"epoch": 1}, path))),
        ConfigError,
        "is not a Lightning checkpoint (no 'state_dict')",
    ),
    ApiCase(
        "ckpt_directory",
        "checkpoint",
        lambda p: read_checkpoint(str(p)),
        ConfigError,
        "not a sharded checkpoint",
    ),
    ApiCase(
        "state_dict_other_vocab",
        "checkpoint",
        lambda _: _state_dict_of_other_shape(),
        RuntimeError,
        "size mismatch for body.embed.weight",
    ),
    # corpus files through the Python API
    ApiCase(
        "file_binary", "file", lambda p: _read(p, "a.bin", b"\x00\x01" * 99), ConfigError, "a.bin is a binary"
    ),
    ApiCase(
        "file_bad_utf8",
        "file",
        lambda p: _read(p, "a.txt", b"ok \xc3\x28 " * 9),
        ConfigError,
        "a.txt is not UTF-8 text (byte 3",
    ),
    ApiCase(
        "jsonl_truncated_line",
        "file",
        lambda p: _read(p, "a.jsonl", '{"text": "a"}\n{"text": "b'),
        ConfigError,
        "a.jsonl:2 is not valid JSON",
    ),
    ApiCase(
        "jsonl_custom_field",
        "file",
        lambda p: _read(p, "a.jsonl", '{"text": "a"}\n', text_field="body"),
        ConfigError,
        "a.jsonl:1 has no field data.text_field='body'",
    ),
]


def _hf(tmp_path: Path, files: tuple[tuple[str, str | bytes], ...] = TOKENIZER, **kwargs) -> None:
    pytest.importorskip("transformers")
    from lit_losses.data.hf_text import HFTextDataModule

    for name, content in files:
        _write(tmp_path, name, content)
    options = {"paths": [str(tmp_path / "*.jsonl")], "seq_len": 8, "tokens_per_batch": 16, **kwargs}
    HFTextDataModule(str(tmp_path / "tok"), val_fraction=0.0, cache_dir=str(tmp_path), **options).setup("fit")


def _unreadable(tmp_path: Path, hf: bool = True) -> None:
    """A corpus file that cannot be read (as root, chmod does not stop a read: the read is made to fail)."""
    read_bytes = Path.read_bytes

    def denied(path: Path) -> bytes:
        if path.name == "locked.jsonl":
            raise PermissionError(13, "Permission denied", str(path))
        return read_bytes(path)

    with mock.patch.object(Path, "read_bytes", denied):
        if hf:
            _hf(tmp_path, (*TOKENIZER, ("locked.jsonl", '{"text": "the fox"}\n')))
            return
        (tmp_path / "locked.jsonl").write_text('{"text": "the fox"}\n')
        TextDataModule(paths=[str(tmp_path / "*.jsonl")], cache_dir=str(tmp_path)).prepare_data()


def keyword_scaled(ctx, *, scale: float):
    return scale * ctx.logprobs


PY_CASES += [
    ApiCase(
        "regularizer_args_unknown",
        "python",
        lambda _: _model(regularizers=[{"name": "entropy", "args": {"mod": "bonus"}}]),
        ConfigError,
        "model.regularizers[0].args.mod: regularizer 'entropy' takes no argument 'mod'; did you mean 'mode'?",
    ),
    ApiCase(
        "regularizer_spec_args_choice",
        "python",
        lambda _: _model(
            regularizers=[{"name": "z_loss"}, RegularizerSpec("entropy", args={"mode": "bonuss"})]
        ),
        ConfigError,
        "model.regularizers[1].args.mode='bonuss': regularizer 'entropy' takes one of ('penalty', 'bonus')",
    ),
    ApiCase(
        "regularizer_args_bool_for_float",
        "python",
        lambda _: _model(regularizers=[{"name": "logprob_l1", "args": {"target": True}}]),
        ConfigError,
        "model.regularizers[0].args.target=True: regularizer 'logprob_l1' takes float, got bool",
    ),
    ApiCase(
        "regularizer_args_missing",
        "python",
        lambda _: _model(regularizers=[{"name": "s", "fn": keyword_scaled}]),
        ConfigError,
        "model.regularizers[0].args: regularizer 's' needs the argument(s) ['scale'], got []",
    ),
    ApiCase(
        "hf_tokenizer_missing",
        "file",
        lambda p: _hf(p, files=(DOCS,)),
        ConfigError,
        "/tok' is not a local directory",
    ),
    ApiCase(
        "hf_tokenizer_config_bad_json",
        "file",
        lambda p: _hf(p, files=(TOKENIZER[0], ("tok/tokenizer_config.json", '{"eos_token": }'), DOCS)),
        ConfigError,
        "tok/tokenizer_config.json is not valid JSON (Expecting value, line 1 column 15)",
    ),
    ApiCase(
        "hf_tokenizer_unloadable",
        "file",
        lambda p: _hf(
            p, files=(("tok/tokenizer_config.json", '{"tokenizer_class": "NoSuchTokenizer"}'), DOCS)
        ),
        ConfigError,
        "tok': the tokenizer cannot be loaded (",
    ),
    ApiCase(
        "hf_jsonl_not_json",
        "file",
        lambda p: _hf(p, files=(*TOKENIZER, ("a.jsonl", '{"text": "the fox"}\n\n{"text": "a"'))),
        ConfigError,
        "a.jsonl:3 is not valid JSON",
    ),
    ApiCase(
        "hf_jsonl_other_field",
        "file",
        lambda p: _hf(p, files=(*TOKENIZER, ("a.jsonl", '{"text": "the fox"}\n')), text_field="body"),
        ConfigError,
        "a.jsonl:1 has no field data.text_field='body'",
    ),
    ApiCase(
        "hf_file_unreadable",
        "file",
        _unreadable,
        ConfigError,
        "locked.jsonl cannot be read (Permission denied)",
    ),
    ApiCase(
        "text_file_unreadable",
        "file",
        lambda p: _unreadable(p, hf=False),
        ConfigError,
        "locked.jsonl cannot be read (Permission denied)",
    ),
]


NORM = "seq-mean-token-sum-norm"
PY_CASES += [  # seq-mean-token-sum-norm without its constant, from the APIs that build their own terms
    ApiCase(
        "custom_call_loss_agg_norm_missing",
        "python",
        lambda _: _model().forward_backward_custom(
            _batch(), regularizers=[{"name": "z", "fn": "z_loss", "agg": NORM}]
        ),
        ConfigError,
        "forward_backward_custom: model.loss_agg_norm is required by aggregation mode "
        "'seq-mean-token-sum-norm'",
    ),
    ApiCase(
        "pipeline_loss_agg_norm_missing",
        "python",
        lambda _: PipelineLoss(lambda: None, 2, loss_agg=NORM),
        ConfigError,
        "PipelineLoss: model.loss_agg_norm is required by aggregation mode 'seq-mean-token-sum-norm'",
    ),
    ApiCase(
        "pipeline_loss_agg_norm_zero",
        "python",
        lambda _: PipelineLoss(lambda: None, 2, loss_agg=NORM, loss_agg_norm=0),
        ConfigError,
        "PipelineLoss: model.loss_agg_norm must be a finite number > 0",
    ),
]


# issue #26: the public functions of aggregation, rl_dataset and the subclass hooks check their arguments'
# types, shapes, ranges and finiteness (before: a raw AttributeError/RuntimeError, or a silently wrong loss)
LOSS, MASK, COUNTS = torch.tensor([[1.0, 2.0, 3.0]]), torch.tensor([[True, True, False]]), MaskStats(2, 1)
LABELS = torch.tensor([[5, 6, -100]])
RECORD = {"tokens": [1, 2, 3], "logprobs": [None, -0.5, -1.0], "advantage": 1.0}


def _agg(**override) -> None:
    args = {"loss_mat": LOSS, "mask": MASK, "mode": "token-mean", "stats": COUNTS, **override}
    aggregate(**args)


def _rl(records=(RECORD,), **override) -> None:
    rl_dataset(list(records), **{"seq_len": 4, "tokens_per_batch": 8, **override})


class TupleHidden(TinyLM):
    def forward_hidden(self, batch):
        return (super().forward_hidden(batch),)


class WeightOnly(TinyLM):
    def output_projection(self):
        return super().output_projection()[0]


def _hook(cls: type) -> None:
    cls(vocab_size=V, d_model=16, n_layers=1, n_heads=2).compute_loss(_batch(), "val")


def _controller_config(rule_ops: str, operations: str) -> None:
    parse_config(
        f"{STATE}operations:\n{operations}controllers:\n  - {{name: c, triggers: [on_optimizer_step_end], "
        f"rule: 'True', operations: [{rule_ops}]}}\n"
    )


def _unreachable(metric: str, triggers: str = "on_optimizer_step_end") -> list:
    config = parse_config(
        f"controller-metrics:\n  - {metric}\ncontrollers:\n  - {{name: c, triggers: [{triggers}], "
        "rule: 'm is not None', operations: [lightning.should_training_stop]}\n"
    )
    found = unreachable(config, VALIDATION_EVENTS)
    raise ConfigError(str(found))


PY_CASES += [
    # aggregate: types, shapes, counts, weights, ids
    ApiCase(
        "agg_mask_list",
        "aggregation",
        lambda _: _agg(mask=[[1, 1, 0]]),
        TypeError,
        "the mask must be a [B, T] tensor, got list",
    ),
    ApiCase(
        "agg_loss_list",
        "aggregation",
        lambda _: _agg(loss_mat=[[1.0, 2.0, 3.0]]),
        TypeError,
        "the loss matrix must be a [B, T] tensor",
    ),
    ApiCase(
        "agg_loss_1d",
        "aggregation",
        lambda _: _agg(loss_mat=torch.ones(3), mask=torch.ones(3, dtype=torch.bool)),
        ValueError,
        "must be a [B, T] tensor (rows × positions), got shape (3,)",
    ),
    ApiCase(
        "agg_loss_3d",
        "aggregation",
        lambda _: _agg(loss_mat=torch.ones(1, 1, 3), mask=torch.ones(1, 1, 3, dtype=torch.bool)),
        ValueError,
        "got shape (1, 1, 3)",
    ),
    ApiCase(
        "agg_zero_rows",
        "aggregation",
        lambda _: _agg(loss_mat=torch.ones(0, 3), mask=torch.ones(0, 3, dtype=torch.bool)),
        ValueError,
        "has shape (0, 3): an empty batch",
    ),
    ApiCase(
        "agg_zero_positions",
        "aggregation",
        lambda _: _agg(loss_mat=torch.ones(2, 0), mask=torch.ones(2, 0, dtype=torch.bool)),
        ValueError,
        "has shape (2, 0): an empty batch",
    ),
    ApiCase(
        "agg_mask_fraction",
        "aggregation",
        lambda _: _agg(mask=torch.tensor([[0.5, 1.0, 0.0]])),
        ValueError,
        "mask holds values other than 0 and 1",
    ),
    ApiCase(
        "agg_stats_tuple",
        "aggregation",
        lambda _: _agg(stats=(2, 1)),
        TypeError,
        "stats must be a MaskStats (the global counts), got tuple",
    ),
    ApiCase(
        "agg_stats_none", "aggregation", lambda _: _agg(stats=None), TypeError, "stats must be a MaskStats"
    ),
    ApiCase(
        "counts_negative",
        "aggregation",
        lambda _: MaskStats(-2, 1),
        ValueError,
        "MaskStats.num_tokens must be an integer >= 0, got -2",
    ),
    ApiCase(
        "counts_fraction",
        "aggregation",
        lambda _: MaskStats(2.5, 1),
        TypeError,
        "MaskStats.num_tokens must be an integer >= 0, got 2.5",
    ),
    ApiCase(
        "counts_contradict",
        "aggregation",
        lambda _: MaskStats(2, 5),
        ValueError,
        "5 sequences with a valid token but only 2 valid tokens",
    ),
    ApiCase(
        "agg_weights_nan",
        "aggregation",
        lambda _: _agg(sample_weights=torch.tensor([[1.0, float("nan"), 1.0]])),
        ValueError,
        "sample_weights holds 1 non-finite value(s)",
    ),
    ApiCase(
        "agg_weights_negative",
        "aggregation",
        lambda _: _agg(sample_weights=torch.tensor([-1.0])),
        ValueError,
        "sample_weights holds a negative weight (-1.0)",
    ),
    ApiCase(
        "agg_weights_list",
        "aggregation",
        lambda _: _agg(sample_weights=[1.0]),
        TypeError,
        "sample_weights must be a tensor, got list",
    ),
    ApiCase(
        "agg_segments_float",
        "aggregation",
        lambda _: _agg(mode="seq-mean-token-mean", segment_ids=torch.tensor([[0.5, 1.5, 1.5]])),
        ValueError,
        "segment_ids must hold integers, got dtype torch.float32",
    ),
    # count_masks and GlobalStatsLoader
    ApiCase(
        "count_masks_list_batch",
        "aggregation",
        lambda _: count_masks([LABELS]),
        TypeError,
        "count_masks needs a dict micro-batch",
    ),
    ApiCase(
        "count_masks_keys_string",
        "aggregation",
        lambda _: count_masks({"labels": LABELS}, mask_keys="labels"),
        TypeError,
        "mask_keys must be a sequence of batch keys, got the string 'labels'",
    ),
    ApiCase(
        "count_masks_label_format",
        "aggregation",
        lambda _: count_masks({"labels": LABELS}, label_format="input-aligned"),
        ConfigError,
        "label_format 'input-aligned' is not one of ('next_token', 'input_aligned'); did you mean "
        "'input_aligned'?",
    ),
    ApiCase(
        "count_masks_float_labels",
        "aggregation",
        lambda _: count_masks({"labels": LABELS.float()}),
        ValueError,
        "batch['labels'] must hold integers, got dtype torch.float32",
    ),
    ApiCase(
        "count_masks_ignore_index_text",
        "aggregation",
        lambda _: count_masks({"labels": LABELS}, ignore_index="-100"),
        TypeError,
        "ignore_index must be an integer label value, got '-100'",
    ),
    ApiCase(
        "count_masks_empty",
        "aggregation",
        lambda _: count_masks({"labels": LABELS[:0]}),
        ValueError,
        "batch['labels'] has shape (0, 3): an empty batch",
    ),
    ApiCase(
        "count_masks_float_segments",
        "aggregation",
        lambda _: count_masks({"labels": LABELS, "segment_ids": torch.tensor([[0.0, 1.0, 1.0]])}),
        ValueError,
        "segment_ids must hold integers",
    ),
    ApiCase(
        "loader_accumulate_fraction",
        "aggregation",
        lambda _: GlobalStatsLoader([], batch_size=None, accumulate_grad_batches=1.5),
        ConfigError,
        "GlobalStatsLoader: accumulate_grad_batches must be an integer >= 1, got 1.5",
    ),
    ApiCase(
        "loader_mask_keys_string",
        "aggregation",
        lambda _: GlobalStatsLoader([], batch_size=None, mask_keys="labels"),
        ConfigError,
        "GlobalStatsLoader: mask_keys must be a sequence of batch keys, got the string 'labels'",
    ),
    ApiCase(
        "loader_label_format",
        "aggregation",
        lambda _: GlobalStatsLoader([], batch_size=None, label_format="inputaligned"),
        ConfigError,
        "GlobalStatsLoader: label_format 'inputaligned' is not one of",
    ),
    ApiCase(
        "loader_ignore_index_text",
        "aggregation",
        lambda _: GlobalStatsLoader([], batch_size=None, ignore_index="x"),
        ConfigError,
        "GlobalStatsLoader: ignore_index must be an integer label value, got 'x'",
    ),
    # rl_dataset checks what RLDataModule checks
    ApiCase(
        "rl_dataset_seq_len", "data", lambda _: _rl(seq_len=1), ConfigError, "data.seq_len=1 must be >= 2"
    ),
    ApiCase(
        "rl_dataset_seq_len_text",
        "data",
        lambda _: _rl(seq_len="4"),
        ConfigError,
        "data.seq_len='4' must be >= 2",
    ),
    ApiCase(
        "rl_dataset_tokens_per_batch",
        "data",
        lambda _: _rl(tokens_per_batch=2),
        ConfigError,
        "data.tokens_per_batch=2 is smaller than one sequence (seq_len=4)",
    ),
    ApiCase(
        "rl_dataset_pad_negative",
        "data",
        lambda _: _rl(pad_id=-1),
        ConfigError,
        "data.pad_id=-1 must be >= 0",
    ),
    ApiCase(
        "rl_dataset_pad_outside",
        "data",
        lambda _: _rl(vocab_size=8, pad_id=9),
        ConfigError,
        "data.pad_id=9 must be a token id in [0, 8) (data.vocab_size)",
    ),
    ApiCase(
        "rl_dataset_vocab_zero",
        "data",
        lambda _: _rl(vocab_size=0),
        ConfigError,
        "data.vocab_size=0 must be >= 1",
    ),
    ApiCase(
        "rl_dataset_no_record",
        "data",
        lambda _: _rl(records=()),
        ConfigError,
        "rl_dataset: records holds no record",
    ),
    ApiCase(
        "rl_module_pad_negative",
        "data",
        lambda _: RLDataModule(paths=["x.jsonl"], pad_id=-1),
        ConfigError,
        "data.pad_id=-1 must be >= 0",
    ),
    # subclass hooks returning the wrong type
    ApiCase(
        "hook_hidden_tuple",
        "python",
        lambda _: _hook(TupleHidden),
        TypeError,
        "TupleHidden.forward_hidden(batch) must return the hidden states as one [B, T, D] tensor, got tuple",
    ),
    ApiCase(
        "hook_projection_tensor",
        "python",
        lambda _: _hook(WeightOnly),
        TypeError,
        "WeightOnly.output_projection() must return (weight [V, D], bias [V] or None), got Parameter",
    ),
    # a missing batch key that a base loss reads: a BatchKeyError (a ConfigError and a KeyError)
    ApiCase(
        "base_loss_key_missing",
        "batch",
        lambda _: _loss(_batch(), base_loss="ppo"),
        BatchKeyError,
        "base loss 'ppo' reads batch key 'sampling_logprobs', which is missing",
    ),
    # controller configs: an action without its argument, a bad exit code, controllers that can never act
    ApiCase(
        "controller_action_argument",
        "controller",
        lambda _: _controller_config(
            "r.should_scale_weight", "  - {name: r, class: RegularizerControl, arguments: {regularizer: z}}\n"
        ),
        ConfigError,
        "r.should_scale_weight needs operations[0].arguments.factor",
    ),
    ApiCase(
        "controller_exit_code_text",
        "controller",
        lambda _: _controller_config(
            "lightning.should_training_stop",
            "  - {name: lightning, class: LightningOperations, arguments: {exit_code: fail}}\n",
        ),
        ConfigError,
        "exit_code='fail' must be an integer in [1, 125]",
    ),
    ApiCase(
        "controller_exit_code_high",
        "controller",
        lambda _: _controller_config(
            "lightning.should_training_stop",
            "  - {name: lightning, class: LightningOperations, arguments: {exit_code: 143}}\n",
        ),
        ConfigError,
        "exit_code=143 must be an integer in [1, 125]",
    ),
    ApiCase(
        "controller_eval_metric_unreachable",
        "controller",
        lambda _: _unreachable("{name: m, class: EvalMetrics}"),
        ConfigError,
        "[('c', \"its rule reads metric(s) ['m'], computed only on ['on_validation_end']\")]",
    ),
    ApiCase(
        "controller_trigger_unreachable",
        "controller",
        lambda _: _unreachable(
            "{name: m, class: TrainingState}", "on_validation_epoch_end, on_validation_end"
        ),
        ConfigError,
        "its triggers ['on_validation_end', 'on_validation_epoch_end'] never fire",
    ),
]


# issue #34: a string where a list of strings is meant, arguments checked at every entry point, torch's
# refusals named by the option, counts of another mask, a mask key missing at validation, format specs
def _fp16_hf(**kwargs) -> None:
    from lit_losses import HFCausalLM

    config = {"model_type": "llama", "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1}
    HFCausalLM(config={**config, "num_attention_heads": 2, "vocab_size": 32}, dtype="float16", **kwargs)


def _log_format(spec: str, argument: str = "message") -> None:
    _controller_config(
        "lg.should_log", f'  - {{name: lg, class: LogControl, arguments: {{{argument}: "step {spec}"}}}}\n'
    )


def _masked_loss(stage: str) -> None:
    _model(regularizers=[{"name": "z_loss", "mask_key": "completion_mask"}]).compute_loss(_batch(), stage)


def _report(tmp_path: Path, out: str) -> None:
    (tmp_path / "metrics.csv").write_text("epoch,step,train/loss_total\n0,0,4.0\n0,1,3.0\n")
    write_report([tmp_path], out.replace("{tmp}", str(tmp_path)))


def _signals(signals) -> None:
    PreemptionCheckpoint(signals=signals)


def _base_loss_reads(reads) -> None:
    register_base_loss("bad_inputs_reads", reads=reads)(lambda logprobs, inputs: -logprobs)


ONE_ROW = torch.ones(1, 3, dtype=torch.bool)
PY_CASES += [
    ApiCase(
        "grpo_ignored_field",
        "python",
        lambda _: _model(grpo={"loss_type": "vespo", "importance_sampling_level": "sequence"}),
        ConfigError,
        "model.grpo.importance_sampling_level='sequence': loss_type 'vespo' ignores it",
    ),
    ApiCase(
        "fsdp_modules_string",
        "python",
        lambda _: ParallelConfig(fsdp_modules="body.blocks.*"),
        ConfigError,
        "model.parallel.fsdp_modules='body.blocks.*' is one string; give a list of name patterns: "
        "['body.blocks.*']",
    ),
    ApiCase(
        "fsdp_modules_number",
        "python",
        lambda _: ParallelConfig(fsdp_modules=["body", 3]),
        ConfigError,
        "model.parallel.fsdp_modules[1]=3 must be a string (name patterns), got int",
    ),
    ApiCase(
        "data_paths_string",
        "python",
        lambda p: _data(p, paths=str(p / "corpus.txt")),
        ConfigError,
        "data.paths='",
    ),
    ApiCase(
        "rl_paths_string",
        "python",
        lambda _: RLDataModule(paths="rollouts.jsonl"),
        ConfigError,
        "data.paths='rollouts.jsonl' is one string; give a list of file globs: ['rollouts.jsonl']",
    ),
    ApiCase(
        "regularizer_needs_string",
        "python",
        lambda _: _model(regularizers=[{"name": "l", "fn": "z_loss", "needs": "lse"}]),
        ConfigError,
        "needs='lse' is one string; give a list of needs: ['lse']",
    ),
    ApiCase(
        "base_loss_reads_string",
        "python",
        lambda _: _base_loss_reads("advantages"),
        ConfigError,
        "register_base_loss('bad_inputs_reads'): reads='advantages' is one string",
    ),
    ApiCase(
        "preemption_signals_string",
        "python",
        lambda _: _signals("SIGTERM"),
        ConfigError,
        "PreemptionCheckpoint.signals='SIGTERM' is one string; give a list of signal names: ['SIGTERM']",
    ),
    ApiCase(
        "preemption_signal_typo",
        "python",
        lambda _: _signals(["SIGTREM"]),
        ConfigError,
        "PreemptionCheckpoint.signals[0]='SIGTREM' is not a signal; did you mean 'SIGTERM'?",
    ),
    ApiCase(
        "optimizer_beta_negative",
        "python",
        lambda _: OptimizerConfig(betas=(-0.1, 0.95)),
        ConfigError,
        "optimizer.betas=(-0.1, 0.95): torch.optim.AdamW refuses it (Invalid beta parameter at index 0",
    ),
    ApiCase(
        "optimizer_three_betas",
        "python",
        lambda _: OptimizerConfig(betas=(0.9, 0.95, 0.99)),
        ConfigError,
        "optimizer.betas=(0.9, 0.95, 0.99) must be two numbers, each in [0, 1)",
    ),
    ApiCase(
        "optimizer_weight_decay_negative",
        "python",
        lambda _: _model(optimizer={"weight_decay": -0.1}),
        ConfigError,
        "optimizer.weight_decay=-0.1: torch.optim.AdamW refuses it",
    ),
    ApiCase(
        "optimizer_lr_nan",
        "python",
        lambda _: OptimizerConfig(lr=float("nan")),
        ConfigError,
        "optimizer.lr=nan: torch.optim.AdamW refuses it (Invalid learning rate: nan)",
    ),
    ApiCase(
        "hf_float16_trainable_weights",
        "python",
        lambda _: _fp16_hf(),
        ConfigError,
        "model.init_args.dtype=float16: optimizer.eps=1e-08 rounds to 0 in torch.float16",
    ),
    ApiCase(
        "loader_configure_accumulate_zero",
        "aggregation",
        lambda _: GlobalStatsLoader([], batch_size=None).configure(
            accumulate_grad_batches=0, mask_keys=["labels"], ignore_index=-100
        ),
        ConfigError,
        "GlobalStatsLoader: accumulate_grad_batches must be an integer >= 1, got 0",
    ),
    ApiCase(
        "loader_configure_mask_keys_string",
        "aggregation",
        lambda _: GlobalStatsLoader([], batch_size=None).configure(
            accumulate_grad_batches=2, mask_keys="labels", ignore_index=-100
        ),
        ConfigError,
        "GlobalStatsLoader: mask_keys must be a sequence of batch keys, got the string 'labels'",
    ),
    ApiCase(
        "agg_counts_of_another_mask",
        "aggregation",
        lambda _: aggregate(torch.ones(1, 3), ONE_ROW, "token-mean", MaskStats(1, 1)),
        ValueError,
        "loss: stats MaskStats(num_tokens=1, num_sequences=1) count fewer valid tokens (1) than the mask "
        "holds in this micro-batch alone (3): they are another mask's counts",
    ),
    ApiCase(
        "agg_counts_of_another_mask_same_sequences",
        "aggregation",
        lambda _: aggregate(torch.ones(1, 3), ONE_ROW, "seq-mean-token-mean", MaskStats(5, 1)),
        ValueError,
        "count 5 valid tokens in 1 sequences, but the mask holds these 1 sequences in this micro-batch "
        "with 3 valid tokens",
    ),
    ApiCase(
        "mask_key_missing_at_validation",
        "batch",
        lambda _: _masked_loss("val"),
        BatchKeyError,
        "regularizer 'z_loss' aggregates over its mask_key 'completion_mask', which is missing from the "
        "batch; the batch has keys ['input_ids', 'labels']",
    ),
    ApiCase(
        "head_chunk_size_text",
        "batch",
        lambda _: FusedLMHead(torch.randn(V, 4), chunk_size="512"),
        TypeError,
        "chunk_size must be an integer >= 1 (tokens per chunk) or None, got '512' (str)",
    ),
    ApiCase(
        "head_ignore_index_text",
        "batch",
        lambda _: FusedLMHead(torch.randn(V, 4), ignore_index="-100"),
        TypeError,
        "ignore_index must be an integer target value, got '-100' (str)",
    ),
    ApiCase(
        "head_zero_width_hidden",
        "batch",
        lambda _: FusedLMHead(torch.randn(V, 0))(torch.randn(2, 3, 0), torch.ones(2, 3, dtype=torch.long)),
        ValueError,
        "hidden states of shape (2, 3, 0) have no width: the head needs [..., D] with D >= 1",
    ),
    ApiCase(
        "head_backend_cuda_only",
        "python",
        lambda _: check_backend_runs("cce", "cpu", "head"),
        ConfigError,
        "head='cce' runs on CUDA only and this run's device is cpu",
    ),
    ApiCase(
        "corpus_whitespace_only",
        "file",
        lambda p: _read(p, "blank.txt", " \n\t\n"),
        ConfigError,
        "data.paths: the corpus is empty: no non-blank document in ",
    ),
    ApiCase(
        "paths_folder",
        "file",
        lambda p: _data(p, paths=[str(p)]),
        ConfigError,
        "' is a folder; name its files with a glob: '",
    ),
    ApiCase(
        "controller_log_format_spec",
        "controller",
        lambda _: _log_format("{s['global_step']:%Y}"),
        ConfigError,
        "arguments.message: {s['global_step']:%Y} has a format spec that fits no value",
    ),
    ApiCase(
        "controller_fms_log_format_spec",
        "controller",
        lambda _: _log_format("{state.global_step:.2z}", argument="log_format"),
        ConfigError,
        "arguments.log_format: {state.global_step:.2z} has a format spec that fits no value",
    ),
    ApiCase(
        "controller_fms_log_format_conversion",
        "controller",
        lambda _: _log_format("{state.global_step!x}", argument="log_format"),
        ConfigError,
        "arguments.log_format: {state.global_step!x} has an unknown conversion; use !r, !s or !a",
    ),
    ApiCase(
        "report_out_folder",
        "file",
        lambda p: _report(p, "{tmp}"),
        ConfigError,
        "--out /",
    ),
    ApiCase(
        "report_out_missing_folder",
        "file",
        lambda p: _report(p, "{tmp}/no/such/folder/r.html"),
        ConfigError,
        "/no/such/folder/r.html: its folder ",
    ),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", PY_CASES, ids=[f"{c.where}-{c.id}" for c in PY_CASES])
def test_api_bad_input_raises_one_clear_line(case: ApiCase, tmp_path):
    with pytest.raises(case.error) as info:
        case.call(tmp_path)
    message = str(info.value.args[0]) if info.value.args else str(info.value)
    if case.where == "controller":  # every problem of a config, one per line; the CLI joins them (one_line)
        message = one_line(message)
    assert case.expected in message, message
    if case.error is not RuntimeError:  # torch's own size-mismatch report lists every tensor
        assert "\n" not in message, message


def test_table_has_at_least_100_distinct_cases():
    ids = [c.id for c in CLI_CASES] + [f"{c.where}-{c.id}" for c in PY_CASES]
    assert len(ids) == len(set(ids)) >= 100


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("out", "expected"),
    [
        ("{tmp}", "--out {tmp} is a folder; give a file name, e.g. --out {tmp}/report.html"),
        ("{tmp}/no/r.html", "--out {tmp}/no/r.html: its folder {tmp}/no does not exist"),
        ("/proc/version", "--out /proc/version cannot be written ("),
    ],
    ids=["folder", "missing_folder", "unwritable"],
)
def test_report_out_errors_name_the_option(out, expected, tmp_path, capsys):
    from lit_losses.cli.report import report_main

    (tmp_path / "metrics.csv").write_text("epoch,step,train/loss_total\n0,0,4.0\n0,1,3.0\n")
    if out.startswith("/proc") and not Path(out).exists():
        pytest.skip("no /proc here")
    with pytest.raises(SystemExit) as exit_info:
        report_main([str(tmp_path), "--out", out.replace("{tmp}", str(tmp_path))])
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert exit_info.value.code == 2 and len(err) == 1, err
    assert err[0].startswith("lit-losses: error: " + expected.replace("{tmp}", str(tmp_path))), err[0]


@pytest.mark.timeout(120)
def test_max_steps_zero_ends_with_its_summary_and_run_end(tmp_path, capsys):
    """Nothing to train is a legitimate run: it ends at step 0 with the summary and ``run_end.json``."""
    (tmp_path / "corpus.txt").write_text(TEXT)
    args = ["fit", "--config", CONFIG, "--trainer.logger=false", "--trainer.max_steps=0", NO_VAL]
    args += [f"--trainer.default_root_dir={tmp_path / 'run'}", "--trainer.enable_checkpointing=false"]
    args += [f"{M}d_model=16", f"{M}n_heads=2", f"{M}n_layers=1", f"{D}vocab_size=300", f"{D}seq_len=16"]
    args += [
        f"{D}tokens_per_batch=32",
        f"{D}cache_dir={tmp_path / 'cache'}",
        f"{D}paths=[{tmp_path / 'corpus.txt'}]",
        f"{D}val_fraction=0",  # one document: no validation item to hold out
    ]
    cli_main(args)
    record = json.loads((tmp_path / "run" / "run_end.json").read_text())
    assert (record["reason"], record["step"], record["detail"]) == ("max_steps", 0, "max_steps=0 reached")
    assert "lit-losses: fit ended at step 0: max_steps=0 reached" in capsys.readouterr().out


@pytest.mark.timeout(120)
def test_legitimate_neighbours_of_the_refused_inputs_are_taken(tmp_path):
    """What the refusals above must not catch: float16 weights that do not train (LoRA on a float16 base:
    the adapters are float32), float16 weights with an eps that float16 holds, betas at the edges of
    [0, 1), counts of a step larger than one micro-batch's, a glob over a folder's files, an integer
    chunk size of another integer type."""
    pytest.importorskip("peft")
    _fp16_hf(lora={"r": 4, "target_modules": ["q_proj"]})
    _fp16_hf(optimizer={"eps": 1e-4})
    assert OptimizerConfig(betas=(0.0, 0.999)).betas == (0.0, 0.999)
    value = aggregate(
        torch.ones(1, 3), ONE_ROW, "seq-mean-token-mean", MaskStats(num_tokens=7, num_sequences=2)
    )
    assert float(value) == pytest.approx(0.5)  # one sequence of mean 1, over the step's 2 sequences
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text(TEXT)
    assert _data(tmp_path, paths=[str(tmp_path / "corpus" / "*.txt")]).sources == [
        str(tmp_path / "corpus" / "a.txt")
    ]
    head = FusedLMHead(torch.randn(V, 4), chunk_size=pytest.importorskip("numpy").int64(2))
    assert head(torch.randn(3, 4), torch.tensor([1, 2, 3])).logprobs.shape == (3,)
