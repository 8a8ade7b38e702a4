"""The suite on a minimal stack (#27): with every optional extra hidden, nothing fails or breaks
collection; what needs an extra skips, naming it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

from tests.minimal_stack import EXTRAS, main

ROOT = Path(__file__).resolve().parent.parent
#: Files whose tests need zstandard, hypothesis, matplotlib, tokenizers or pyarrow here and there.
TOUCHING_EXTRAS = (
    "tests/balance/test_balance_cli.py",
    "tests/sources/test_sources_chat.py",
    "tests/sources/test_sources_convert_input.py",
    "tests/sources/test_sources_shards.py",
)


def _pytest_without_extras(*args: str) -> str:
    """Output of ``python -m tests.minimal_stack args`` from the repository root."""
    cmd = [sys.executable, "-m", "tests.minimal_stack", "-q", "-p", "no:cacheprovider", *args]
    try:
        done = subprocess.run(
            cmd, cwd=ROOT, env=dict(os.environ), capture_output=True, text=True, timeout=480
        )
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"{cmd} ran past 480 s: {str(e.stdout)[-2000:]}") from e
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    return out


@pytest.mark.slow
def test_the_whole_suite_collects_without_any_extra():
    out = _pytest_without_extras("--collect-only", "tests")
    assert not re.search(r"\d+ errors?\b", out), out[-4000:]
    assert re.search(r"\d+ tests collected", out), out[-2000:]
    # The extras were hidden: module-level skips name them.
    assert "could not import 'pyarrow'" in out and "None in sys.modules" in out


@pytest.mark.slow
def test_tests_that_need_an_extra_skip_naming_it_and_the_rest_pass():
    out = _pytest_without_extras("-m", "not slow", "-rs", *TOUCHING_EXTRAS)
    summary = out.strip().splitlines()[-1]
    assert re.fullmatch(r"=* ?\d+ passed, \d+ skipped(, \d+ deselected)? in .*", summary), summary
    for reason in (
        'needs zstandard (pip install "meshfeed[zstd]")',
        'needs hypothesis (pip install "meshfeed[test]")',
        'the plot needs matplotlib: "meshfeed[plot]"',
        "pip install tokenizers (the test extra)",
        'reading Parquet needs pyarrow: "meshfeed[parquet]"',
    ):
        assert reason in out, reason


def test_extras_already_imported_are_refused_and_nothing_is_hidden(monkeypatch):
    monkeypatch.setitem(sys.modules, "zstandard", types.ModuleType("zstandard"))
    before = {name: sys.modules.get(name, "absent") for name in EXTRAS}
    with pytest.raises(RuntimeError, match=r"extras were imported before .*'zstandard'"):
        main(["--collect-only"])
    assert {name: sys.modules.get(name, "absent") for name in EXTRAS} == before
