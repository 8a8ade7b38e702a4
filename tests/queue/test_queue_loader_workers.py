"""StoreLoader worker processes never hang: a worker that ignores SIGTERM and stalls, a stopped
(SIGSTOP) worker and a worker killed mid-batch each end in a clear error within timeout + 1 s,
with no process left behind; iterating again restarts the workers and loses nothing; the
interpreter exits with such workers still running."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from pathlib import Path

import pytest

from meshfeed.queue import Batch, SampleStore, StoreLoader
from meshfeed.runtime import WorkerError
from tests.process_checks import alive, run_script_leaving_workers

TIMEOUT = 1.5


class _Misbehave:
    """A picklable collate_fn that misbehaves once (a marker file, shared by every worker)
    on the batch starting at sample ``at``: ``hang`` ignores SIGTERM and sleeps, ``kill``
    kills its own process; otherwise returns the batch's ids."""

    def __init__(self, directory: str, how: str, at: int) -> None:
        self.directory, self.how, self.at = directory, how, at

    def __call__(self, batch: Batch) -> list:
        marker = os.path.join(self.directory, f"{self.how}-done")
        if batch.ids[0] == self.at and self.how != "none" and not os.path.exists(marker):
            open(marker, "w").close()
            if self.how == "hang":
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
                while True:
                    time.sleep(1)
            os.kill(os.getpid(), signal.SIGKILL)
        return list(batch.ids)


def _loader(tmp_path: Path, how: str) -> StoreLoader:
    store = SampleStore(tasks=["t"])  # evicts consumed samples: a lost batch cannot come back
    store.put("p", {"x": list(range(24))})
    store.close("p")
    return StoreLoader(
        store,
        task="t",
        fields=["x"],
        batch_size=3,
        partition="p",
        mesh={"dp": 1},
        rank=0,
        num_workers=2,
        prefetch=2,
        timeout=TIMEOUT,
        collate_fn=_Misbehave(str(tmp_path), how, at=6),  # batch 2
    )


@pytest.mark.slow
@pytest.mark.parametrize("case", ["ignores_sigterm", "sigstop", "sigkill"])
def test_stuck_stopped_or_killed_store_worker_fails_within_timeout_plus_one_second(tmp_path, case):
    how = {"ignores_sigterm": "hang", "sigstop": "none", "sigkill": "kill"}[case]
    loader = _loader(tmp_path, how)
    out = [next(loader), next(loader)]  # batches 0 and 1: both workers up
    assert out == [[0, 1, 2], [3, 4, 5]]
    pids = list(loader.service.pids)  # type: ignore[union-attr]
    assert len(pids) == 2
    if case == "sigstop":
        os.kill(pids[0], signal.SIGSTOP)
    match = (
        "exited unexpectedly with exit code -9"
        if case == "sigkill"
        else "within timeout="  # the store's own timeout plus a margin: its error comes first
    )
    with pytest.raises(WorkerError, match=match) as info:
        while True:  # the stopped worker may have made its next batch already
            start = time.monotonic()
            out.append(next(loader))
    assert time.monotonic() - start < TIMEOUT + 1.0
    message = str(info.value)  # names the batch, and what happens next
    assert f"step {len(out)}" in message and "continues from the first batch" in message
    assert len(out) == 2 or case == "sigstop"
    assert multiprocessing.active_children() == []
    assert not any(alive(p) for p in pids)
    # Iterating again starts fresh workers and continues from the loader's state.
    out += list(loader)
    assert [k for ids in out for k in ids] == list(range(24))  # exactly once, in order
    assert loader.store.stats()["held"] == 0
    loader.shutdown()
    assert multiprocessing.active_children() == []


@pytest.mark.slow
def test_a_checkpoint_after_a_worker_died_names_the_batches_still_to_deliver(tmp_path):
    loader = _loader(tmp_path, "kill")
    assert [next(loader), next(loader)] == [[0, 1, 2], [3, 4, 5]]
    with pytest.raises(WorkerError, match="exit code -9"):
        next(loader)
    # fresh workers fetch again; the state names the first batch not returned and how far the
    # loader lets its requests go: 2 workers x prefetch 2, and the batch being returned
    state = loader.state_dict()
    assert (state["next"], state["requested"]) == (2, 2 + 5)
    assert [k for ids in loader for k in ids] == list(range(6, 24))
    loader.shutdown()
    assert multiprocessing.active_children() == []


_EXIT_SCRIPT = """
import signal, sys, time
from meshfeed.queue import SampleStore, StoreLoader

def hang(batch):
    if batch.ids[0] > 0:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        while True:
            time.sleep(1)
    return list(batch.ids)

if __name__ == "__main__":
    store = SampleStore()
    store.put("p", {"x": list(range(10))})
    loader = StoreLoader(store, task="t", fields=["x"], partition="p", batch_size=1,
                         mesh={"dp": 1}, rank=0, num_workers=2, prefetch=3, timeout=60,
                         collate_fn=hang)
    assert next(loader) == [0]
    time.sleep(0.5)  # the workers now hang on batches 1 and 2, ignoring SIGTERM
    print(" ".join(map(str, loader.service.pids)), flush=True)
    # no shutdown(): the interpreter must still exit
"""


@pytest.mark.slow
def test_interpreter_exits_with_store_workers_that_ignore_sigterm(tmp_path):
    run_script_leaving_workers(_EXIT_SCRIPT, tmp_path, timeout=60)


def _ids(batch: Batch) -> list:
    return list(batch.ids)


@pytest.mark.ray
@pytest.mark.slow
def test_state_dict_with_ray_workers_keeps_its_own_bound_under_an_unlimited_timeout(ray_session):
    import math
    import uuid

    store = SampleStore("ray", name=f"loader-{uuid.uuid4().hex[:8]}")
    try:
        store.put("p", {"x": [0]})
        loader = StoreLoader(
            store,
            task="t",
            fields=["x"],
            batch_size=1,
            partition="p",
            mesh={"dp": 1},
            rank=0,
            num_workers=1,
            prefetch=3,
            timeout=math.inf,
            collate_fn=_ids,
        )
        assert next(loader) == [0]  # batches 1 and 2 wait in the worker for producers
        start = time.monotonic()
        state = loader.state_dict()  # at once: it names indices, not the batches' samples
        assert time.monotonic() - start < 1.0
        assert (state["next"], state["requested"]) == (1, 4)  # 1 worker x 3, and batch 0
        store.put("p", {"x": [1, 2, 3]})
        store.close("p")
        assert list(loader) == [[1], [2], [3]]
        loader.shutdown()
    finally:
        store.shutdown()
    assert multiprocessing.active_children() == []
