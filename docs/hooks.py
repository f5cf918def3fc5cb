"""mkdocs hooks: pages generated at build time from the package itself.

- ``<!-- cli-options: ARGS -->`` in a page is replaced by the output of ``lit-losses ARGS`` (the parser's own
  help: every option with its type, default and choices), e.g. ``fit --help`` or ``fit --model.help TinyLM``.
- ``<!-- include: PATH -->`` is replaced by the text of ``PATH`` (relative to the repository), e.g. the
  benchmark results.
- ``<!-- benchmarks: PATH -->`` is replaced by the figures of ``PATH`` (``benchmarks/current.yaml``): for
  each, its device, date and command, a table, and the chart that ``benchmarks/charts.py`` drew from it.
- Maths (``$…$``, ``$$…$$``, which ``pymdownx.arithmatex`` marks) is rendered to MathML when the site is
  built (``latex2mathml``): browsers draw it natively, with no script and nothing fetched from outside
  the site.
"""

from __future__ import annotations

import contextlib
import html
import importlib.util
import io
import re
from pathlib import Path

from latex2mathml.converter import convert

REPO = Path(__file__).resolve().parents[1]
_CLI = re.compile(r"<!-- cli-options: (.*?) -->")
_INCLUDE = re.compile(r"<!-- include: (.*?) -->")
_BENCHMARKS = re.compile(r"<!-- benchmarks: (.*?) -->")
_MATH = re.compile(
    r'<(?P<tag>div|span) class="arithmatex">\\(?P<open>[\[(])(?P<tex>.*?)\\[\])]</(?P=tag)>', re.S
)


def cli_help(args: str) -> str:
    """What ``lit-losses <args>`` prints (the help options exit with status 0)."""
    from lit_losses.cli.app import cli_main
    from lit_losses.cli.report import report_main

    words = args.split()
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        report_main(words[1:]) if words[0] == "report" else cli_main(words)
    return f"```text\n$ lit-losses {args}\n{out.getvalue().rstrip()}\n```"


def benchmark_figures(path: str) -> str:
    """The figures of a results file as Markdown: heading, where and how measured, table, chart."""
    spec = importlib.util.spec_from_file_location("charts", REPO / "benchmarks" / "charts.py")
    charts = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(charts)
    parts = []
    for figure in charts.read_figures(REPO / path):
        header = "| " + " | ".join(figure["columns"]) + " |"
        rule = "|---" + "|---:" * (len(figure["columns"]) - 1) + "|"
        rows = [
            "| " + " | ".join(f"{cell:g}" if isinstance(cell, float) else str(cell) for cell in row) + " |"
            for row in figure["rows"]
        ]
        parts += [
            f"## {figure['title']}",
            f"*{figure['date']} · {figure['device']}*"
            + (f" · {figure['shape']}" if "shape" in figure else ""),
            f"`{figure['command']}`",
            "\n".join([header, rule, *rows]),
            figure.get("note", ""),
            f"![{figure['title']}](../assets/benchmarks/{figure['id']}.png)",
        ]
    return "\n\n".join(p for p in parts if p)


def on_page_markdown(markdown: str, **kwargs) -> str:
    markdown = _CLI.sub(lambda m: cli_help(m.group(1)), markdown)
    markdown = _BENCHMARKS.sub(lambda m: benchmark_figures(m.group(1)), markdown)
    return _INCLUDE.sub(lambda m: (REPO / m.group(1)).read_text(encoding="utf-8"), markdown)


def mathml(match: re.Match[str]) -> str:
    """One arithmatex element (``\\(…\\)`` inline, ``\\[…\\]`` display) as MathML."""
    display = "block" if match["open"] == "[" else "inline"
    return convert(html.unescape(match["tex"]).strip(), display=display)


def on_page_content(content: str, **kwargs) -> str:
    return _MATH.sub(mathml, content)
