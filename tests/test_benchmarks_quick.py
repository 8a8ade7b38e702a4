"""Every ``benchmarks/*.py --quick`` runs to the end, so a benchmark that crashes fails CI.

A smoke run only: no timing is asserted (the scripts measure ratios; a shared CI machine makes
absolute times meaningless). Each run has a hard timeout so a hung benchmark fails instead of
stalling the suite.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.optional import importable
from tests.process_checks import run_python

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((ROOT / "benchmarks").glob("bench_*.py"))
TIMEOUT = 600.0
#: What a benchmark cannot run without (its other peers it skips itself, saying so): on a stack
#: without it, its smoke run is skipped, naming what to install (#27).
NEEDS = {
    "bench_convert": ("tokenizers",),  # trains the BPE it converts with
    "bench_loader": ("torchdata",),
    "bench_packing": ("tokenizers", "grain"),  # its ratios are against Grain's packers
    "bench_queue": ("ray",),
    "bench_ray": ("ray",),
    "bench_shards": ("zstandard",),  # writes zstd-compressed meshfeed shards
    "bench_stream": ("zstandard",),
}


def _smoke_run(script: Path) -> object:
    missing = [m for m in NEEDS.get(script.stem, ()) if not importable(m)]
    reason = f'{script.stem} needs {", ".join(missing)} (pip install "meshfeed[bench,test]")'
    return pytest.param(
        script, id=script.stem, marks=pytest.mark.skipif(bool(missing), reason=reason)
    )


def test_every_benchmark_is_collected() -> None:
    # A renamed folder or glob must not turn the smoke runs below into zero tests.
    assert len(SCRIPTS) >= 10, [s.name for s in SCRIPTS]
    assert set(NEEDS) <= {s.stem for s in SCRIPTS}  # no stale entry


@pytest.mark.slow
@pytest.mark.parametrize("script", [_smoke_run(s) for s in SCRIPTS])
def test_benchmark_quick_runs(script: Path, tmp_path: Path) -> None:
    proc = run_python(
        script, "--quick", cwd=tmp_path, timeout=TIMEOUT, what=f"{script.name} --quick"
    )
    assert proc.returncode == 0, (
        f"{script.name} --quick exited with {proc.returncode}:\n"
        f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    )
    assert proc.stdout.strip(), f"{script.name} --quick printed no report"


@pytest.mark.slow
@pytest.mark.parametrize(
    "args",
    [
        pytest.param(["bench_shards.py", "--large", "--quick"], id="shards"),
        pytest.param(["bench_remote.py", "--large", "--quick", "--workers", "0"], id="remote"),
    ],
)
def test_large_sample_rows_run_and_serve_every_sample_once(args: list[str], tmp_path: Path) -> None:
    # each epoch is checked in its child process (every id once) and reported on the last line
    proc = run_python(
        ROOT / "benchmarks" / args[0], *args[1:], cwd=tmp_path, timeout=TIMEOUT, what=" ".join(args)
    )
    assert proc.returncode == 0, f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    lines = proc.stdout.strip().splitlines()
    assert lines[-1].endswith("each resume a full batch: True"), proc.stdout[-2000:]
    assert any(line.startswith("w=0 epoch 1 samples/s") for line in lines), proc.stdout[-2000:]
