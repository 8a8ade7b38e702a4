import json
import threading

import numpy as np
import pytest
import torch

import meshfeed
import meshfeed.services
from meshfeed import DataLoader, DataMesh
from meshfeed.loader_base import LoaderBase
from meshfeed.testing import assert_resume_equivalence, assert_same, take
from tests.optional import given, settings, st


class Squares:
    """Map-style: item i is a dict holding i and a small tensor."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"index": i, "x": torch.full((2,), float(i))}


mesh_sizes = st.fixed_dictionaries(
    {"dp": st.integers(1, 4)},
    optional={
        "tp": st.integers(1, 3),
        "cp": st.integers(1, 2),
        "pp": st.integers(1, 2),
        "fsdp": st.integers(1, 2),
    },
)


@settings(max_examples=40, deadline=None)
@given(
    sizes=mesh_sizes,
    n=st.integers(1, 120),
    batch=st.integers(1, 5),
    seed=st.integers(0, 1000),
    drop_last=st.booleans(),
)
def test_simulated_ranks_exactly_once_replicas_identical_equal_steps(
    sizes, n, batch, seed, drop_last
):
    mesh = DataMesh.from_sizes(**sizes)
    G = batch * mesh.data_world_size
    if drop_last and n < G:
        with pytest.raises(ValueError, match="smaller than one global batch"):
            DataLoader(Squares(n), batch_size=batch, mesh=mesh, rank=0, seed=seed)
        return
    outputs = {}
    for rank in range(mesh.world_size):
        loader = DataLoader(
            Squares(n), batch_size=batch, mesh=mesh, rank=rank, seed=seed, drop_last=drop_last
        )
        outputs[rank] = [b["index"].tolist() for b in loader]
        assert len(outputs[rank]) == len(loader)
    steps = {len(v) for v in outputs.values()}
    assert len(steps) == 1  # every rank takes the same number of steps
    for group in mesh.replica_groups():
        for r in group[1:]:
            assert outputs[r] == outputs[group[0]]  # replica peers get identical batches
    seen = [i for group in mesh.replica_groups() for b in outputs[group[0]] for i in b]
    expected = (n // G) * G if drop_last else n
    padded = len(seen) - expected
    assert len(set(seen)) == expected  # every index once (pads repeat epoch-start samples)
    assert 0 <= padded < mesh.data_world_size


def test_tp_peers_see_identical_batches_and_dp_ranks_disjoint():
    mesh = {"dp": 2, "tp": 2}
    out = [
        [b["index"].tolist() for b in DataLoader(Squares(64), batch_size=4, mesh=mesh, rank=r)]
        for r in range(4)
    ]
    assert out[0] == out[1] and out[2] == out[3]
    assert not set(sum(out[0], [])) & set(sum(out[2], []))


def test_default_collate_dicts_and_deterministic_order():
    a = list(DataLoader(Squares(20), batch_size=4, seed=7))
    b = list(DataLoader(Squares(20), batch_size=4, seed=7))
    c = list(DataLoader(Squares(20), batch_size=4, seed=8))
    assert_same(a, b)
    assert a[0]["x"].shape == (4, 2)
    assert [x["index"].tolist() for x in a] != [x["index"].tolist() for x in c]


def test_shuffle_false_is_sequential():
    out = [b.tolist() for b in DataLoader(list(range(10)), batch_size=3, shuffle=False)]
    assert out == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]


def test_set_epoch_reshuffles_and_iteration_advances_epochs():
    loader = DataLoader(list(range(12)), batch_size=4, seed=1)
    e0 = [b.tolist() for b in loader]
    e1 = [b.tolist() for b in loader]  # an epoch iterated to its end advances
    assert loader.epoch == 2
    loader.set_epoch(1)
    assert [b.tolist() for b in loader] == e1
    loader.set_epoch(0)
    assert [b.tolist() for b in loader] == e0
    assert e0 != e1 and sorted(sum(e0, [])) == sorted(sum(e1, []))


@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize("mesh", [{"dp": 1}, {"dp": 3, "tp": 2}])
def test_exact_resume_at_every_step_across_epochs(mesh, drop_last):
    def factory():
        return DataLoader(
            Squares(23),
            batch_size=2,
            mesh=mesh,
            rank=DataMesh.from_sizes(**mesh).world_size - 1,
            drop_last=drop_last,
            seed=3,
        )

    ref = assert_resume_equivalence(factory, num_items=3 * len(factory()) + 2, max_state_bytes=1024)
    assert len(ref) == 3 * len(factory()) + 2


def test_state_dict_is_small_json_with_required_fields():
    loader = DataLoader(Squares(50), batch_size=4, mesh={"dp": 2}, rank=1, seed=9)
    take(loader, 3)
    state = loader.state_dict()
    assert json.loads(json.dumps(state)) == state
    assert state["kind"] == "loader" and state["version"] == 2 and state["pad_last"] is True
    assert state["seed"] == 9 and state["epoch"] == 0
    assert state["position"] == 24 and state["global_batch_size"] == 8
    assert state["data_world_size"] == 2 and state["dataset_length"] == 50
    assert len(json.dumps(state)) < 600


def _global_stream(loaders, steps):
    """Concatenate every data rank's slice per step: the global batches."""
    outs = [take(lo, steps) for lo in loaders]
    return [sum((o[s]["index"].tolist() for o in outs), []) for s in range(steps)]


