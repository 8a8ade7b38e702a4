"""HFSource: a datasets.Dataset as a map-style source with one batched read per batch."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

datasets = pytest.importorskip("datasets")

from meshfeed.loader import DataLoader  # noqa: E402
from meshfeed.sources.hf import HFSource  # noqa: E402
from meshfeed.testing import assert_resume_equivalence  # noqa: E402


def make(n: int = 10) -> Any:
    return datasets.Dataset.from_dict(
        {"id": list(range(n)), "text": [f"t{i}" for i in range(n)], "v": [[i, i] for i in range(n)]}
    )


def test_getitems_returns_rows_in_index_order() -> None:
    src = HFSource(make())
    assert len(src) == 10
    assert src.__getitems__([7, 0, 7]) == [
        {"id": 7, "text": "t7", "v": [7, 7]},
        {"id": 0, "text": "t0", "v": [0, 0]},
        {"id": 7, "text": "t7", "v": [7, 7]},
    ]
    assert src[-1]["id"] == 9
    assert src.__getitems__([]) == []


@pytest.mark.parametrize("fmt", ["arrow", "pandas", "pa", "pd"])
def test_a_table_format_is_refused_by_name(fmt: str) -> None:
    with pytest.raises(ValueError, match=r"has format '(arrow|pandas)'.*with_format\(None\)"):
        HFSource(make().with_format(fmt))
    with pytest.raises(ValueError, match="one-row tables"):
        HFSource(make().with_format(fmt), columns=["id"])


@pytest.mark.parametrize("fmt", [None, "numpy", "torch"])
def test_a_single_read_and_a_batched_read_give_the_same_rows(fmt: str | None) -> None:
    src = HFSource(make().with_format(fmt))
    batch = src.__getitems__([3, 1])
    for row, i in zip(batch, (3, 1), strict=True):
        one = src[i]
        assert isinstance(one, dict) and sorted(one) == sorted(row) == ["id", "text", "v"]
        for k in row:
            a, b = one[k], row[k]
            assert type(a) is type(b)
            if isinstance(a, torch.Tensor):
                assert torch.equal(a, b)
            elif isinstance(a, np.ndarray):
                assert np.array_equal(a, b)
            else:
                assert a == b
    assert int(batch[0]["id"]) == 3 and list(map(int, batch[1]["v"])) == [1, 1]


def test_getitems_is_one_batched_read(monkeypatch: pytest.MonkeyPatch) -> None:
    ds = make()
    calls: list[Any] = []
    original = type(ds).__getitem__

    def spy(self: Any, key: Any) -> Any:
        calls.append(key)
        return original(self, key)

    monkeypatch.setattr(type(ds), "__getitem__", spy)
    HFSource(ds).__getitems__([3, 1, 4, 1, 5])
    assert calls == [[3, 1, 4, 1, 5]]


def test_columns_select_and_unknown_columns_are_named() -> None:
    src = HFSource(make(), columns=["text"])
    assert src.__getitems__([2]) == [{"text": "t2"}]
    assert src.column_names == ["text"]
    with pytest.raises(ValueError, match=r"columns \['nope'\] are not in the dataset"):
        HFSource(make(), columns=["nope"])


def test_torch_format_yields_tensors_per_row() -> None:
    src = HFSource(make().with_format("torch"), columns=["v"])
    rows = src.__getitems__([1, 2])
    assert torch.equal(rows[1]["v"], torch.tensor([2, 2]))


def test_non_random_access_inputs_are_rejected_with_the_fix() -> None:
    with pytest.raises(TypeError, match=r"pick one, e.g. HFSource\(dataset\['train'\]\)"):
        HFSource(datasets.DatasetDict({"train": make()}))
    with pytest.raises(TypeError, match="not random access"):
        HFSource(make().to_iterable_dataset())
    with pytest.raises(TypeError, match="must be a datasets.Dataset"):
        HFSource([1, 2, 3])
    with pytest.raises(IndexError, match=r"outside \[0, 10\)"):
        HFSource(make()).__getitems__([10])


def test_fingerprint_follows_the_dataset_content() -> None:
    a = HFSource(make()).fingerprint
    assert a == HFSource(make()).fingerprint
    assert a != HFSource(make(11)).fingerprint
    assert a != HFSource(make().map(lambda r: {"id": r["id"] + 1})).fingerprint


def test_loader_reads_hf_rows_and_resumes_exactly() -> None:
    def collate(rows: list[dict[str, Any]]) -> list[int]:
        return [r["id"] for r in rows]

    ref = assert_resume_equivalence(
        lambda: DataLoader(HFSource(make(9)), batch_size=2, seed=5, collate_fn=collate),
        num_items=10,
    )
    first_epoch = sum(ref[:4], [])
    assert len(set(first_epoch)) == 8


@pytest.mark.parametrize("fmt", ["numpy", "torch"])
def test_a_batched_row_does_not_depend_on_the_other_rows_of_its_batch(fmt: str) -> None:
    """datasets formats a batch as a whole: an int column with a null in the batch came back
    as float32 (16777217 -> 16777216.0) and float64 as float32, while src[i] gave the row's
    own values; a row's value depended on its neighbours."""
    ds = datasets.Dataset.from_dict(
        {"id": [16_777_217, None, 123_456_789], "score": [0.1, 0.2, 1 / 3]}
    ).with_format(fmt)
    src = HFSource(ds)
    for keys in ([0, 1, 2], [2, 0], [0]):
        for i, row in zip(keys, src.__getitems__(keys), strict=True):
            one = src[i]
            for k in ("id", "score"):
                a, b = one[k], row[k]
                assert type(a) is type(b), (keys, i, k)
                if a is None:
                    assert b is None
                    continue
                assert a.dtype == b.dtype, (keys, i, k, a, b)
                assert np.array_equal(np.asarray(a), np.asarray(b), equal_nan=True), (keys, i, k)
    assert int(src.__getitems__([0, 1])[0]["id"]) == 16_777_217


def test_a_null_in_a_string_column_keeps_the_batched_formatting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A null in a string column formats alike in a batch and alone: the batch is formatted
    once (not every row alone, 10-17x slower)."""
    from datasets import formatting

    ds = datasets.Dataset.from_dict(
        {"x": list(range(64)), "s": [None if i == 5 else f"t{i}" for i in range(64)]}
    ).with_format("torch")
    src = HFSource(ds)
    calls: list[Any] = []
    real = formatting.format_table
    monkeypatch.setattr(
        formatting, "format_table", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    rows = src.__getitems__(list(range(64)))
    assert len(calls) == 2  # the first row alone (the check) and the batch
    assert rows[5]["s"] is None and int(rows[63]["x"]) == 63
