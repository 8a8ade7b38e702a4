"""Store safety: checkpoints never run code from the file, atomic saves clean up after killed
ones, bad timeouts and samplers are refused by name, late consumers see the end."""

from __future__ import annotations

import math
import os
import pickle
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

from meshfeed.queue import PartitionClosed, RequestCancelled, SampleStore, StoreLoader
from meshfeed.queue.checkpoints import state as ckpt


class _Payload:
    """Unpickling this creates a file: proof that a load ran code from the file."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_crafted_pickle_does_not_run_on_load(tmp_path):
    marker = tmp_path / "pwned"
    bad = tmp_path / "store.ckpt"
    torch.save({"meta": _Payload(str(marker)), "payload": []}, bad)
    for allow in (False, True):
        with pytest.raises(ValueError, match="not a SampleStore checkpoint this meshfeed can read"):
            SampleStore.load(bad, allow_pickle=allow)
        assert not marker.exists()
    with open(bad, "wb") as f:  # a bare pickle, not even a torch file
        pickle.dump(_Payload(str(marker)), f)
    with pytest.raises(ValueError, match="can read safely"):
        SampleStore.load(bad)
    assert not marker.exists()


def test_tensors_arrays_and_json_values_round_trip_exactly(tmp_path):
    store = SampleStore()
    values = {
        "t": torch.arange(6, dtype=torch.int16).reshape(3, 2),
        "a": np.arange(3, dtype=np.uint32),
        "j": [{"k": [1, 2.5, None]}, "text", True],
    }
    store.put("p", {"t": values["t"], "a": [values["a"]] * 3, "j": values["j"]})
    store.save(tmp_path / "s")
    batch = SampleStore.load(tmp_path / "s").get("x", ["t", "a", "j"], 3, "p", timeout=1)
    assert torch.equal(batch["t"], values["t"])
    assert batch["a"].dtype == np.uint32 and (batch["a"] == values["a"]).all()
    assert batch["j"] == values["j"]


def test_values_that_are_neither_tensor_nor_json_are_refused_at_save_naming_the_field(tmp_path):
    store = SampleStore()
    store.put("p", {"ok": [1, 2], "pair": [(1, 2), (3, 4)]}, ids=["a", "b"])
    with pytest.raises(ValueError, match=r"field 'pair' of sample 'a' of 'p' is a tuple"):
        store.save(tmp_path / "s")
    assert not os.listdir(tmp_path)  # nothing written, no temp file left
    store.save(tmp_path / "s", allow_pickle=True)  # the explicit opt-in
    with pytest.raises(ValueError, match="holds pickled values .* allow_pickle=True"):
        SampleStore.load(tmp_path / "s")
    restored = SampleStore.load(tmp_path / "s", allow_pickle=True)
    assert restored.get("t", ["pair"], 2, "p", timeout=1)["pair"] == [(1, 2), (3, 4)]
    with pytest.raises(TypeError, match="allow_pickle must be True or False"):
        store.save(tmp_path / "s", allow_pickle="yes")


def test_a_save_removes_temp_files_of_killed_saves_and_keeps_live_ones(tmp_path):
    host = socket.gethostname().replace("-", "_")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    dead_pid = int(dead.stdout)
    killed = tmp_path / f".samplestore-{host}-{dead_pid}-abc.tmp"
    live = tmp_path / f".samplestore-{host}-{os.getpid()}-def.tmp"  # a save in progress
    foreign_old = tmp_path / ".samplestore-otherhost-1-ghi.tmp"
    foreign_new = tmp_path / ".samplestore-otherhost-2-jkl.tmp"
    for f in (killed, live, foreign_old, foreign_new):
        f.write_bytes(b"half")
    day_ago = time.time() - ckpt.STALE_SECONDS - 60
    os.utime(foreign_old, (day_ago, day_ago))
    store = SampleStore()
    store.put("p", {"x": [1]})
    store.save(tmp_path / "s")
    assert sorted(os.listdir(tmp_path)) == sorted(["s", live.name, foreign_new.name])


def test_a_killed_save_leaves_its_temp_file_and_the_next_save_removes_it(tmp_path):
    target = str(tmp_path / "s")
    script = (
        "import os, torch\n"
        "from meshfeed.queue import SampleStore\n"
        "def stop(*a, **k): os._exit(9)\n"  # dies in the middle of writing
        "torch.save = stop\n"
        f"s = SampleStore(); s.put('p', {{'x': [1]}}); s.save({target!r})\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    assert subprocess.run([sys.executable, "-c", script], env=env, timeout=120).returncode == 9
    left = [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]
    assert len(left) == 1
    store = SampleStore()
    store.put("p", {"x": [1]})
    store.save(tmp_path / "s")
    assert os.listdir(tmp_path) == ["s"]


@pytest.mark.parametrize("timeout", [math.nan, -1.0])
def test_get_and_put_refuse_nan_and_negative_timeouts_by_name(timeout):
    store = SampleStore()
    with pytest.raises(ValueError, match=r"timeout=(nan|-1\.0)"):
        store.get("t", ["x"], 1, "p", timeout=timeout)
    with pytest.raises(ValueError, match=r"timeout=(nan|-1\.0)"):
        store.put("p", {"x": [1]}, timeout=timeout)


@pytest.mark.parametrize("timeout", [math.inf, 1e10, 1e300])
def test_infinite_and_huge_timeouts_wait_and_are_served(timeout):
    store = SampleStore()
    out: list = []
    thread = threading.Thread(
        target=lambda: out.append(store.get("t", ["x"], 1, "p", timeout=timeout).ids)
    )
    thread.start()
    time.sleep(0.05)
    store.put("p", {"x": [1]})
    thread.join(10)
    assert out == [[0]]


def test_a_sampler_that_is_not_one_is_a_type_error_naming_it():
    store = SampleStore()
    store.put("p", {"x": [1]})
    with pytest.raises(TypeError, match="sampler=5"):
        store.get("t", ["x"], 1, "p", sampler=5, timeout=1)


def test_a_consumer_arriving_after_the_partition_was_drained_gets_partition_closed():
    store = SampleStore(tasks=["t"])
    store.put("p", {"x": [1, 2]})
    store.close("p")
    assert store.get("t", ["x"], 2, "p", timeout=1).ids == [0, 1]  # drained and evicted
    with pytest.raises(PartitionClosed):
        store.get("t", ["x"], 2, "p", timeout=1)
    empty = SampleStore()
    empty.close("q")  # closed before anything was put: the stream is empty
    with pytest.raises(PartitionClosed, match=r"field\(s\) \['x'\]"):
        empty.get("t", ["x"], 1, "q", timeout=1)


def test_store_loader_shutdown_wakes_its_requests_blocked_without_a_deadline():
    store = SampleStore()
    loader = StoreLoader(store, task="t", fields=["x"], partition="p", batch_size=1,
                         mesh={"dp": 1}, rank=0, prefetch=3, timeout=math.inf)  # fmt: skip
    raised: list[BaseException] = []

    def read() -> None:
        try:
            next(loader)
        except BaseException as exc:
            raised.append(exc)

    reader = threading.Thread(target=read)
    with loader:
        # The loader's fetch thread waits in the store without a deadline (index order: one
        # request at a time), while another thread waits in next().
        reader.start()
        deadline = time.monotonic() + 10
        while store.stats()["waiting_consumers"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    reader.join(10)
    assert not reader.is_alive(), "shutdown() left next() waiting"
    assert len(raised) == 1 and isinstance(raised[0], RequestCancelled), raised
    deadline = time.monotonic() + 10
    while store.stats()["waiting_consumers"]:
        assert time.monotonic() < deadline, "shutdown() left requests waiting"
        time.sleep(0.01)
    assert store.stats()["consumed"] == {}  # cancelled requests consumed nothing
    with pytest.raises(RuntimeError, match="was shut down"):
        next(loader)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"next": -1}, "negative"),
        ({"next": 10**30}, "next=10"),
        ({"requested": 0}, "requested=0"),  # below next
        ({"requested": 2**60}, "requested=1152921504606846976"),
        ({"requested": "x"}, "'requested' has 'x'"),
        ({"ended": 1}, "'ended' has 1"),
        ({"data_world_size": 3}, r"global batch of 3 samples \(3 data ranks"),
        ({"unit": 2}, "groups of 2 samples"),
    ],
)
def test_store_loader_state_fields_are_each_validated(change, message):
    store = SampleStore()
    kwargs = dict(task="t", fields=["x"], partition="p", batch_size=1, mesh={"dp": 1}, rank=0)
    state = StoreLoader(store, **kwargs, prefetch=1).state_dict()
    state = {**state, "next": 1, "requested": 1, **change}
    with pytest.raises(ValueError, match=message):
        StoreLoader(store, **kwargs, prefetch=1).load_state_dict(state)
