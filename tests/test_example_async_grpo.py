"""examples/async_grpo.py: Ray rollout actors, 2 gloo trainer ranks, max_staleness 1 and 0."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tests.process_checks import run_python

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "async_grpo.py"


@pytest.mark.ray
@pytest.mark.slow
def test_async_grpo_trains_within_the_staleness_bound_and_faster_than_the_synchronous_loop():
    proc = run_python(EXAMPLE, "--steps", "6", cwd=ROOT, timeout=400.0)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    jobs = {}
    for s, rate, hist in re.findall(
        r"max_staleness=(\d): ([\d.]+) samples/s trained; staleness histogram (\{.*?\})",
        proc.stdout,
    ):
        jobs[int(s)] = (float(rate), ast.literal_eval(hist))
    assert set(jobs) == {0, 1}, proc.stdout
    for s, (_, hist) in jobs.items():
        assert max(hist) <= s  # no sample older than max_staleness was trained on
        assert sum(hist.values()) == 6 * 2 * 8  # 6 full steps of 2 ranks x 2 groups of 4
    # The target is 1.6x (measured 1.83x-2.05x); a loaded machine keeps a margin.
    assert jobs[1][0] >= 1.3 * jobs[0][0], proc.stdout