@pytest.mark.parametrize(("old_dp", "new_dp"), [(4, 2), (2, 4), (4, 1), (1, 8)])
def test_elastic_resume_onto_a_different_data_parallel_size(old_dp, new_dp):
    n, G = 200, 8
    reference = _global_stream(
        [
            DataLoader(Squares(n), batch_size=G // old_dp, mesh={"dp": old_dp}, rank=r)
            for r in range(old_dp)
        ],
        40,
    )
    first = [
        DataLoader(Squares(n), batch_size=G // old_dp, mesh={"dp": old_dp}, rank=r)
        for r in range(old_dp)
    ]
    for lo in first:
        take(lo, 7)
    state = first[old_dp - 1].state_dict()
    resumed = []
    for r in range(new_dp):
        lo = DataLoader(Squares(n), batch_size=G // new_dp, mesh={"dp": new_dp}, rank=r)
        lo.load_state_dict(state)
        resumed.append(lo)
    assert _global_stream(resumed, 33) == reference[7:40]


def test_global_batch_change_refused_unless_opted_in():
    old = DataLoader(Squares(100), batch_size=4)
    take(old, 3)
    state = old.state_dict()
    new = DataLoader(Squares(100), batch_size=6)
    with pytest.raises(ValueError, match="global batch size 4 differs from this loader's 6"):
        new.load_state_dict(state)
    new.load_state_dict(state, allow_global_batch_change=True)
    nxt = next(iter(new))["index"].tolist()
    full = DataLoader(Squares(100), batch_size=1, shuffle=True)
    assert nxt == [b["index"].item() for b in take(full, 18)][12:18]


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda s: s.update(version=99), "version=99"),
        (lambda s: s.pop("position"), "missing 'position'"),
        (lambda s: s.update(position="3"), "'position' has '3'"),
        (lambda s: s.update(position=10**9), "beyond the epoch length"),
        (lambda s: s.update(seed=4), "seed=4"),
        (lambda s: s.update(dataset_length=51), "another dataset"),
        (lambda s: s.update(fingerprint="other"), "another dataset"),
        (lambda s: s.update(epoch=-1), "'epoch' is negative"),
    ],
)
def test_corrupted_or_foreign_state_is_refused(mutate, match):
    loader = DataLoader(Squares(50), batch_size=4)
    take(loader, 2)
    state = loader.state_dict()
    mutate(state)
    fresh = DataLoader(Squares(50), batch_size=4)
    with pytest.raises(ValueError, match=match):
        fresh.load_state_dict(state)
    assert fresh.position == 0  # nothing was half-applied


def test_state_that_is_not_a_dict_is_refused():
    with pytest.raises(ValueError, match="must be a dict"):
        DataLoader(Squares(8), batch_size=2).load_state_dict([1, 2])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"batch_size": 0}, "batch_size must be a positive int"),
        ({"batch_size": -2}, "batch_size must be a positive int"),
        ({"batch_size": 2, "mesh": {"dp": 2}, "rank": 2}, "rank=2 is out of range"),
        ({"batch_size": 2, "num_workers": -1}, "num_workers must be an int >= 0"),
        ({"batch_size": 2, "num_workers": 10**6}, r"num_workers=1000000 .*MAX_WORKERS = 1024"),
        ({"batch_size": 2, "seed": -1}, "seed must be a non-negative int"),
        ({"batch_size": 2, "mesh": "dp=2"}, "is not a DataMesh"),
        ({"batch_size": 2, "on_error": "ignore"}, "on_error='ignore'"),
        ({"batch_size": 2, "timeout": 0}, "timeout must be positive seconds"),
        ({"batch_size": 2, "max_retries": -1}, "max_retries must be an int >= 0"),
        ({"batch_size": 2, "prefetch": 0}, "prefetch must be an int >= 1"),
        (
            {"batch_size": 2, "num_workers": 2, "service": meshfeed.services.InProcessService()},
            "both say where batches are made",
        ),
    ],
)
def test_bad_arguments_raise_clear_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DataLoader(Squares(8), **kwargs)


