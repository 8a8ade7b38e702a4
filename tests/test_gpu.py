"""The GPU path on a GPU: NCCL collectives, pinned memory, DCP under an NCCL process group.

Every test here is marked ``gpu``: skipped (with the reason) where CUDA is missing, run by the
default test command where it is there. On one GPU the process group has one rank, and
meshfeed skips collectives for a group of one (a rank alone needs no agreement); the
``collectives_on_one_rank`` fixture turns that shortcut off, so every collective really runs,
and the results must equal the shortcut's. Which device each collective uses is the design of
:mod:`meshfeed.dist`, and each test says it: the *control* collectives (the plan agreement,
all-gathers of ints and objects, the min / max reductions) run on meshfeed's own gloo group
with CPU tensors, so they never queue behind the model's NCCL kernels and their timeout is the
loader's; the *data* collective (``all_to_all_single`` of BalancedBatches' tokens) runs on the
caller's group, here NCCL, with tensors on ``cuda:<current>`` (the device rule of
:func:`meshfeed.dist.device_for_backend`). With two or more GPUs the same flows run on two real
NCCL ranks (one GPU each). Delivery (pinned batches, ``device="cuda"`` prefetch on a side
stream) is checked against the CPU path.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as tdist

from meshfeed import DataLoader, StreamLoader, dist
from meshfeed.balance import BalancedBatches, CostModel
from meshfeed.balance.routing import route_local
from meshfeed.delivered import Delivered
from meshfeed.delivery import to_device
from meshfeed.queue import SampleStore, StoreLoader
from meshfeed.services import DistributedService, InProcessService
from meshfeed.sources import ShardedStream
from meshfeed.sources.tokens.indexed_write import write_indexed
from meshfeed.sources.tokens.windows import TokenWindows
from meshfeed.testing import assert_resume_equivalence, assert_same
from tests.balance.checks import Samples, make_sample

pytestmark = pytest.mark.gpu

S2 = CostModel(quadratic=1.0)
TWO_GPUS = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="needs 2 or more CUDA devices (one NCCL rank per GPU)",
)


# ----------------------------------------------------------------- fixtures
@pytest.fixture
def nccl_group(tmp_path: Path) -> Iterator[None]:
    """An NCCL default process group of one rank on cuda:0 (a file store, no network)."""
    torch.cuda.set_device(0)
    tdist.init_process_group(
        "nccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        yield
    finally:
        tdist.destroy_process_group()


@pytest.fixture
def collectives_on_one_rank(
    nccl_group: None, monkeypatch: pytest.MonkeyPatch
) -> Iterator[list[tuple[str, str, str]]]:
    """Make a one-rank group count as distributed, and record every collective meshfeed makes
    as ``(name, device type of its tensor, backend of its group)``."""

    def initialised(group: Any = None) -> bool:
        return dist.is_initialized()

    monkeypatch.setattr(dist, "is_distributed", initialised)
    calls: list[tuple[str, str, str]] = []
    for name, arg in (("all_reduce", 0), ("all_gather", 1), ("all_to_all_single", 1)):
        real = getattr(tdist, name)

        def spy(
            *args: Any,
            _real: Callable[..., Any] = real,
            _arg: int = arg,
            _name: str = name,
            **kw: Any,
        ) -> Any:
            backend = str(tdist.get_backend(kw.get("group")))
            calls.append((_name, args[_arg].device.type, backend))
            return _real(*args, **kw)

        monkeypatch.setattr(tdist, name, spy)
    yield calls


def _control_on_gloo_cpu(calls: list[tuple[str, str, str]], at_least: int) -> None:
    """The control collectives ran on meshfeed's own gloo group, with CPU tensors."""
    control = [c for c in calls if c[0] != "all_to_all_single"]
    assert len(control) >= at_least, f"only {len(control)} control collectives ran: {calls}"
    assert {(d, b) for _, d, b in control} == {("cpu", "gloo")}, control


