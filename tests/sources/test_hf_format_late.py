"""HFSource refuses a table format set in place after it was made, at the next read.

``HFSource`` checks the dataset's format when it is made; ``dataset.set_format("pandas")``
afterwards changes the same ``Dataset`` object in place, and reads then returned one-row tables
(``src[i]``: a dict of pandas Series) or column values picked by label, without a word."""

from __future__ import annotations

import pickle
from typing import Any

import pytest

from meshfeed.errors import NEVER_SUBSTITUTED, SourceError
from tests.optional import importable

pytestmark = pytest.mark.skipif(
    not importable("datasets"),
    reason='needs datasets (pip install "meshfeed[hf]"), which is not installed',
)


def make(n: int = 6) -> Any:
    import datasets

    return datasets.Dataset.from_dict({"id": list(range(n)), "text": [f"t{i}" for i in range(n)]})


NEEDS_POLARS = pytest.mark.skipif(
    not importable("polars"), reason="needs polars, which is not installed"
)
TABLE_FORMATS = ["pandas", "pd", "arrow", "pa", pytest.param("polars", marks=NEEDS_POLARS)]


@pytest.mark.parametrize("fmt", TABLE_FORMATS)
def test_a_table_format_set_after_the_source_is_made_is_refused_at_each_read(fmt: str) -> None:
    from meshfeed.sources.hf import FormatChangedError, HFSource

    ds = make()
    src = HFSource(ds)
    assert src[1] == {"id": 1, "text": "t1"}  # read before the change: fine
    ds.set_format(fmt)
    kind = ds.format["type"]
    fix = r"reset_format\(\).*set_format\(\"numpy\"\)"
    with pytest.raises(FormatChangedError, match=rf"has format '{kind}'.*one-row tables.*{fix}"):
        src[1]
    with pytest.raises(ValueError, match=rf"has format '{kind}'"):  # a ValueError, as at start
        src.__getitems__([2, 0])
    assert issubclass(FormatChangedError, NEVER_SUBSTITUTED)  # the loader raises, never swaps
    ds.reset_format()  # the fix the message names
    assert src[1] == {"id": 1, "text": "t1"}
    assert src.__getitems__([2, 0]) == [{"id": 2, "text": "t2"}, {"id": 0, "text": "t0"}]


@pytest.mark.parametrize("fmt", ["numpy", "torch", None])
def test_a_row_format_set_after_the_source_is_made_still_reads(fmt: str | None) -> None:
    from meshfeed.sources.hf import HFSource

    ds = make().with_format("numpy")
    src = HFSource(ds)
    ds.set_format(fmt)
    assert int(src[3]["id"]) == 3
    assert [int(r["id"]) for r in src.__getitems__([4, 1])] == [4, 1]


def test_the_source_of_a_copy_ignores_a_later_set_format_on_the_original() -> None:
    from meshfeed.sources.hf import HFSource

    ds = make()
    by_copy, by_columns = HFSource(ds.with_format(None)), HFSource(ds, columns=["id"])
    ds.set_format("pandas")
    assert by_copy[2] == {"id": 2, "text": "t2"}
    assert by_columns.__getitems__([2]) == [{"id": 2}]


def test_the_loader_raises_the_late_format_error_instead_of_substituting() -> None:
    from meshfeed.loader import DataLoader
    from meshfeed.sources.hf import FormatChangedError, HFSource

    ds = make(8)
    loader = DataLoader(HFSource(ds), batch_size=2, seed=1, collate_fn=list)
    ds.set_format("pandas")
    with pytest.raises(FormatChangedError, match="has format 'pandas'"):
        next(iter(loader))


def test_the_late_format_error_pickles_as_itself() -> None:
    from meshfeed.sources.hf import FormatChangedError, HFSource

    ds = make()
    src = pickle.loads(pickle.dumps(HFSource(ds)))  # a worker's copy checks as well
    src.dataset.set_format("arrow")
    with pytest.raises(FormatChangedError) as info:
        src[0]
    again = pickle.loads(pickle.dumps(info.value))
    assert type(again) is FormatChangedError and isinstance(again, SourceError)
    assert str(again) == str(info.value)
