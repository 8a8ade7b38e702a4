"""LazyDataset: recorded ops run at fetch time, filters substitute, picklable, mixable."""

from __future__ import annotations

import functools
import os
import pickle
from typing import Any

import numpy as np
import pytest

from meshfeed.fetch import Failed
from meshfeed.loader import DataLoader
from meshfeed.sources.lazy import LazyDataset
from meshfeed.sources.mixture import Mixture
from meshfeed.testing import assert_resume_equivalence, take


def double(x: int) -> int:
    return 2 * x


def is_even(x: int) -> bool:
    return x % 2 == 0


def with_pid(x: int) -> dict[str, int]:
    return {"x": x, "pid": os.getpid()}


def jitter(x: int, rng: np.random.Generator) -> float:
    return x + float(rng.random())


class CharTokenizer:
    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]


class CountingSource:
    def __init__(self, n: int) -> None:
        self.n, self.reads = n, 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        self.reads += 1
        return i


def test_ops_are_recorded_immutably_and_applied_per_item():
    base = LazyDataset(range(10))
    mapped = base.map(double)
    filtered = mapped.filter(lambda x: x % 4 == 0)
    assert base.ops == [] and len(mapped.ops) == 1 and len(filtered.ops) == 2
    assert [mapped[i] for i in range(4)] == [0, 2, 4, 6]
    assert [filtered[i] for i in range(4)] == [0, None, 4, None]
    assert len(filtered) == 10


def test_nothing_is_read_until_an_item_is_fetched():
    src = CountingSource(5)
    ds = LazyDataset(src).map(double).filter(is_even)
    assert src.reads == 0
    assert ds[3] == 6 and src.reads == 1


def test_encode_tokenises_strings_and_dict_fields():
    ds = LazyDataset(["ab", "c"]).encode(CharTokenizer())
    assert ds[0].tolist() == [97, 98] and ds[0].dtype == np.int64
    rows = LazyDataset([{"text": "hi", "id": 1}]).encode(CharTokenizer())
    assert rows[0]["input_ids"].tolist() == [104, 105] and rows[0]["id"] == 1
    with pytest.raises(KeyError, match="field="):
        LazyDataset([{"body": "x"}]).encode(CharTokenizer())[0]


def test_callable_tokenizer_returning_a_dict_is_accepted():
    ds = LazyDataset(["xy"]).encode(lambda t: {"input_ids": [len(t)]})
    assert ds[0].tolist() == [2]


def test_filtered_items_are_substituted_so_batches_stay_full_and_deterministic():
    ds = LazyDataset(range(40)).filter(is_even)
    runs = [
        [b.tolist() for b in DataLoader(ds, batch_size=5, mesh={"dp": 2}, rank=r, seed=4)]
        for r in (0, 1)
    ]
    assert len(runs[0]) == len(runs[1]) == 4
    for run in runs:
        assert all(len(b) == 5 and all(x % 2 == 0 for x in b) for b in run)
    again = [b.tolist() for b in DataLoader(ds, batch_size=5, mesh={"dp": 2}, rank=0, seed=4)]
    assert again == runs[0]


def test_random_map_is_keyed_on_seed_epoch_and_index_not_on_rank_or_worker():
    ds = LazyDataset(range(16)).random_map(jitter)
    whole = DataLoader(ds, batch_size=8, seed=1, shuffle=False)
    ref = [b for b in whole]
    halves = [
        list(DataLoader(ds, batch_size=4, mesh={"dp": 2}, rank=r, seed=1, shuffle=False))
        for r in (0, 1)
    ]
    assert np.allclose(ref[0].numpy(), np.concatenate([halves[0][0], halves[1][0]]))
    second = [b for b in whole]  # epoch 1: fresh randomness
    assert not np.allclose(ref[0].numpy(), second[0].numpy())
    assert ds[3] == ds[3]  # outside a fetch: seed 0, epoch 0


def test_ops_run_in_the_worker_process():
    ds = LazyDataset(range(8)).map(with_pid)
    with DataLoader(ds, batch_size=4, num_workers=1, shuffle=False) as lo:
        pids = {int(p) for b in lo for p in b["pid"]}
    assert pids and os.getpid() not in pids


