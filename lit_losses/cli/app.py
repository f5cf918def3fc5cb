"""``lit-losses``: the LightningCLI entry point (``fit``, ``validate``, ``predict``, ``test``).

The model is any `RegularizedLM` subclass (``model.class_path``, e.g. `lit_losses.TinyLM`); the data
is a `lit_losses.data.FileDataModule` subclass (``data.class_path``: `lit_losses.TextDataModule`, the default,
`lit_losses.data.RLDataModule`, `lit_losses.data.hf_text.HFTextDataModule`, ...), whose ``vocab_size`` (a
Hugging Face tokenizer's size unless given) becomes ``model.init_args.vocab_size`` when it is built (a
different ``model.init_args.vocab_size`` given is refused: `lit_losses.cli.given_options`). Each
default class (`lit_losses.cli.class_defaults`) applies only when the run names no class of its own.
Closed options are typed as ``Literal`` so that ``--help`` lists their choices. Every configuration
error, whether jsonargparse's, a `ConfigError` raised while building or training, or Lightning refusing a
trainer option before the run started (`lit_losses.cli.trainer_errors`), is reported as one
``lit-losses: error: …`` line naming the option's path, with exit code 2. Each run claims its own log
folder and config file (`lit_losses.cli.run_dir`). A preempted ``fit`` (``SIGTERM``, ``SIGUSR1``) ends
after the optimizer step in flight with a checkpoint and exit code ``128 + signal``
(`lit_losses.checkpoint.preemption`).
"""

from __future__ import annotations

import ast
import importlib
import re
import sys
from pathlib import Path
from typing import Any, Literal, NoReturn

import yaml
from jsonargparse import Namespace
from jsonargparse import Path as ResolvedPath
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

import lit_losses
from lit_losses.checkpoint.latest import checkpoint_folders, latest_checkpoint
from lit_losses.checkpoint.preemption import PreemptionCheckpoint
from lit_losses.checkpoint.resume import ARCHITECTURE_HINT, check_changes, option_changes, read_checkpoint
from lit_losses.checkpoint.verified import VerifiedCheckpoints
from lit_losses.checkpoint.verify import verify_checkpoint, warn_unverifiable
from lit_losses.cli.class_defaults import config_file_args, default_classes, environment_configs
from lit_losses.cli.console import quiet_console, use_step_progress_bar
from lit_losses.cli.given_options import check_given_grpo, check_given_linked, given_options
from lit_losses.cli.import_hint import import_error_line
from lit_losses.cli.nested_help import with_class_help
from lit_losses.cli.nested_values import parser_argument
from lit_losses.cli.null_options import check_null_options
from lit_losses.cli.option_hint import fields_expected_line, unknown_key_line, unknown_option_line
from lit_losses.cli.run_dir import (
    RunClaim,
    SharedLoggerVersions,
    auto_versions,
    claim_file,
    claim_logger_versions,
    is_global_zero,
    launched_logger_versions,
)
from lit_losses.cli.run_end import add_run_callbacks
from lit_losses.cli.trainer_errors import RunStarted, lightning_config_error
from lit_losses.cli.trainer_options import check_parallel_sizes, check_trainer_numbers
from lit_losses.controller.operations import ControllerStop
from lit_losses.data.datamodule import FileDataModule
from lit_losses.distributed import exit_distributed_process
from lit_losses.errors import ConfigError
from lit_losses.module import RegularizedLM
from lit_losses.registry import closest

PUBLIC_API = {name: getattr(lit_losses, name) for name in lit_losses.__all__}
"""The public API, imported (``lit_losses`` imports lazily): jsonargparse resolves short class names such
as ``--model=TinyLM`` or ``--trainer.callbacks+=TrainingController`` among the classes imported."""

_KEY = re.compile(r'Parser key "([^"]+)"')
_LITERAL = re.compile(r"Expected a typing\.Literal\[(.*?)\]")
_TYPE = re.compile(r"Expected a <class '(\w+)'>")
_VALUE = re.compile(r"(?:Got|Given) value: (.*)")
_SUBCLASS_ROOTS = ("model", "data")
LINKED = {"model.init_args.vocab_size": "data.init_args.vocab_size"}
"""The options whose value is another's (LightningCLI's ``link_arguments``): target → source. The model's
are the data module's attributes once it is built (``vocab_size``: a Hugging Face tokenizer's size unless
given); a value given to the model's that differs is refused (`check_given_linked`)."""


