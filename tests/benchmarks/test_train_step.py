"""`benchmarks/train_step.py` at a tiny size on CPU: the table has this package's, Hugging Face's and
(where Liger-Kernel imports) HF + Liger rows, and the package's loss at the first step is HF's own."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
VARIANTS = ("lit_sft", "lit_grpo", "hf", "hf_liger")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("train_step")
    out = root / "rows.json"
    cmd = [
        sys.executable,
        "benchmarks/train_step.py",
        "--device",
        "cpu",
        "--tiny",
        "--dtype",
        "float32",
        "--vocab",
        "512",
        "--seq-len",
        "32",
        "--rows",
        "2",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--threads",
        "1",
        "--variants",
        *VARIANTS,
        "--json",
        str(out),
        "--profile",
        str(root / "profiles"),
    ]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout, {row["variant"]: row for row in json.loads(out.read_text())["rows"]}, root


def test_a_profiled_step_names_its_phases_and_their_operators(run):
    """``--profile``: one more step per variant under the profiler, its phases and the operators in them."""
    root = run[2]
    for variant in ("lit_sft", "hf"):
        text = (root / "profiles" / f"{variant}.txt").read_text()
        for name in ("loss (forward)", "backward", "optimizer", "aten::mm"):
            assert name in text, (variant, name, text[:2000])


def test_the_table_has_the_package_hf_and_liger_rows(run):
    stdout, rows, _ = run
    for variant in ("lit_sft", "lit_grpo", "hf"):
        assert f"| {variant} | " in stdout
        row = rows[variant]
        assert "absent" not in row, row
        assert row["tokens_per_s"] > 0 and row["peak_gib"] > 0 and row["step_s"] > 0
    if importlib.util.find_spec("liger_kernel") is not None:
        assert "| hf_liger | " in stdout
        # on CPU Liger's Triton kernels cannot run: the row says why (on CUDA it has figures)
        assert "absent" not in rows["hf_liger"] or rows["hf_liger"]["absent"]


def test_the_package_loss_is_hf_own_loss_at_the_first_step(run):
    """The same seeded weights and batch in separate processes: the fused head's token-mean cross-entropy
    of the next-token labels against ``model(input_ids, labels=input_ids).loss`` (HF shifts inside)."""
    _, rows, _ = run
    assert rows["lit_sft"]["loss"] == pytest.approx(rows["hf"]["loss"], rel=1e-6)
    assert rows["lit_sft"]["params"] == rows["hf"]["params"]
    assert rows["lit_grpo"]["loss"] != pytest.approx(rows["hf"]["loss"], rel=1e-2)  # another loss
