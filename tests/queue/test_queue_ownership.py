"""What a get hands out is the reader's own: an in-place edit of a batch never reaches another
task, a replica peer, a retry, a lease's re-delivery or a resume, on either backend.

The embedded store hands out a view of a put's column only for the rows' last read (the store
drops them with that get); while it keeps them it hands out copies. The Ray store's rows reach
their reader as copies (tensors) or read-only views of its object store (numpy arrays).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest
import torch

from meshfeed.queue import SampleStore, StoreLoader

N = 8


def _put(store: SampleStore, ids: list[int] | None = None) -> None:
    """Three kinds of column: a tensor column, an array column, and one tensor per sample."""
    store.put(
        "p",
        {
            "t": torch.arange(N * 2, dtype=torch.float32).reshape(N, 2),
            "a": np.arange(N * 3, dtype=np.int64).reshape(N, 3),
            "r": [torch.full((1 + i % 3,), float(i)) for i in range(N)],
        },
        ids=ids,
    )


def _expected(ids: list[int]) -> dict[str, Any]:
    return {
        "t": torch.arange(N * 2, dtype=torch.float32).reshape(N, 2)[ids],
        "a": np.arange(N * 3, dtype=np.int64).reshape(N, 3)[ids],
        "r": [torch.full((1 + i % 3,), float(i)) for i in ids],
    }


def _scribble(batch: Any) -> int:
    """Write into every value of ``batch`` that can be written (a read-only array, Ray's view
    of its object store, refuses any write); how many values were written."""
    written = 0
    for value in [batch["t"], batch["a"], *batch["r"]]:
        if isinstance(value, np.ndarray) and not value.flags.writeable:
            with pytest.raises(ValueError, match="read-only"):
                value += 1000
            continue
        value += 1000
        written += 1
    return written


def _check(batch: Any) -> None:
    want = _expected(list(batch.ids))
    assert torch.equal(batch["t"], want["t"])
    assert np.array_equal(batch["a"], want["a"])
    assert all(torch.equal(g, w) for g, w in zip(batch["r"], want["r"], strict=True))


FIELDS = ["t", "a", "r"]


def test_one_tasks_edits_never_reach_another_tasks_read(make_store):
    store = make_store(tasks=["first", "second"])
    _put(store)
    first = store.get("first", FIELDS, 4, "p", timeout=5)
    assert _scribble(first) >= 5  # the tensor column and the four per-sample tensors at least
    second = store.get("second", FIELDS, 4, "p", timeout=5)
    assert second.ids == first.ids == [0, 1, 2, 3]
    _check(second)


def test_an_expired_leases_batch_comes_back_as_it_was_put(make_store):
    store = make_store(lease_timeout=0.3)
    _put(store)
    leased = store.get("t", FIELDS, 3, "p", timeout=5, consumer="dies")
    _scribble(leased)
    time.sleep(0.5)  # never acknowledged: the samples return to ready
    again = store.get("t", FIELDS, 3, "p", timeout=5, consumer="lives")
    assert again.ids == leased.ids
    _check(again)


def test_a_held_batch_read_again_is_as_it_was_put(make_store):
    store = make_store(tasks=["t"])
    _put(store)
    held = store.get("t", FIELDS, 4, "p", timeout=5, hold=True)
    _scribble(held)
    again = store.peek("p", held.ids, FIELDS)
    _check(again)
    store.release("p", held.ids)


def test_the_last_read_of_rows_on_the_embedded_store_is_a_view_of_the_put():
    """No copy where none is needed: one task, nothing kept, the rows go with the get."""
    store = SampleStore(tasks=["t"])
    column = torch.arange(12.0).reshape(6, 2)
    array = np.arange(8).reshape(4, 2)
    store.put("p", {"x": column})
    store.put("q", {"a": array})
    assert store.get("t", ["x"], 4, "p", timeout=1)["x"].data_ptr() == column.data_ptr()
    assert np.shares_memory(store.get("t", ["a"], 4, "q", timeout=1)["a"], array)
    kept = SampleStore()  # no declared tasks: samples stay for any other task, so a copy
    kept.put("p", {"x": column})
    got = kept.get("t", ["x"], 4, "p", timeout=1)["x"]
    assert got.data_ptr() != column.data_ptr() and torch.equal(got, column[:4])


@pytest.mark.parametrize("dp", [1, 2])
def test_replica_peers_and_a_rolled_back_store_and_loader_read_what_was_put(make_store, dp):
    """tp=2 replica peers share each batch's plan, and a store and loaders restored from a
    checkpoint taken with batches in flight re-read those batches: none sees the edits the
    readers before it made."""
    store = make_store()
    _put(store)
    store.close("p")
    mesh = {"dp": dp, "tp": 2}

    def loader(on: SampleStore, rank: int) -> StoreLoader:
        return StoreLoader(
            on, task="train", fields=FIELDS, partition="p", batch_size=2, mesh=mesh,
            rank=rank, prefetch=2, timeout=10,
        )  # fmt: skip

    ranks = [loader(store, r) for r in range(2 * dp)]
    its = [iter(x) for x in ranks]
    before = []
    for it in its:  # rank 0 edits first; its tp peer (rank 1) reads the same plan after
        batch = next(it)
        _check(batch)
        assert _scribble(batch) >= 3
        before += batch.ids
    saved_store = store.state_dict()
    saved = [x.state_dict() for x in ranks]
    for it in its:  # the batches in flight at the checkpoint, and the rest: edited too
        for batch in it:
            _check(batch)
            _scribble(batch)
    for x in ranks:
        x.shutdown()
    store.load_state_dict(saved_store)  # consumption rolled back over the rows it holds
    again = [loader(store, r) for r in range(2 * dp)]
    for x, state in zip(again, saved, strict=True):
        x.load_state_dict(state)
    after = []
    for it in map(iter, again):
        for batch in it:
            _check(batch)
            after += batch.ids
    assert sorted(before + after) == sorted(list(range(N)) * 2)  # each sample to both tp peers


def test_nested_per_sample_values_are_the_readers_own_at_any_depth(make_store):
    """Per-sample lists of token ids, several images per sample, dicts of tensors: an edit of
    any of them (an append, an in-place op) never reaches another task's read."""
    store = make_store(tasks=["first", "second"])

    def values() -> dict[str, list[Any]]:
        return {
            "tokens": [[1, 2, 3 + i] for i in range(N)],
            "images": [(np.ones(2) * i, torch.ones(3) * i) for i in range(N)],
            "extra": [{"mask": torch.zeros(2), "name": f"s{i}"} for i in range(N)],
        }

    store.put("p", values())
    first = store.get("first", ["tokens", "images", "extra"], N, "p", timeout=5)
    for tokens, (array, tensor), extra in zip(
        first["tokens"], first["images"], first["extra"], strict=True
    ):
        tokens.append(99)
        if array.flags.writeable:
            array += 1000
        tensor += 1000
        extra["mask"] += 1
        extra["name"] = "edited"
    second = store.get("second", ["tokens", "images", "extra"], N, "p", timeout=5)
    want = values()
    assert [list(t) for t in second["tokens"]] == want["tokens"]
    for (a, t), (wa, wt) in zip(second["images"], want["images"], strict=True):
        assert np.array_equal(a, wa) and torch.equal(t, wt)
    for got, w in zip(second["extra"], want["extra"], strict=True):
        assert torch.equal(got["mask"], w["mask"]) and got["name"] == w["name"]
