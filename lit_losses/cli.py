"""``lit-losses``: the LightningCLI entry point (``fit``, ``validate``, ``predict``, ``test``).

The model is any `RegularizedLM` subclass (``model.class_path``, e.g. `lit_losses.TinyLM`); the data
is any LightningDataModule (``data.class_path``, e.g. `lit_losses.TextDataModule`). With a data module
that has a ``vocab_size`` (as `TextDataModule`), it is linked to ``model.init_args.vocab_size``.
Closed options are typed as ``Literal`` so that ``--help`` lists their choices. Every configuration
error, whether jsonargparse's or a `ConfigError` raised while building or training, is reported as one
``lit-losses: error: …`` line naming the option's path, with exit code 2.
"""

from __future__ import annotations

import ast
import re
import sys
from itertools import pairwise
from pathlib import Path
from typing import Any, Literal, NoReturn

import torch
import yaml
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from lit_losses.data.text import TextDataModule
from lit_losses.errors import ConfigError
from lit_losses.module import RegularizedLM
from lit_losses.registry import closest
from lit_losses.resume import check_changes, option_changes

_KEY = re.compile(r'Parser key "([^"]+)"')
_LITERAL = re.compile(r"Expected a typing\.Literal\[(.*?)\]")
_TYPE = re.compile(r"Expected a <class '(\w+)'>")
_VALUE = re.compile(r"(?:Got|Given) value: (.*)")
_SUBCLASS_ROOTS = ("model", "data")


def one_line_error(message: str) -> str:
    """jsonargparse's nested parse error as one line: the option's path, the value and the fix.

    Example:
        >>> one_line_error('Parser key "model":\\n  Problem with given class_path:\\n'
        ...                '    Parser key "agg":\\n'
        ...                "      Expected a typing.Literal['mean', 'sum']. Got value: maen")
        "model.init_args.agg: 'maen' is not one of ('mean', 'sum'); did you mean 'mean'?"
    """
    keys = _KEY.findall(message)
    if not keys:
        return " ".join(line.strip() for line in message.splitlines() if line.strip())
    path = keys[0]
    if len(keys) > 1:
        path += (".init_args." if keys[0] in _SUBCLASS_ROOTS else ".") + ".".join(keys[1:])
    inner = message[message.rindex(f'Parser key "{keys[-1]}"') :]
    value = _VALUE.search(inner)
    value = value.group(1).strip() if value else "?"
    choices = tuple(c for group in _LITERAL.findall(inner) for c in ast.literal_eval(f"({group},)"))
    if choices:
        return f"{path}: {value!r} is not one of {choices}{closest(value, choices)}"
    types = [t for t in _TYPE.findall(inner) if t != "NoneType"]
    if types:
        return f"{path}: expected {' or '.join(dict.fromkeys(types))}, got {value!r}"
    boilerplate = (
        "Does not validate",
        "Subtypes:",
        "Errors:",
        "- Problem with",
        "- Expected a",
        "Given value",
    )
    detail = [
        ln.strip() for ln in inner.splitlines()[1:] if ln.strip() and not ln.strip().startswith(boilerplate)
    ]
    same_line = inner.splitlines()[0].partition(":")[2].strip()  # 'Parser key "config": File does not…'
    return f"{path}: {detail[0] if detail else same_line or value}"


class LitLossesParser(LightningArgumentParser):
    """LightningCLI's parser whose errors are one line and exit code 2 (no usage dump, no traceback)."""

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        if not self.exit_on_error:
            super().error(message, ex)
        print(f"lit-losses: error: {one_line_error(message)}", file=sys.stderr)
        sys.exit(2)


ResumeChanges = Literal["apply", "error"]
"""With ``--ckpt_path``, what options that differ from the checkpoint's do (architecture ones: an error)."""

_NOT_DATA = ("num_workers", "cache_dir")
"""Data options that do not change which micro-batches a run trains on."""


