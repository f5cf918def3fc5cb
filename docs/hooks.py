"""mkdocs hooks: pages generated at build time from the package itself.

- ``<!-- cli-options: ARGS -->`` in a page is replaced by the output of ``lit-losses ARGS`` (the parser's own
  help: every option with its type, default and choices), e.g. ``fit --help`` or ``fit --model.help TinyLM``.
- ``<!-- include: PATH -->`` is replaced by the text of ``PATH`` (relative to the repository), e.g. the
  benchmark results.
- ``<!-- benchmarks: PATH -->`` is replaced by the figures of ``PATH`` (``benchmarks/current.yaml``): for
  each, its device, date and command, a table, and the chart that ``benchmarks/charts.py`` drew from it.
- In the guides (every page outside ``reference/``), the first `` `Name` `` of a page that is a public
  name documented on an API page links to its entry (mkdocs-autorefs' ``[`Name`][identifier]``).
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
import sys
from pathlib import Path

from latex2mathml.converter import convert

REPO = Path(__file__).resolve().parents[1]
_CLI = re.compile(r"<!-- cli-options: (.*?) -->")
_INCLUDE = re.compile(r"<!-- include: (.*?) -->")
_API_ROOT = re.compile(r"^::: (lit_losses\S*)", re.M)
_INLINE_NAME = re.compile(r"(?<![\[\w`])`([A-Za-z_][A-Za-z0-9_]*)`(?![\]\w`(])")
_BENCHMARKS = re.compile(r"<!-- benchmarks: (.*?) -->")
_MATH = re.compile(
    r'<(?P<tag>div|span) class="arithmatex">\\(?P<open>[\[(])(?P<tex>.*?)\\[\])]</(?P=tag)>', re.S
)


@contextlib.contextmanager
def _argv(argv: list[str]):
    """``sys.argv`` set to ``argv`` for the duration."""
    saved, sys.argv = sys.argv, argv
    try:
        yield
    finally:
        sys.argv = saved


def cli_help(args: str) -> str:
    """What ``lit-losses <args>`` prints (the help options exit with status 0)."""
    from lit_losses.cli.app import cli_main
    from lit_losses.cli.checkpoint import checkpoint_main
    from lit_losses.cli.from_trl import from_trl_main
    from lit_losses.cli.report import report_main

    words = args.split()
    own = {"report": report_main, "checkpoint": checkpoint_main, "from-trl": from_trl_main}
    out = io.StringIO()
    # sys.argv as if `lit-losses` ran: LightningCLI warns when given args beside mkdocs' own argv
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit), _argv(["lit-losses"]):
        own[words[0]](words[1:]) if words[0] in own else cli_main(words)
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


def api_identifiers() -> dict[str, str]:
    """Public name → the identifier of its entry on the API pages: the objects named by ``:::`` lines,
    then the ``__all__`` names of the packages rendered whole (a name documented twice keeps the first)."""
    import importlib

    found: dict[str, str] = {}
    roots = [
        m
        for page in sorted((REPO / "docs" / "reference" / "api").glob("*.md"))
        for m in _API_ROOT.findall(page.read_text(encoding="utf-8"))
    ]
    for root in roots:
        found.setdefault(root.rpartition(".")[2], root)
    for root in roots:
        module = importlib.import_module(root) if root.count(".") and _is_module(root) else None
        for name in getattr(module, "__all__", ()):
            found.setdefault(name, f"{root}.{name}")
    return {
        name: identifier
        for name, identifier in found.items()
        if name[:1].isupper() or "_" in name or name in ("aggregate",)
    }


def _is_module(path: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(path) is not None
    except ModuleNotFoundError:
        return False


def link_api_names(markdown: str, identifiers: dict[str, str]) -> str:
    """The first `` `Name` `` of each public name outside code blocks as a link to its API entry."""
    linked: set[str] = set()
    out, fenced = [], False

    def link(match: re.Match[str]) -> str:
        name = match[1]
        if name not in identifiers or name in linked:
            return match[0]
        linked.add(name)
        return f"[`{name}`][{identifiers[name]}]"

    for line in markdown.splitlines(keepends=True):
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
        heading = line.lstrip().startswith("#")
        out.append(line if fenced or heading else _INLINE_NAME.sub(link, line))
    return "".join(out)


def on_page_markdown(markdown: str, page=None, **kwargs) -> str:
    markdown = _CLI.sub(lambda m: cli_help(m.group(1)), markdown)
    markdown = _BENCHMARKS.sub(lambda m: benchmark_figures(m.group(1)), markdown)
    if page is not None and not page.file.src_uri.startswith("reference/"):
        markdown = link_api_names(markdown, api_identifiers())
    return _INCLUDE.sub(lambda m: (REPO / m.group(1)).read_text(encoding="utf-8"), markdown)


def mathml(match: re.Match[str]) -> str:
    """One arithmatex element (``\\(…\\)`` inline, ``\\[…\\]`` display) as MathML."""
    display = "block" if match["open"] == "[" else "inline"
    return convert(html.unescape(match["tex"]).strip(), display=display)


def on_page_content(content: str, **kwargs) -> str:
    return _MATH.sub(mathml, content)
