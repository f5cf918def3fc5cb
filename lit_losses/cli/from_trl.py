"""``lit-losses from-trl x.yaml [--trainer T] [-o ours.yaml]``: a TRL config file in, a ``lit-losses fit``
config out (`lit_losses.cli.trl_convert`), without importing TRL or torch.

The config goes to ``-o`` (or is printed); each field that did not carry over, and each placeholder to
replace, is one ``lit-losses: from-trl: …`` line on stderr. Bad input (a file that is not YAML or not a
mapping, a field that the trainer's TRL config does not have, a value of the wrong kind, a trainer that
the fields do not tell) is one ``lit-losses: error: from-trl: …`` line, exit code 2, and nothing written.
"""

from __future__ import annotations

import sys
from pathlib import Path

from lit_losses.cli.arguments import OneLineArgumentParser
from lit_losses.cli.trl_config import TRAINERS, read_trl_config
from lit_losses.cli.trl_convert import Conversion, convert
from lit_losses.errors import ConfigError


def from_trl_main(args: list[str]) -> None:
    """``lit-losses from-trl``."""
    parser = OneLineArgumentParser(
        prog="lit-losses from-trl",
        description="Convert a TRL config (trl sft|dpo|kto|grpo --config x.yaml) to a lit-losses fit config "
        "that trains as TRL's trainer would: every field at its option, commented with its TRL name, and "
        "TRL's defaults written out where this package's differ.",
    )
    parser.add_argument("config", metavar="CONFIG", help="the TRL config file (YAML)")
    parser.add_argument(
        "--trainer",
        choices=TRAINERS,
        help="the TRL trainer whose config it is (default: the one whose fields it has)",
    )
    parser.add_argument("-o", "--output", metavar="OUT", help="the file to write (default: print it)")
    options = parser.parse_args(args)
    try:
        if options.output and Path(options.output).resolve() == Path(options.config).resolve():
            raise ConfigError(f"-o {options.output} is the TRL config itself; write the conversion elsewhere")
        conversion = convert(read_trl_config(options.config, trainer=options.trainer))
        text = header(conversion, options.config) + conversion.config.yaml() + "\n"
        if options.output:
            Path(options.output).write_text(text, encoding="utf-8")
    except (ConfigError, OSError) as err:
        print(f"lit-losses: error: from-trl: {err}", file=sys.stderr)
        sys.exit(2)
    for note in conversion.notes:
        print(f"lit-losses: from-trl: {note}", file=sys.stderr)
    if options.output:
        print(f"lit-losses: wrote {options.output} (from TRL's {conversion.trl.config_class})")
    else:
        print(text, end="")


def header(conversion: Conversion, source: str) -> str:
    """The comment lines that open the converted config."""
    config_class = conversion.trl.config_class
    return (
        f"# {source} ({config_class}) converted by lit-losses from-trl, for lit-losses fit --config.\n"
        "# Each option names its TRL field; \"(TRL's default)\": TRL's default, written out where this\n"
        "# package's differs. Replace the placeholders that lit-losses from-trl named.\n"
    )
