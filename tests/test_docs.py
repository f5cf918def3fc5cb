"""The docs site: ``mkdocs build --strict`` passes, and every code block of the docs runs or parses."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.docs_blocks import DOCS, REPO, blocks, pages, run_python_blocks

pytest.importorskip("mkdocs")
PYTHON_PAGES = [p for p in pages() if blocks(p, "python")]


def test_the_docs_have_runnable_examples():
    assert len(PYTHON_PAGES) >= 10, PYTHON_PAGES


@pytest.mark.parametrize("page", PYTHON_PAGES, ids=lambda p: str(p.relative_to(DOCS)))
def test_python_blocks_run_top_to_bottom(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    run_python_blocks(page, tmp_path)


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(DOCS)))
def test_yaml_and_json_blocks_parse(page):
    for block in blocks(page):
        if block.language == "yaml":
            assert isinstance(yaml.safe_load(block.text), dict), block.text
        elif block.language == "json":  # a JSON object, or JSONL: one object per line
            text = block.text.strip()
            lines = (
                [text]
                if text.startswith("{") and text.endswith("}") and "\n{" not in text
                else text.splitlines()
            )
            assert all(isinstance(json.loads(line), dict) for line in lines)


def blocks_of_objects(lines: list[str]) -> list[str]:
    """The lines that start a JSON object (one: a single object over several lines)."""
    return [line for line in lines if line.startswith("{")]


@pytest.mark.slow
def test_mkdocs_build_strict(tmp_path):
    """No broken link, no missing reference; the CLI options page and the API reference are generated."""
    env = dict(os.environ, PYTHONPATH=str(REPO), NO_MKDOCS_2_WARNING="1")
    cmd = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    cli_page = (tmp_path / "site" / "reference" / "cli" / "index.html").read_text()
    for option in (
        "--trainer.max_steps",
        "--model.head_backend",
        "--data.tokens_per_batch",
        "--resume_changes",
    ):
        assert option in cli_page, option
    api_pages = "".join(p.read_text() for p in (tmp_path / "site" / "reference" / "api").rglob("*.html"))
    assert "GlobalStatsLoader" in api_pages and "forward_backward_custom" in api_pages
    check_built_pages(tmp_path / "site")


CODE = re.compile(r"<(pre|code|script)\b.*?</\1>", re.S)
EXTERNAL = re.compile(r"<(?:script|link)\b[^>]*(?:src|href)=\"(?:https?:)?//", re.I)


def check_built_pages(site: Path) -> None:
    """What a reader sees: maths rendered (no raw ``\\[``/``\\(`` outside code), nothing fetched from
    outside the site (scripts, stylesheets, fonts), every usage line naming ``lit-losses``."""
    html_pages = sorted(site.rglob("*.html"))
    assert len(html_pages) > 20
    for page in html_pages:
        text = page.read_text(encoding="utf-8")
        prose = CODE.sub("", text)
        assert "\\[" not in prose and "\\(" not in prose, f"raw LaTeX in {page.relative_to(site)}"
        assert not EXTERNAL.search(text), f"{page.relative_to(site)}: {EXTERNAL.search(text)[0]}"
        assert "usage: __main__" not in text, page.relative_to(site)
    aggregation = (site / "concepts" / "aggregation" / "index.html").read_text(encoding="utf-8")
    assert aggregation.count("<math") >= 10
    check_api_pages(site / "reference" / "api")
    tutorial = (site / "tutorials" / "fused-head" / "index.html").read_text(encoding="utf-8")
    assert (
        'href="../../reference/api/head/#lit_losses.heads.FusedLMHead"' in tutorial
    )  # names link to the API


SUBPACKAGES = ("aggregation", "autograd", "controller", "data", "heads", "loss", "models", "objectives")
SUBPACKAGES += ("parallel", "regularizers", "checkpoint", "cli")


def documented(ids: set[str], sub: str, name: str) -> bool:
    """``lit_losses.<sub>.<name>`` has an entry: under that path, its module's, or the top level's."""
    return any(
        i in (f"lit_losses.{sub}.{name}", f"lit_losses.{name}")
        or (i.startswith(f"lit_losses.{sub}.") and i.endswith(f".{name}") and i.count(".") == 3)
        for i in ids
    )


def check_api_pages(api: Path) -> None:
    """Every public name (``lit_losses.__all__`` and each subpackage's ``__all__``) has an entry on an API
    page; a class's entry shows its constructor's signature."""
    import importlib

    import lit_losses

    pages = {p: p.read_text(encoding="utf-8") for p in api.rglob("*.html")}
    ids = {i for text in pages.values() for i in re.findall(r'id="(lit_losses\.[^"]*)"', text)}
    missing = [
        name
        for name in lit_losses.__all__
        if not any(i.endswith(f".{name}") or i.startswith(f"lit_losses.{name}.") for i in ids)
    ]
    for sub in SUBPACKAGES:
        names = importlib.import_module(f"lit_losses.{sub}").__all__
        missing += [f"lit_losses.{sub}.{n}" for n in names if not documented(ids, sub, n)]
    assert not missing, f"public names without an API entry: {missing}"
    head = re.sub(r"<[^>]+>", "", pages[api / "head" / "index.html"])
    assert re.search(r"FusedLMHead\s*\(\s*weight: Tensor,\s*bias: Tensor \| None = None", head)


def test_the_benchmark_charts_are_drawn_from_the_results_data(tmp_path):
    """``benchmarks/charts.py`` redraws a chart per figure of ``current.yaml``; the docs hold each one."""
    cmd = [sys.executable, str(REPO / "benchmarks" / "charts.py"), "--out", str(tmp_path)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    figures = yaml.safe_load((REPO / "benchmarks" / "current.yaml").read_text())["figures"]
    for figure in figures:
        drawn = tmp_path / f"{figure['id']}.png"
        assert drawn.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", drawn
        assert (DOCS / "assets" / "benchmarks" / drawn.name).is_file(), (
            f"run benchmarks/charts.py ({drawn.name})"
        )