def _data_on_nccl_cuda(calls: list[tuple[str, str, str]], at_least: int) -> None:
    """The data collective ran on the caller's NCCL group, with CUDA tensors."""
    data = [c for c in calls if c[0] == "all_to_all_single"]
    assert len(data) >= at_least, f"only {len(data)} all_to_all_single ran: {calls}"
    assert {(d, b) for _, d, b in data} == {("cuda", "nccl")}, data


def _on_cuda(devices: list[torch.device], at_least: int) -> None:
    assert len(devices) >= at_least, f"only {len(devices)} collectives ran"
    assert {d.type for d in devices} == {"cuda"}, devices


# ----------------------------------------------------------------- 1 GPU, NCCL group of one
def _balanced_items(max_len: int = 250) -> list[dict[str, Any]]:
    with BalancedBatches(
        Samples(0, seed=3, batches=3, max_len=max_len, docs=8), max_tokens=256, cost=S2
    ) as it:
        return list(it)


def test_balanced_batches_on_nccl_match_the_one_rank_result(nccl_group, monkeypatch):
    alone = _balanced_items()  # the one-rank shortcut (no collective)
    with monkeypatch.context() as m:
        m.setattr(dist, "is_distributed", lambda group=None: True)
        devices: list[torch.device] = []
        real = tdist.all_to_all_single

        def spy(out: torch.Tensor, inp: torch.Tensor, *a: Any, **k: Any) -> Any:
            devices.append(inp.device)
            return real(out, inp, *a, **k)

        m.setattr(tdist, "all_to_all_single", spy)
        on_nccl = _balanced_items()
    _on_cuda(devices, 3)
    assert_same(on_nccl, alone)
    assert all(i["tokens"].device.type == "cpu" for i in on_nccl)  # results come back on CPU


def test_balanced_batches_resume_on_nccl(collectives_on_one_rank):
    def make() -> BalancedBatches:
        return BalancedBatches(
            Samples(0, seed=4, batches=3, max_len=250, docs=8), max_tokens=256, cost=S2
        )

    with make() as it:
        items = list(it)
    with make() as it:
        head = [next(it) for _ in range(3)]
        state = it.state_dict()
    with make() as it:
        it.load_state_dict(state)
        tail = list(it)
    assert_same(head + tail, items)
    # Tokens move over NCCL on the GPU; the per-batch headers are gathered on gloo (CPU).
    _data_on_nccl_cuda(collectives_on_one_rank, 3)
    _control_on_gloo_cpu(collectives_on_one_rank, 3)


def _stream(shards: int = 3, rows: int = 10) -> ShardedStream:
    return ShardedStream(
        [lambda s=s: iter(range(100 * s, 100 * s + rows)) for s in range(shards)],
        shuffle_buffer=4,
        seed=5,
    )


def test_a_stream_agrees_on_nccl_and_reads_what_it_reads_alone(collectives_on_one_rank):
    alone = [b.tolist() for b in StreamLoader(_stream(), batch_size=4, seed=1)]
    agreement = {"seed": 1, "global_batch_size": 4, "dataset_length": 30}
    service = DistributedService(InProcessService(), agreement=agreement)
    on_nccl = [b.tolist() for b in StreamLoader(_stream(), batch_size=4, seed=1, service=service)]
    assert on_nccl == alone and len(alone) >= 5
    _control_on_gloo_cpu(collectives_on_one_rank, 1)  # the plan agreement: a control collective


def test_distributed_service_agreement_runs_on_nccl(collectives_on_one_rank):
    data = np.arange(32, dtype=np.float32)
    agreement = {"seed": 7, "global_batch_size": 4, "dataset_length": 32}
    service = DistributedService(InProcessService(), agreement=agreement)
    loader = DataLoader(data, batch_size=4, seed=7, service=service)
    got = [b.tolist() for b in loader]
    want = [b.tolist() for b in DataLoader(data, batch_size=4, seed=7)]
    assert got == want
    _control_on_gloo_cpu(collectives_on_one_rank, 1)  # the agreement runs on meshfeed's group
    # The default (NCCL) group's device is where data collectives put their tensors.
    assert dist.group_device() == torch.device("cuda", torch.cuda.current_device())


