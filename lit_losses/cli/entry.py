"""``lit-losses``'s console-script entry point: `main` starts the subcommand asked for, importing only what
it needs, so that ``lit-losses report`` and ``lit-losses --version`` start without torch or Lightning."""

from __future__ import annotations

import sys

import lit_losses


def main() -> None:
    """``lit-losses report …`` is `lit_losses.cli.report.report_main`, ``lit-losses checkpoint …``
    `lit_losses.cli.checkpoint.checkpoint_main`, ``lit-losses --version`` prints the version, every other
    command line is LightningCLI's (`lit_losses.cli.app.lightning_main`; exit status:
    `lit_losses.cli.app.cli_main`)."""
    command, args = sys.argv[1:2], sys.argv[2:]
    if command == ["report"]:
        from lit_losses.cli.report import report_main  # matplotlib only when a report is asked for

        report_main(args)
    elif command == ["checkpoint"]:
        from lit_losses.cli.checkpoint import checkpoint_main

        checkpoint_main(args)
    elif command == ["--version"] and not args:
        print(f"lit-losses {lit_losses.__version__}")
    else:
        from lit_losses.cli.app import lightning_main

        lightning_main()
