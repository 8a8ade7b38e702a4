"""Runs: a put of new samples is one record; every path stays exact (differential test)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from meshfeed.queue import PartitionClosed, SampleStore
from meshfeed.queue.engine.records import Run, Sample
from tests.optional import HealthCheck, given, settings, st


def _records(store: SampleStore, partition: str) -> list[type]:
    return [type(r) for r in store._backend.core.partitions[partition].samples.values()]


def test_a_put_of_new_samples_is_one_run_and_a_later_field_splits_off_only_its_samples():
    store = SampleStore()
    store.put("p", {"x": torch.arange(8).reshape(4, 2), "y": [0, 1, 2, 3]})
    part = store._backend.core.partitions["p"]
    assert len({id(r) for r in part.samples.values()}) == 1 and _records(store, "p") == [Run] * 4
    store.put("p", {"z": [9.0]}, ids=[2])
    assert _records(store, "p") == [Run, Run, Sample, Run]
    batch = store.get("t", ["x", "y"], 4, "p", timeout=1)
    assert batch.ids == [0, 1, 2, 3]
    assert torch.equal(batch["x"], torch.arange(8).reshape(4, 2)) and batch["y"] == [0, 1, 2, 3]
    assert store.get("u", ["z", "y"], 1, "p", timeout=1)["y"] == [2]


def test_a_batch_across_runs_is_concatenated_and_a_run_slice_is_a_view():
    store = SampleStore(tasks=["t"])
    a, b = torch.arange(6.0).reshape(3, 2), torch.arange(6.0, 12.0).reshape(3, 2)
    store.put("p", {"x": a})
    store.put("p", {"x": b})
    first = store.get("t", ["x"], 2, "p", timeout=1)["x"]
    assert first.data_ptr() == a.data_ptr()  # rows 0-1 of the first put: no copy
    across = store.get("t", ["x"], 3, "p", timeout=1)
    assert across.ids == [2, 3, 4] and torch.equal(across["x"], torch.arange(4.0, 10.0).view(3, 2))
    assert store.stats()["held"] == 1  # consumed by the only task: dropped, run by run


def test_a_runs_list_column_is_copied_so_the_caller_may_reuse_its_list():
    store = SampleStore()
    rewards = [1.0, 2.0]
    store.put("p", {"r": rewards}, ids=["a", "b"])
    rewards[0] = 99.0
    assert store.get("t", ["r"], 2, "p", timeout=1)["r"] == [1.0, 2.0]


def test_non_consecutive_and_str_ids_keep_their_rows():
    store = SampleStore()
    store.put("p", {"x": np.arange(4) * 10}, ids=[7, 3, 5, 1])
    store.put("p", {"x": np.arange(4, 6) * 10}, ids=["u", "v"])
    batch = store.get("t", ["x"], 6, "p", timeout=1)
    assert batch.ids == [7, 3, 5, 1, "u", "v"] and batch["x"].tolist() == [0, 10, 20, 30, 40, 50]
    assert store.put("p", {"x": np.zeros(1)}) == [8]  # fresh ids above every int id


def test_an_expired_lease_returns_rows_of_a_run_in_production_order():
    store = SampleStore(lease_timeout=60)
    store.put("p", {"x": torch.arange(6)})
    leased = store.get("t", ["x"], 2, "p", timeout=1)
    store._backend.core.drop_leases([leased.lease])
    again = store.get("t", ["x"], 6, "p", timeout=1)
    assert again.ids == [0, 1, 2, 3, 4, 5] and again["x"].tolist() == list(range(6))
    assert store.stats()["lease_expired"] == 2


def _value(key: object) -> float:
    return float(key) if isinstance(key, int) else 1000.0 + ord(str(key)[-1])


_put = st.tuples(
    st.just("put"),
    st.integers(1, 6),  # how many samples
    st.sampled_from(["consecutive", "shuffled", "str"]),
    st.sampled_from([("x",), ("y",), ("x", "y")]),
    st.sampled_from(["torch", "numpy"]),
    st.randoms(use_true_random=False),
)
_add = st.tuples(st.just("add"), st.randoms(use_true_random=False))
_get = st.tuples(
    st.just("get"),
    st.sampled_from(["a", "b"]),
    st.integers(1, 7),
    st.sampled_from([("x",), ("y",), ("x", "y")]),
)


@pytest.mark.parametrize("tasks", [("a", "b"), ("a",)])
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(st.one_of(_put, _add, _get), min_size=1, max_size=30))
def test_runs_match_a_per_sample_model_under_any_schedule(tasks, ops):
    """Puts of runs (consecutive, shuffled or str ids; tensors or arrays; one or both
    fields), fields added to existing samples, and gets of two tasks (both declared, or
    only "a": its batches are dropped at once while "b" reads what is still held), against
    a model that keeps one record per sample: same ids, same values, same eviction."""
    store = SampleStore(tasks=list(tasks))
    order: list[object] = []  # held ids in production order
    fields: dict[object, set[str]] = {}
    consumed: dict[str, set[object]] = {"a": set(), "b": set()}
    next_int, next_str = 0, 0

    def check(batch, task: str, need: tuple[str, ...]) -> None:
        for f in need:
            column = batch[f]
            rows = list(column) if not isinstance(column, list) else column
            want = [[_value(k), 2 * _value(k)] if f == "x" else _value(k) for k in batch.ids]
            assert [np.asarray(r, dtype=np.float64).tolist() for r in rows] == want

    for op in ops:
        if op[0] == "put":
            _, n, kind, names, lib, rnd = op
            if kind == "str":
                ids: list[object] = [f"s{next_str + i}" for i in range(n)]
                next_str += n
            else:
                ids = list(range(next_int, next_int + n))
                next_int += n
                if kind == "shuffled":
                    rnd.shuffle(ids)
            values = np.array([_value(k) for k in ids])
            cols: dict[str, object] = {}
            if "x" in names:
                x = np.stack([values, 2 * values], axis=1)
                cols["x"] = torch.from_numpy(x) if lib == "torch" else x
            if "y" in names:
                cols["y"] = values.tolist()
            store.put("p", cols, ids=ids)
            order.extend(ids)
            for k in ids:
                fields[k] = set(names)
        elif op[0] == "add":
            rnd = op[1]
            lacking = [k for k in order if fields[k] != {"x", "y"}]
            if not lacking:
                continue
            picked = rnd.sample(lacking, min(len(lacking), rnd.randint(1, 3)))
            by_field: dict[str, list[object]] = {}
            for k in picked:
                by_field.setdefault("x" if "x" not in fields[k] else "y", []).append(k)
            for f, ks in by_field.items():
                values = np.array([_value(k) for k in ks])
                col = (
                    torch.from_numpy(np.stack([values, 2 * values], 1))
                    if f == "x"
                    else values.tolist()
                )
                store.put("p", {f: col}, ids=ks)
                for k in ks:
                    fields[k].add(f)
        else:
            _, task, size, need = op
            ready = [k for k in order if k not in consumed[task] and set(need) <= fields[k]]
            if len(ready) < size:
                with pytest.raises(TimeoutError):
                    store.get(task, list(need), size, "p", timeout=0)
                continue
            batch = store.get(task, list(need), size, "p", timeout=0)
            assert batch.ids == ready[:size]
            check(batch, task, need)
            consumed[task].update(batch.ids)
            gone = set.intersection(*(consumed[t] for t in tasks))
            order = [k for k in order if k not in gone]
            consumed = {t: c - gone for t, c in consumed.items()}
            for k in gone:
                del fields[k]
        stats = store.stats()
        assert stats["held"] == len(order)
        counts = stats["partitions"].get("p", {}).get("fields", {})
        want = {f: sum(f in fields[k] for k in order) for f in ("x", "y")}
        assert {f: n for f, n in counts.items() if n} == {f: n for f, n in want.items() if n}
    store.close("p")
    for task in ("b", "a"):  # "a" last: with tasks=("a",) its drain drops what it reads
        ready = [k for k in order if k not in consumed[task] and fields[k] == {"x", "y"}]
        got: list[object] = []
        while True:
            try:
                batch = store.get(task, ["x", "y"], 4, "p", timeout=0)
            except PartitionClosed:
                break
            check(batch, task, ("x", "y"))
            got.extend(batch.ids)
        assert got == ready


def test_runs_are_delivered_exactly_once_by_four_producers_to_four_consumers_at_capacity():
    """The benchmark's workload as a test: puts of 64 tensor rows (one run each) against a
    capacity of four puts, two tasks with two consumer threads each; every row once per task,
    with its own values, and nothing left held."""
    store = SampleStore(capacity=256, tasks=["a", "b"])
    producers, puts, rows = 4, 12, 64
    got: dict[str, list] = {"a": [], "b": []}
    lock = threading.Lock()
    errors: list[BaseException] = []

    def produce(p: int) -> None:
        try:
            for i in range(puts):
                start = (p * puts + i) * rows
                x = torch.arange(start, start + rows, dtype=torch.float64)
                store.put(
                    "p", {"x": x, "y": x * 2}, ids=list(range(start, start + rows)), timeout=20
                )
        except BaseException as exc:
            errors.append(exc)

    def consume(task: str) -> None:
        try:
            while True:
                try:
                    b = store.get(task, ["x", "y"], rows, "p", timeout=20)
                except PartitionClosed:
                    return
                assert b["x"].tolist() == [float(k) for k in b.ids]
                assert b["y"].tolist() == [2.0 * k for k in b.ids]
                with lock:
                    got[task].extend(b.ids)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=consume, args=(t,)) for t in ["a", "b"] * 2]
    threads += [threading.Thread(target=produce, args=(p,)) for p in range(producers)]
    for t in threads:
        t.start()
    for t in threads[4:]:
        t.join(60)
    store.close("p")
    for t in threads[:4]:
        t.join(60)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads)
    for task in ("a", "b"):
        assert sorted(got[task]) == list(range(producers * puts * rows))
    assert store.stats()["held"] == 0
