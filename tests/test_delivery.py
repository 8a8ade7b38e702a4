"""Delivery on CPU: ``device="cpu"`` runs the delivery thread and its ordering like ``"cuda"``.

The CUDA parts (pinned memory, the side stream and its event) are in tests/test_gpu.py.
"""

import dataclasses
import threading
import time
from collections import namedtuple

import numpy as np
import pytest
import torch

from meshfeed import DataLoader, StreamLoader
from meshfeed.delivery import check_device, pin, to_device
from meshfeed.fetch import SampleError
from meshfeed.sources import ShardedStream
from meshfeed.testing import assert_resume_equivalence, assert_same, take
from tests.dist_utils import run_distributed

Pair = namedtuple("Pair", "a b")


class Counted:
    """Items 0..n-1 as 1-element tensors; counts the reads (the delivery thread reads ahead)."""

    def __init__(self, n, fail_at=None):
        self.n, self.reads, self.fail_at = n, 0, fail_at

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        self.reads += 1
        if i == self.fail_at:
            raise KeyError(f"sample {i} is broken")
        return torch.tensor([i])


def _delivery_threads():
    return [t for t in threading.enumerate() if t.name == "meshfeed-delivery"]


def _stream():
    return ShardedStream([lambda: range(0, 9), lambda: range(20, 31)])


@pytest.mark.parametrize("num_workers", [0, 1])
def test_device_cpu_delivers_the_same_batches_in_the_same_order(num_workers):
    data = np.arange(80, dtype=np.float32).reshape(40, 2)
    kwargs = {"batch_size": 4, "seed": 2, "num_workers": num_workers}
    ahead = list(DataLoader(data, device="cpu", device_prefetch=3, **kwargs))
    plain = list(DataLoader(data, **kwargs))
    assert len(ahead) == 10
    assert_same(ahead, plain)


def test_a_batch_delivered_ahead_but_not_returned_is_not_consumed():
    data = Counted(64)
    loader = DataLoader(data, batch_size=4, shuffle=False, device="cpu", device_prefetch=4)
    it = iter(loader)
    got = [next(it), next(it)]
    deadline = time.monotonic() + 10
    while data.reads < 4 * 6 and time.monotonic() < deadline:  # the thread fills its queue
        time.sleep(0.01)
    assert data.reads >= 4 * 6, data.reads  # read 4 batches past the 2 returned
    assert loader.position == 8 and loader.state_dict()["position"] == 8
    assert [b.tolist() for b in got] == [[[0], [1], [2], [3]], [[4], [5], [6], [7]]]
    again = DataLoader(Counted(64), batch_size=4, shuffle=False)
    again.load_state_dict(loader.state_dict())
    assert next(iter(again)).view(-1).tolist() == [8, 9, 10, 11]
    it.close()
    assert not _delivery_threads()


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_is_exact_with_device_prefetch(num_workers):
    def factory():
        return DataLoader(
            Counted(30),
            batch_size=4,
            seed=5,
            num_workers=num_workers,
            device="cpu",
            device_prefetch=3,
            drop_last=False,
        )

    out = assert_resume_equivalence(factory, num_items=12, every=3, max_state_bytes=1024)
    assert len(out) == 12


def test_stream_loader_resume_is_exact_with_device_prefetch():
    def factory():
        return StreamLoader(_stream(), batch_size=3, seed=1, device="cpu", device_prefetch=2)

    assert_resume_equivalence(factory, num_items=9, every=2, max_state_bytes=1024)


def test_an_error_made_ahead_is_raised_at_its_batch_and_the_thread_stops():
    loader = DataLoader(Counted(40, fail_at=9), batch_size=4, shuffle=False, on_error="raise")
    loader_ahead = DataLoader(
        Counted(40, fail_at=9), batch_size=4, shuffle=False, on_error="raise", device="cpu"
    )
    for each in (loader, loader_ahead):
        it = iter(each)
        assert next(it).view(-1).tolist() == [0, 1, 2, 3]
        assert next(it).view(-1).tolist() == [4, 5, 6, 7]
        with pytest.raises(SampleError, match="sample 9 is broken"):
            next(it)
        assert each.position == 8
    assert not _delivery_threads()


