"""When a rank dies or fails, every other rank stops within ``timeout`` + 5 s and exits (#20).

Real gloo ranks started as plain subprocesses (the default group keeps torch's 30-minute
timeout, as in a training job; workers use fork, the default start method), each bounded by a
wall clock and killed in a ``finally`` (see :mod:`tests.process_faults`):

- a rank SIGKILLed mid-epoch: the survivors' next collective fails at once ("connection
  closed"), for a ``StreamLoader`` and a ``DataLoader`` with ``on_error="raise"`` (one status
  check per step); both exit. (With the default ``on_error`` a loader makes no collective per
  step: its ranks are aligned by construction, so a dead peer is the training step's concern);
- ``on_error="raise"`` on 4 ranks, one bad sample on rank 1: rank 1 raises its error, every
  other rank :class:`~meshfeed.errors.RankError` naming rank 1, all at step 0.

The fault matrix adds a stopped rank and a rank that never reaches its first batch.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.process_faults import assert_raise_on_every_rank, assert_survivors_stop


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["stream", "map-raise"])
def test_survivors_of_a_killed_rank_raise_and_exit(kind: str, tmp_path: Path) -> None:
    assert_survivors_stop(kind, "kill", tmp_path)


@pytest.mark.slow
def test_on_error_raise_stops_every_rank_at_the_same_step(tmp_path: Path) -> None:
    assert_raise_on_every_rank(tmp_path)
