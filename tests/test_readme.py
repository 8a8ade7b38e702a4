"""Every ```python block of README.md runs as written, so the README cannot rot."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.process_checks import run_python

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
TIMEOUT = 180.0


def python_blocks(text: str) -> list[tuple[int, str]]:
    """``(line, code)`` of every fenced python block, the line counted from 1."""
    blocks = []
    for match in re.finditer(r"^```python\n(.*?)^```", text, flags=re.M | re.S):
        blocks.append((text.count("\n", 0, match.start()) + 2, match.group(1)))
    return blocks


BLOCKS = python_blocks(README.read_text())


def test_readme_has_python_blocks() -> None:
    # One block per recipe (quick start, DCP, streams, shards, mixture, curriculum, balance, RL
    # store, HF) at least; an extraction bug must not pass vacuously.
    assert len(BLOCKS) >= 9


@pytest.mark.slow
@pytest.mark.parametrize(
    "line,code",
    [pytest.param(line, code, id=f"line{line}") for line, code in BLOCKS],
)
def test_readme_block_runs(line: int, code: str, tmp_path: Path) -> None:
    script = tmp_path / f"readme_line{line}.py"
    script.write_text(code)
    proc = run_python(script, cwd=tmp_path, timeout=TIMEOUT, what=f"README block at line {line}")
    assert proc.returncode == 0, (
        f"README block at line {line} failed:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    )
    # Written where it runs, never next to the README.
    assert not (ROOT / "meshfeed_plan.png").exists()


def test_python_blocks_finds_each_block() -> None:
    text = "a\n```python\nx = 1\n```\n\n```bash\nls\n```\n```python\ny = 2\nz = 3\n```\n"
    assert python_blocks(text) == [(3, "x = 1\n"), (10, "y = 2\nz = 3\n")]