def test_a_collate_fn_that_is_not_callable_is_refused_when_the_loader_is_built():
    # It was accepted, and the first batch raised "'int' object is not callable".
    with pytest.raises(TypeError, match=r"collate_fn must be a function .* collate_fn=5\)"):
        DataLoader(Squares(8), batch_size=2, collate_fn=5)


def test_empty_dataset_and_no_len():
    with pytest.raises(ValueError, match="dataset is empty"):
        DataLoader([], batch_size=1)
    with pytest.raises(ValueError, match="has no len"):
        DataLoader(iter([1, 2]), batch_size=1)


def test_getitems_is_used_for_one_call_per_batch():
    class Batched(Squares):
        calls = 0

        def __getitems__(self, indices):
            type(self).calls += 1
            return [self[i] for i in indices]

    ds = Batched(16)
    out = list(DataLoader(ds, batch_size=4))
    assert Batched.calls == 4 and len(out) == 4


def test_fetch_batch_is_used_without_collate():
    class Ready(Squares):
        def fetch_batch(self, indices):
            return torch.as_tensor(np.asarray(indices) * 10)

    out = [b.tolist() for b in DataLoader(Ready(8), batch_size=4, shuffle=False)]
    assert out == [[0, 10, 20, 30], [40, 50, 60, 70]]


def test_sample_rng_is_keyed_on_seed_epoch_index():
    class Noisy(Squares):
        def __getitem__(self, i):
            info = meshfeed.fetch_info()
            assert info is not None
            return float(meshfeed.sample_rng(i).random())

    a = [b.tolist() for b in DataLoader(Noisy(8), batch_size=8, seed=1, mesh={"dp": 1})]
    # the same sample gets the same noise whichever rank fetches it
    halves = [
        b.tolist()
        for r in range(2)
        for b in DataLoader(Noisy(8), batch_size=4, seed=1, mesh={"dp": 2}, rank=r)
    ]
    assert sorted(a[0]) == sorted(sum(halves, []))
    r0 = float(meshfeed.sample_rng(3, seed=1, epoch=0).random())
    assert r0 == float(meshfeed.sample_rng(3, seed=1, epoch=0).random())
    assert r0 != float(meshfeed.sample_rng(3, seed=1, epoch=1).random())
    with pytest.raises(ValueError, match="only inside a fetch"):
        meshfeed.sample_rng(3)


def test_shutdown_is_idempotent_and_context_manager():
    with DataLoader(Squares(8), batch_size=2) as loader:
        assert len(list(loader)) == 4
    loader.shutdown()
    loader.shutdown()


def test_a_stream_given_to_dataloader_is_read_exactly_as_streamloader_reads_it():
    from meshfeed import StreamLoader
    from meshfeed.sources import ShardedStream

    stream = ShardedStream([lambda: iter(range(6)), lambda: iter(range(6, 12))])
    plain = [b.tolist() for b in DataLoader(stream, batch_size=3, shuffle=False)]
    loader = StreamLoader(stream, batch_size=3, shuffle=False)
    assert isinstance(loader, DataLoader) and isinstance(loader, LoaderBase)
    assert [b.tolist() for b in loader] == plain == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]


def test_resume_restores_a_mixture_reweighted_after_construction():
    def build(reweight):
        mix = meshfeed.Mixture({"a": list(range(30)), "b": list(range(100, 130))}, {"a": 1, "b": 1})
        loader = DataLoader(mix, batch_size=2, collate_fn=list)
        if reweight:
            mix.reweight(3, {"a": 1, "b": 3})  # after the fingerprint was taken
        return loader

    source = build(reweight=True)
    take(source, 2)
    state = source.state_dict()
    fresh = build(reweight=False)  # the schedule comes back from the checkpoint
    fresh.load_state_dict(state)
    resumed = build(reweight=True)  # or is declared again: the same
    resumed.load_state_dict(state)
    want = take(source, 4)
    assert take(resumed, 4) == want == take(fresh, 4)