class LitLossesCLI(LightningCLI):
    """LightningCLI with the data→model vocabulary link, one-line configuration errors, and ``--ckpt_path``
    that never replaces this run's model options silently (`check_resume_options`)."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.set_defaults(
            {
                "model": {"class_path": "lit_losses.TinyLM"},
                "data": {"class_path": "lit_losses.TextDataModule"},
            }
        )
        parser.link_arguments("data.init_args.vocab_size", "model.init_args.vocab_size")
        parser.add_argument(
            "--resume_changes",
            type=ResumeChanges,
            default="apply",
            help="With --ckpt_path, options that differ from the checkpoint's: 'apply' them (a warning "
            "lists each) or stop with an 'error' listing them; architecture changes are always an error.",
        )

        parser.add_argument(
            "--reuse_run_dir",
            type=bool,
            default=False,
            help="Let 'fit' without a logger write its checkpoints into a trainer.default_root_dir that "
            "already holds another run's checkpoints (default: refused).",
        )

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        check_config_files(sys.argv[1:] if args is None else args)
        super().parse_arguments(parser, args)
        self.given_config = self.config.clone()
        """The options as given, before LightningCLI replaces the model's with a checkpoint's."""
        check_trainer_options(self)

    def before_instantiate_classes(self) -> None:
        check_resume_options(self)


_SPECIAL_CKPT_PATHS = ("last", "best", "hpc", "registry")


def check_config_files(args: Any) -> None:
    """Refuse a ``--config`` file that is not valid YAML with one line naming the file and the line.

    Raises:
        ConfigError: ``--config <file>: not valid YAML (<problem>, line <n>)``.
    """
    if not isinstance(args, (list, tuple)):
        return
    args = [str(a) for a in args]
    files = [b for a, b in pairwise(args) if a == "--config"]
    files += [a.partition("=")[2] for a in args if a.startswith("--config=")]
    for name in files:
        if not Path(name).is_file():
            continue  # jsonargparse reports it: "config: File does not exist: …"
        try:
            yaml.safe_load(Path(name).read_text(encoding="utf-8"))
        except UnicodeDecodeError as err:
            raise ConfigError(f"--config {name}: not UTF-8 text (byte {err.start})") from None
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f", line {mark.line + 1} column {mark.column + 1}" if mark else ""
            problem = getattr(err, "problem", None) or str(err).splitlines()[0]
            raise ConfigError(f"--config {name}: not valid YAML ({problem}{where})") from None


def check_trainer_options(cli: LitLossesCLI) -> None:
    """Refuse trainer options that would hang or do nothing, and a ``--ckpt_path`` that is no readable
    checkpoint (checked right after parsing, before LightningCLI reads the checkpoint's hyper-parameters).

    Raises:
        ConfigError: one line naming the option and its value.
    """
    sub = cli.config.get("subcommand")
    config = cli.config[sub] if sub else cli.config
    trainer = config.get("trainer") or {}
    accumulate = trainer.get("accumulate_grad_batches")
    if isinstance(accumulate, int) and accumulate < 1:
        raise ConfigError(f"trainer.accumulate_grad_batches={accumulate} must be >= 1")
    ckpt_path = config.get("ckpt_path")
    if ckpt_path and str(ckpt_path) not in _SPECIAL_CKPT_PATHS:
        if not Path(ckpt_path).is_file():
            raise ConfigError(f"--ckpt_path {ckpt_path}: no such checkpoint file")
        load_checkpoint(ckpt_path)
    check_run_dir(sub, config, trainer)


def check_run_dir(sub: str | None, config: Any, trainer: Any) -> None:
    """Refuse a ``fit`` without a logger whose checkpoint folder (``<default_root_dir>/checkpoints``)
    already holds another run's checkpoints, unless resuming (``--ckpt_path``) or ``--reuse_run_dir``.
    (With a logger, each run gets a new ``version_N`` folder.)
    """
    if sub != "fit" or config.get("ckpt_path") or config.get("reuse_run_dir"):
        return
    if trainer.get("logger") is not False or trainer.get("enable_checkpointing") is False:
        return
    root = Path(trainer.get("default_root_dir") or ".")
    if any((root / "checkpoints").glob("*.ckpt")):
        raise ConfigError(
            f"trainer.default_root_dir={str(root)!r} already holds another run's checkpoints in "
            f"{root / 'checkpoints'}; choose a new folder, resume with --ckpt_path, "
            "or pass --reuse_run_dir=true"
        )


def check_resume_options(cli: LitLossesCLI) -> None:
    """With ``--ckpt_path``: compare this run's model and data options with the checkpoint's, refuse
    architecture changes (and any change with ``--resume_changes=error``), warn about data changes (the
    model warns about its own when it loads the checkpoint), and keep this run's model options, which
    LightningCLI would otherwise replace by the checkpoint's hyper-parameters.

    Raises:
        ConfigError: one line naming each refused option.
    """
    sub = cli.config.get("subcommand")
    config, given = (cli.config[sub], cli.given_config[sub]) if sub else (cli.config, cli.given_config)
    ckpt_path = config.get("ckpt_path")
    if not ckpt_path or not Path(ckpt_path).is_file():
        return
    checkpoint = load_checkpoint(ckpt_path)
    where = f"--ckpt_path {ckpt_path}"
    model, data = given["model"].as_dict(), given["data"].as_dict() if given.get("data") else {}
    changes = option_changes(
        checkpoint.get("hyper_parameters") or {},
        {"_class_path": model["class_path"], **(model.get("init_args") or {})},
    )
    saved_data = checkpoint.get("datamodule_hyper_parameters") or {}
    data_changes = [
        c
        for c in option_changes(saved_data, {**(data.get("init_args") or {})}, prefix="data.init_args")
        if c.path.rpartition(".")[2] not in _NOT_DATA
    ]
    check_changes(changes + data_changes, where, config.get("resume_changes", "apply") == "apply", warn=False)
    check_changes(data_changes, where)
    config["model"] = given["model"]


def load_checkpoint(ckpt_path: str) -> dict[str, Any]:
    """``torch.load`` of a checkpoint; an empty, truncated or foreign file is a `ConfigError` naming it."""
    try:
        checkpoint = torch.load(ckpt_path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:  # EOFError, RuntimeError, UnpicklingError: all mean "not a checkpoint"
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ConfigError(f"--ckpt_path {ckpt_path} is not a readable checkpoint ({reason})") from None
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        raise ConfigError(f"--ckpt_path {ckpt_path} is not a Lightning checkpoint (no 'state_dict')")
    return checkpoint


def _fail_on_config_error(err: BaseException) -> None:
    """Exit with one line if a `ConfigError` caused ``err`` (jsonargparse wraps the ones it meets)."""
    cause: BaseException | None = err
    while cause is not None and not isinstance(cause, ConfigError):
        cause = cause.__cause__ or cause.__context__
    if cause is not None:
        print(f"lit-losses: error: {cause}", file=sys.stderr)
        sys.exit(2)


def cli_main(args: list[str] | None = None) -> LitLossesCLI:
    """Run ``lit-losses`` with ``args`` (default: ``sys.argv[1:]``) and return the CLI object."""
    try:
        return LitLossesCLI(
            RegularizedLM,
            TextDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            args=args,
            parser_class=LitLossesParser,
            save_config_kwargs={"overwrite": True},
            auto_configure_optimizers=False,
        )
    except Exception as err:
        _fail_on_config_error(err)
        raise


def main() -> None:
    """Console-script entry point ``lit-losses`` (exit status 0 on success)."""
    cli_main()


if __name__ == "__main__":
    main()
