"""When a rank dies or fails, every other rank stops within ``timeout`` + 5 s and exits (#20).

Real gloo ranks started as plain subprocesses (the default group keeps torch's 30-minute
timeout, as in a training job; workers use fork, the default start method), each bounded by a
wall clock and killed in a ``finally``:

- a rank SIGKILLed mid-epoch: the survivors' next collective fails at once ("connection
  closed"), for a ``StreamLoader`` (one agreement per batch) and a ``DataLoader`` with
  ``on_error="raise"`` (one status check per step); both exit;
- ``on_error="raise"`` on 4 ranks, one bad sample on rank 1: rank 1 raises its error, every
  other rank :class:`~meshfeed.errors.RankError` naming rank 1, all at step 0.

The fault matrix adds a stopped rank and a rank that never reaches its first batch.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.process_faults import run_ranks, survivor_times

TIMEOUT = 5.0
BOUND = TIMEOUT + 5.0  # the bound: no survivor alive later than timeout + 5 s


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["stream", "map-raise"])
def test_survivors_of_a_killed_rank_raise_and_exit(kind: str, tmp_path: Path) -> None:
    run = run_ranks(kind, "kill", tmp_path, timeout=TIMEOUT, bound=120)
    times = survivor_times(run)
    for r, (raised, exited) in times.items():
        report = run.reports[r]
        assert report["error"] == "CollectiveError", report
        assert "connection closed" in report["message"] and f"rank {r} of 3" in report["message"]
        assert raised < BOUND and exited < BOUND, (r, times)


@pytest.mark.slow
def test_on_error_raise_stops_every_rank_at_the_same_step(tmp_path: Path) -> None:
    run = run_ranks("map-raise", "raise", tmp_path, world=4, workers=0, timeout=TIMEOUT, bound=120)
    assert sorted(run.reports) == [0, 1, 2, 3] and len(run.exited_at) == 4, run
    assert {r: run.reports[r]["steps"] for r in range(4)} == {0: 0, 1: 0, 2: 0, 3: 0}
    assert run.reports[1]["error"] == "SampleError", run.reports[1]
    assert "sample 2 is bad on rank 1" in run.reports[1]["message"]
    for r in (0, 2, 3):
        assert run.reports[r]["error"] == "RankError", run.reports[r]
        assert run.reports[r]["message"].startswith(
            f"rank 1 failed to make its batch at step 0 of epoch 0 (this is rank {r})"
        )