def test_check_agreement_and_all_gather_objects_round_trip_on_nccl(collectives_on_one_rank):
    dist.check_agreement({"a": 1, "b": 2**62})
    assert dist.all_gather_objects({"x": [1, "two"]}) == [{"x": [1, "two"]}]
    assert dist.all_min([5, -3]) == [5, -3] and dist.all_max([2**62]) == [2**62]
    _control_on_gloo_cpu(collectives_on_one_rank, 4)  # all four are control collectives


@pytest.mark.parametrize("num_workers", [0, 1])
def test_pin_memory_delivers_pinned_batches(num_workers):
    data = np.arange(64, dtype=np.float32).reshape(32, 2)
    loader = DataLoader(data, batch_size=4, pin_memory=True, num_workers=num_workers, seed=0)
    batches = list(loader)
    assert batches and all(b.is_pinned() for b in batches)
    plain = list(DataLoader(data, batch_size=4, num_workers=num_workers, seed=0))
    assert all(torch.equal(a, b) for a, b in zip(batches, plain, strict=True))


class _Custom:
    """A custom batch type with torch's hook for pinning it: its own ``pin_memory()``."""

    def __init__(self, x: torch.Tensor) -> None:
        self.x = x

    def pin_memory(self) -> _Custom:
        return _Custom(self.x.pin_memory())


@pytest.mark.parametrize("num_workers", [0, 2])
def test_pin_memory_pins_a_custom_batch_type_by_its_own_method(num_workers):
    data = np.arange(64, dtype=np.float32).reshape(32, 2)
    loader = DataLoader(
        data, batch_size=4, pin_memory=True, num_workers=num_workers, seed=0,
        collate_fn=lambda rows: _Custom(torch.as_tensor(np.stack(rows))),
    )  # fmt: skip
    batches = list(loader)
    assert batches and all(type(b) is _Custom and b.x.is_pinned() for b in batches)


def test_stream_loader_pin_memory_delivers_pinned_batches():
    batches = list(StreamLoader(_stream(), batch_size=4, seed=1, pin_memory=True))
    assert batches and all(b.is_pinned() for b in batches)


@pytest.mark.parametrize("dtype", [torch.uint16, torch.int32, torch.int64])
def test_pinned_token_windows_fetch_batch_is_pinned_and_equal(tmp_path, dtype):
    rng = np.random.default_rng(0)
    corpus = write_indexed(
        tmp_path / "c", [rng.integers(0, 60000, 300) for _ in range(20)], "uint16"
    )
    idx = np.array([0, 7, 3, 40, 41], dtype=np.int64)
    pinned = TokenWindows(corpus, seq_len=64, dtype=dtype, pin_memory=True).fetch_batch(idx)
    plain = TokenWindows(corpus, seq_len=64, dtype=dtype).fetch_batch(idx)
    assert pinned.is_pinned() and not plain.is_pinned()
    assert pinned.dtype == dtype and torch.equal(pinned, plain)
    on_gpu = pinned.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(on_gpu.cpu(), plain)


class _Dicts:
    """Nested batches: a dict of a tensor, a tuple and a list (the shapes delivery walks)."""

    def __init__(self, n: int, width: int) -> None:
        self.n, self.width = n, width

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        row = torch.full((self.width,), i, dtype=torch.int64)
        return {"tokens": row, "pair": (row + 1, [row.float()])}


def _cpu(batch: Any) -> Any:
    return to_device(batch, torch.device("cpu"))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_device_prefetch_delivers_the_cpu_batches_on_the_current_cuda_device(num_workers):
    data = _Dicts(48, 64 * 1024)  # 512 KiB of int64 per sample and key: 2 MiB batches
    kwargs = {"batch_size": 4, "seed": 3, "num_workers": num_workers}
    plain = list(DataLoader(data, **kwargs))
    loader = DataLoader(data, device="cuda", pin_memory=True, device_prefetch=3, **kwargs)
    side = torch.cuda.Stream()
    got = []
    with torch.cuda.stream(side):  # the loop runs on a stream of its own: delivery waits on it
        for batch in loader:
            assert batch["tokens"].device == torch.device("cuda", torch.cuda.current_device())
            # Used at once on the loop's stream: a read before the copy finished would differ.
            got.append({"tokens": batch["tokens"] * 1, "pair": batch["pair"]})
    torch.cuda.synchronize()
    assert_same([_cpu(b) for b in got], plain)
    phases = loader.stats()["delivery"]["phases"]
    assert phases["pin"] > 0 and phases["device_copy"] > 0


