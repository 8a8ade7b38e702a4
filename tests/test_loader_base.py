"""What every loader shares: argument checks, the epoch API, the state envelope, DCP."""

from __future__ import annotations

import json
import math
import pathlib

import pytest
import torch

from meshfeed import DataLoader, StreamLoader
from meshfeed.loader_base import LoaderBase
from meshfeed.options import MAX_TIMEOUT, check_loader_arguments, resolve_timeout
from meshfeed.sources import ShardedStream
from meshfeed.testing import take


class Squares:
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i * i


def _stream() -> ShardedStream:
    return ShardedStream([lambda: iter(range(6)), lambda: iter(range(6, 12))])


def _both(**kwargs):
    """Build both loaders with the same arguments (each must refuse or accept alike)."""
    yield lambda: DataLoader(Squares(16), **kwargs)
    yield lambda: StreamLoader(_stream(), **kwargs)


# ---------------------------------------------------------------------- arguments (#11 8-10)
@pytest.mark.parametrize("name", ["shuffle", "drop_last", "pin_memory"])
@pytest.mark.parametrize("value", ["False", 0, 1, None])
def test_non_bool_flags_are_refused_naming_the_argument(name, value):
    for build in _both(batch_size=2, **{name: value}):
        with pytest.raises(TypeError, match=f"{name} must be True or False"):
            build()


@pytest.mark.parametrize("seed", [2**64, 2**70, -1])
def test_seeds_outside_64_bits_are_refused(seed):
    for build in _both(batch_size=2, seed=seed):
        with pytest.raises(ValueError, match="seed must be a non-negative int below 2\\*\\*64"):
            build()
    DataLoader(Squares(16), batch_size=2, seed=2**64 - 1)  # the largest seed is fine


@pytest.mark.parametrize("timeout", [True, "5"])
def test_non_number_timeouts_are_refused(timeout):
    for build in _both(batch_size=2, timeout=timeout):
        with pytest.raises(TypeError, match="timeout must be positive seconds"):
            build()


def test_nan_timeout_is_refused_and_inf_means_without_limit():
    for build in _both(batch_size=2, timeout=math.nan):
        with pytest.raises(ValueError, match="use math.inf to wait without limit"):
            build()
    assert resolve_timeout(math.inf) == MAX_TIMEOUT == resolve_timeout(1e300)
    assert resolve_timeout(5) == 5.0


def test_dataloader_with_infinite_timeout_and_a_worker_iterates():
    loader = DataLoader(Squares(16), batch_size=4, shuffle=False, num_workers=1, timeout=math.inf)
    try:
        assert [b.tolist() for b in loader][:2] == [[0, 1, 4, 9], [16, 25, 36, 49]]
        assert loader.timeout == math.inf and loader.wait_timeout == MAX_TIMEOUT
    finally:
        loader.shutdown()


@pytest.mark.parametrize("path", ["data/corpus", pathlib.Path("data/corpus"), b"data"])
def test_a_path_is_not_a_dataset(path):
    with pytest.raises(TypeError, match=r"is a path, not a dataset.*TokenWindows\(path, seq_len"):
        DataLoader(path, batch_size=2)


def test_one_check_function_with_the_loaders_keyword_names():
    with pytest.raises(ValueError, match="on_error='ignore'"):
        check_loader_arguments(batch_size=2, seed=0, on_error="ignore")
    with pytest.raises(ValueError, match="multiprocessing_context"):
        check_loader_arguments(batch_size=2, seed=0, multiprocessing_context="thread")
    check_loader_arguments(batch_size=2, seed=0)


def test_a_lambda_collate_with_spawned_workers_says_why():
    for build in _both(
        batch_size=2,
        num_workers=1,
        multiprocessing_context="spawn",
        collate_fn=lambda items: items,
    ):
        with pytest.raises(TypeError, match="spawned workers need importable functions"):
            build()


def test_both_loaders_share_the_base_and_its_lifecycle():
    for build in _both(batch_size=2):
        with build() as loader:
            assert isinstance(loader, LoaderBase)
            assert loader.epoch == 0
        loader.shutdown()  # idempotent


def _every_door(**kwargs):
    """The three doors (map-style, stream, store) built with the same shared arguments."""
    from meshfeed.queue import SampleStore, StoreLoader

    yield from _both(**kwargs)
    store = SampleStore()
    yield lambda: StoreLoader(store, task="t", fields=["x"], partition="p", **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"batch_size": 0}, ValueError, r"batch_size must be a positive int per data rank \(got"),
        ({"batch_size": 2, "prefetch": True}, TypeError, "prefetch must be an int >= 1"),
        ({"batch_size": 2, "timeout": math.nan}, ValueError, "timeout must be positive seconds"),
        ({"batch_size": 2, "on_error": "ignore"}, ValueError, "on_error='ignore' is not one of"),
    ],
)
def test_every_door_refuses_a_bad_shared_argument_with_the_same_message(kwargs, error, match):
    messages = set()
    for build in _every_door(**kwargs):
        with pytest.raises(error, match=match) as refused:
            build()
        messages.add(str(refused.value))
    assert len(messages) == 1  # one options object validates every door


