"""meshfeed shards: arrays with no elements (a zero in the shape) round-trip, compressed or
not, in fixed- and variable-shape columns; samples with no fields are refused by name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from meshfeed.sources import ShardedStream, ShardFormatReader, write_shards
from tests.optional import ZSTD
from tests.sources.test_sources_shards import assert_same

COMPRESSIONS = [None, ZSTD]


def _samples() -> dict[str, list[Any]]:
    """Columns by case: every row empty (fixed), empty among non-empty (var), tensors."""
    return {
        "fixed_1d": [{"id": i, "a": np.zeros(0, np.int64)} for i in range(5)],
        "fixed_2d": [{"boxes": np.zeros((0, 4), np.float32)} for _ in range(5)],
        "var_2d": [
            {"boxes": np.arange(4 * (i % 3), dtype=np.float32).reshape(-1, 4)} for i in range(5)
        ],
        "var_shapes": [{"m": np.zeros((0, i + 1), np.int16)} for i in range(5)],
        "tensor": [torch.zeros(i % 2, 3, dtype=torch.bfloat16) for i in range(5)],
    }


@pytest.mark.parametrize("compression", COMPRESSIONS)
@pytest.mark.parametrize("case", sorted(_samples()))
def test_zero_size_arrays_round_trip(tmp_path: Path, compression: str | None, case: str) -> None:
    samples = _samples()[case]
    index = write_shards(
        samples, tmp_path / "ds", rows_per_shard=4, block_rows=3, compression=compression
    )
    reader = ShardFormatReader.from_index(index)
    got = [s for shard in reader.shards for s in reader(shard)]
    assert len(got) == len(samples)
    for a, b in zip(samples, got, strict=True):
        assert_same(a, b)
    stream = ShardedStream.from_index(index)  # by row, out of order
    for i in (4, 0, 3):
        assert_same(samples[i], stream[i])


def test_samples_with_no_fields_are_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"row 0 is a dict with no fields.*at least one field"):
        write_shards([{}, {}], tmp_path / "ds")
    assert not (tmp_path / "ds").exists()