def one_line_error(message: str) -> str:
    """jsonargparse's nested parse error as one line: the option's path, the value and the fix.

    Example:
        >>> one_line_error('Parser key "model":\\n  Problem with given class_path:\\n'
        ...                '    Parser key "agg":\\n'
        ...                "      Expected a typing.Literal['mean', 'sum']. Got value: maen")
        "model.init_args.agg: 'maen' is not one of ('mean', 'sum'); did you mean 'mean'?"
    """
    found = _KEY.findall(message)
    # a dataclass option that is not optional is named twice in a row (``Parser key "optimizer"``)
    keys = [key for i, key in enumerate(found) if i == 0 or key != found[i - 1]]
    if not keys:
        unknown = unknown_key_line(message)
        if unknown is not None:
            return unknown
        return " ".join(line.strip() for line in message.splitlines() if line.strip())
    path = keys[0]
    if len(keys) > 1:
        path += (".init_args." if keys[0] in _SUBCLASS_ROOTS else ".") + ".".join(keys[1:])
    inner = message[message.rindex(f'Parser key "{keys[-1]}"') :]
    unknown = unknown_option_line(path + (".init_args" if path in _SUBCLASS_ROOTS else ""), inner)
    if unknown is not None:
        return unknown
    value = _VALUE.search(inner)
    value = value.group(1).strip() if value else "?"
    choices = tuple(c for group in _LITERAL.findall(inner) for c in ast.literal_eval(f"({group},)"))
    if choices:
        return f"{path}: {value!r} is not one of {choices}{closest(value, choices)}"
    types = [t for t in _TYPE.findall(inner) if t != "NoneType"]
    if types:
        return f"{path}: expected {' or '.join(dict.fromkeys(types))}, got {value!r}"
    fields = fields_expected_line(path, inner, value, whole=message)
    if fields is not None:
        return fields
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
    """LightningCLI's parser whose errors are one line and exit code 2 (no usage dump, no traceback), whose
    usage lines name ``lit-losses`` however it was started (``python -m lit_losses.cli``, the docs), and
    which takes options by their whole name only: argparse would read ``--trainer.max_st=3`` as
    ``--trainer.max_steps=3`` (an abbreviation), and a mistyped option as another one."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("prog", "lit-losses")
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_args(self, args: Any = None, namespace: Any = None, **kwargs: Any) -> Namespace:
        """jsonargparse's ``parse_args``; a class's parser (``exit_on_error`` false) given one option nested
        in it reads the option's ``null`` as null (`lit_losses.cli.nested_values`)."""
        if not self.exit_on_error and isinstance(args, list) and len(args) == 1 and isinstance(args[0], str):
            args = [parser_argument(args[0])]
        return super().parse_args(args, namespace, **kwargs)

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        if not self.exit_on_error:
            super().error(message, ex)
        print(f"lit-losses: error: {import_error_line(message) or one_line_error(message)}", file=sys.stderr)
        sys.exit(2)


ResumeChanges = Literal["apply", "error"]
"""With ``--ckpt_path``, what options that differ from the checkpoint's do (architecture ones: an error)."""

_NOT_DATA = ("num_workers", "cache_dir")
"""Data options that do not change which micro-batches a run trains on."""

_LINKED_MODEL_OPTIONS = tuple(target.rpartition(".")[2] for target in LINKED if target.startswith("model."))
"""The model options that the data module gives when it is built (`LINKED`)."""


