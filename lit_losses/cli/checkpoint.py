"""``lit-losses checkpoint convert SRC DST`` and ``lit-losses checkpoint verify PATH``.

``convert`` writes a sharded checkpoint folder (FSDP2's) as one checkpoint file, or a file as a folder
(`lit_losses.checkpoint.convert`); ``verify`` checks a checkpoint against its manifest
(`lit_losses.checkpoint.verify`; one without a manifest must at least be readable) and says what it holds.
Errors are one line and exit code 2.
"""

from __future__ import annotations

import sys
import warnings

from lit_losses.checkpoint.convert import convert_checkpoint
from lit_losses.checkpoint.resume import read_checkpoint
from lit_losses.checkpoint.verify import verify_checkpoint
from lit_losses.cli.arguments import OneLineArgumentParser
from lit_losses.errors import ConfigError


def checkpoint_main(args: list[str]) -> None:
    """``lit-losses checkpoint {convert,verify}``."""
    parser = OneLineArgumentParser(prog="lit-losses checkpoint", description="Checkpoint tools.")
    commands = parser.add_subparsers(dest="command", required=True)
    convert = commands.add_parser(
        "convert",
        help="write a sharded checkpoint folder as one file, or a file as a sharded folder",
        description="Write checkpoint SRC in the other layout at DST (a new path): a sharded folder "
        "(FSDP2's) becomes one checkpoint file, a file becomes a sharded folder. Both resume.",
    )
    convert.add_argument("source", metavar="SRC", help="a checkpoint file or sharded checkpoint folder")
    convert.add_argument("target", metavar="DST", help="the checkpoint to write (must not exist)")
    verify = commands.add_parser("verify", help="check a checkpoint against its manifest")
    verify.add_argument("path", metavar="PATH", help="a checkpoint file or sharded checkpoint folder")
    options = parser.parse_args(args)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if options.command == "convert":
                message = f"lit-losses: wrote {convert_checkpoint(options.source, options.target)}"
            else:
                where = "lit-losses checkpoint verify:"
                found = verify_checkpoint(options.path, where=where)
                if found.state == "unverifiable":  # no manifest: at least a checkpoint that can be read
                    read_checkpoint(options.path, where=where)
                step = found.manifest.global_step if found.manifest else None
                message = f"lit-losses: {options.path}: {found.state}" + (
                    f" (step {step})" if step is not None else ""
                )
    except (ConfigError, OSError) as err:
        print(f"lit-losses: error: {err}", file=sys.stderr)
        sys.exit(2)
    for warning in caught:
        print(f"lit-losses: warning: {warning.message}", file=sys.stderr)
    print(message)
