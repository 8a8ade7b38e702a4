"""Every ```python block of README.md runs as written, so the README cannot rot."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tests.optional import importable
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


def missing_modules(code: str) -> list[str]:
    """Modules a block imports (top level), or needs for zstd shards, that are not installed."""
    names = {"zstandard"} if 'compression="zstd"' in code else set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            names |= {alias.name.partition(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.partition(".")[0])
    return sorted(name for name in names if not importable(name))


def _block(line: int, code: str) -> object:
    missing = missing_modules(code)
    reason = f"the block needs {', '.join(missing)}, not installed (its extra, see Set-up)"
    return pytest.param(
        line, code, id=f"line{line}", marks=pytest.mark.skipif(bool(missing), reason=reason)
    )


BLOCKS = python_blocks(README.read_text())


def test_readme_has_python_blocks() -> None:
    # One block per recipe (quick start, DCP, streams, shards, mixture, curriculum, balance, RL
    # store, HF) at least; an extraction bug must not pass vacuously.
    assert len(BLOCKS) >= 9


@pytest.mark.slow
@pytest.mark.parametrize(
    "line,code",
    [_block(line, code) for line, code in BLOCKS],
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


def test_missing_modules_names_what_a_block_imports_and_is_not_installed() -> None:
    code = "import json\nimport no_such_module_xyz.sub\nfrom no_such_pkg_xyz import a\n"
    assert missing_modules(code) == ["no_such_module_xyz", "no_such_pkg_xyz"]
    assert missing_modules("from . import x\nimport meshfeed\n") == []
