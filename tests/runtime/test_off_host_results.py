"""A batch made in a worker process (or a Ray loader actor) that holds a tensor on a device is
refused with the fix, on every door, whatever ``on_error`` says: pickled as torch pickles it, a
CUDA tensor would come back on the worker's device (``cuda:0`` for every rank of a node) after
a copy through host memory. ``meta`` tensors stand in for CUDA ones here (no GPU needed); the
in-process path leaves device tensors as they are (nothing crosses a process there)."""

from __future__ import annotations

import pytest
import torch

from meshfeed import DataLoader, StreamLoader
from meshfeed.queue import SampleStore, StoreLoader
from meshfeed.runtime.transport import off_host
from meshfeed.sources import ShardedStream
from meshfeed.testing import take

REFUSED = r"holds a tensor on device 'meta' \(shape \(4, 3\), torch\.int64\).*device='cuda'"


class _OnMeta:
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> dict:
        return {"i": i, "x": torch.full((3,), i, device="meta")}


def _on_meta() -> _OnMeta:
    return _OnMeta()


def _shard():
    return ({"x": torch.full((3,), i, device="meta")} for i in range(8))


def _to_meta(batch) -> torch.Tensor:
    return torch.tensor([[i] * 3 for i in batch.ids]).to("meta")


def test_off_host_names_the_device_and_passes_host_tensors():
    assert off_host(torch.zeros(2)) is None and off_host([torch.zeros(2)]) is None
    error = off_host(torch.zeros(4, 3, dtype=torch.int64, device="meta"))
    assert isinstance(error, ValueError)
    assert "device 'meta'" in str(error) and "num_workers=0" in str(error)


@pytest.mark.parametrize("on_error", [None, "skip"])
def test_a_map_style_workers_device_tensor_is_refused_whatever_on_error_says(on_error):
    kwargs = {} if on_error is None else {"on_error": on_error}
    with (
        DataLoader(_OnMeta(), batch_size=4, num_workers=2, **kwargs) as loader,
        pytest.raises(ValueError, match=REFUSED),
    ):
        take(loader, 1)


def test_in_process_batches_keep_their_device():
    with DataLoader(_OnMeta(), batch_size=4) as loader:
        assert take(loader, 1)[0]["x"].device.type == "meta"


def test_a_stream_workers_device_tensor_is_refused():
    stream = ShardedStream([_shard, _shard], rows=[8, 8])
    with (
        StreamLoader(stream, batch_size=4, num_workers=2, timeout=30) as loader,
        pytest.raises(ValueError, match=REFUSED),
    ):
        take(loader, 1)


def test_a_store_workers_device_tensor_is_refused():
    store = SampleStore(tasks=["t"])
    store.put("p", {"x": list(range(8))})
    store.close("p")
    loader = StoreLoader(
        store,
        task="t",
        fields=["x"],
        batch_size=4,
        partition="p",
        mesh={"dp": 1},
        rank=0,
        num_workers=2,
        timeout=30,
        collate_fn=_to_meta,
    )
    with loader, pytest.raises(ValueError, match=REFUSED):
        take(loader, 1)


@pytest.mark.ray
def test_a_ray_loader_actors_device_tensor_is_refused(ray_session):
    import ray

    from meshfeed.services.ray import RayService

    with (
        DataLoader(_on_meta, mesh={"dp": 1}, service=RayService(), batch_size=4) as loader,
        pytest.raises(
            ValueError, match=REFUSED.replace("holds", "a batch of a Ray loader actor holds")
        ),
    ):
        ray.get(take(loader, 1)[0].for_rank(0))
