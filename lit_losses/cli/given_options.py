"""The options a run gives itself (its command line and ``--config`` files, without the defaults), and the
checks that only they allow.

jsonargparse merges the defaults into the parsed config, so that ``model.init_args.vocab_size: 32768``
reads the same whether a config wrote it or `lit_losses.TinyLM`'s signature gave it, and a dataclass option
(``model.init_args.grpo``) arrives with every field. Two options given together may disagree only when one
of them is given at its default value, which the parsed config cannot tell from one left out:

- ``model.init_args.vocab_size``, which the data module's ``vocab_size`` replaces when it is built (a link
  applied on instantiation): a value given that differs from the data's is refused (`check_given_linked`);
- ``model.grpo``'s rollout-correction fields (``vllm_importance_sampling_cap`` beside
  ``vllm_importance_sampling_clip_max: 3.0``, a field a preset sets given at its default beside the
  preset): `check_given_grpo`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jsonargparse import ArgumentParser, Namespace

from lit_losses.errors import ConfigError
from lit_losses.objectives.correction import check_given_fields


def given_options(parser: ArgumentParser, args: Any, parsed: Namespace) -> Namespace:
    """The options of the subcommand that ``args`` give (the command line and its ``--config`` files, as
    LightningCLI takes them: a list of arguments, or a dict of options; and the environment variables where
    the parser reads them), without the defaults: jsonargparse's parse with ``defaults=False``.

    That parse validates what it holds, and ``model`` and ``data`` are required: it starts from their
    classes as ``parsed`` (the parse with the defaults) chose them (``class_path`` only, none of their
    options), so that a run leaving the default class unnamed still parses, and the given options read as
    options of the class that takes them.

    Example:
        >>> from lit_losses.cli.app import LitLossesParser
        >>> parser = LitLossesParser()
        >>> _ = parser.add_argument("--seq_len", type=int, default=64)
        >>> _ = parser.add_argument("--vocab_size", type=int, default=32768)
        >>> args = ["--vocab_size=32768"]
        >>> given_options(parser, args, parsed=parser.parse_args(args))
        Namespace(vocab_size=32768)
    """
    sub = parsed.get("subcommand")
    section = parsed.get(sub) if sub else parsed
    classes = Namespace()
    for root in ("model", "data"):
        class_path = section.get(f"{root}.class_path") if isinstance(section, Namespace) else None
        if class_path is not None:
            classes[root] = Namespace(class_path=class_path)
    start = Namespace({"subcommand": sub, sub: classes}) if sub else classes
    if isinstance(args, Mapping | Namespace):
        given = parser.parse_object(args, namespace=start, defaults=False)
    else:
        given = parser.parse_args(list(args), namespace=start, defaults=False)
    section = given.get(sub) if sub else given
    return section if isinstance(section, Namespace) else Namespace()


def check_given_linked(
    given: Namespace, linked: Mapping[str, str], *, datamodule: Any, data_config: Any
) -> None:
    """Refuse a linked option given a value other than the one its source gave once built: for
    ``model.init_args.vocab_size`` (target) → ``data.init_args.vocab_size`` (source), the data module's
    ``vocab_size`` (a tokenizer's size unless given), which the model takes when it is built. The same
    value is accepted (a config saved by a run, or written out by hand).

    Args:
        given: the options given (`given_options`).
        linked: target → source options (``lit_losses.cli.app.LINKED``).
        datamodule: the built data module.
        data_config: the parsed ``data`` option (``class_path``, ``init_args``), for messages.

    Raises:
        ConfigError: naming both options and their values.
    """
    for target, source in linked.items():
        value = given.get(target)
        name = source.rpartition(".")[2]
        built = getattr(datamodule, name, None)
        if value is None or built is None or value == built:
            continue
        init_args = data_config.get("init_args") if data_config is not None else None
        configured = init_args.get(name) if init_args is not None else None
        if configured == built:
            where = f"{source}={built!r}"
        else:
            shown = "null" if configured is None else repr(configured)
            where = f"data.{name}={built!r} ({type(datamodule).__name__}'s own: {source} is {shown})"
        raise ConfigError(
            f"{target}={value!r} differs from {where}, which the model takes when it is built; remove "
            f"{target}, or give both the same value"
        )


def check_given_grpo(given: Namespace) -> None:
    """Refuse ``model.grpo``'s rollout-correction fields given together that disagree where one of them is
    given at its default (`lit_losses.objectives.correction.check_given_fields`).

    Raises:
        ConfigError: one line naming both fields and their values.
    """
    grpo = given.get("model.init_args.grpo")
    if isinstance(grpo, Namespace):
        check_given_fields(grpo.as_dict(), "model.grpo")
