"""DDP: a rule that holds on one rank only makes every rank stop at the same step, without a hang."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("ddp_stop.py")


@pytest.mark.slow
@pytest.mark.ddp
@pytest.mark.timeout(300)
def test_rank1_only_rule_stops_both_ranks_at_the_same_step(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=SCRIPT.parents[2],
        env={**os.environ, "PYTHONPATH": str(SCRIPT.parents[2])},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["step"] for r in results] == [2, 2]
    assert all([f["step"] for f in r["fired"]] == [2] for r in results)