def test_breaking_out_stops_the_thread_and_iter_continues_where_it_stopped():
    loader = DataLoader(Counted(40), batch_size=4, shuffle=False, device="cpu", device_prefetch=5)
    first = take(loader, 3)
    assert not _delivery_threads()
    rest = list(loader)
    flat = [v for b in first + rest for v in b.view(-1).tolist()]
    assert flat == list(range(40))


def test_to_device_and_pin_keep_nested_structure():
    batch = {
        "x": torch.arange(4),
        "pair": Pair(torch.ones(2), [torch.zeros(1), "label"]),
        "t": (torch.tensor([1.5]), 3),
    }
    moved = to_device(batch, torch.device("cpu"))
    assert_same(moved, batch)
    assert isinstance(moved["pair"], Pair) and moved["pair"].b[1] == "label"
    if not torch.cuda.is_available():
        assert pin(batch) is batch  # without CUDA nothing is pinned


def test_dataclasses_are_walked_and_rebuilt():
    from meshfeed.queue import Batch

    batch = Batch(ids=[1, 2], columns={"x": torch.arange(2), "s": ["a", "b"]})
    moved = to_device(batch, torch.device("cpu"))
    assert isinstance(moved, Batch) and moved is not batch
    assert moved.ids == [1, 2] and moved["s"] == ["a", "b"] and torch.equal(moved["x"], batch["x"])


def test_bad_device_and_delivery_options_are_refused_by_name():
    with pytest.raises(TypeError, match="device must be None, a str or a torch.device"):
        check_device(3)
    with pytest.raises(ValueError, match="device='gpu!' is not a torch device"):
        DataLoader(list(range(8)), batch_size=2, device="gpu!")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs CUDA"):
            DataLoader(list(range(8)), batch_size=2, device="cuda")
    with pytest.raises(ValueError, match="device_prefetch must be an int >= 1"):
        DataLoader(list(range(8)), batch_size=2, device="cpu", device_prefetch=0)
    with pytest.raises(ValueError, match=r"warn_wait_share must be a share in \(0, 1\]"):
        DataLoader(list(range(8)), batch_size=2, warn_wait_share=1.5)
    with pytest.raises(TypeError, match="on_step must be a function"):
        DataLoader(list(range(8)), batch_size=2, on_step="print")
    assert check_device(None) is None and check_device("cpu") == torch.device("cpu")


def _ranks_ahead(rank, world):
    # The plan agreement and the per-step error check (on_error="raise") run on the delivery
    # thread, on meshfeed's gloo group: the ranks still agree and resume exactly.
    def make(**kw):
        return DataLoader(Counted(40), batch_size=2, seed=1, on_error="raise", **kw)

    ahead = make(device="cpu", device_prefetch=3)
    first = [b.view(-1).tolist() for b in take(ahead, 4)]
    state = ahead.state_dict()
    rest = [b.view(-1).tolist() for b in ahead]
    plain = [b.view(-1).tolist() for b in make()]
    again = make()
    again.load_state_dict(state)
    resumed = [b.view(-1).tolist() for b in again]
    return {"ahead": first + rest, "plain": plain, "rest": rest, "resumed": resumed}


def test_two_gloo_ranks_with_device_prefetch_agree_and_resume():
    results = run_distributed(_ranks_ahead, 2)
    for r in results:
        assert r["ahead"] == r["plain"] and r["rest"] == r["resumed"]
    seen = [v for r in results for b in r["ahead"] for v in b]
    assert sorted(seen) == list(range(40))  # each sample once, over the two ranks


