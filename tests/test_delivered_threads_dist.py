"""Two threads of one rank, each making meshfeed collectives: ``Delivered(BalancedBatches)``
runs ahead on its delivery thread while the loop's thread iterates another loader (an eval
loader between training steps). On one group, the two threads' collectives would pair with
their peer's in whatever order each rank's threads reach them: mismatched sizes, a hang, or
one loader's agreement read as the other's. A delivery thread's collectives run on groups of
their own (:func:`meshfeed.dist.control_group`)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as tdist

from meshfeed import DataLoader, dist
from meshfeed.balance import BalancedBatches, CostModel
from meshfeed.balance._group import own_group
from meshfeed.balance.routing import route_local
from meshfeed.delivered import Delivered
from meshfeed.delivery import _Copier, to_device
from meshfeed.testing import assert_same
from tests.balance.checks import Samples, make_sample
from tests.dist_utils import run_distributed

STEPS = 6
S2 = CostModel(quadratic=1.0)


def _train_and_eval(rank: int, world: int) -> dict[str, list]:
    inner = BalancedBatches(
        Samples(rank, seed=9, batches=STEPS, max_len=450, docs=8),
        max_tokens=256, cost=S2, timeout=30,
    )  # fmt: skip
    train, evals = [], []
    with Delivered(inner, device="cpu", device_prefetch=2, timeout=30) as it:
        for n, step in enumerate(it):
            train.append(to_device(step, torch.device("cpu")))
            if n % 2 == 0:  # the delivery thread is making the next steps meanwhile
                ev = DataLoader(np.arange(40), batch_size=4, seed=n, timeout=30)
                evals.append([b.tolist() for b in ev])
    inner.close()
    return {"train": train, "evals": evals}


def test_a_delivered_iterator_and_a_loop_loader_on_two_gloo_ranks_keep_their_collectives_apart():
    started = time.monotonic()
    results = run_distributed(_train_and_eval, 2, timeout=120)
    assert time.monotonic() - started < 60  # no collective waited out its timeout
    for n, (a, b) in enumerate(zip(results[0]["evals"], results[1]["evals"], strict=True)):
        seen = sorted(v for batch in a + b for v in batch)
        assert seen == list(range(40)), f"eval {n}: each sample once over both ranks"
    want: list[list] = [[], []]
    for b in range(STEPS):
        samples = [make_sample(r, b, seed=9, max_len=450, docs=8) for r in range(2)]
        _, outputs = route_local(samples, max_tokens=256, cost=S2, cp_sizes="any")
        for r in range(2):
            want[r] += outputs[r]
    for r in range(2):
        assert_same(results[r]["train"], want[r], f"rank {r}")


def _gather_items(rank: int) -> Iterator[list]:
    for i in range(3):
        yield dist.all_gather_objects((rank, i), timeout=20)


def _after_a_subgroup_of_some_ranks(rank: int, world: int) -> list:
    tdist.new_group([0, 1], backend="gloo")  # every rank makes it; rank 2 is no member
    with Delivered(_gather_items(rank), device="cpu", timeout=30) as it:
        return list(it)


def test_a_delivery_threads_group_is_made_where_ranks_hold_different_numbers_of_groups():
    results = run_distributed(_after_a_subgroup_of_some_ranks, 3, timeout=120)
    want = [[(r, i) for r in range(3)] for i in range(3)]
    assert results == [want] * 3


class _Gathered:
    """Item ``i``: every rank's ``(walk, i)``, gathered on the thread that iterates it."""

    def __init__(self) -> None:
        self.i, self.walks = 0, 0

    def __iter__(self) -> Iterator[list]:
        self.walks += 1
        walk = self.walks
        while self.i < 6:
            got = dist.all_gather_objects((walk, self.i), timeout=3)
            self.i += 1
            yield got

    def state_dict(self) -> dict[str, int]:
        return {"i": self.i}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.i = state["i"]


def _walk_abandoned_with_threads_apart(rank: int, world: int) -> list:
    prepare = _Copier.prepare
    made = {"n": 0}

    def held(self: _Copier, batch: Any) -> Any:
        made["n"] += 1
        if rank == 1 and made["n"] == 2:
            time.sleep(3.0)  # rank 1's thread stops after this item; rank 0's gathers item 2
        return prepare(self, batch)

    _Copier.prepare = held  # type: ignore[method-assign]
    inner = _Gathered()
    it = Delivered(inner, device="cpu", device_prefetch=3, timeout=30)
    first = [next(it)]
    state = it.state_dict()
    # Rank 0's thread waits in item 2's gather, which rank 1's never joins (until its 3 s
    # timeout); rank 1 starts its next walk about then, well inside each other's 3 s setup.
    time.sleep(0.5 if rank == 0 else 2.0)
    it.load_state_dict(state)  # abandons the walk: rank 0's thread is one collective ahead
    rest = list(it)
    it.shutdown()
    return first + rest


