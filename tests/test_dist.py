"""meshfeed.dist: the device rule as a pure function, one-process no-ops, real gloo collectives."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest
import torch

from meshfeed import dist
from meshfeed.balance import BalancedBatches, CostModel
from meshfeed.errors import CollectiveError, RankError
from tests.dist_utils import run_distributed

# ---------------------------------------------------------------- the device rule


@pytest.mark.parametrize("backend", ["nccl", "NCCL"])
def test_nccl_groups_get_tensors_on_the_given_cuda_device(backend):
    assert dist.device_for_backend(backend, cuda_device=3) == torch.device("cuda", 3)


@pytest.mark.parametrize("backend", ["gloo", "mpi", "ucc", "fake", "cpu:gloo,cuda:nccl"])
def test_every_other_backend_gets_cpu_tensors(backend):
    assert dist.device_for_backend(backend, cuda_device=3) == torch.device("cpu")


def test_nccl_without_a_cuda_index_asks_torch_for_the_current_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 5)
    assert dist.device_for_backend("nccl") == torch.device("cuda", 5)


def test_the_device_rule_refuses_a_backend_that_is_not_a_name():
    with pytest.raises(TypeError, match="backend must be a str"):
        dist.device_for_backend(None)  # type: ignore[arg-type]


class _FakeGroup:
    """torch.distributed of an initialised 2-rank group with a chosen backend, without I/O."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, backend: str) -> None:
        import torch.distributed as tdist

        self.devices: list[tuple[str, torch.device]] = []
        self.owns: list[object] = []  # meshfeed's own control groups (gloo groups)
        self.created: list[dict[str, Any]] = []
        monkeypatch.setattr(dist, "_OWN_GROUPS", {})
        monkeypatch.setattr(tdist, "is_initialized", lambda: True)
        monkeypatch.setattr(tdist, "get_world_size", lambda group=None: 2)
        monkeypatch.setattr(tdist, "get_rank", lambda group=None: 0)
        monkeypatch.setattr(
            tdist, "get_backend", lambda group=None: "gloo" if group in self.owns else backend
        )
        monkeypatch.setattr(tdist, "new_group", self.new_group)
        monkeypatch.setattr(tdist, "all_gather", self.all_gather)
        monkeypatch.setattr(tdist, "all_to_all_single", self.all_to_all_single)

    def new_group(self, **kw: Any) -> Any:
        self.created.append(kw)
        self.owns.append(object())
        return self.owns[-1]

    def all_gather(self, out: list[torch.Tensor], t: torch.Tensor, **kw: Any) -> Any:
        self.devices.append(("all_gather", t.device))
        for o in out:
            o.copy_(t)
        return _Done()

    def all_to_all_single(self, recv: torch.Tensor, send: torch.Tensor, *a: Any, **kw: Any) -> Any:
        self.devices.append(("all_to_all_single", send.device))
        self.devices.append(("all_to_all_single recv", recv.device))
        recv.copy_(torch.cat([send, send])[: recv.shape[0]])
        return _Done()


class _Done:
    def wait(self, timeout: Any = None) -> bool:
        return True


def test_collectives_put_their_tensors_on_the_device_the_rule_names(monkeypatch):
    fake = _FakeGroup(monkeypatch, "gloo")
    asked: list[Any] = []
    real = dist.device_for_backend

    def spy(backend: str, **kw: Any) -> torch.device:
        asked.append(backend)
        return real(backend, **kw)

    monkeypatch.setattr(dist, "device_for_backend", spy)
    rows = dist.all_gather_ints([1, 2, 3])
    assert [r.tolist() for r in rows] == [[1, 2, 3], [1, 2, 3]]
    out = dist.all_to_all_single(torch.ones(2, 3), [1, 1], [1, 1])
    assert out.device == torch.device("cpu") and out.shape == (2, 3)
    assert asked and set(asked) == {"gloo"}
    assert {d for _, d in fake.devices} == {torch.device("cpu")}


