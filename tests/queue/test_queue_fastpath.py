"""The store's fast paths give exactly what the general path gives, on the same stores.

``select_fast`` (a sequential batch chosen run by run) against the sampler's own ``select``;
and whole ``try_get`` sequences with the fast paths (run selection, dropping consumed samples
of a sole reader at once) against the same sequences with them switched off.
"""

from __future__ import annotations

import itertools
import random
from typing import Any

import numpy as np
import pytest

from meshfeed.queue.engine import core as core_module
from meshfeed.queue.engine.core import PartitionClosed, StoreCore, StoreOptions
from meshfeed.queue.engine.fastpath import select_fast, select_runs
from meshfeed.queue.engine.records import View
from meshfeed.queue.request import GetRequest, PutRequest
from meshfeed.queue.samplers import RankAwareSampler, SequentialSampler


def _put(core: StoreCore, partition: str, rows: dict, ids: Any, groups: Any) -> Any:
    return core.try_put(PutRequest(partition=partition, rows=rows, ids=ids, groups=groups))


SEQ = SequentialSampler()


def _ops(seed: int) -> list[tuple[str, Any]]:
    """A random mix of run puts (chunks, scalar lists), single puts, later fields and gets."""
    rng = random.Random(seed)
    ops: list[tuple[str, Any]] = []
    for _ in range(40):
        r = rng.random()
        if r < 0.35:
            n = rng.randint(1, 6)
            if rng.random() < 0.5:
                column: Any = np.arange(n * 2, dtype=np.int64).reshape(n, 2) + len(ops)
            else:
                column = [float(len(ops) + i) for i in range(n)]
            ops.append(("put", {"x": column, "y": list(range(n))}))
        elif r < 0.45:
            ops.append(("put_x", rng.randint(1, 3)))  # samples lacking y: not ready yet
        elif r < 0.55:
            ops.append(("add_y", None))
        else:
            ops.append(("get", rng.randint(1, 5)))
    ops.append(("close", None))
    ops.extend(("get", 3) for _ in range(12))
    return ops


def _play(core: StoreCore, ops: list[tuple[str, Any]]) -> list[Any]:
    out: list[Any] = []
    missing: list[int] = []
    for op, arg in ops:
        if op == "put":
            out.append(_put(core, "p", arg, None, None))
        elif op == "put_x":
            ids = _put(core, "p", {"x": [0.5] * arg}, None, None)
            assert ids is not None
            missing.extend(ids)  # type: ignore[arg-type]
            out.append(ids)
        elif op == "add_y" and missing:
            k = missing.pop(0)
            out.append(_put(core, "p", {"y": [k]}, [k], None))
        elif op == "close":
            core.close("p")
        elif op == "get":
            request = GetRequest(task="t", fields=("x", "y"), batch_size=arg, partition="p")
            try:
                got = core.try_get(request)
            except PartitionClosed:
                out.append("closed")
                continue
            out.append(None if got is None else (got[0], {f: _plain(c) for f, c in got[1].items()}))
    stats = core.stats()
    out.append((stats["held"], stats["consumed"], stats["produced"]))
    return out


def _plain(column: Any) -> Any:
    data = getattr(column, "data", column)
    if isinstance(data, np.ndarray):
        return data.tolist()
    return [np.asarray(v).tolist() for v in data]


@pytest.mark.parametrize("tasks", [None, ("t",)])
@pytest.mark.parametrize("seed", range(12))
def test_try_get_gives_the_same_batches_with_and_without_its_fast_paths(seed, tasks, monkeypatch):
    ops = _ops(seed)
    fast = _play(StoreCore(StoreOptions(tasks=tasks)), ops)
    monkeypatch.setattr(core_module, "select_fast", lambda *args: False)
    monkeypatch.setattr(StoreCore, "_sole_reader", lambda self, part, task: False)
    general = _play(StoreCore(StoreOptions(tasks=tasks)), ops)
    assert fast == general
    assert any(isinstance(o, tuple) and len(o) == 2 for o in fast)  # some batches were served


@pytest.mark.parametrize("seed", range(12))
def test_select_runs_chooses_what_the_sequential_sampler_chooses(seed):
    rng = random.Random(seed)
    core = StoreCore(StoreOptions())
    for _ in range(rng.randint(1, 6)):
        n = rng.randint(1, 5)
        ids = _put(core, "p", {"x": list(range(n))}, None, None)
        assert ids is not None
        if rng.random() < 0.3:
            _put(core, "p", {"y": [1]}, [ids[0]], None)
    if rng.random() < 0.5:
        core.close("p")
    part = core.partitions["p"]
    pending = part.task("t")
    fields = ("x",) if rng.random() < 0.5 else ("x", "y")
    for batch_size in range(1, 12):
        request = GetRequest(task="t", fields=fields, batch_size=batch_size, partition="p")
        fast = select_fast(part, pending, request, request.need)
        assert fast == select_runs(part, pending, request.need, batch_size)
        general = SEQ.select(View(part, pending, request.need), batch_size)
        if fast is not False:  # False: the fast path does not apply here
            assert fast == general, (batch_size, fields)


def test_select_fast_leaves_other_samplers_to_the_general_path():
    core = StoreCore(StoreOptions())
    _put(core, "p", {"x": [1, 2, 3]}, None, None)
    part = core.partitions["p"]
    request = GetRequest(
        task="t",
        fields=("x",),
        batch_size=2,
        partition="p",
        sampler=SequentialSampler(extra_fields=("x",)),
    )
    assert select_fast(part, part.task("t"), request, request.need) == [[0, 1]]

    class Custom(SequentialSampler):
        pass

    other = GetRequest(task="t", fields=("x",), batch_size=2, partition="p", sampler=Custom())
    assert select_fast(part, part.task("t"), other, other.need) is False


@pytest.mark.parametrize("seed", range(12))
def test_select_fast_plans_a_rank_aware_round_as_the_sampler_does(seed):
    """Over a sequential choice, a round of D data ranks is the first D * batch_size ready
    samples split by the sampler's rule, and a short last round of fewer than D samples is
    not handed out: the fast answer's parts equal ``RankAwareSampler.select``'s."""
    rng = random.Random(seed)
    core = StoreCore(StoreOptions())
    for _ in range(rng.randint(1, 6)):
        ids = _put(core, "p", {"x": list(range(rng.randint(1, 9)))}, None, None)
        if rng.random() < 0.3:
            _put(core, "p", {"y": [1]}, [ids[0]], None)
    if rng.random() < 0.5:
        core.close("p")
    part = core.partitions["p"]
    pending = part.task("t")
    served = 0
    for fields, ranks in itertools.product((("x",), ("x", "y")), (1, 2, 3, 5)):
        sampler = RankAwareSampler(data_rank=0, data_world_size=ranks)
        for batch_size in range(1, 6):
            request = GetRequest(
                task="t", fields=fields, batch_size=batch_size, partition="p", sampler=sampler
            )
            fast = select_fast(part, pending, request, request.need)
            general = sampler.select(View(part, pending, request.need), batch_size)
            if fast is False:  # a pending sample lacks a field: the general path decides
                continue
            assert (None if fast is None else list(fast)) == (
                None if general is None else list(general)
            ), (ranks, batch_size, fields)
            served += fast is not None
    assert served  # every sample has x: some rounds were planned the fast way
