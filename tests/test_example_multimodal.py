"""examples/multimodal_packing.py runs: placeholders stay with their pixels, resume is exact,
and balanced over gloo ranks every placeholder finds its own patch."""

from __future__ import annotations

from pathlib import Path

from tests.process_checks import run_python

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "multimodal_packing.py"


def test_multimodal_example_keeps_every_image_with_its_placeholders_and_resumes():
    proc = run_python(
        EXAMPLE, "--samples", "120", "--workers", "2", cwd=ROOT, timeout=300.0, what=EXAMPLE.name
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert "every image with its placeholders; resumed at step" in proc.stdout
    assert "120 samples with" in proc.stdout
    # two gloo ranks: the images travel with their documents through BalancedBatches
    assert "balanced over 2 gloo ranks at 128 tokens: all" in proc.stdout
    assert "placeholders found their own patches" in proc.stdout