def test_pickles_with_module_level_functions():
    ds = LazyDataset(range(6)).map(functools.partial(pow, 2)).filter(is_even)
    back = pickle.loads(pickle.dumps(ds))
    assert [back[i] for i in range(6)] == [ds[i] for i in range(6)]
    assert back.fingerprint == ds.fingerprint


def test_an_op_that_raises_in_a_batch_keeps_the_rest_of_the_batch():
    src = CountingSource(6)

    def boom(x: int) -> int:
        if x == 2:
            raise ValueError("bad item 2")
        return x

    ds = LazyDataset(src).map(boom)
    out = ds.__getitems__([1, 2, 3])
    assert out[0] == 1 and out[2] == 3 and type(out[1]).__name__ == "Failed"
    assert src.reads == 3


def test_lazy_sources_compose_with_a_mixture_and_resume_exactly():
    def factory() -> DataLoader:
        mix = Mixture(
            {
                "a": LazyDataset(range(10)).map(double).filter(is_even),
                "b": LazyDataset(range(100, 107)).filter(is_even),
            },
            {"a": 2, "b": 1},
        )
        return DataLoader(mix, batch_size=3, seed=3)

    ref = assert_resume_equivalence(factory, num_items=9)
    assert all(int(x) % 2 == 0 for b in ref for x in b)


def test_non_map_style_sources_are_refused():
    with pytest.raises(TypeError, match="map-style"):
        LazyDataset(iter([1, 2]))
    with pytest.raises(TypeError, match="callable"):
        LazyDataset([1]).map(3)  # type: ignore[arg-type]
    assert take(DataLoader(LazyDataset([1, 2]), batch_size=2), 1)[0].tolist() in ([1, 2], [2, 1])


def test_a_filtered_lazy_dataset_resumes_exactly_across_epochs():
    def factory() -> DataLoader:
        ds = LazyDataset(range(30)).map(double).filter(lambda x: x % 3 != 0).random_map(jitter)
        return DataLoader(ds, batch_size=4, mesh={"dp": 2}, rank=1, seed=9)

    ref = assert_resume_equivalence(factory, num_items=10)
    assert all(int(x) % 3 != 0 for b in ref for x in b)


def _fails_on_two(x: int) -> int:
    if x == 2:
        raise ValueError("bad item 2")
    return x


def test_a_failure_reported_by_an_inner_source_passes_through_the_outer_ops():
    """Lazy over a mixture of lazy sources: the outer ops must not run on a Failed marker."""
    inner = LazyDataset(list(range(5))).map(_fails_on_two)
    outer = LazyDataset(Mixture({"a": inner}, {"a": 1})).map(str)
    out = outer.__getitems__([1, 2, 3])
    assert out[0] == "1" and out[2] == "3"
    assert isinstance(out[1], Failed) and str(out[1].error) == "bad item 2"


def _three_to_one() -> Mixture:
    return Mixture({"a": list(range(1000)), "b": list(range(10_000, 11_000))}, {"a": 3, "b": 1})


def _values(batches: list) -> np.ndarray:
    return np.concatenate([np.asarray(b) for b in batches])


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_lazy_map_over_a_mixture_keeps_its_weights_order_and_state(num_workers):
    """#28: LazyDataset(Mixture(3:1)).map(f) served the sources uniformly, with no order state."""
    plain = take(DataLoader(_three_to_one(), batch_size=40, seed=5), 20)
    lazy = DataLoader(
        LazyDataset(_three_to_one()).map(double), batch_size=40, seed=5, num_workers=num_workers
    )
    got = take(lazy, 20)
    assert _values(got).tolist() == (2 * _values(plain)).tolist()
    assert (_values(got) < 20_000).mean() == pytest.approx(0.75, abs=1 / 800)
    order = lazy.stats()["order"]
    assert order["kind"] == "mixture" and order["consumed"] == {"a": 600, "b": 200}


def test_reweight_of_a_mixture_under_a_lazy_map_takes_effect():
    mix = _three_to_one()
    lazy = DataLoader(LazyDataset(mix).map(double), batch_size=40, seed=1)
    mix.reweight(5, {"a": 1, "b": 3})
    got = _values(take(lazy, 10))
    assert (got[:200] < 20_000).mean() == pytest.approx(0.75, abs=1 / 200)
    assert (got[200:] < 20_000).mean() == pytest.approx(0.25, abs=1 / 200)
    assert lazy.state_dict()["order"]["schedule"] == [[0, [3, 1]], [5, [1, 3]]]


