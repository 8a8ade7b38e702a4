"""MetricIndex: values, sorted order, percentiles, fingerprint; saved, memory-mapped, checked."""

from __future__ import annotations

import json

import numpy as np
import pytest

from meshfeed.curriculum import MetricIndex, content_fingerprint, load_accumulated
from meshfeed.curriculum.index import save_accumulated


def _docs(n: int = 50, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 100, size=int(rng.integers(1, 20))) for _ in range(n)]


def test_index_sorts_stably_and_takes_percentiles_from_actual_values():
    docs = _docs()
    values = np.array([3, 1, 3, 2, 1] * 10)
    index = MetricIndex.from_values("m", values, fingerprint=content_fingerprint(docs))
    assert index.order[:10].tolist() == [1, 4, 6, 9, 11, 14, 16, 19, 21, 24]
    assert np.all(np.diff(index.sorted_values()) >= 0)
    assert index.percentiles[0] == 1 and index.percentiles[100] == 3
    assert set(index.percentiles.tolist()) <= set(values.tolist())
    assert index.percentile_count(np.array([0, 10, 50, 100])).tolist() == [0, 5, 25, 50]


def test_float_values_keep_their_dtype_through_save_and_load(tmp_path):
    docs = _docs()
    values = np.linspace(1.0, 0.0, 50).astype(np.float32)
    MetricIndex.from_values("f", values, fingerprint=content_fingerprint(docs)).save(tmp_path / "f")
    loaded = MetricIndex.load(tmp_path / "f", dataset=docs)
    assert loaded.values.dtype == np.float32 and isinstance(loaded.values, np.memmap)
    assert loaded.order.tolist() == list(range(49, -1, -1))
    meta = json.loads((tmp_path / "f" / "meta.json").read_text())
    assert meta["version"] == 1 and meta["fingerprint"] == content_fingerprint(docs)


def test_loading_an_index_against_another_dataset_is_refused(tmp_path):
    docs = _docs()
    MetricIndex.from_values("m", np.arange(50), fingerprint=content_fingerprint(docs)).save(
        tmp_path / "m"
    )
    other = _docs(seed=1)
    with pytest.raises(ValueError, match="was built for another dataset"):
        MetricIndex.load(tmp_path / "m", dataset=other)
    with pytest.raises(ValueError, match="was built for another dataset"):
        MetricIndex.load(tmp_path / "m", dataset=docs[:49])


def test_fingerprint_depends_on_length_and_content_not_identity():
    docs = _docs()
    assert content_fingerprint(docs) == content_fingerprint([d.copy() for d in docs])
    assert content_fingerprint(docs)["length"] == 50
    changed = [d.copy() for d in docs]
    for d in changed:
        d += 1
    assert content_fingerprint(changed) != content_fingerprint(docs)


def test_accumulated_metrics_round_trip_and_are_checked(tmp_path):
    docs = _docs()
    save_accumulated(tmp_path / "h", "h", np.arange(5), content_fingerprint(docs))
    assert load_accumulated(tmp_path / "h", dataset=docs).tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="holds an accumulated metric"):
        MetricIndex.load(tmp_path / "h")


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (np.array([1.0, np.nan]), "has NaN values"),
        (np.array(["a", "b"]), "1-D numeric array"),
        (np.arange(3), "has 3 values for a dataset of 2"),
    ],
)
def test_bad_values_are_refused(values, message):
    with pytest.raises((ValueError, TypeError), match=message):
        MetricIndex.from_values("m", values, fingerprint={"length": 2, "hash": "x"})


def test_a_directory_without_an_index_is_refused(tmp_path):
    with pytest.raises(ValueError, match="not a meshfeed metric index"):
        MetricIndex.load(tmp_path)


def test_an_accumulated_array_that_is_not_the_one_its_meta_recorded_is_refused(tmp_path):
    docs = [[1], [2, 3]]
    save_accumulated(tmp_path / "old", "h", np.arange(5), content_fingerprint(docs))
    save_accumulated(tmp_path / "new", "h", np.arange(5) * 7, content_fingerprint(docs))
    assert sorted(p.name for p in (tmp_path / "old").iterdir()) == ["accumulated.npy", "meta.json"]
    (tmp_path / "new" / "meta.json").replace(tmp_path / "old" / "meta.json")  # half rewritten
    with pytest.raises(ValueError, match=r"old/accumulated.npy is not the file .*meta.json"):
        load_accumulated(tmp_path / "old")
