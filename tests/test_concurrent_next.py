"""Two threads calling ``next()`` on one loader iterator: the second is told what happened and
the fix, by name, and the first one's walk goes on untouched."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from meshfeed import DataLoader
from meshfeed.loader_base import is_concurrent_next


def _blocking(entered: threading.Event, go: threading.Event) -> Iterator[int]:
    entered.set()
    go.wait(30)
    yield 1


def test_is_concurrent_next_tells_a_running_generator_from_a_value_error_inside_it():
    entered, go = threading.Event(), threading.Event()
    gen = _blocking(entered, go)
    first = threading.Thread(target=next, args=(gen,))
    first.start()
    assert entered.wait(30)
    try:
        with pytest.raises(ValueError) as info:
            next(gen)
        assert is_concurrent_next(info.value)
    finally:
        go.set()
        first.join(30)

    def raises_inside() -> Iterator[int]:
        raise ValueError("generator already executing")
        yield 0

    with pytest.raises(ValueError) as inside:
        next(raises_inside())
    assert not is_concurrent_next(inside.value)


def test_concurrent_next_error_names_the_loader_and_the_fix():
    loader = DataLoader(list(range(8)), batch_size=2)
    text = str(loader._concurrent_next_error())
    assert text.startswith("DataLoader: next() was called on one iterator from two threads")
    assert "threading.Lock" in text and "queue.Queue" in text


class _Gate:
    """Sample 0 waits for ``go`` (after setting ``entered``): a next() that stays running."""

    def __init__(self) -> None:
        self.entered, self.go = threading.Event(), threading.Event()

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> int:
        if i == 0:
            self.entered.set()
            self.go.wait(30)
        return i


def test_a_second_threads_next_is_refused_by_name_and_the_first_walk_goes_on():
    ds = _Gate()
    loader = DataLoader(ds, batch_size=2, seed=0, shuffle=False, warn_wait_share=None)
    it = iter(loader)
    got: list = []
    first = threading.Thread(target=lambda: got.append(next(it)))
    first.start()
    assert ds.entered.wait(30)
    try:
        with pytest.raises(
            RuntimeError, match=r"DataLoader: next\(\) was called on one iterator from two threads"
        ):
            next(it)
    finally:
        ds.go.set()
        first.join(30)
    assert got[0].tolist() == [0, 1]
    assert [b.tolist() for b in it] == [[2, 3], [4, 5], [6, 7]]  # no batch lost or repeated


def _gated_stream_loader(entered: threading.Event, go: threading.Event) -> Any:
    from meshfeed import StreamLoader
    from meshfeed.sources import ShardedStream

    def shard() -> Iterator[int]:
        for i in range(8):
            if i == 0:
                entered.set()
                go.wait(30)
            yield i

    return StreamLoader(ShardedStream([shard], rows=[8]), batch_size=2, seed=0)


def _gated_store_loader(entered: threading.Event, go: threading.Event) -> Any:
    from meshfeed.queue import SampleStore, StoreLoader

    store = SampleStore()
    store.put("p", {"x": list(range(8))})
    store.close("p")

    def collate(batch: Any) -> Any:
        if 0 in batch.ids:
            entered.set()
            go.wait(30)
        return torch.tensor(batch.ids)

    return StoreLoader(
        store, task="t", fields=["x"], partition="p", batch_size=2, collate_fn=collate
    )


@pytest.mark.parametrize(
    ("make", "name"), [(_gated_stream_loader, "StreamLoader"), (_gated_store_loader, "StoreLoader")]
)
def test_every_door_refuses_a_second_threads_next_and_its_first_walk_goes_on(make, name):
    entered, go = threading.Event(), threading.Event()
    loader = make(entered, go)
    it = iter(loader)
    got: list = []
    first = threading.Thread(target=lambda: got.append(next(it)))
    first.start()
    assert entered.wait(30)
    try:
        with pytest.raises(RuntimeError, match=rf"{name}: next\(\) was called on one iterator"):
            next(it)
    finally:
        go.set()
        first.join(30)
    served = [got[0].tolist()] + [b.tolist() for b in it]
    assert sorted(x for b in served for x in b) == list(range(8))  # none lost or repeated
    loader.shutdown()