def test_a_lazy_map_over_a_mixture_resumes_exactly_and_adopts_the_schedule():
    def factory(reweight: bool = True) -> DataLoader:
        mix = Mixture({"a": list(range(9)), "b": list(range(100, 105))}, {0: {"a": 2, "b": 1}})
        if reweight:
            mix.reweight(3, {"a": 1, "b": 2})
        return DataLoader(LazyDataset(mix).map(double), batch_size=4, mesh={"dp": 2}, rank=1)

    assert_resume_equivalence(factory, num_items=8)
    ref = factory()
    take(ref, 2)
    state = ref.state_dict()
    other = factory(reweight=False)  # a resume takes the checkpoint's schedule, as a mixture's
    other.load_state_dict(state)
    assert other.state_dict()["order"]["schedule"] == [[0, [2, 1]], [3, [1, 2]]]
    assert [b.tolist() for b in take(other, 4)] == [b.tolist() for b in take(ref, 4)]


def test_a_curriculum_over_a_lazy_mixture_gates_each_source_like_over_the_mixture():
    from meshfeed.curriculum import Curriculum, CurriculumMetric, MetricIndex, fixed_linear

    def loader(wrap: bool) -> DataLoader:
        mix = Mixture({"a": list(range(40)), "b": list(range(100, 140))}, {"a": 1, "b": 1})
        values = np.arange(80) % 40
        index = MetricIndex.from_values("d", values, fingerprint={"length": 80, "hash": "d"})
        cur = Curriculum([CurriculumMetric(index=index, schedule=fixed_linear(10, 39, 4, 1))])
        ds = LazyDataset(mix).map(double) if wrap else mix
        return DataLoader(ds, batch_size=4, curriculum=cur, seed=2)

    got, want = take(loader(True), 6), take(loader(False), 6)
    assert _values(got).tolist() == (2 * _values(want)).tolist()


def _rows(start: int, stop: int) -> Any:
    return lambda: range(start, stop)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_stream_loader_takes_a_lazy_map_over_a_mixture_of_streams(num_workers):
    """#28: StreamLoader refused LazyDataset(Mixture of streams) with a TypeError."""
    from meshfeed.sources.streams.stream import ShardedStream
    from meshfeed.stream_loader import StreamLoader

    def mix() -> Mixture:
        a = ShardedStream([_rows(0, 300), _rows(300, 600)])
        b = ShardedStream([_rows(1000, 1200)])
        return Mixture({"a": a, "b": b}, {"a": 3, "b": 1})

    want = _values(take(StreamLoader(mix(), batch_size=16), 10))
    lazy = StreamLoader(LazyDataset(mix()).map(double), batch_size=16, num_workers=num_workers)
    got = _values(take(lazy, 10))
    assert got.tolist() == (2 * want).tolist()
    assert (got < 2000).mean() == pytest.approx(0.75, abs=1 / 160)
    assert lazy.stats()["order"]["kind"] == "mixture"
    one = StreamLoader(LazyDataset(ShardedStream([_rows(0, 8)])).map(double), batch_size=4)
    assert [b.tolist() for b in one] in (
        [[0, 2, 4, 6], [8, 10, 12, 14]],
        [[8, 10, 12, 14], [0, 2, 4, 6]],
    )


def _scale(x: int, k: int) -> int:
    return x * k


class _Add:
    def __init__(self, k: int) -> None:
        self.k = k

    def __call__(self, x: int) -> int:
        return x + self.k


def test_the_fingerprint_of_partials_and_callable_objects_holds_no_memory_address():
    # It held repr(fn), with the address of a partial or of an object: another process (the
    # next run, another rank) had another fingerprint, and the checkpoint was refused.
    def built(k: int) -> LazyDataset:
        return LazyDataset(list(range(8))).map(functools.partial(_scale, k=k)).map(_Add(k))

    assert built(3).fingerprint == built(3).fingerprint  # other objects, the same text
    assert built(3).fingerprint != built(4).fingerprint  # their arguments count
    assert "0x" not in " ".join(built(3).ops)