def test_a_walk_abandoned_with_the_ranks_threads_apart_leaves_nothing_for_the_next():
    results = run_distributed(_walk_abandoned_with_threads_apart, 2, timeout=120)
    assert results[0] == results[1]
    assert results[0] == [[(1, 0), (1, 0)]] + [[(2, i), (2, i)] for i in range(1, 6)]


class _SubgroupGathered(_Gathered):
    """Gathers on meshfeed's own group over ``ranks`` (as a DP x CP BalancedBatches under TP)."""

    def __init__(self, ranks: list[int]) -> None:
        super().__init__()
        self.group = tdist.new_group(ranks, backend="gloo")  # every rank makes it

    def __iter__(self) -> Iterator[list]:
        self.walks += 1
        walk = self.walks
        while self.i < 3:
            group = own_group(self.group, 20.0)
            got = dist.all_gather_objects((walk, self.i), timeout=20, group=group)
            self.i += 1
            yield got


def _subgroup_walks(rank: int, world: int) -> list:
    inner = _SubgroupGathered([0, 1])
    if rank == 2:  # no member: it makes the group (as torch requires) and nothing else
        return []
    it = Delivered(inner, device="cpu", timeout=30)
    out = []
    for _ in range(3):
        if rank == 1:
            time.sleep(2.0)  # the ranks start each walk apart (their groups made apart)
        out.append(list(it))
        it.load_state_dict({"i": 0})
    it.shutdown()
    return out


def test_a_subgroups_delivery_thread_groups_serve_walk_after_walk():
    results = run_distributed(_subgroup_walks, 3, timeout=180)
    want = [[[(w, i), (w, i)] for i in range(3)] for w in (1, 2, 3)]
    assert results == [want, want, []]


class _WorldAndSubgroup:
    """Item ``i``: every rank's ``(walk, i)`` gathered over every rank, and on ranks 0 and 1
    also over their subgroup (as a BalancedBatches over DP x CP under TP whose inner loader
    agrees over every rank)."""

    def __init__(self, sub: Any, n: int) -> None:
        self.sub, self.n, self.walks = sub, n, 0

    def __iter__(self) -> Iterator[tuple]:
        self.walks += 1
        walk, rank = self.walks, tdist.get_rank()
        for i in range(self.n):
            every = dist.all_gather_objects((walk, i), timeout=20)
            some = None
            if rank in (0, 1):
                group = own_group(self.sub, 20.0)
                some = dist.all_gather_objects((walk, i), timeout=20, group=group)
            yield every, some


def _train_and_evals_over_a_subgroup(rank: int, world: int) -> list:
    sub = tdist.new_group([0, 1], backend="gloo")  # every rank makes it; rank 2 is no member
    train = Delivered(_WorldAndSubgroup(sub, 4), device="cpu", device_prefetch=1, timeout=30)
    it = iter(train)
    out = [next(it)]
    evals = Delivered(_WorldAndSubgroup(sub, 2), device="cpu", timeout=30)
    out.append(list(evals))  # while train's thread waits, an eval walk, then the next one
    out.append(list(evals))
    out += list(it)
    out += list(it)  # a second train walk
    train.shutdown()
    evals.shutdown()
    return out


def test_train_and_eval_walks_over_every_rank_and_a_subgroup_take_groups_of_their_own():
    # Groups are never destroyed (torch names one from a count of groups; a destroyed one gave
    # its name to the next, which met its stale rendezvous or was refused as a duplicate).
    results = run_distributed(_train_and_evals_over_a_subgroup, 3, timeout=180)

    def item(rank: int, walk: int, i: int) -> tuple:
        return [(walk, i)] * 3, ([(walk, i)] * 2 if rank < 2 else None)

    for r, got in enumerate(results):
        evals = [[item(r, w, i) for i in range(2)] for w in (1, 2)]
        want = [item(r, 1, 0), *evals] + [item(r, 1, i) for i in (1, 2, 3)]
        assert got == want + [item(r, 2, i) for i in range(4)], f"rank {r}"