def test_closing_the_stage_on_its_own_delivery_thread_does_not_join_itself():
    """A loader dropped while its delivery thread makes a batch is collected on that thread
    (``__del__`` -> ``shutdown`` closes the stage there): closing must not try to join the
    thread it runs on, which would raise and cut the shutdown short (workers left running)."""
    from meshfeed.delivery import Delivery
    from meshfeed.telemetry import Telemetry

    delivery = Delivery(
        pin_memory=False, device=torch.device("cpu"), depth=1, timeout=5.0,
        telemetry=Telemetry("test"),
    )  # fmt: skip
    box: dict[str, object] = {}
    errors: list[BaseException] = []
    closed, returned = threading.Event(), threading.Event()

    def items():
        yield torch.zeros(1), 0
        returned.wait(10)  # the loop holds the first batch and is out of the stage
        try:
            box["stage"].close()  # as __del__ -> shutdown() would, on this thread
        except BaseException as exc:
            errors.append(exc)
        closed.set()
        yield torch.zeros(1), 1

    stage = delivery.stage(items())
    box["stage"] = stage
    assert next(stage)[1] == 0
    returned.set()
    assert closed.wait(10), "the delivery thread never reached the close"
    deadline = time.monotonic() + 10
    while any(t.name == "meshfeed-delivery" for t in threading.enumerate()):
        assert time.monotonic() < deadline, "the delivery thread did not end"
        time.sleep(0.01)
    assert errors == []


def _stats_while_ahead(rank, world):
    # The per-step error check (on_error="raise") runs on the delivery thread, which rank 1
    # lets run ahead while its loop sleeps; the loop's across-ranks stats run meanwhile.
    loader = DataLoader(
        Counted(80), batch_size=2, seed=1, on_error="raise", device="cpu", device_prefetch=4
    )
    shares, seen = [], []
    for step, batch in enumerate(loader):
        seen += batch.view(-1).tolist()
        if rank == 1:
            time.sleep(0.02)  # the delivery thread fills its queue: its checks run now
        if step % 4 == 0:
            shares.append(loader.delivery_stats(across_ranks=True)["slowest"]["rank"])
    return {"seen": seen, "shares": shares}


def test_across_ranks_stats_while_the_delivery_thread_checks_batches_do_not_mix():
    """The loop's ``delivery_stats(across_ranks=True)`` and the delivery thread's per-step
    checks are collectives of two threads: on one group, a rank whose thread ran ahead would
    pair its check with a peer's stats gather. They run on groups of their own."""
    results = run_distributed(_stats_while_ahead, 2, timeout=120)
    assert sorted(v for r in results for v in r["seen"]) == list(range(80))
    assert results[0]["shares"] == results[1]["shares"] and len(results[0]["shares"]) == 5


def _live_doors():
    """A DataLoader, a StreamLoader, a StoreLoader and a Delivered, each with device="cpu"."""
    from meshfeed.delivered import Delivered
    from meshfeed.queue import SampleStore, StoreLoader

    store = SampleStore()
    store.put("p", {"x": list(range(40))})
    store.close("p")
    place = {"mesh": {"dp": 1}, "rank": 0}
    return [
        DataLoader(Counted(40), batch_size=4, device="cpu"),
        StreamLoader(_stream(), batch_size=2, device="cpu"),
        StoreLoader(
            store, task="t", fields=["x"], partition="p", batch_size=2, device="cpu", **place
        ),
        Delivered(iter([torch.ones(2)] * 20), device="cpu"),
    ]


def test_shutdown_stops_and_joins_the_delivery_thread_of_every_door():
    for door in _live_doors():
        it = iter(door)
        next(it)
        assert _delivery_threads()
        door.shutdown()
        assert not _delivery_threads(), type(door).__name__


