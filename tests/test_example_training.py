"""examples/train_tiny_transformer.py in reduced form: DCP checkpoint, stop, resume, same losses."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.process_checks import run_python

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train_tiny_transformer.py"


def _run(*args: str, timeout: float = 400.0) -> subprocess.CompletedProcess[str]:
    return run_python(EXAMPLE, *args, cwd=ROOT, timeout=timeout)


@pytest.mark.slow
def test_tiny_transformer_resumes_from_dcp_with_an_identical_loss_curve():
    argv = ["--steps", "5", "--save-at", "2", "--d-model", "16", "--layers", "1"]
    proc = _run(*argv, "--seq-len", "32", "--documents", "80")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    rows = [line.split() for line in proc.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert [int(r[0]) for r in rows] == [0, 1, 2, 3, 4]
    # Steps after the checkpoint: resumed equals uninterrupted, printed to 6 decimals.
    assert all(r[1] == r[2] for r in rows[2:]) and all(r[2] == "nan" for r in rows[:2])
    assert "identical to the uninterrupted run (3 steps after the checkpoint)" in proc.stdout


@pytest.mark.slow
def test_tiny_transformer_refuses_a_checkpoint_step_outside_the_run():
    proc = _run("--steps", "4", "--save-at", "4", timeout=120.0)
    assert proc.returncode == 2
    assert "--save-at must lie inside the run (got save_at=4, steps=4)" in proc.stderr