def _walk_loader(kind, **kwargs):
    """A DataLoader, or a StreamLoader, over 0..79 in order, 4 per batch."""
    if kind == "stream":
        stream = meshfeed.sources.ShardedStream([lambda: range(0, 40), lambda: range(40, 80)])
        return meshfeed.StreamLoader(stream, batch_size=4, shuffle=False, **kwargs)
    return DataLoader(np.arange(80), batch_size=4, seed=0, shuffle=False, **kwargs)


def _flat(batches):
    return [v for b in batches for v in b.view(-1).tolist()]


@pytest.mark.parametrize(
    "kind, kwargs",
    [("map", {}), ("map", {"num_workers": 2}), ("map", {"device": "cpu"}), ("stream", {})],
)
def test_a_new_iterator_supersedes_the_live_one_and_nothing_repeats(kind, kwargs):
    loader = _walk_loader(kind, **kwargs)
    a = iter(loader)
    served = [next(a)]
    b = iter(loader)  # a second loop over the same loader while `a` is alive
    with pytest.raises(RuntimeError, match=r"iterated again \(a new iter\(loader\)\) after this"):
        next(a)
    with pytest.raises(RuntimeError, match="build a second"):
        next(a)  # and stays stopped
    served += [next(b), next(b)]
    state = loader.state_dict()
    assert state["position"] == 12  # what was returned, nothing `a` prefetched
    loader.shutdown()
    resumed = _walk_loader(kind, **kwargs)
    resumed.load_state_dict(state)
    rest = list(resumed)
    resumed.shutdown()
    assert _flat(served + rest) == list(range(80))


def test_set_epoch_and_load_state_dict_stop_a_live_iterator():
    loader = DataLoader(list(range(40)), batch_size=4, seed=0)
    epoch1 = DataLoader(list(range(40)), batch_size=4, seed=0)
    epoch1.set_epoch(1)
    want = [b.tolist() for b in epoch1]
    it = iter(loader)
    for _ in range(3):
        next(it)
    loader.set_epoch(1)
    with pytest.raises(RuntimeError, match=r"moved to epoch 1 \(set_epoch\(1\)\) after this"):
        next(it)
    assert (loader.epoch, loader.position) == (1, 0)  # the state says what comes next
    assert [b.tolist() for b in loader] == want

    start = DataLoader(list(range(40)), batch_size=4, seed=0)
    it = iter(start)
    first = [next(it).tolist(), next(it).tolist()]
    start.load_state_dict(DataLoader(list(range(40)), batch_size=4, seed=0).state_dict())
    with pytest.raises(
        RuntimeError, match=r"loaded a state \(load_state_dict: epoch 0, position 0"
    ):
        next(it)
    assert start.position == 0
    assert [b.tolist() for b in start][:2] == first  # rolled back: served again


def test_shutdown_stops_the_live_iterator_and_its_delivery_thread():
    loader = DataLoader(list(range(40)), batch_size=4, shuffle=False, device="cpu")
    with loader:
        it = iter(loader)
        first = [next(it), next(it)]
    assert not [t for t in threading.enumerate() if t.name == "meshfeed-delivery"]
    with pytest.raises(RuntimeError, match=r"was shut down .* continue from the last batch"):
        next(it)
    assert _flat(first + list(loader)) == list(range(40))  # iterated again: exact


class _FailsOnceAt:
    """Items 0..79; item ``bad`` raises the first time any process reads it (``marker``)."""

    def __init__(self, bad: int, marker) -> None:
        self.bad, self.marker = bad, marker

    def __len__(self) -> int:
        return 80

    def __getitem__(self, i: int) -> int:
        if i == self.bad and not self.marker.exists():
            self.marker.touch()
            raise OSError(f"sample {i}: a transient read error")
        return i


@pytest.mark.parametrize(
    "kwargs", [{}, {"device": "cpu"}, {"num_workers": 2}, {"num_workers": 2, "device": "cpu"}]
)
def test_an_error_raised_through_an_iterator_leaves_it_going_on_from_the_same_batch(
    kwargs, tmp_path
):
    # The walk's generator ended with the error, and the next next() of the same iterator
    # raised StopIteration: the rest of the epoch looked read, silently.
    loader = DataLoader(
        _FailsOnceAt(41, tmp_path / "failed"), batch_size=4, seed=0, shuffle=False,
        on_error="raise", **kwargs,
    )  # fmt: skip
    it, got = iter(loader), []
    with pytest.raises(meshfeed.SampleError, match="sample 41"):
        while True:
            got.append(next(it))
    got += list(it)  # the same iterator: the batch that raised, then the rest of the epoch
    assert _flat(got) == list(range(80)) and loader.epoch == 1
    loader.shutdown()