def test_a_delivery_threads_control_collectives_run_on_a_group_of_their_own(monkeypatch):
    # Delivered runs its inner iterator (BalancedBatches...) on a delivery thread while the
    # loop's thread may iterate another loader: the two threads never share a group. A walk
    # that ended frees its group for the next; one left part way retires it.
    fake = _FakeGroup(monkeypatch, "gloo")
    monkeypatch.setattr(dist, "_POOL", {})
    monkeypatch.setattr(dist, "_POOL_WORLD", [None])  # the fake's default group (WORLD) is None
    loop = dist.control_group(7)

    def walk(clean: bool) -> list[Any]:
        got: list[Any] = []

        def on_thread() -> None:
            got.append(dist.mark_delivery_thread())
            got.extend([dist.control_group(7), dist.control_group(7)])
            got.append(dist.control_group(7, side=True))

        thread = threading.Thread(target=on_thread)
        thread.start()
        thread.join()
        dist.free_thread_groups(got[0], clean)  # on the loop's thread, as Delivery does
        return got[1:]

    first = walk(clean=True)
    loop7, side7, delivery7 = fake.owns
    assert loop is loop7 and first == [delivery7, delivery7, side7]
    made = fake.created[-1]  # made over every rank at the thread's first collective
    assert made["group_desc"] == "meshfeed-delivery" and made["timeout"].total_seconds() == 7
    assert walk(clean=False) == first  # the walk that ended freed it for this one
    third = walk(clean=True)  # the one left part way retired it: a new one
    assert third[0] is fake.owns[-1] and third[0] is not delivery7 and len(fake.owns) == 4
    assert dist.control_group(7) is loop7 and not dist.on_delivery_thread()