def test_every_door_is_a_loader_base_with_its_options():
    for build in _every_door(batch_size=2, prefetch=3):
        with build() as loader:
            assert isinstance(loader, LoaderBase)
            assert (loader.options.batch_size, loader.options.prefetch) == (2, 3)
            assert loader.epoch == 0


@pytest.mark.parametrize("loader", ["DataLoader", "StreamLoader"])
def test_a_mesh_of_two_ranks_without_rank_or_process_group_is_refused(loader, monkeypatch):
    """Guessing rank 0 would make every process read the same data."""
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    stream = ShardedStream([lambda: range(8), lambda: range(8)])

    def build() -> LoaderBase:
        if loader == "DataLoader":
            return DataLoader(list(range(16)), batch_size=2, mesh={"dp": 2})
        return StreamLoader(stream, batch_size=2, mesh={"dp": 2})

    with pytest.raises(ValueError, match=r"the world has 2 processes \(from the mesh\)"):
        build()
    monkeypatch.setenv("RANK", "1")
    assert build().data_rank == 1
    monkeypatch.delenv("RANK")
    assert DataLoader(list(range(16)), batch_size=2, mesh={"dp": 1}).data_rank == 0


# ---------------------------------------------------------------------- epochs (#14)
def _run(loader: DataLoader, num_epochs: int, stop_after: int | None = None) -> list:
    seen = []
    for epoch in loader.epochs(num_epochs):
        for batch in loader:
            seen.append((epoch, batch.tolist()))
            if stop_after is not None and len(seen) == stop_after:
                return seen
    return seen


def test_epochs_resume_where_the_checkpoint_says():
    def build() -> DataLoader:
        return DataLoader(Squares(12), batch_size=4, seed=3)

    full = _run(build(), 3)
    assert [e for e, _ in full] == [0] * 3 + [1] * 3 + [2] * 3
    first = build()
    head = _run(first, 3, stop_after=5)
    state = json.loads(json.dumps(first.state_dict()))
    resumed = build()
    resumed.load_state_dict(state)
    assert resumed.epoch == 1
    assert head + _run(resumed, 3) == full


def test_epochs_moves_on_when_an_epoch_is_left_early():
    loader = DataLoader(Squares(12), batch_size=4, shuffle=False)
    got = []
    for epoch in loader.epochs(3):
        got.append((epoch, next(iter(loader)).tolist()))
    assert got == [(0, [0, 1, 4, 9]), (1, [0, 1, 4, 9]), (2, [0, 1, 4, 9])]
    assert list(loader.epochs(3)) == [2]  # left in epoch 2 at position 4: it continues there
    assert len(list(loader)) == 2 and loader.epoch == 3
    assert list(loader.epochs(3)) == []
    with pytest.raises(ValueError, match="num_epochs must be an int >= 0"):
        next(loader.epochs(-1))


def test_set_epoch_backwards_after_a_resume_raises_unless_allowed():
    source = DataLoader(Squares(12), batch_size=4)
    take(source, 10)  # epoch 3, position 4
    loader = DataLoader(Squares(12), batch_size=4)
    loader.load_state_dict(source.state_dict())
    assert loader.epoch == 3
    with pytest.raises(ValueError, match=r"set_epoch\(0\) goes back from epoch 3"):
        loader.set_epoch(0)
    loader.set_epoch(3)  # the same epoch keeps the resume
    assert loader.position == 4
    loader.set_epoch(1, allow_rewind=True)
    assert (loader.epoch, loader.position) == (1, 0)
    fresh = DataLoader(Squares(12), batch_size=4)
    fresh.set_epoch(5)
    fresh.set_epoch(2)  # without a resume, moving around is the user's business
    for bad in (-1, 2**32, True, 1.0):
        with pytest.raises(ValueError, match="epoch must be an int in"):
            fresh.set_epoch(bad)  # type: ignore[arg-type]


# ---------------------------------------------------------------------- state (#10, #11 11)
def _state(**changes):
    loader = DataLoader(Squares(16), batch_size=4, seed=1)
    take(loader, 2)
    state = json.loads(json.dumps(loader.state_dict()))
    for key, value in changes.items():
        if "." in key:
            outer, inner = key.split(".")
            state[outer][inner] = value
        else:
            state[key] = value
    return state


def test_loader_state_is_the_one_envelope():
    state = _state()
    assert (state["kind"], state["version"]) == ("loader", 2)
    assert state["stats"] == {
        "retries": 0,
        "substituted": 0,
        "skipped": 0,
        "padded": 0,
        "failures": [],
    }


def test_a_version_1_loader_state_of_the_previous_release_is_refused_by_name():
    old = {k: v for k, v in _state().items() if k != "kind"}
    old["version"] = 1
    old["stats"]["failures"] = [{"index": 1}]  # the old layout, never misread
    with pytest.raises(
        ValueError, match=r"version=1, this meshfeed reads version 2.*meshfeed 0\.1"
    ):
        DataLoader(Squares(16), batch_size=4, seed=1).load_state_dict(old)


