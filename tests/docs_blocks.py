"""The fenced code blocks of the README and of the docs pages, for the tests that run them."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
_FENCE = re.compile(r"^```(\w+)([^\n]*)\n(.*?)^```", re.S | re.M)
_TITLE = re.compile(r'title="([^"]+)"')


@dataclass
class Block:
    """One fenced block: its language, its ``title="…"`` (a file name in the recipes) and its text."""

    language: str
    title: str | None
    text: str


def blocks(page: Path, language: str | None = None) -> list[Block]:
    """The fenced blocks of ``page`` in order (only ``language``'s when given)."""
    found = []
    for lang, info, text in _FENCE.findall(page.read_text(encoding="utf-8")):
        title = _TITLE.search(info)
        found.append(Block(lang, title.group(1) if title else None, text))
    return [b for b in found if language is None or b.language == language]


def pages() -> list[Path]:
    """Every Markdown page of the docs, sorted."""
    return sorted(DOCS.rglob("*.md"))


def run_python_blocks(page: Path, folder: Path) -> None:
    """Run ``page``'s Python blocks top to bottom in one namespace, with ``folder`` as the working
    directory (the caller's job); a block with a ``title`` is also written there as that file first."""
    namespace = {"__name__": f"docs.{page.stem}"}
    for block in blocks(page, "python"):
        if block.title:
            (folder / block.title).parent.mkdir(parents=True, exist_ok=True)
            (folder / block.title).write_text(block.text, encoding="utf-8")
        exec(compile(block.text, str(page), "exec"), namespace)


def write_titled_blocks(page: Path, folder: Path) -> list[Path]:
    """Write every block of ``page`` that has a ``title`` into ``folder`` as that file."""
    written = []
    for block in blocks(page):
        if block.title:
            path = folder / block.title
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(block.text, encoding="utf-8")
            written.append(path)
    return written