def test_control_collectives_run_on_a_gloo_group_of_their_own_per_timeout(monkeypatch):
    """Without a group, reductions and gathers go to meshfeed's gloo group whose timeout is
    the caller's (created once per timeout); the data exchange stays on the caller's group."""

    fake = _FakeGroup(monkeypatch, "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    groups: list[Any] = []

    def gather(t: torch.Tensor, timeout: float, group: Any, what: str) -> torch.Tensor:
        groups.append(group)
        return torch.stack([t, t])

    monkeypatch.setattr(dist, "_all_gather_fixed", gather)
    dist.all_gather_ints([1], timeout=7)
    dist.check_agreement({"seed": 1}, timeout=7)
    dist.all_gather_ints([1], timeout=9)
    # Two groups per timeout, made together: the loop's and a side one (delivery_stats).
    assert [(c["timeout"].total_seconds(), c["group_desc"]) for c in fake.created] == [
        (7, "meshfeed"),
        (7, "meshfeed-side"),
        (9, "meshfeed"),
        (9, "meshfeed-side"),
    ]
    assert {c["backend"] for c in fake.created} == {"gloo"}
    loop7, side7, loop9, _ = fake.owns
    assert len(groups) == 5 and groups == [loop7] * 3 + [loop9] * 2
    assert dist.control_group(7, side=True) is side7 and len(fake.created) == 4
    explicit = object()
    dist.all_gather_ints([1], timeout=7, group=explicit)
    assert groups[-1] is explicit and len(fake.created) == 4


def test_an_nccl_group_asks_for_the_current_cuda_device(monkeypatch):
    """On an NCCL group the tensors go to cuda:<current>; checked without a GPU via the rule."""
    _FakeGroup(monkeypatch, "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert dist.group_device() == torch.device("cuda", 1)


def test_balanced_batches_collectives_ask_dist_for_the_groups_device(monkeypatch):
    """BalancedBatches never picks a device itself: its collectives go through meshfeed.dist."""
    _FakeGroup(monkeypatch, "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    asked: list[Any] = []

    def group_device(group: Any = None) -> torch.device:
        asked.append(group)
        return torch.device("cpu")  # where a CPU-only test can run; the rule is tested above

    monkeypatch.setattr(dist, "group_device", group_device)
    sample = {
        "tokens": torch.arange(6),
        "labels": torch.arange(6),
        "loss_mask": torch.ones(6, dtype=torch.int64),
        "position_ids": torch.tensor([0, 1, 2, 0, 1, 2]),
        "cu_seqlens": torch.tensor([0, 3, 6], dtype=torch.int32),
    }
    it = BalancedBatches(
        iter([sample]), max_tokens=64, cost=CostModel(linear=1.0), plan_ahead=False
    )
    assert it._comm.device() == torch.device("cpu") and asked
    asked.clear()
    next(it)
    assert len(asked) >= 2  # the header all-gather and the all-to-all
    it.close()


# ---------------------------------------------------------------- one process


def test_without_a_process_group_a_rank_agrees_with_itself():
    assert dist.all_ranks_have_a_batch(True, timeout=1.0) is True
    assert dist.all_ranks_have_a_batch(False, timeout=1.0) is False


def test_agreement_check_is_a_no_op_in_one_process():
    dist.check_agreement({"seed": 3, "batch_size": 8}, timeout=1.0)


def test_one_process_collectives_return_this_ranks_values():
    assert dist.all_min([3, 1]) == [3, 1] and dist.all_max([3, 1]) == [3, 1]
    assert [a.tolist() for a in dist.all_gather_ints([4, 5])] == [[4, 5]]
    assert dist.all_gather_objects({"a": 1}) == [{"a": 1}]
    send = torch.arange(6).reshape(3, 2)
    assert torch.equal(dist.all_to_all_single(send, [3], [3]), send)
    dist.barrier(timeout=1.0)
    assert (dist.rank(), dist.world_size(), dist.global_rank(None, 0)) == (0, 1, 0)
    assert dist.group_device() == torch.device("cpu") and not dist.is_distributed()


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), True, "5"])
def test_collectives_refuse_a_timeout_that_is_not_positive_seconds(bad):
    with pytest.raises((TypeError, ValueError), match="timeout"):
        dist.all_min([1], timeout=bad)


def test_all_gather_ints_refuses_more_values_than_max_len():
    with pytest.raises(ValueError, match="more than max_len=2; raise max_len"):
        dist.all_gather_ints([1, 2, 3], max_len=2)


def test_all_to_all_refuses_split_sizes_that_do_not_add_up():
    with pytest.raises(ValueError, match="send_rows must add up"):
        dist.all_to_all_single(torch.zeros(3, 2), [2], [2])


# ---------------------------------------------------------------- real gloo ranks