def test_a_whole_training_checkpoint_is_refused_naming_the_fix():
    whole = {"model": {"w": 1}, "optimizer": {}, "data": _state()}
    with pytest.raises(ValueError, match=r"whole training checkpoint.*checkpoint\[\"data\"\]"):
        DataLoader(Squares(16), batch_size=4, seed=1).load_state_dict(whole)


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"epoch": 10**30}, "epoch=10{30}.*beyond the largest epoch"),
        ({"epoch": -1}, "'epoch' is negative"),
        ({"position": 17}, "position 17 is beyond the epoch length 16"),
        ({"position": "4"}, "'position' has '4'"),
        ({"stats": "garbage"}, "'stats' has 'garbage'"),
        ({"stats.retries": -3}, "'retries' is -3"),
        ({"stats.padded": 2**63}, "'padded' is 9223372036854775808"),
        ({"stats.substituted": True}, "'substituted' is True"),
        ({"stats.extra": 1}, "'stats' has keys"),
        ({"stats.failures": [[1, 2, 3]]}, r"failure \[1, 2, 3\] is not"),
        ({"stats.failures": [[-1, 2, 0, "E", "m"]]}, "is not"),
        ({"stats.failures": [[1, 2, 0, "E", "m"]] * 9}, "at most 8 rows"),
        ({"global_batch_size": 0}, "'global_batch_size' must be >= 1"),
        ({"order": {"step": 1}}, "has order facts"),
        ({"shuffle": "True"}, "'shuffle' has 'True'"),
    ],
)
def test_every_field_of_a_loader_state_is_checked(changes, match):
    loader = DataLoader(Squares(16), batch_size=4, seed=1)
    with pytest.raises(ValueError, match=match):
        loader.load_state_dict(_state(**changes))
    assert (loader.epoch, loader.position) == (0, 0)  # a refused state changes nothing


# ---------------------------------------------------------------------- DCP (#14)
class Flaky:
    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> int:
        if i % 7 == 3:
            raise OSError(f"bad record {i}")
        return i


def test_loader_state_round_trips_through_torch_distributed_checkpoint(tmp_path):
    dcp = pytest.importorskip("torch.distributed.checkpoint")

    def build() -> DataLoader:
        return DataLoader(Flaky(), batch_size=4, seed=5, drop_last=False)

    source = build()
    take(source, 12)  # across an epoch boundary, with substitutions recorded
    assert source.stats()["failures"] and source.stats()["substituted"] > 0
    with pytest.warns(UserWarning):  # DCP says it runs without a process group
        dcp.save({"data": source}, checkpoint_id=str(tmp_path), no_dist=True)
    resumed = build()
    with pytest.warns(UserWarning):
        dcp.load({"data": resumed}, checkpoint_id=str(tmp_path), no_dist=True)
    assert resumed.state_dict() == source.state_dict()
    assert resumed.stats()["failures"] == source.stats()["failures"]
    want = take(source, 6)
    got = take(resumed, 6)
    assert [w.tolist() for w in want] == [g.tolist() for g in got]
    assert isinstance(want[0], torch.Tensor)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"prefetch": 4}, "prefetch=4"),
        ({"timeout": 5.0}, "timeout=5.0"),
        ({"multiprocessing_context": "spawn"}, "multiprocessing_context='spawn'"),
    ],
)
def test_arguments_a_given_service_decides_are_refused_not_ignored(kwargs, name):
    from meshfeed.services import InProcessService

    with pytest.raises(ValueError, match=f"{name} would be ignored"):
        DataLoader(Squares(8), batch_size=2, service=InProcessService(), **kwargs)
    DataLoader(Squares(8), batch_size=2, service=InProcessService())  # defaults are fine


def test_loader_options_are_validated_once_and_kept_on_the_loader():
    from meshfeed.options import LoaderOptions

    loader = DataLoader(Squares(16), batch_size=2, seed=3, drop_last=False)
    assert loader.options == LoaderOptions(batch_size=2, seed=3, drop_last=False)
    assert loader.options.on_error == "substitute"  # None means the default
    with pytest.raises(ValueError, match="pad_last=False would be ignored with drop_last=True"):
        LoaderOptions(batch_size=2, pad_last=False)
    with pytest.raises(TypeError, match="pad_last must be True or False"):
        LoaderOptions(batch_size=2, pad_last="no")
    with pytest.raises(AttributeError):
        loader.options.batch_size = 4  # type: ignore[misc]


def test_workers_are_asked_for_one_way_and_a_service_refuses_what_it_would_ignore():
    from meshfeed.services import InProcessService

    with pytest.raises(ValueError, match="num_workers=2 and service=InProcessService both say"):
        DataLoader(Squares(8), batch_size=2, num_workers=2, service=InProcessService())
    with pytest.raises(ValueError, match=r"prefetch=4 would be ignored: with service="):
        DataLoader(Squares(8), batch_size=2, prefetch=4, service=InProcessService())
