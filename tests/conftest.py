import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session", autouse=True)
def _isolated_cache(tmp_path_factory):
    """Tokenizers are cached per test session (CI starts with an empty cache)."""
    cache = tmp_path_factory.mktemp("lit_losses_cache")
    os.environ["LIT_LOSSES_CACHE"] = str(cache)
    yield cache


@pytest.fixture
def text_corpus(tmp_path) -> Path:
    """A small corpus of real text: a few standard-library modules, one file per document."""
    from lit_losses.data import stdlib_sources

    folder = tmp_path / "corpus"
    folder.mkdir()
    for i, src in enumerate(stdlib_sources()[:40]):
        (folder / f"doc{i:02d}.txt").write_text(Path(src).read_text(encoding="utf-8"), encoding="utf-8")
    return folder
