"""Request tokens: what the store keeps of them stays bounded, and a cancelled one is refused.

Every ``StoreLoader`` walk makes its requests with one token and cancels it as it ends. The
store issues these tokens (``SampleStore.new_token``) and keeps only those not yet cancelled,
so a run that builds a loader per step (the README's RL loop), or a loader whose walks keep
ending early, leaves nothing behind per walk (it left the cancelled token, about 100 bytes, for
as long as the store lived). A request made with a cancelled token, however late (a worker's
task of an ended walk), is still refused and consumes nothing, on both backends. A token of
the caller's own is remembered once cancelled, as before.
"""

from __future__ import annotations

import functools
import gc
import operator
import os
import threading
import time
import tracemalloc
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from meshfeed.queue import CollateError, SampleStore, StoreLoader
from meshfeed.queue.engine.wakeups import RequestCancelled
from meshfeed.queue.loading.reach import LocalDoor
from meshfeed.queue.samplers import RankAwareSampler
from meshfeed.testing import _inspect


def _kept(store: SampleStore) -> int:
    """How many tokens the store keeps (every set of tokens of its waiters' registry)."""
    if store.backend == "ray":
        waiters = _inspect(store, operator.attrgetter("waiters"))
    else:
        waiters = store._backend.waiters
    return sum(len(v) for v in vars(waiters).values() if isinstance(v, set))


def _step(store: SampleStore, i: int, **kw: Any) -> None:
    """One RL step: a partition put, closed, read by a new loader, cleared."""
    part = f"step-{i}"
    store.put(part, {"x": torch.zeros(8, 2)}, ids=[f"{i}/{k}" for k in range(8)])
    store.close(part)
    with StoreLoader(
        store, task="actor", fields=["x"], partition=part, batch_size=4, mesh={"dp": 1},
        rank=0, **kw,
    ) as loader:  # fmt: skip
        assert sum(len(b["x"]) for b in loader) == 8
    store.clear(part)


@pytest.mark.parametrize(
    ("kw", "steps"),
    [
        pytest.param({"prefetch": 1}, 500, id="in-process"),
        pytest.param({"prefetch": 2}, 500, id="fetch-thread"),
        pytest.param({"prefetch": 1, "device": "cpu"}, 200, id="delivery-thread"),
        pytest.param({"num_workers": 2}, 20, id="workers"),
    ],
)
def test_a_loader_per_step_leaves_no_token_in_the_store(kw, steps):
    store = SampleStore(tasks=["actor"])
    for i in range(steps):
        _step(store, i, **kw)
    assert _kept(store) == 0  # was one cancelled token per step


def test_bytes_per_walk_stay_flat_over_500_walks():
    store = SampleStore(tasks=["actor"])
    for i in range(10):
        _step(store, i)
    gc.collect()
    tracemalloc.start()
    try:
        m0 = tracemalloc.get_traced_memory()[0]
        for i in range(10, 510):
            _step(store, i)
        gc.collect()
        m1 = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert (m1 - m0) / 500 < 50, (m1 - m0) / 500  # was ~120 bytes per walk


def _collate_once(flag: str, batch: Any) -> torch.Tensor:
    """Fails until the file ``flag`` exists (seen by worker processes too)."""
    if not os.path.exists(flag):
        raise ValueError("collate_fn not ready")
    return torch.as_tensor(batch["x"]).view(-1)


@pytest.mark.parametrize(
    ("kw", "walks"),
    [
        pytest.param({"prefetch": 1}, 500, id="in-process"),
        pytest.param({"prefetch": 2}, 100, id="fetch-thread"),
        pytest.param({"num_workers": 2}, 25, id="workers"),
    ],
)
def test_walks_that_end_early_leave_no_token_and_lose_no_sample(kw, walks, tmp_path: Path):
    """Each ``next()`` raises ``CollateError``: a new walk each time, whose requests ahead
    (a fetch thread's, the workers' tasks drained by the next walk) come after its token was
    cancelled. The store keeps no token, and every sample is returned once in the end."""
    flag = str(tmp_path / "ready")
    store = SampleStore()
    store.put("p", {"x": [torch.tensor([i]) for i in range(20)]})
    loader = StoreLoader(
        store, task="t", fields=["x"], partition="p", batch_size=2, mesh={"dp": 1}, rank=0,
        collate_fn=functools.partial(_collate_once, flag), collate_retries=0, timeout=30, **kw,
    )  # fmt: skip
    with loader:
        for _ in range(walks):
            with pytest.raises(CollateError):
                next(loader)
        assert _kept(store) == 0  # was one cancelled token per walk
        Path(flag).touch()
        store.put("p", {"x": [torch.tensor([i]) for i in range(20, 24)]})
        store.close("p")
        got = sorted(x for batch in loader for x in batch.tolist())
    assert got == list(range(24))
    assert _kept(store) == 0


