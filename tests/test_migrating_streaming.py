"""docs/migrating/streaming.md runs as written, and the names its table promises exist."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

import meshfeed
from meshfeed.sources import ShardedStream, mds_stream, wds_stream, write_shards

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "migrating" / "streaming.md"


def _blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", GUIDE.read_text(), flags=re.DOTALL)


def test_the_guide_has_a_before_and_an_after_example_and_a_names_table():
    text = GUIDE.read_text()
    before, after = _blocks()
    assert "StreamingDataset" in before and "proportion=" in before and "epoch_size=" in before
    assert "Mixture" in after and "samples_per_epoch=" in after and "load_state_dict" in after
    assert "## Coming from MosaicML Streaming or litdata" in text


def test_the_after_example_runs():
    pytest.importorskip("zstandard", reason="the example writes zstd shards: meshfeed[zstd]")
    scope: dict[str, object] = {}
    exec(compile(_blocks()[1], str(GUIDE), "exec"), scope)  # its own asserts are the check
    assert len(scope["served"]) == 1280  # type: ignore[arg-type]


def test_the_keywords_the_table_maps_to_exist():
    from_index = inspect.signature(ShardedStream.from_index).parameters
    stream = inspect.signature(ShardedStream).parameters
    for name in ("cache_dir", "cache_limit", "storage_options"):
        assert name in from_index and name in stream
    for name in ("shuffle_buffer", "samples_per_epoch", "seed"):
        assert name in stream
    writer = inspect.signature(write_shards).parameters
    for name in ("bytes_per_shard", "rows_per_shard", "compression", "num_workers"):
        assert name in writer
    assert callable(mds_stream) and callable(wds_stream)
    assert hasattr(meshfeed.Mixture, "reweight") and meshfeed.StreamLoader
