"""mkdocs hooks: pages generated at build time from the package itself.

- ``<!-- cli-options: ARGS -->`` in a page is replaced by the output of ``lit-losses ARGS`` (the parser's own
  help: every option with its type, default and choices), e.g. ``fit --help`` or ``fit --model.help TinyLM``.
- ``<!-- include: PATH -->`` is replaced by the text of ``PATH`` (relative to the repository), e.g. the
  benchmark results.
"""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
_CLI = re.compile(r"<!-- cli-options: (.*?) -->")
_INCLUDE = re.compile(r"<!-- include: (.*?) -->")


def cli_help(args: str) -> str:
    """What ``lit-losses <args>`` prints (the help options exit with status 0)."""
    from lit_losses.cli.app import cli_main
    from lit_losses.cli.report import report_main

    words = args.split()
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        report_main(words[1:]) if words[0] == "report" else cli_main(words)
    return f"```text\n$ lit-losses {args}\n{out.getvalue().rstrip()}\n```"


def on_page_markdown(markdown: str, **kwargs) -> str:
    markdown = _CLI.sub(lambda m: cli_help(m.group(1)), markdown)
    return _INCLUDE.sub(lambda m: (REPO / m.group(1)).read_text(encoding="utf-8"), markdown)