def test_device_prefetch_waits_for_a_copy_that_is_still_running(monkeypatch):
    # The side stream sleeps before each copy, so a batch is handed over while its copy is
    # still queued: a loop stream that did not wait for the copy's event would read memory not
    # yet written (the check that matters on a real GPU, where copies usually finish first).
    from meshfeed.delivery import _Copier

    prepare = _Copier.prepare

    def slow(self: _Copier, batch: Any) -> Any:
        if self.side is not None:
            with torch.cuda.stream(self.side):
                torch.cuda._sleep(20_000_000)  # ~10 ms of GPU cycles, queued before the copy
        return prepare(self, batch)

    monkeypatch.setattr(_Copier, "prepare", slow)
    data = _Dicts(24, 64 * 1024)
    kwargs = {"batch_size": 4, "seed": 3}
    plain = list(DataLoader(data, **kwargs))
    got = []
    for batch in DataLoader(data, device="cuda", pin_memory=True, device_prefetch=2, **kwargs):
        got.append(batch["tokens"] + 0)  # read at once, on the loop's stream
    torch.cuda.synchronize()
    assert_same([g.cpu() for g in got], [b["tokens"] for b in plain])


def test_pin_memory_leaves_a_datasets_cuda_tensors_on_the_gpu():
    class OnGpu:
        def __len__(self) -> int:
            return 8

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            return {"x": torch.full((4,), i, device="cuda"), "y": torch.tensor([i])}

    batches = list(DataLoader(OnGpu(), batch_size=4, seed=0, pin_memory=True))
    assert all(b["x"].is_cuda and b["y"].is_pinned() for b in batches)


def test_pinned_token_windows_in_workers_forked_after_cuda_was_used(tmp_path):
    # The parent has used CUDA (a model on the GPU): a forked worker cannot. Workers gather into
    # ordinary memory, and the loader pins in this process.
    torch.zeros(1, device="cuda")
    rng = np.random.default_rng(1)
    corpus = write_indexed(tmp_path / "c", [rng.integers(0, 60000, 500) for _ in range(8)])
    windows = TokenWindows(corpus, seq_len=32, pin_memory=True)
    kw = {"batch_size": 4, "seed": 1}
    got = list(DataLoader(windows, num_workers=2, pin_memory=True, **kw))
    assert got and all(b.is_pinned() for b in got)
    assert_same(got, list(DataLoader(TokenWindows(corpus, seq_len=32), **kw)))


