"""The argument parser of the subcommands that LightningCLI does not parse (``lit-losses checkpoint``,
``lit-losses report``): an error is one ``lit-losses: error: …`` line (no usage dump) and exit code 2."""

from __future__ import annotations

import argparse
import re
import sys
from typing import Any, NoReturn

from lit_losses.registry import closest

_INVALID_CHOICE = re.compile(r"invalid choice: '([^']*)' \(choose from (.*)\)")


class OneLineArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose errors are one line naming the subcommand, with the closest
    choice for a misspelled one, and exit code 2; options are taken by their whole name only (``--o`` is
    not ``--out``).

    Example:
        >>> parser = OneLineArgumentParser(prog="lit-losses checkpoint")
        >>> _ = parser.add_subparsers(dest="command", required=True).add_parser("verify")
        >>> print(parser.one_line("argument command: invalid choice: 'verfy' (choose from 'verify')"))
        lit-losses: error: checkpoint: argument command: invalid choice: 'verfy' (choose from 'verify'); did
        you mean 'verify'?
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def one_line(self, message: str) -> str:
        """The error line of ``message``."""
        command = self.prog.removeprefix("lit-losses").strip()
        found = _INVALID_CHOICE.search(message)
        if found:
            message += closest(found.group(1), re.findall(r"'([^']*)'", found.group(2)))
        return f"lit-losses: error: {command + ': ' if command else ''}{message}"

    def error(self, message: str) -> NoReturn:
        print(self.one_line(message), file=sys.stderr)
        sys.exit(2)
