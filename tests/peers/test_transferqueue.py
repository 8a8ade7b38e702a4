"""TransferQueue parity: its own sampler code and meshfeed's store on the same scenarios.

Runs TransferQueue's ``RankAwareSampler`` and ``GRPOGroupNSampler`` (the installed package's
source files; its controller, Ray and ZMQ are not needed for them) against
``SampleStore.get`` with meshfeed's samplers. Skipped when TransferQueue is not installed
(``pip install transferqueue``).
"""

from __future__ import annotations

import importlib.util
import os
import random
import sys
import types
from collections.abc import Iterator
from typing import Any

import pytest

from meshfeed.queue import GroupSampler, RankAwareSampler, SampleStore


@pytest.fixture(scope="module")
def tq() -> Iterator[types.ModuleType]:
    """TransferQueue's ``transfer_queue.sampler`` package, loaded from its own files."""
    spec = importlib.util.find_spec("transfer_queue")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("TransferQueue is not installed (pip install transferqueue)")
    root = next(iter(spec.submodule_search_locations))
    folder = os.path.join(root, "sampler")
    saved = {k: v for k, v in sys.modules.items() if k.startswith("transfer_queue")}
    # Stub parent packages so its sampler modules load without its controller's dependencies.
    top = types.ModuleType("transfer_queue")
    top.__path__ = [root]
    pkg = types.ModuleType("transfer_queue.sampler")
    pkg.__path__ = [folder]
    sys.modules["transfer_queue"], sys.modules["transfer_queue.sampler"] = top, pkg
    try:
        for name in ("base", "rank_aware_sampler", "grpo_group_n_sampler"):
            full = f"transfer_queue.sampler.{name}"
            mspec = importlib.util.spec_from_file_location(full, os.path.join(folder, f"{name}.py"))
            assert mspec is not None and mspec.loader is not None
            module = importlib.util.module_from_spec(mspec)
            sys.modules[full] = module
            mspec.loader.exec_module(module)
            if name == "base":
                pkg.BaseSampler = module.BaseSampler  # type: ignore[attr-defined]
        pkg.RankAwareSampler = sys.modules[  # type: ignore[attr-defined]
            "transfer_queue.sampler.rank_aware_sampler"
        ].RankAwareSampler
        pkg.GRPOGroupNSampler = sys.modules[  # type: ignore[attr-defined]
            "transfer_queue.sampler.grpo_group_n_sampler"
        ].GRPOGroupNSampler
        yield pkg
    finally:
        for k in [k for k in sys.modules if k.startswith("transfer_queue")]:
            del sys.modules[k]
        sys.modules.update(saved)


def _tq_sample(sampler: Any, ready: list[int], batch_size: int, **kw: Any) -> list[int]:
    sampled, consumed = sampler.sample(ready, batch_size, **kw)
    assert sampled == consumed  # both samplers consume what they hand out
    return list(sampled)


@pytest.mark.parametrize("seed", range(4))
def test_rank_aware_retries_return_the_same_batch_in_both(tq, seed):
    rng = random.Random(seed)
    n, batch, dp = 100, 4, 3
    theirs = tq.RankAwareSampler()
    consumed: set[int] = set()
    store = SampleStore()
    store.put("p", {"x": list(range(n))})
    ours = {d: RankAwareSampler(data_rank=d) for d in range(dp)}
    index = dict.fromkeys(range(dp), 0)
    for _ in range(30):
        d = rng.randrange(dp)
        retry = index[d] > 0 and rng.random() < 0.4  # ask again for the last batch index
        i = index[d] - 1 if retry else index[d]
        ready = [k for k in range(n) if k not in consumed]
        kw = dict(dp_rank=d, batch_index=i, task_name="t", partition_id="p")
        expect = _tq_sample(theirs, ready, batch, **kw)
        if not expect:  # too few ready: TransferQueue returns nothing, meshfeed keeps waiting
            with pytest.raises(TimeoutError):
                store.get("t", ["x"], batch, "p", sampler=ours[d], timeout=0, batch_index=i)
            break
        consumed.update(expect)
        got = store.get("t", ["x"], batch, "p", sampler=ours[d], timeout=1, batch_index=i).ids
        assert got == expect, (d, i, retry)
        if not retry:
            index[d] += 1
    assert store.stats()["consumed"]["t"] == len(consumed)


@pytest.mark.parametrize("seed", range(6))
def test_consecutive_id_groups_match_grpo_group_n_sampler(tq, seed):
    rng = random.Random(seed)
    n_per, batch = 3, 6
    ready = sorted(rng.sample(range(36), 26))
    theirs = tq.GRPOGroupNSampler(n_samples_per_prompt=n_per)
    store = SampleStore()
    store.put("p", {"x": ready}, ids=ready)
    ours = GroupSampler(group_size=n_per, consecutive_ids=True)
    left = list(ready)
    for step in range(6):
        expect = _tq_sample(theirs, left, batch, task_name="t", partition_id="p", batch_index=step)
        if not expect:
            with pytest.raises(TimeoutError):  # TransferQueue: empty; meshfeed: keeps waiting
                store.get("t", ["x"], batch, "p", sampler=ours, timeout=0)
            break
        assert store.get("t", ["x"], batch, "p", sampler=ours, timeout=1).ids == expect
        left = [k for k in left if k not in expect]


def test_explicit_groups_give_the_batches_of_aligned_consecutive_ids(tq):
    n_per, batch = 4, 8
    ready = [k for k in range(40) if k // n_per not in (2, 5)] + [9, 21]  # groups 2, 5 partial
    ready.sort()
    theirs = tq.GRPOGroupNSampler(n_samples_per_prompt=n_per)
    store = SampleStore()
    store.put("p", {"x": ready}, ids=ready, groups=[k // n_per for k in ready])
    ours = GroupSampler(group_size=n_per)
    left = list(ready)
    for step in range(3):
        expect = _tq_sample(theirs, left, batch, task_name="t", partition_id="p", batch_index=step)
        assert store.get("t", ["x"], batch, "p", sampler=ours, timeout=1).ids == expect
        left = [k for k in left if k not in expect]