def test_device_prefetch_resume_is_exact_on_cuda():
    def factory() -> DataLoader:
        return DataLoader(
            _Dicts(30, 16), batch_size=4, seed=5, device="cuda", pin_memory=True, drop_last=False
        )

    out = assert_resume_equivalence(factory, num_items=10, every=2)
    assert all(b["tokens"].is_cuda for b in out)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_pinned_delivery_costs_the_loop_little_per_512_kib_batch(num_workers):
    # The loop's wait per batch when the data is ready: the delivery thread pins ahead, the
    # loop only takes the batch (#27: 4.7 ms per batch when pinning ran on the loop's thread).
    data = np.zeros((4096, 16 * 1024 // 8), dtype=np.int64)  # 16 KiB samples, 512 KiB batches
    loader = DataLoader(data, batch_size=32, pin_memory=True, num_workers=num_workers)
    for batch in loader:
        assert batch.is_pinned()
        time.sleep(0.004)  # the step: longer than making a batch
    stats = loader.stats()["delivery"]
    assert stats["wait_p50_s"] < 3e-4, stats


def test_store_loader_delivers_pinned_and_on_cuda():
    store = SampleStore()
    store.put("p", {"x": [torch.full((1024,), i) for i in range(8)]})
    store.close("p")
    with StoreLoader(
        store, task="t", fields=["x"], partition="p", batch_size=4, mesh={"dp": 1}, rank=0,
        pin_memory=True, device="cuda",
    ) as loader:  # fmt: skip
        batches = [b["x"] for b in loader]
    assert all(b.is_cuda for b in batches)  # the store's Batch (a dataclass) is walked too
    assert [b.cpu()[:, 0].tolist() for b in batches] == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_balanced_batches_delivered_pinned_and_on_cuda_equal_the_cpu_path():
    with _make_balanced() as plain:
        want = list(plain)
    inner = _make_balanced()
    with Delivered(inner, pin_memory=True, device="cuda") as it:
        got = list(it)
    inner.close()
    assert got and all(i["tokens"].is_cuda for i in got)
    assert_same([_cpu(i) for i in got], want)


def test_balanced_batches_over_samples_on_the_gpu_equal_the_cpu_path():
    # An inner loader with device="cuda": BalancedBatches plans and packs on the CPU.
    def on_gpu() -> Iterator[dict[str, torch.Tensor]]:
        for sample in Samples(0, seed=4, batches=3, max_len=250, docs=8):
            yield {k: v.cuda() for k, v in sample.items()}

    with _make_balanced() as plain:
        want = list(plain)
    with BalancedBatches(on_gpu(), max_tokens=256, cost=S2) as it:
        got = list(it)
    assert_same(got, want)


def _make_balanced() -> BalancedBatches:
    return BalancedBatches(
        Samples(0, seed=4, batches=3, max_len=250, docs=8), max_tokens=256, cost=S2
    )


def test_dcp_saves_and_loads_a_loader_under_an_nccl_group(nccl_group, tmp_path):
    import torch.distributed.checkpoint as dcp

    data = np.arange(96, dtype=np.float32)
    loader = DataLoader(data, batch_size=4, seed=7)
    it = iter(loader)
    for _ in range(5):
        next(it)
    dcp.save({"data": loader}, checkpoint_id=str(tmp_path / "ckpt"))
    rest = [b.tolist() for b in it]
    fresh = DataLoader(data, batch_size=4, seed=7)
    dcp.load({"data": fresh}, checkpoint_id=str(tmp_path / "ckpt"))
    assert fresh.position == 20
    assert [b.tolist() for b in fresh] == rest


# ----------------------------------------------------------------- 2+ GPUs, one NCCL rank each
def _nccl_entry(rank: int, world: int, init: str, fn: Callable[..., Any], out: str) -> None:
    torch.cuda.set_device(rank)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    tdist.init_process_group("nccl", init_method=init, rank=rank, world_size=world)
    try:
        torch.save(fn(rank, world), os.path.join(out, f"{rank}.pt"))
    finally:
        tdist.destroy_process_group()


def _run_nccl(fn: Callable[[int, int], Any], world: int = 2, timeout: float = 240.0) -> list[Any]:
    """``fn(rank, world)`` on ``world`` spawned NCCL ranks, GPU ``rank`` each; the results."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as out:
        init = f"file://{out}/store"
        ctx = mp.start_processes(
            _nccl_entry, args=(world, init, fn, out), nprocs=world, join=False, start_method="spawn"
        )
        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=5.0):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError(f"{world} NCCL ranks did not finish within {timeout}s")
        return [torch.load(os.path.join(out, f"{r}.pt"), weights_only=False) for r in range(world)]


def _rank_balanced(rank: int) -> BalancedBatches:
    """The BalancedBatches of NCCL rank ``rank`` (:func:`_simulated` computes its output)."""
    return BalancedBatches(
        Samples(rank, seed=9, batches=3, max_len=450, docs=8), max_tokens=256, cost=S2
    )


def _balanced_rank(rank: int, world: int) -> list[dict[str, Any]]:
    with _rank_balanced(rank) as it:
        return list(it)


def _simulated() -> list[list[dict[str, Any]]]:
    """Each rank's micro-steps of :func:`_rank_balanced`, computed in one process."""
    want: list[list[dict[str, Any]]] = [[], []]
    for b in range(3):
        samples = [make_sample(r, b, seed=9, max_len=450, docs=8) for r in range(2)]
        _, outputs = route_local(samples, max_tokens=256, cost=S2, cp_sizes="any")
        for r in range(2):
            want[r] += outputs[r]
    return want


@TWO_GPUS
def test_balanced_batches_on_two_nccl_ranks_match_the_simulation():
    results = _run_nccl(_balanced_rank)
    want = _simulated()
    for r in range(2):
        assert_same(results[r], want[r], f"rank {r}")


def _delivered_balanced_rank(rank: int, world: int) -> list[tuple[dict[str, Any], float]]:
    out = []
    inner = _rank_balanced(rank)
    with Delivered(inner, pin_memory=True, device="cuda") as it:
        for step in it:
            # The loop's own collective on the default NCCL group, as DDP's gradient
            # all-reduce, while the delivery thread runs BalancedBatches' all_to_all ahead.
            grad = torch.full((1 << 20,), float(rank + 1), device="cuda")
            tdist.all_reduce(grad)
            assert step["tokens"].device == torch.device("cuda", rank)
            out.append((_cpu(step), grad[0].item()))
    inner.close()
    return out


@TWO_GPUS
def test_delivered_balanced_batches_on_two_nccl_ranks_beside_the_loops_all_reduce():
    # Run on the delivery thread, BalancedBatches exchanges its tokens on the thread's own gloo
    # group (not the default NCCL group, where the loop's all-reduce would interleave with it in
    # a different order on each rank), and the batches land on each rank's own GPU (the
    # thread's CUDA device is the loop's, not device 0).
    results = _run_nccl(_delivered_balanced_rank)
    want = _simulated()
    for r in range(2):
        assert_same([step for step, _ in results[r]], want[r], f"rank {r}")
        assert all(total == 3.0 for _, total in results[r])


@TWO_GPUS
def test_the_delivery_thread_runs_on_the_loaders_cuda_device():
    devices = []

    def items() -> Iterator[dict[str, torch.Tensor]]:
        for i in range(3):
            devices.append(torch.cuda.current_device())  # on the delivery thread
            yield {"x": torch.full((4,), i)}

    with Delivered(items(), pin_memory=True, device="cuda:1") as it:
        got = list(it)
    assert devices == [1, 1, 1]
    assert all(b["x"].device == torch.device("cuda", 1) for b in got)


def _stream_rank(rank: int, world: int) -> dict[str, Any]:
    stream = ShardedStream(
        [lambda s=s: iter(range(100 * s, 100 * s + 7 + 5 * s)) for s in range(4)], seed=2
    )
    loader = StreamLoader(stream, batch_size=2, seed=1)
    batches = [b.tolist() for b in loader]
    try:
        DataLoader(np.arange(16), batch_size=2, seed=rank).__iter__().__next__()
        disagreement = ""
    except ValueError as exc:
        disagreement = str(exc)
    return {"batches": batches, "disagreement": disagreement}


@TWO_GPUS
def test_stream_ranks_stop_together_and_disagreement_is_refused_on_two_nccl_ranks():
    results = _run_nccl(_stream_rank)
    assert len(results[0]["batches"]) == len(results[1]["batches"]) > 0
    seen = [{x for b in r["batches"] for x in b} for r in results]
    assert not seen[0] & seen[1]
    for r in results:
        assert "disagree on seed" in r["disagreement"]


def test_pad_collate_keeps_cuda_items_on_their_device():
    from meshfeed.collate import pad_collate

    items = [{"tokens": torch.arange(n, device="cuda")} for n in (3, 5)]
    out = pad_collate()(items)
    assert out["tokens"].shape == (2, 5) and all(v.is_cuda for v in out.values())
    plain = pad_collate()([{"tokens": torch.arange(n)} for n in (3, 5)])
    assert_same({k: v.cpu() for k, v in out.items()}, plain)