def _collectives(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    out["min"] = dist.all_min([rank, 10 - rank])
    out["max"] = dist.all_max([rank, 10 - rank])
    out["have"] = dist.all_ranks_have_a_batch(rank != 1, timeout=30.0)
    out["gather"] = [a.tolist() for a in dist.all_gather_ints(list(range(rank + 1)))]
    out["gather_cap"] = [a.tolist() for a in dist.all_gather_ints([rank] * rank, max_len=4)]
    out["objects"] = dist.all_gather_objects({"rank": rank, "name": "r" * rank})
    # Rank r sends r+1 rows to every rank, each row [r, destination].
    send = torch.tensor([[rank, d] for d in range(world) for _ in range(rank + 1)])
    recv = dist.all_to_all_single(send, [rank + 1] * world, [s + 1 for s in range(world)])
    out["a2a"] = recv.tolist()
    dist.check_agreement({"seed": 7}, timeout=30.0)
    try:
        dist.check_agreement({"seed": 7, "rank parity": rank % 2}, timeout=30.0)
    except ValueError as e:
        out["disagree"] = str(e)
    dist.barrier(timeout=30.0)
    return out


@pytest.mark.slow
def test_collectives_on_3_gloo_ranks():
    results = run_distributed(_collectives, 3, timeout=120.0)
    for rank, out in enumerate(results):
        assert out["min"] == [0, 8] and out["max"] == [2, 10]
        assert out["have"] is False
        assert out["gather"] == [[0], [0, 1], [0, 1, 2]]
        assert out["gather_cap"] == [[], [1], [2, 2]]
        assert out["objects"] == [{"rank": r, "name": "r" * r} for r in range(3)]
        assert out["a2a"] == [[s, rank] for s in range(3) for _ in range(s + 1)]
        assert out["disagree"].startswith("data loaders disagree on rank parity: rank i holds")
        assert "[0, 1, 0]" in out["disagree"]


def _stalled_peer(rank: int, world: int) -> tuple[str, float]:
    if rank == 1:
        time.sleep(4.0)  # never joins the collective in time
        return "", 0.0
    start = time.monotonic()
    try:
        dist.all_min([0], timeout=1.5)
    except RuntimeError as e:
        return str(e), time.monotonic() - start
    return "", time.monotonic() - start


@pytest.mark.slow
def test_a_stalled_rank_is_an_error_on_the_others_within_the_timeout():
    results = run_distributed(_stalled_peer, 2, timeout=120.0)
    message, waited = results[0]
    assert "waited more than timeout=1.5s" in message, message
    assert waited < 1.5 + 2.0


def test_all_gather_objects_round_trips_numpy_arrays_on_gloo():
    results = run_distributed(_gather_arrays, 2, timeout=120.0)
    for parts in results:
        assert [p.tolist() for p in parts] == [[0.0], [0.5, 1.0]]


def _gather_arrays(rank: int, world: int) -> list[np.ndarray]:
    return dist.all_gather_objects(np.arange(rank + 1, dtype=np.float64) * 0.5 + rank * 0.5)


# ---------------------------------------------------------------- failures (#20)
def test_a_failed_collective_says_whether_a_peer_closed_or_time_ran_out(monkeypatch):
    _FakeGroup(monkeypatch, "gloo")
    closed = dist._failure(
        RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:41"), 0.1, 5.0, "all_min"
    )
    assert isinstance(closed, CollectiveError) and closed.reason == "closed"
    assert str(closed).startswith(
        "rank 0 of 2: a peer rank's connection closed after 0.1s in all_min"
    )
    assert "Connection closed by peer [127.0.0.1]:41" in str(closed)
    for exc, waited in ((None, 5.0), (RuntimeError("Timed out waiting 5000ms for recv"), 4.0)):
        late = dist._failure(exc, waited, 5.0, "all_min")
        assert late.reason == "timeout" and late.this_rank == 0
        assert "rank 0 of 2 waited more than timeout=5.0s for the other ranks in all_min" in str(
            late
        )


class _FailingWork:
    def wait(self, timeout: Any = None) -> bool:
        raise RuntimeError("Connection reset by peer")


def test_wait_turns_a_backend_error_into_a_collective_error_at_once(monkeypatch):
    _FakeGroup(monkeypatch, "gloo")
    start = time.monotonic()
    with pytest.raises(CollectiveError, match="connection closed after 0.0s in a barrier") as e:
        dist._wait(_FailingWork(), 30.0, "a barrier")
    assert e.value.reason == "closed" and time.monotonic() - start < 1.0
    assert isinstance(e.value.__cause__, RuntimeError)


def test_first_failed_rank_alone_is_this_rank_or_none():
    assert dist.first_failed_rank(True) == 0
    assert dist.first_failed_rank(False) is None
    with pytest.raises(ValueError, match="timeout must be positive"):
        dist.first_failed_rank(False, timeout=0)


def test_fail_together_alone_passes_items_and_raises_an_items_own_error():
    assert list(dist.fail_together(iter([1, 2]))) == [1, 2]

    def items() -> Any:
        yield 1
        raise KeyError("bad item")

    it = dist.fail_together(items())
    assert next(it) == 1
    with pytest.raises(KeyError, match="bad item"):
        next(it)


def test_fail_together_stops_every_rank_at_the_step_a_peer_failed(monkeypatch):
    """Rank 0 of 2, simulated: the peer (rank 1) fails at its third item; rank 0 raises
    RankError naming rank 1 at that item, not later, and the source is closed."""
    _FakeGroup(monkeypatch, "gloo")
    calls: list[list[int]] = []

    def all_reduce(values: Any, op: str, timeout: float, group: Any, what: str) -> list[int]:
        peer = 1 if len(calls) == 2 else 2  # rank 1 says "I failed" at the third step
        calls.append(list(values))
        return [min(values[0], peer)]

    monkeypatch.setattr(dist, "_all_reduce", all_reduce)
    closed: list[bool] = []

    def source() -> Any:
        try:
            yield from range(10)
        finally:
            closed.append(True)

    got: list[int] = []
    with pytest.raises(RankError, match="rank 1 failed to make its batch at step 2") as e:
        for x in dist.fail_together(source(), timeout=3.0, where=lambda: f"step {len(got)}"):
            got.append(x)
    assert got == [0, 1] and e.value.rank == 1 and closed == [True]
    assert calls == [[2], [2], [2]]  # "no failure here" is the world size


def test_the_plan_agreement_waits_the_loaders_timeout(monkeypatch):
    from meshfeed import DataLoader
    from meshfeed.services import distributed

    _FakeGroup(monkeypatch, "gloo")
    seen: list[float] = []
    monkeypatch.setattr(
        distributed, "check_agreement", lambda values, timeout, group=None: seen.append(timeout)
    )
    loader = DataLoader(list(range(8)), batch_size=2, mesh={"dp": 2}, rank=0, timeout=7.0)
    assert isinstance(loader.service, distributed.DistributedService)
    loader.service.start(loader.fetcher)
    assert seen == [7.0]


def test_every_walk_start_is_agreed_in_one_collective_simulated(monkeypatch):
    # Both ranks in one process: the all-gather returns each simulated rank's facts.
    import torch.distributed as tdist

    from meshfeed import DataLoader
    from meshfeed.services import distributed

    _FakeGroup(monkeypatch, "gloo")
    peers = []
    for r in (0, 1):  # each built as the rank of the process group it stands for
        monkeypatch.setattr(tdist, "get_rank", lambda group=None, r=r: r)
        peers.append(DataLoader(list(range(16)), batch_size=2, mesh={"dp": 2}, rank=r))
    monkeypatch.setattr(tdist, "get_rank", lambda group=None: 0)
    gathers: list[dict[str, int]] = []

    def gather(values, timeout, group=None):
        gathers.append(dict(values))
        rows = [{**values, **peer._walk_facts()} for peer in peers]
        return {name: [row[name] for row in rows] for name in values}

    monkeypatch.setattr(distributed, "gather_agreement", gather)
    me, peer = peers
    assert len(list(me)) == 4 and len(gathers) == 1  # one collective per walk, not per batch
    assert {"seed", "global_batch_size", "epoch", "position", "order"} <= set(gathers[0])
    with pytest.raises(ValueError, match=r"rank 0: epoch=1 position=0, rank 1: epoch=0 position"):
        next(iter(me))  # the peer has not finished epoch 0
    peer.set_epoch(1)
    it = iter(me)
    next(it)
    state = me.state_dict()
    peer.load_state_dict(state)
    assert len(list(iter(me))) == 3 and len(gathers) == 4  # every iter() is a walk start
    me.load_state_dict({**state, "position": 8})  # only this rank loads another checkpoint
    with pytest.raises(ValueError, match="they differ in position") as error:
        list(me)
    assert "load_state_dict with the same checkpoint on every rank" in str(error.value)
