"""Process helpers the tests share: run a script in a fresh interpreter with this tree's
``src`` first on the path; is a process alive; and does an interpreter that leaves stuck
workers behind still exit with every worker gone (the hang tests of every worker runtime)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

SRC = str(Path(__file__).resolve().parents[1] / "src")


def run_python(
    script: Path, *args: str, cwd: Path, timeout: float, what: str | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``python script *args`` in ``cwd`` with this tree's ``src`` first on
    ``PYTHONPATH``, output captured; running past ``timeout`` seconds fails the test
    (``AssertionError`` naming ``what``, default the script's name), never hangs it."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([SRC, env.get("PYTHONPATH", "")])
    env.setdefault("RAY_DEDUP_LOGS", "0")
    try:
        return subprocess.run(
            [sys.executable, str(script), *args],
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"{what or script.name} ran longer than {timeout}s") from e


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def run_script_leaving_workers(script: str, tmp_path: Path, *, timeout: float) -> str:
    """Run ``script`` in a fresh interpreter; it prints its worker pids last and returns
    without shutting its loader down. Assert it exits cleanly and no worker outlives it;
    return its standard output."""
    path = tmp_path / "leave.py"
    path.write_text(script)
    done = subprocess.run(
        [sys.executable, str(path)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONPATH": SRC},
    )
    assert done.returncode == 0, done.stderr
    pids = [int(p) for p in done.stdout.split("]")[-1].split()]
    assert len(pids) == 2, done.stdout
    time.sleep(0.2)
    assert not any(alive(p) for p in pids)
    return done.stdout
