"""docs/migrating/deepspeed.md: the "after" example runs as written (no DeepSpeed needed)."""

from __future__ import annotations

import re
from pathlib import Path

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "migrating" / "deepspeed.md"


def _blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", GUIDE.read_text(), flags=re.DOTALL)


def test_the_guide_has_a_before_and_an_after_example():
    before, after = _blocks()
    assert "deepspeed.initialize" in before
    assert "from_deepspeed_config" in after and "meshfeed.DataLoader" in after


def test_the_after_example_runs_and_matches_deepspeeds_allowed_difficulties():
    after = _blocks()[1]
    scope: dict[str, object] = {}
    exec(compile(after, str(GUIDE), "exec"), scope)  # its own asserts are the check
    assert scope["longest"] == [2, 4, 4, 6, 6, 8, 8, 10, 10, 10]
