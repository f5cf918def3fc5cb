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
from pathlib import Path
from typing import Any, Literal, NoReturn

import torch
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
    return f"{path}: {detail[0] if detail else value}"


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

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        super().parse_arguments(parser, args)
        self.given_config = self.config.clone()
        """The options as given, before LightningCLI replaces the model's with a checkpoint's."""

    def before_instantiate_classes(self) -> None:
        check_resume_options(self)


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
    checkpoint = torch.load(ckpt_path, map_location="cpu", weights_only=True, mmap=True)
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
