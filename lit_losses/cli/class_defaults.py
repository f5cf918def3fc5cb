"""The default classes of ``model`` and ``data`` (`DEFAULT_CLASSES`), set only for the ones a run does not
choose itself.

jsonargparse keeps the options of a default class that the chosen class also takes: with
``TextDataModule`` as the default of ``data``, a config that sets ``data.class_path:
lit_losses.PreferenceDataModule`` would silently get ``TextDataModule``'s ``vocab_size: 32768`` and
``val_fraction: 0.02`` instead of ``PreferenceDataModule``'s own defaults. Without a default, jsonargparse
takes every option the config leaves out from the chosen class's signature, so the default is set only
when no source of options names the class (`chosen_classes`): the command line, its ``--config`` files, and
the environment variables where the parser reads them (`environment_configs`). Default config files
(``parser_kwargs={"default_config_files": [...]}``) need nothing here: jsonargparse reads them into the
defaults, where the class they name replaces the default class before any of its options is filled in.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from itertools import pairwise
from pathlib import Path
from typing import Any

import yaml

DEFAULT_CLASSES = {"model": "lit_losses.TinyLM", "data": "lit_losses.TextDataModule"}
"""The class of each of ``model`` and ``data`` when a run names none."""


def config_file_args(args: Sequence[str]) -> list[str]:
    """The values of the ``--config`` options of ``args`` (``--config FILE`` and ``--config=FILE``).

    Example:
        >>> config_file_args(["fit", "--config", "a.yaml", "--config=b.yaml", "--trainer.max_steps=3"])
        ['a.yaml', 'b.yaml']
    """
    args = [str(a) for a in args]
    given = [(i, b) for i, (a, b) in enumerate(pairwise(args)) if a == "--config"]
    given += [(i, a.partition("=")[2]) for i, a in enumerate(args) if a.startswith("--config=")]
    return [value for _, value in sorted(given)]


def _names_class(value: Any) -> bool:
    """Whether ``value`` (what a config gives ``model`` or ``data``) chooses a class: a class path or name,
    a nested config file, or a mapping with ``class_path``."""
    return isinstance(value, str) or (isinstance(value, Mapping) and "class_path" in value)


def _config_contents(value: str) -> Any:
    """The YAML content of a ``--config`` value: a file's, or the value itself (jsonargparse also takes the
    config as a string); ``None`` when it does not parse (the parser reports that)."""
    try:
        text = Path(value).read_text(encoding="utf-8") if Path(value).is_file() else value
        return yaml.safe_load(text)
    except (OSError, UnicodeDecodeError, ValueError, yaml.YAMLError):
        return None


def _chosen_in_mapping(config: Any, roots: Iterable[str], subcommands: Iterable[str]) -> set[str]:
    if not isinstance(config, Mapping):
        return set()
    sections = [config, *(config.get(sub) for sub in subcommands)]
    return {root for root in roots for s in sections if isinstance(s, Mapping) and _names_class(s.get(root))}


def _chosen_on_command_line(args: Sequence[str], roots: Iterable[str]) -> Iterator[str]:
    for arg in args:
        for root in roots:
            if arg == f"--{root}" or arg.startswith((f"--{root}=", f"--{root}.class_path")):
                yield root


SUBCOMMANDS = ("fit", "validate", "test", "predict")
"""LightningCLI's subcommands: a ``--config`` file may give their options under their names."""


def environment_configs(
    env_prefix: str | bool,
    default_env: bool,
    subcommands: Iterable[str] = SUBCOMMANDS,
    environ: Mapping[str, str] | None = None,
) -> list[Any]:
    """The options that environment variables give a parser that reads them (``default_env``:
    LightningCLI's ``parser_kwargs={"default_env": True}``, or ``JSONARGPARSE_DEFAULT_ENV=true``), as
    configs: the config of ``<PREFIX>_CONFIG``, and for each subcommand the config of
    ``<PREFIX>_<SUB>__CONFIG`` and the values of ``<PREFIX>_<SUB>__MODEL`` and ``<PREFIX>_<SUB>__DATA``
    (jsonargparse's names: the parser's ``env_prefix``, ``PL`` for LightningCLI, then the option's key,
    ``.`` as ``__``, upper case); none when the parser does not read the environment.

    Example:
        >>> environ = {"PL_FIT__DATA": "PreferenceDataModule", "PL_FIT__CONFIG": "model: HFCausalLM"}
        >>> environment_configs("PL", default_env=True, environ=environ)
        [{'model': 'HFCausalLM'}, {'data': 'PreferenceDataModule'}]
        >>> environment_configs("PL", default_env=False, environ=environ)
        []
    """
    if not default_env:
        return []
    environ = os.environ if environ is None else environ
    prefix = f"{env_prefix}_".replace("-", "_") if isinstance(env_prefix, str) else ""
    configs = []
    keys = ["config"] + [f"{sub}.{key}" for sub in subcommands for key in ("config", *DEFAULT_CLASSES)]
    for key in keys:
        value = environ.get((prefix + key).replace(".", "__").upper())
        if value is None:
            continue
        content = _config_contents(value)
        root = key.rpartition(".")[2]
        configs.append(content if root == "config" else {root: content})
    return configs


