"""A loader nested below the top level of a ``torch.distributed.checkpoint`` dict is refused.

DCP calls ``state_dict()`` / ``load_state_dict()`` only on the top-level values of the dict it
is given; a loader nested deeper (``{"app": {"model": ..., "data": loader}}``) was pickled whole.
Without a live iterator the save succeeded and the load left the user's loader at position 0 (the
epoch repeated, silently); with one, the save failed with "cannot pickle 'weakref'". Loaders now
refuse pickling and copying by name, naming the fix (the loader at the top level, or its
``state_dict()``), and the top-level use keeps working.
"""

from __future__ import annotations

import copy
import copyreg
import io
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from meshfeed import DataLoader, StreamLoader
from meshfeed.sources.streams.stream import ShardedStream
from meshfeed.testing import take

FIX = "put the loader at the top level of the dict given to dcp.save / dcp.load"


def _loader() -> DataLoader:
    return DataLoader(np.arange(200), batch_size=8, seed=0, rampup=(4, 4, 40))


def _stream_loader() -> StreamLoader:
    stream = ShardedStream([lambda k=k: range(k, k + 20) for k in range(0, 60, 20)])
    return StreamLoader(stream, batch_size=4, seed=0)


@pytest.mark.parametrize("live", [True, False])
def test_a_loader_nested_in_a_dcp_dict_is_refused_naming_the_fix(tmp_path: Path, live: bool):
    loader = _loader()
    it = iter(loader)
    for _ in range(5):
        next(it)
    if not live:  # e.g. right after a resume: no iterator (the save succeeded silently before)
        resumed = _loader()
        resumed.load_state_dict(loader.state_dict())
        loader = resumed
    model = torch.nn.Linear(2, 2)
    with pytest.raises(CheckpointException) as err:  # DCP wraps the loader's TypeError
        dcp.save(
            {"app": {"model": model.state_dict(), "data": loader}},
            checkpoint_id=str(tmp_path),
            no_dist=True,
        )
    msg = str(err.value)
    assert "DataLoader cannot be pickled" in msg and FIX in msg
    assert "loader.state_dict()" in msg
    assert "weakref" not in msg


def test_a_top_level_loader_still_round_trips_through_dcp(tmp_path: Path):
    loader = _loader()
    take(loader, 5)
    model = torch.nn.Linear(2, 2)
    path = str(tmp_path)
    dcp.save(
        {"app": {"model": model.state_dict()}, "data": loader}, checkpoint_id=path, no_dist=True
    )
    fresh = _loader()
    dcp.load(
        {"app": {"model": model.state_dict()}, "data": fresh}, checkpoint_id=path, no_dist=True
    )
    assert fresh.position == loader.position > 0
    assert next(iter(fresh)).tolist() == next(iter(loader)).tolist()


@pytest.mark.parametrize("make", [_loader, _stream_loader])
@pytest.mark.parametrize("how", [pickle.dumps, copy.copy, copy.deepcopy])
def test_pickling_or_copying_a_loader_is_refused_by_name(make: Any, how: Any):
    loader = make()
    take(loader, 1)
    with pytest.raises(TypeError) as err:
        how(loader)
    assert f"{type(loader).__name__} cannot be pickled or copied" in str(err.value)
    assert FIX in str(err.value)
    assert len(take(loader, 1)) == 1  # the loader itself is untouched


def test_a_loader_pickled_by_an_older_meshfeed_is_refused_when_loaded():
    # What an older meshfeed wrote for a nested loader: the object's class and its __dict__.
    class OldPickler(pickle.Pickler):
        def reducer_override(self, obj: Any) -> Any:
            if isinstance(obj, DataLoader):
                return copyreg.__newobj__, (type(obj),), {"_position": 40}  # type: ignore[attr-defined]
            return NotImplemented

    buffer = io.BytesIO()
    OldPickler(buffer, protocol=4).dump(_loader())
    with pytest.raises(TypeError, match="DataLoader cannot be pickled or copied"):
        pickle.loads(buffer.getvalue())


@pytest.mark.slow
def test_a_worker_pool_under_spawn_still_starts():
    # Workers get the fetcher pickled (the dataset, collate_fn), never the loader.
    loader = DataLoader(
        list(range(16)), batch_size=4, seed=0, num_workers=1, multiprocessing_context="spawn"
    )
    with loader:
        got = [b.tolist() for b in loader]
    assert sorted(x for b in got for x in b) == list(range(16))
