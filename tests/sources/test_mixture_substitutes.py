"""A substitute for a bad or filtered sample of a Mixture comes from the same source, so the
weights hold through bad samples and filters (it was drawn from every source: with a filter
dropping a quarter of the samples, a weight-0 source made up 22% of the batches)."""

from __future__ import annotations

import collections
import logging

import numpy as np
import pytest

from meshfeed import DataLoader, LazyDataset, Mixture
from meshfeed.curriculum import Curriculum, CurriculumMetric, MetricIndex, fixed_linear
from meshfeed.fetch import Fetcher
from meshfeed.testing import assert_resume_equivalence, take

CODE, WEB = np.arange(0, 400), np.arange(10_000, 10_400)


def _source(x: int) -> str:
    return "code" if x < 10_000 else "web"


def _kept(x: int) -> bool:
    return x % 4 != 1  # a quarter of each source filtered out


def _filtered(weights) -> LazyDataset:
    return LazyDataset(Mixture({"code": CODE, "web": WEB}, weights, seed=0)).filter(_kept)


def _served(dataset, n: int = 40, **kw) -> list[int]:
    loader = DataLoader(dataset, batch_size=16, seed=1, warn_wait_share=None, **kw)
    return [int(x) for b in take(loader, n) for x in np.asarray(b).tolist()]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_filter_over_a_mixture_keeps_its_weights(workers):
    served = _served(_filtered({"code": 1, "web": 0}), num_workers=workers)
    assert {_source(x) for x in served} == {"code"}  # web, at weight 0, never served
    assert all(_kept(x) for x in served)
    counts = collections.Counter(map(_source, _served(_filtered({"code": 3, "web": 1}))))
    assert counts == {"code": 480, "web": 160}  # 3:1 exactly, filtered samples replaced


class _Broken:
    """A source whose listed samples raise (damaged records)."""

    def __init__(self, base: np.ndarray, bad: set[int]) -> None:
        self.base, self.bad = base, bad

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int) -> int:
        if i in self.bad:
            raise ValueError(f"record {i} is damaged")
        return int(self.base[i])


def test_a_bad_sample_is_replaced_from_its_own_source_and_resumes_exactly():
    def make() -> DataLoader:
        web = _Broken(WEB, bad=set(range(0, 400, 3)))
        mix = Mixture({"code": CODE, "web": web}, {"code": 1, "web": 1}, seed=0)
        return DataLoader(mix, batch_size=8, seed=2, warn_wait_share=None)

    out = assert_resume_equivalence(make, num_items=30)
    served = [int(x) for b in out for x in np.asarray(b).tolist()]
    assert collections.Counter(map(_source, served)) == {"code": 120, "web": 120}


def test_a_nested_mixture_substitutes_within_the_innermost_source():
    inner = Mixture({"a": np.arange(100), "b": np.arange(1000, 1100)}, {"a": 1, "b": 1})
    outer = Mixture({"ab": inner, "c": np.arange(5000, 5100)}, {"ab": 1, "c": 1})
    assert outer.substitute_span(0) == (0, 100)  # inner source a
    assert outer.substitute_span(150) == (100, 100)  # inner source b
    assert outer.substitute_span(250) == (200, 100)  # c
    fetcher = Fetcher(LazyDataset(outer), seed=0)
    for attempt in range(1, 17):  # the first 16 substitutes: the source's own
        assert 100 <= fetcher.substitute_index(0, 7, attempt, 150) < 200
    later = {fetcher.substitute_index(0, p, 17, 150) for p in range(200)}
    assert min(later) < 100 or max(later) >= 200  # then any index


def test_a_plain_dataset_still_substitutes_from_every_index():
    fetcher = Fetcher(list(range(50)), seed=0)
    picks = {fetcher.substitute_index(0, p, 1, 3) for p in range(400)}
    assert picks == set(range(50))


def test_the_warning_says_a_substitute_is_not_gated_by_a_curriculum(caplog):
    values = np.arange(400) % 10 + 1
    index = MetricIndex.from_values("v", values, fingerprint={"length": 400, "hash": "v"})
    curriculum = Curriculum([CurriculumMetric(index=index, schedule=fixed_linear(2, 10, 20, 1))])
    data = LazyDataset(np.arange(400)).filter(_kept)
    with caplog.at_level(logging.WARNING, logger="meshfeed"):
        _served(data, n=4, curriculum=curriculum)
    assert "not gated by the curriculum" in caplog.text


def test_a_source_damaged_throughout_falls_back_to_any_source_and_the_run_goes_on():
    # Substitutes come from the bad sample's source first; a one-record source whose record is
    # damaged would fail all of them and end the run, which went on before.
    tiny = _Broken(np.arange(90_000, 90_001), bad={0})
    mix = Mixture({"web": WEB, "tiny": tiny}, {"web": 99, "tiny": 1}, seed=0)
    loader = DataLoader(mix, batch_size=16, seed=1, warn_wait_share=None)
    served = [int(x) for b in take(loader, 40) for x in np.asarray(b).tolist()]
    assert len(served) == 640 and 90_000 not in served
    assert loader.stats()["substituted"] >= 1
