"""docs/migrating/twinkle.md runs as written (its after example checks itself)."""

from __future__ import annotations

import re
from pathlib import Path

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "migrating" / "twinkle.md"


def _blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", GUIDE.read_text(), flags=re.DOTALL)


def test_the_guide_has_a_twinkle_before_and_a_meshfeed_after_example():
    before, after = _blocks()
    assert "device_mesh=mesh" in before and "create_dataset" in before
    assert "meshfeed.DataLoader(create_dataset, device_mesh=mesh" in after


def test_the_after_example_runs_and_splits_every_sample_once():
    scope: dict[str, object] = {}
    exec(compile(_blocks()[1], str(GUIDE), "exec"), scope)  # its own asserts are the check
    per_rank = scope["per_rank"]
    assert isinstance(per_rank, dict) and sorted(per_rank) == [0, 1, 2, 3]