def test_a_loader_per_step_leaves_no_token_on_either_backend(make_store):
    store = make_store(tasks=["actor"])
    before = _kept(store)  # a Ray test's actor is the session's: what other tests left
    for i in range(20):
        _step(store, i)
    assert _kept(store) == before


def test_a_request_with_a_cancelled_token_is_refused_however_late(make_store):
    """Data is ready for it, yet a request with a cancelled token, issued or the caller's
    own, is refused and consumes nothing; an issued one is not kept once cancelled."""
    store = make_store()
    store.put("p", {"x": list(range(6))})
    before = _kept(store)
    token = store.new_token()
    assert _kept(store) == before + 1  # issued, not yet cancelled
    assert store.get("t", ["x"], 2, "p", token=token).ids == [0, 1]
    store.cancel(token)
    assert _kept(store) == before  # nothing kept of it
    with pytest.raises(RequestCancelled):
        store.get("t", ["x"], 2, "p", token=token)
    store.cancel(token)  # again: still nothing kept, still refused
    with pytest.raises(RequestCancelled):
        store.get("t", ["x"], 2, "p", token=token, timeout=0)
    assert _kept(store) == before
    # A token another store issued was never issued here: refused.
    with pytest.raises(RequestCancelled):
        store.get("t", ["x"], 2, "p", token=SampleStore().new_token())
    assert store.stats()["consumed"] == {"t": 2}
    assert store.get("t", ["x"], 4, "p").ids == [2, 3, 4, 5]  # none lost


def test_a_cancelled_token_of_the_callers_own_is_remembered_and_refused(make_store):
    """As before ``new_token``: a token of the caller's own, cancelled, is refused for as
    long as the store lives, also where data is ready (the Ray store served it then)."""
    store = make_store()
    store.put("p", {"x": list(range(4))})
    before, mine = _kept(store), f"mine-{uuid.uuid4().hex}"  # Ray: the session's actor
    assert store.get("t", ["x"], 2, "p", token=mine).ids == [0, 1]
    store.cancel(mine)
    with pytest.raises(RequestCancelled):
        store.get("t", ["x"], 2, "p", token=mine)
    assert _kept(store) == before + 1
    assert store.stats()["consumed"] == {"t": 2}


@pytest.mark.parametrize("kind", ["issued", "callers"])
def test_cancel_wakes_a_request_waiting_without_a_deadline(make_store, kind):
    """Whatever the token (issued by the store, or a caller's own), ``cancel`` wakes the
    request waiting with it, which raises having consumed nothing."""
    store = make_store()
    token = store.new_token() if kind == "issued" else f"loader-{uuid.uuid4().hex}"
    errors: list[BaseException] = []

    def consume() -> None:
        try:
            store.get("t", ["x"], 1, "p", token=token)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=consume, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while store.stats()["waiting_consumers"] < 1:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    store.cancel(token)
    thread.join(30)
    assert not thread.is_alive() and isinstance(errors[0], RequestCancelled)
    assert store.stats()["waiting_consumers"] == 0
    store.put("p", {"x": [1]})
    assert store.stats()["consumed"] == {}


def test_a_late_request_of_an_ended_walk_through_the_door_consumes_nothing():
    """A worker's request of a walk that ended (its token cancelled, the store keeping
    nothing of it) reaches the store after a new walk opened, with data ready: refused."""
    store = SampleStore()
    store.put("p", {"x": list(range(4))})
    door = LocalDoor(store)
    try:
        old, new = store.new_token(), store.new_token()
        door.open(old, 0)
        store.cancel(old)
        door.open(new, 0)
        reach = door.reach.connect()
        with pytest.raises(RequestCancelled):
            reach.get(
                "t", ["x"], 2, "p", RankAwareSampler(data_rank=0), timeout=5, token=old,
                batch_index=0,
            )  # fmt: skip
        assert store.stats()["consumed"] == {}
        got = reach.get(
            "t", ["x"], 2, "p", RankAwareSampler(data_rank=0), timeout=5, token=new,
            batch_index=0,
        )  # fmt: skip
        assert got.ids == [0, 1]
        store.cancel(new)
        assert _kept(store) == 0
    finally:
        door.close()