_EXIT_SCRIPT = """
import torch
import meshfeed
from meshfeed.delivered import Delivered
from meshfeed.queue import SampleStore, StoreLoader

def busy(batch):  # torch's C++ code on the delivery thread when the script ends
    x = torch.ones(500, 500)
    for _ in range(20):
        x = x @ x / 500.0
    return batch

def items():
    while True:
        yield busy(torch.ones(2))

store = SampleStore()
store.put("p", {"x": list(range(40))})
store.close("p")
doors = [
    meshfeed.DataLoader(list(range(100)), batch_size=4, device="cpu", collate_fn=busy),
    StoreLoader(store, task="t", fields=["x"], partition="p", batch_size=2, mesh={"dp": 1},
                rank=0, device="cpu", collate_fn=busy),
    Delivered(items(), device="cpu"),
]
live = [iter(door) for door in doors]  # a step-based loop: next() per step, no shutdown
for it in live:
    next(it)
print("training done")
"""


def test_delivery_threads_live_at_exit_are_stopped_before_the_interpreter_tears_down():
    # Without the exit hook the process aborts (SIGABRT, "terminate called without an active
    # exception") every time: a daemon thread is inside torch's C++ code at finalization.
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _EXIT_SCRIPT], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "training done" and "terminate" not in done.stderr


class _Movable:
    """A custom batch type with its own ``to()``: its tensors are not seen, it stays as is."""

    def __init__(self, x):
        self.x = x

    def to(self, device):
        raise AssertionError("meshfeed calls no method of a custom batch type")


def test_a_custom_batch_type_stays_as_it_is_and_is_named_once(caplog):
    data = np.arange(32, dtype=np.float32).reshape(16, 2)
    loader = DataLoader(
        data, batch_size=4, seed=0, device="cpu",
        collate_fn=lambda rows: {"m": _Movable(torch.as_tensor(np.stack(rows))), "n": 1},
    )  # fmt: skip
    with caplog.at_level("WARNING", logger="meshfeed"):
        batches = list(loader)
    assert len(batches) == 4 and all(type(b["m"]) is _Movable for b in batches)
    told = [r.getMessage() for r in caplog.records if "_Movable" in r.getMessage()]
    assert len(told) == 1 and "make it a dataclass or a dict" in told[0]


@dataclasses.dataclass
class _Record:
    x: torch.Tensor

    def to(self, device):
        raise AssertionError("meshfeed walks a dataclass's fields")


def test_a_dataclass_with_a_to_method_is_walked_without_a_word(caplog):
    with caplog.at_level("WARNING", logger="meshfeed"):
        moved = to_device(_Record(torch.ones(2)), torch.device("cpu"))
    assert type(moved) is _Record and torch.equal(moved.x, torch.ones(2))
    assert not caplog.records


def test_the_delivery_thread_makes_the_loops_cuda_device_its_own(monkeypatch):
    # CUDA's current device is per thread (a new thread's is 0): the delivery thread sets the
    # loop's before it runs anything (here faked, to follow the calls on a CPU-only build).
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(
        torch.cuda, "set_device", lambda d: calls.append((d, threading.current_thread().name))
    )
    loader = DataLoader(Counted(8), batch_size=4, shuffle=False, device="cpu")
    assert len(list(loader)) == 2
    assert calls == [(3, "meshfeed-delivery")]


def test_the_delivery_thread_leaves_cuda_alone_where_the_process_has_not_used_it(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    loader = DataLoader(Counted(8), batch_size=4, shuffle=False, device="cpu")
    assert len(list(loader)) == 2 and calls == []


def test_device_cuda_on_another_gpu_than_local_rank_is_named(monkeypatch, caplog):
    # device="cuda" is the current device when the loader is built: before set_device on a
    # node of several GPUs, every rank would copy to cuda:0 (faked on a CPU-only build).
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setenv("LOCAL_RANK", "3")
    with caplog.at_level("WARNING", logger="meshfeed"):
        assert check_device("cuda") == torch.device("cuda", 0)
    assert any("LOCAL_RANK=3" in r.getMessage() for r in caplog.records)
    caplog.clear()
    monkeypatch.setenv("LOCAL_RANK", "0")
    with caplog.at_level("WARNING", logger="meshfeed"):
        check_device("cuda")
    assert not caplog.records
