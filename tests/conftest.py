import os
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]

# The first vectorized transcendental op of a process (exp, log, tanh, ...) on torch 2.13 CPU sometimes
# returns values ~1e-10 (relative) off every later call: measured in separate processes, fp64 ``exp``
# differed from its second call in 4 of 25 and ``tanh`` in 3 of 30, fp32 ``exp`` in 1 of 40; after one
# warm-up op, 0 of 40 for every op tried. Float64 tests compare to 1e-12, so settle it before any test.
torch.exp(torch.ones(64, dtype=torch.float64))


@pytest.fixture(scope="session", autouse=True)
def _isolated_cache(tmp_path_factory):
    """Tokenizers are cached per test session (CI starts with an empty cache)."""
    cache = tmp_path_factory.mktemp("lit_losses_cache")
    os.environ["LIT_LOSSES_CACHE"] = str(cache)
    yield cache


@pytest.fixture(scope="session", autouse=True)
def _trainer_root(tmp_path_factory):
    """`quiet_trainer`'s default checkpoints go to a temporary folder, not the working directory."""
    from tests import helpers

    helpers.TRAINER_ROOT = tmp_path_factory.mktemp("trainer_root")
    yield helpers.TRAINER_ROOT


@pytest.fixture
def text_corpus(tmp_path) -> Path:
    """A small corpus of real text: a few standard-library modules, one file per document."""
    from lit_losses.data import stdlib_sources

    folder = tmp_path / "corpus"
    folder.mkdir()
    for i, src in enumerate(stdlib_sources()[:40]):
        (folder / f"doc{i:02d}.txt").write_text(Path(src).read_text(encoding="utf-8"), encoding="utf-8")
    return folder