def chosen_classes(
    args: Any, subcommands: Iterable[str] = SUBCOMMANDS, configs: Iterable[Any] = ()
) -> set[str]:
    """Which of ``model`` and ``data`` the command line ``args`` chooses the class of: with ``--model X``,
    ``--model=X``, ``--model.class_path=X`` (likewise ``--data``), or in a ``--config`` file (at its top or
    under a subcommand); or one of the other ``configs`` (`environment_configs`). Options of a class
    (``--data.init_args.seq_len=64``) choose none: they apply to the default class. ``args`` may also be a
    dict of options, as `LightningCLI` takes them.

    Example:
        >>> sorted(chosen_classes(["fit", "--model=HFCausalLM", "--data.init_args.seq_len=64"]))
        ['model']
        >>> sorted(chosen_classes({"fit": {"data": {"class_path": "lit_losses.PreferenceDataModule"}}}))
        ['data']
        >>> sorted(chosen_classes(["fit"], configs=[{"data": "lit_losses.PreferenceDataModule"}]))
        ['data']
    """
    roots = tuple(DEFAULT_CLASSES)
    subcommands = tuple(subcommands)
    chosen = {root for config in configs for root in _chosen_in_mapping(config, roots, subcommands)}
    if isinstance(args, Mapping):
        return chosen | _chosen_in_mapping(args, roots, subcommands)
    if not isinstance(args, list | tuple):
        return chosen
    args = [str(a) for a in args]
    chosen |= set(_chosen_on_command_line(args, roots))
    for value in config_file_args(args):
        chosen |= _chosen_in_mapping(_config_contents(value), roots, subcommands)
    return chosen


def chosen_class(args: Sequence[str], root: str) -> str:
    """The class of ``root`` (``model`` or ``data``) that the command line ``args`` chooses, the last one
    given winning (on the command line or as ``class_path`` in a ``--config`` file); else the default
    class (`DEFAULT_CLASSES`).

    Example:
        >>> chosen_class(["fit", "--model=HFCausalLM", "--model.init_args.lr=1"], "model")
        'HFCausalLM'
        >>> chosen_class(["fit"], "data")
        'lit_losses.TextDataModule'
    """
    args = [str(a) for a in args]
    found = DEFAULT_CLASSES[root]
    for i, arg in enumerate(args):
        name, sep, value = arg.partition("=")
        if not sep and i + 1 < len(args):
            value = args[i + 1]
        given = None
        if name in (f"--{root}", f"--{root}.class_path"):
            given = _class_path(_config_contents(value))
        elif name == "--config":
            config = _config_contents(value)
            given = _class_path(config.get(root)) if isinstance(config, Mapping) else None
        found = given or found
    return found


def _class_path(value: Any) -> str | None:
    """The class that a value given to ``model`` or ``data`` names (a name, or a mapping's ``class_path``)."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("class_path"), str):
        return value["class_path"]
    return None


def default_classes(args: Any, configs: Iterable[Any] = ()) -> dict[str, dict[str, str]]:
    """The defaults to set on the parser: `DEFAULT_CLASSES` for each of ``model`` and ``data`` whose class
    neither ``args`` nor the other ``configs`` (`environment_configs`) choose (`chosen_classes`).

    Example:
        >>> default_classes(["fit", "--data=lit_losses.PreferenceDataModule"])
        {'model': {'class_path': 'lit_losses.TinyLM'}}
    """
    chosen = chosen_classes(args, configs=configs)
    return {root: {"class_path": path} for root, path in DEFAULT_CLASSES.items() if root not in chosen}
