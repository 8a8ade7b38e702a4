"""A metric index built for another dataset of the same length is refused by its content
fingerprint (``Curriculum.check_dataset``); datasets without a stable fingerprint, and indexes
with a fingerprint given by hand, are checked by length alone."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest

import meshfeed
from meshfeed.curriculum import (
    Curriculum,
    CurriculumIndexWarning,
    CurriculumMetric,
    MetricIndex,
    content_fingerprint,
    fixed_linear,
)
from meshfeed.curriculum.index import is_content_fingerprint, stable_fingerprint
from meshfeed.sources import LazyDataset

DATA = np.arange(200)
OTHER = np.arange(1000, 1200)[::-1].copy()  # another dataset, the same length


def _curriculum(fingerprint: dict[str, Any], name: str = "m") -> Curriculum:
    index = MetricIndex.from_values(name, DATA.astype(np.float64), fingerprint=fingerprint)
    return Curriculum([CurriculumMetric(index=index, schedule=fixed_linear(10, 200, 20))])


class _Counted:
    """200 items of ``make(i)``, counting the reads."""

    def __init__(self, make: Any) -> None:
        self.make, self.reads = make, 0

    def __len__(self) -> int:
        return len(DATA)

    def __getitem__(self, i: int) -> Any:
        self.reads += 1
        return self.make(i)


def test_an_index_of_another_dataset_is_refused_by_name() -> None:
    cur = _curriculum(content_fingerprint(DATA))
    cur.check_dataset(DATA)
    cur.check_dataset(LazyDataset(DATA).map(lambda x: x * 2))  # its source matches
    other = content_fingerprint(OTHER)["hash"]
    with pytest.warns(CurriculumIndexWarning, match=rf"metric index 'm' was built for another "
                      rf"dataset of 200 samples .*this dataset {other}\): unless this dataset "
                      "transforms that one"):  # fmt: skip
        cur.check_dataset(OTHER)


def test_the_check_reads_a_bounded_sample_and_skips_unstable_content() -> None:
    cur = _curriculum(content_fingerprint(DATA))
    plain = _Counted(lambda i: int(DATA[i]) + 1)
    with pytest.warns(CurriculumIndexWarning, match="another dataset"):
        cur.check_dataset(plain)
    assert plain.reads == 32  # 16 sampled items, twice; never the whole dataset
    rng = np.random.default_rng(0)
    counter = itertools.count()
    for unstable in (
        _Counted(lambda i: rng.random(3)),  # random augmentation: reads differ
        _Counted(lambda i: object()),  # hashed by a repr that names an address
        _Counted(lambda i: {"x": [np.zeros(2), object()]}),
        _Counted(lambda i: 1 / 0),  # unreadable
        _Counted(lambda i: next(counter)),
    ):
        cur.check_dataset(unstable)  # no stable content to compare: not refused
    assert stable_fingerprint(_Counted(lambda i: {"a": [np.int64(i), "s", None]})) is not None


def test_a_fingerprint_given_by_hand_is_checked_by_length_only() -> None:
    assert is_content_fingerprint(content_fingerprint(DATA))
    for made_up in ({"length": 200, "hash": "t"}, {"length": 200}):
        assert not is_content_fingerprint(made_up)
        _curriculum(made_up).check_dataset(OTHER)


def test_the_loader_warns_of_an_index_of_another_dataset() -> None:
    cur = _curriculum(content_fingerprint(DATA))
    with pytest.warns(CurriculumIndexWarning, match="metric index 'm' was built for another"):
        meshfeed.DataLoader(OTHER, batch_size=4, seed=0, curriculum=cur)
