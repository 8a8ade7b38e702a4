"""meshfeed.launch.run_distributed: the rank that failed first is the one reported."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.distributed as dist
from torch.multiprocessing.spawn import ProcessRaisedException

from tests.dist_utils import run_distributed


def _raise_on_1(rank: int, world: int) -> int:
    if rank == 1:
        raise RuntimeError("boom on rank 1")
    t = torch.zeros(1)
    dist.all_reduce(t)  # the others wait for rank 1 in a collective, and fail with it
    return rank


def test_the_rank_that_raised_first_is_reported_with_its_own_error():
    # Its peers, left in a group torn down under them, used to exit first: the caller got
    # their "Connection reset by peer" and never saw "boom".
    with pytest.raises(ProcessRaisedException, match=r"rank 1 of 3 raised first") as info:
        run_distributed(_raise_on_1, 3, timeout=120)
    assert "RuntimeError: boom on rank 1" in str(info.value)


def _exit_on_1(rank: int, world: int) -> int:
    if rank == 1:
        sys.exit(0)
    return rank


def test_a_rank_that_exits_without_a_result_is_named():
    # It was a FileNotFoundError for the missing result file.
    with pytest.raises(RuntimeError, match=r"rank\(s\) \[1\] of 2 exited .* without returning"):
        run_distributed(_exit_on_1, 2, timeout=120)


@pytest.mark.parametrize("world", [0, True, 2.0])
def test_a_world_that_is_not_a_positive_int_is_refused(world):
    with pytest.raises(ValueError, match=r"world must be a positive number of processes"):
        run_distributed(_exit_on_1, world)