class LitLossesCLI(LightningCLI):
    """LightningCLI with the data→model vocabulary link, one-line configuration errors, ``--ckpt_path``
    that never replaces this run's model options silently (`check_resume_options`), and a log folder and
    config file of its own (`claim_run_dir`).

    Lightning's refusal of a trainer option before the run started is raised as a `ConfigError`. A run
    that fails gives back the folders it claimed that are still empty, and its config file while empty
    (nothing written yet); a run refused before it started (a `ConfigError`, or Lightning's refusal) gives
    back its config file and its claimed folders in any case (`RunClaim.release`).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.run_claim = RunClaim()
        """The folders and config file this run created to claim its log folder."""
        self.run_started = RunStarted()
        given = kwargs.get("args")
        self.given_args = sys.argv[1:] if given is None else given
        """The command line (or dict of options) this run parses."""
        self.class_defaults: dict[str, dict[str, str]] | None = None
        """The default class of each of ``model`` and ``data`` whose class no source of options chooses
        (`lit_losses.cli.class_defaults`), once the parser is built."""
        self.resumed_linked_options: tuple[str, dict[str, Any]] = ("", {})
        """With ``--ckpt_path``: the checkpoint's values of the model options the data module gives when it
        is built (`check_linked_options`)."""
        try:
            super().__init__(*args, **kwargs)
        except Exception as err:
            translated = (
                None if self.run_started.started else lightning_config_error(err, self.trainer_options())
            )
            refused = not self.run_started.started and (translated is not None or config_error_in(err))
            self.run_claim.release(refused=bool(refused))
            if translated is not None:
                raise translated from err
            raise

    def trainer_options(self) -> dict[str, Any]:
        """The parsed ``trainer`` options of the subcommand (empty before parsing)."""
        config = getattr(self, "config", None)
        if config is None:
            return {}
        sub = config.get("subcommand")
        trainer = (config[sub] if sub else config).get("trainer")
        return trainer.as_dict() if isinstance(trainer, Namespace) else {}

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        if self.class_defaults is None:  # the main parser is built: its environment settings are known
            configs = environment_configs(self.parser.env_prefix, self.parser.default_env, self.subcommands())
            self.class_defaults = default_classes(self.given_args, configs)
        if self.class_defaults:
            parser.set_defaults(self.class_defaults)
        for target, source in LINKED.items():  # when the data module is built: its attribute
            parser.link_arguments(source.replace(".init_args.", "."), target, apply_on="instantiate")
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
            help="Let 'fit' write into a folder that already holds another run's config or checkpoints "
            "(trainer.default_root_dir without a logger, or a logger's fixed version; default: refused). Its "
            "config is then saved as config_<n>.yaml, never over another run's.",
        )

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        given = sys.argv[1:] if args is None else args
        check_config_files(given)
        if isinstance(given, list | tuple) and with_class_help(list(given)) != list(given):
            parser.parse_args(with_class_help(list(given)))  # --model.grpo.help alone: prints it and exits
        super().parse_arguments(parser, args)
        self.given_config = self.config.clone()
        """The options as given, before LightningCLI replaces the model's with a checkpoint's."""
        self.given_options = given_options(parser, given, parsed=self.config)
        """The options the command line and its config files give, without the defaults."""
        check_trainer_options(self)

    def before_instantiate_classes(self) -> None:
        check_given_grpo(self.given_options)
        check_resume_options(self)
        sub = self.config.get("subcommand")
        config = self.config[sub] if sub else self.config
        for root in ("data", "model"):  # the data's first: the model's vocab_size is the data's
            check_null_options(config.get(root), root, linked=LINKED)

    def after_instantiate_classes(self) -> None:
        sub = self.config.get("subcommand")
        data_config = (self.config[sub] if sub else self.config).get("data")
        check_given_linked(self.given_options, LINKED, datamodule=self.datamodule, data_config=data_config)
        check_linked_options(self)
        self.trainer.callbacks.append(self.run_started)
        if not any(isinstance(c, VerifiedCheckpoints) for c in self.trainer.callbacks):
            self.trainer.callbacks.append(VerifiedCheckpoints())
        if self.subcommand == "fit" and not any(
            isinstance(c, PreemptionCheckpoint) for c in self.trainer.callbacks
        ):
            self.trainer.callbacks.append(PreemptionCheckpoint())
        if self.subcommand == "fit":
            log_every_step_of_a_short_run(self.trainer)
            add_run_callbacks(self.trainer)
            use_step_progress_bar(self.trainer, self.config["fit"]["trainer"].get("callbacks"))
        claim_run_dir(self)

    def before_fit(self) -> None:
        resolve_last_checkpoint(self)

    def before_validate(self) -> None:
        resolve_last_checkpoint(self)

    def before_test(self) -> None:
        resolve_last_checkpoint(self)

    def before_predict(self) -> None:
        resolve_last_checkpoint(self)


_SPECIAL_CKPT_PATHS = ("last", "best", "hpc", "registry")


def log_every_step_of_a_short_run(trainer: Any) -> None:
    """A fit of fewer optimizer steps (``max_steps``) than the logging interval logs every step, so that its
    report and TensorBoard show a training loss (Lightning would log none before the interval)."""
    if 0 < trainer.max_steps < trainer.log_every_n_steps:
        trainer.log_every_n_steps = 1


def check_config_files(args: Any) -> None:
    """Refuse a ``--config`` file that is not valid YAML with one line naming the file and the line.

    Raises:
        ConfigError: ``--config <file>: not valid YAML (<problem>, line <n>)``.
    """
    if not isinstance(args, (list, tuple)):
        return
    for name in config_file_args(args):
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
    """Refuse trainer options that would hang or do nothing (`check_trainer_numbers`), a model-parallel
    mesh other than the processes started (`check_parallel_sizes`), and a ``--ckpt_path`` that is no
    readable checkpoint (checked right after parsing, before LightningCLI reads the checkpoint's
    hyper-parameters).

    Raises:
        ConfigError: one line naming the option and its value.
    """
    sub = cli.config.get("subcommand")
    config = cli.config[sub] if sub else cli.config
    trainer = config.get("trainer") or {}
    options = trainer.as_dict() if isinstance(trainer, Namespace) else trainer
    check_trainer_numbers(options)
    check_parallel_sizes(options)
    ckpt_path = config.get("ckpt_path")
    if ckpt_path and str(ckpt_path) not in _SPECIAL_CKPT_PATHS:
        # global rank 0 hashes the files, the other ranks check their sizes
        verified = verify_checkpoint(ckpt_path, hash_content=is_global_zero(), warn=False)
        read_checkpoint(ckpt_path)
        warn_unverifiable(verified)
    check_run_dir(sub, config, trainer)


def resolve_last_checkpoint(cli: LitLossesCLI) -> None:
    """``--ckpt_path last``: the newest complete checkpoint of the run's checkpoint folders, verified
    (`lit_losses.checkpoint.latest`), instead of Lightning's newest ``last*.ckpt``; none: the run starts
    from scratch, with a warning (as Lightning's).

    Raises:
        ConfigError: the newest complete checkpoint does not match its manifest.
    """
    config = cli.config_init[cli.subcommand]
    if str(config.get("ckpt_path")) != "last":
        return
    found = latest_checkpoint(checkpoint_folders(cli.trainer), hash_content=is_global_zero())
    if found is None:
        rank_zero_warn(
            f"--ckpt_path last: no checkpoint in {', '.join(map(str, checkpoint_folders(cli.trainer)))}; "
            "the run starts from scratch"
        )
    else:
        rank_zero_info(f"lit-losses: --ckpt_path last: {found}")
    config["ckpt_path"] = None if found is None else str(found)


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
    if slurm_requeue(root):
        return
    if any((root / "checkpoints").glob("*.ckpt")):
        raise ConfigError(
            f"trainer.default_root_dir={str(root)!r} already holds another run's checkpoints in "
            f"{root / 'checkpoints'}; choose a new folder, resume with --ckpt_path, "
            "or pass --reuse_run_dir=true"
        )


def slurm_requeue(root: Path) -> bool:
    """Whether this is a SLURM job that Lightning resumes by itself from ``root``'s ``hpc_ckpt_*.ckpt``
    (an auto-requeued job: the same folder, no ``--ckpt_path``), which is no second run."""
    return SLURMEnvironment.detect() and any(root.glob("hpc_ckpt_*.ckpt"))


def claim_run_dir(cli: LitLossesCLI) -> None:
    """Give this run a log folder and a config file of its own (`lit_losses.cli.run_dir`): on global rank 0, a
    version folder created with ``os.mkdir`` for each TensorBoard or CSV logger left to pick its version,
    and the config file (``config.yaml``) created with ``O_EXCL`` in the run's log folder. A ``fit`` whose
    folder already holds another run's config is refused unless it resumes (``--ckpt_path``) or
    ``--reuse_run_dir``; then, as ``validate``, ``test`` and ``predict`` always, its config is saved under
    the next free name (``config_1.yaml``, …). Nothing is ever overwritten.

    Raises:
        ConfigError: the folder, the option that chose it and how to choose another.
    """
    trainer, sub = cli.trainer, cli.subcommand
    config = cli.config[sub] if sub else cli.config
    trainer_config = config.get("trainer") or {}
    rebuild = auto_versions(trainer_config.get("logger"), trainer.loggers)
    trainer.callbacks.insert(0, SharedLoggerVersions(rebuild))
    if not is_global_zero():
        trainer.loggers = launched_logger_versions(trainer.loggers, rebuild)
    else:
        trainer.loggers, _ = claim_logger_versions(trainer.loggers, rebuild, cli.run_claim)
    for saver in (c for c in trainer.callbacks if isinstance(c, SaveConfigCallback)):
        saver.overwrite = True  # it writes into the file claimed here (set on every rank: same code path)
        saver.config = with_absolute_paths(saver.config)
        if not is_global_zero() or trainer.log_dir is None:  # no folder: Lightning's own error follows
            continue
        reuse = sub != "fit" or bool(config.get("ckpt_path")) or bool(config.get("reuse_run_dir"))
        reuse = reuse or slurm_requeue(Path(trainer.default_root_dir))
        refuse = (
            f"set another {_run_dir_option(trainer, trainer_config)}, resume with --ckpt_path, or pass "
            "--reuse_run_dir=true"
        )
        cli.run_claim.config_file = claim_file(
            Path(trainer.log_dir), saver.config_filename, reuse, refuse=refuse
        )
        saver.config_filename = cli.run_claim.config_file.name


def with_absolute_paths(config: Any) -> Any:
    """A copy of ``config`` where each path that jsonargparse resolved (a relative path in a config file is
    relative to that file: `TrainingController`'s ``config``) is absolute, so that the saved ``config.yaml``
    names the same files from its own folder (jsonargparse would write the path as it was given).

    Example:
        >>> from jsonargparse.typing import Path_fr
        >>> relative = Path_fr("__init__.py", cwd=lit_losses.__path__[0])  # as given in lit_losses/x.yaml
        >>> config = Namespace(callbacks=[Namespace(config=relative)])
        >>> str(relative), str(with_absolute_paths(config).callbacks[0].config) == lit_losses.__file__
        ('__init__.py', True)
    """
    if isinstance(config, ResolvedPath):
        return type(config)(config.absolute)
    if isinstance(config, list):
        return [with_absolute_paths(value) for value in config]
    if isinstance(config, Namespace):
        config = config.clone()
        for key, value in config.items():
            config[key] = with_absolute_paths(value)
    return config


def _run_dir_option(trainer: Any, trainer_config: Any) -> str:
    """The option that chose the run's log folder, for messages."""
    if not trainer.loggers:
        return f"trainer.default_root_dir (now {trainer_config.get('default_root_dir')!r})"
    logger = trainer.loggers[0]
    if isinstance(logger, TensorBoardLogger | CSVLogger):
        return f"logger version (now {logger.version!r}; null picks a free one)"
    return f"logger save_dir (now {logger.save_dir!r})"


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
    if not ckpt_path or str(ckpt_path) in _SPECIAL_CKPT_PATHS:
        return
    checkpoint = read_checkpoint(ckpt_path)
    where = f"--ckpt_path {ckpt_path}"
    model, data = given["model"].as_dict(), given["data"].as_dict() if given.get("data") else {}
    saved = checkpoint.get("hyper_parameters") or {}
    changes = [
        c
        for c in option_changes(
            saved,
            {"_class_path": model["class_path"], **(model.get("init_args") or {})},
            model_class=_class_of(model["class_path"]),
        )
        if c.path.rpartition(".")[2] not in _LINKED_MODEL_OPTIONS  # checked once built (check_linked_options)
    ]
    given_data = {**(data.get("init_args") or {})}
    saved_data = checkpoint.get("datamodule_hyper_parameters") or {}
    data_changes = [
        c
        for c in option_changes(saved_data, given_data, prefix="data.init_args")
        if _compared_data_option(c.path.rpartition(".")[2], given_data)
    ]
    check_changes(changes + data_changes, where, config.get("resume_changes", "apply") == "apply", warn=False)
    check_changes(data_changes, where)
    config["model"] = given["model"]
    cli.resumed_linked_options = (
        where,
        {name: saved[name] for name in _LINKED_MODEL_OPTIONS if name in saved},
    )


def _compared_data_option(name: str, given: dict[str, Any]) -> bool:
    """Whether a resumed run's data option ``name`` is compared with the checkpoint's before it is built: not
    the options that do not change the micro-batches, nor a linked option left to the data module (``None``:
    a tokenizer's size), which `check_linked_options` compares once it is built."""
    return name not in _NOT_DATA and not (name in _LINKED_MODEL_OPTIONS and given.get(name) is None)


def check_linked_options(cli: LitLossesCLI) -> None:
    """With ``--ckpt_path``: the model options that the data module gave when it was built (its vocabulary,
    a tokenizer's size unless given) are the checkpoint's.

    Raises:
        ConfigError: naming the option, both values and the data module that gave it.
    """
    where, saved_options = cli.resumed_linked_options
    for name, saved in saved_options.items():
        now = cli.model.hparams.get(name)
        if now != saved:
            raise ConfigError(
                f"{where}: resuming with options that differ from the checkpoint's: model.init_args.{name}: "
                f"{saved!r} in the checkpoint, {now!r} now (data.{name} of {type(cli.datamodule).__name__}); "
                f"{ARCHITECTURE_HINT}"
            )


def _class_of(class_path: str) -> type | None:
    """The class that a parsed ``class_path`` names (``None`` if it cannot be imported: jsonargparse
    has reported that already)."""
    module, _, name = class_path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return None


def config_error_in(err: BaseException) -> ConfigError | None:
    """The `ConfigError` that caused ``err``, if any (jsonargparse wraps the ones it meets)."""
    cause: BaseException | None = err
    while cause is not None and not isinstance(cause, ConfigError):
        cause = cause.__cause__ or cause.__context__
    return cause


def _fail_on_config_error(err: BaseException) -> None:
    """Exit with one line if a `ConfigError` caused ``err``."""
    cause = config_error_in(err)
    if cause is not None:
        print(f"lit-losses: error: {one_line(str(cause))}", file=sys.stderr)
        sys.exit(2)


def one_line(message: str) -> str:
    """A multi-line error (a list of problems) as one line: the heading, then the problems joined by ``;``.

    Example:
        >>> one_line("controller config has 2 problem(s):\\n  a: bad\\n  b: worse")
        'controller config has 2 problem(s): a: bad; b: worse'
    """
    head, *rest = [line.strip() for line in message.splitlines() if line.strip()] or [""]
    return f"{head} {'; '.join(rest)}" if rest else head


def cli_main(args: list[str] | None = None) -> LitLossesCLI:
    """Run ``lit-losses`` with ``args`` (default: ``sys.argv[1:]``) and return the CLI object.

    Exits with status 2 for a configuration error (one line), and with a controller's ``exit_code`` when
    its ``lightning.should_training_stop`` stopped training (`stop_exit_code`).
    """
    quiet_console()
    try:
        cli = LitLossesCLI(
            RegularizedLM,
            FileDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            args=args,
            parser_class=LitLossesParser,
            auto_configure_optimizers=False,
        )
    except Exception as err:
        _fail_on_config_error(err)
        raise
    code = stop_exit_code(cli)
    if code:
        sys.exit(code)
    return cli


def stop_exit_code(cli: LitLossesCLI) -> int:
    """The exit status a controller's ``should_training_stop`` asked for (its operation's ``exit_code``),
    else 0; a stop with an exit code is told on one line of stderr."""
    trainer = getattr(cli, "trainer", None)
    for callback in getattr(trainer, "callbacks", []):
        stop = getattr(callback, "stop", None)
        if isinstance(stop, ControllerStop) and stop.exit_code is not None:
            print(
                f"lit-losses: controller {stop.controller!r} stopped training at step {stop.step} "
                f"(exit code {stop.exit_code})",
                file=sys.stderr,
            )
            return stop.exit_code
    return 0


def lightning_main() -> None:
    """``lit-losses fit|validate|test|predict …`` (``sys.argv``): `cli_main`, then the end of the process
    group of a distributed run, whatever its exit status."""
    try:
        cli_main()
    except SystemExit as stop:  # a controller's exit code, a preemption: the process group ends all the same
        exit_distributed_process(stop.code)
        raise
    exit_distributed_process(0)
