"""Benchmark: SampleStore put + get throughput and latency against plain queues.

Producers put one sample per call and consumers get batches of ``--batch`` samples; both run
as threads of this process (with Ray, every call goes to the store actor in another process).
Latency is put-call start to get return, per sample. Baselines, measured in the same run:
``queue.Queue`` (embedded) and a plain async Ray actor wrapping an ``asyncio.Queue`` (Ray).
Small samples are three scalars; large ones carry a 1 MiB float32 array. Rows "put xK" put K
samples per call (the store's columnar API); the others put one sample per call. Rows
"2 tensors x64" are the RL workload of issue #12: two small tensor fields per sample, one put
and one get per 64 rows (a put's column stays one chunk; a get of contiguous rows is a view).

Rows "SampleStore" / "TransferQueue" put the same tensor workloads into meshfeed's Ray store
and into TransferQueue 0.1.11 (its own API and default SimpleStorage backend; the ``bench``
extra installs it), in turns, warm-up excluded, medians of ``--repeat`` turns; ``thr. vs
baseline`` there is the ratio to TransferQueue (see :class:`TransferQueueBench`).

    PYTHONPATH=src python benchmarks/bench_queue.py           # full run (a few minutes)
    PYTHONPATH=src python benchmarks/bench_queue.py --quick   # small version
"""

from __future__ import annotations

import argparse
import asyncio
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from meshfeed.progress import Progress
from meshfeed.queue import PartitionClosed, SampleStore

LARGE = np.ones(262144, dtype=np.float32)  # 1 MiB


def _sample(i: int, large: bool) -> dict[str, Any]:
    s: dict[str, Any] = {"reward": float(i), "length": i % 97, "t": time.perf_counter()}
    if large:
        s["obs"] = LARGE
    return s


def _run(
    n: int,
    workers: int,
    produce: Callable[[int], None],
    consume: Callable[[], list[float]],
    finish: Callable[[], None],
    step: int = 1,
) -> tuple[float, list[float]]:
    """``workers`` producer threads share ``n`` samples, ``step`` per put; ``workers``
    consumer threads drain."""
    latencies: list[float] = []
    lock = threading.Lock()
    # Every thread is started before the clock starts: a Thread.start() can wait tens of
    # milliseconds for the interpreter lock, which is not the store's time.
    ready = threading.Barrier(2 * workers + 1, timeout=60)

    def producer(w: int) -> None:
        ready.wait()
        for i in range(w * step, n, workers * step):
            produce(i)

    def consumer() -> None:
        ready.wait()
        got = consume()
        with lock:
            latencies.extend(got)

    cons = [threading.Thread(target=consumer) for _ in range(workers)]
    prods = [threading.Thread(target=producer, args=(w,)) for w in range(workers)]
    for t in cons + prods:
        t.start()
    ready.wait()
    start = time.perf_counter()
    for t in prods:
        t.join(600)
    finish()
    for t in cons:
        t.join(600)
    elapsed = time.perf_counter() - start
    if len(latencies) != n:
        raise RuntimeError(f"delivered {len(latencies)} of {n} samples")
    return elapsed, latencies


def bench_store(
    store: SampleStore, n: int, workers: int, large: bool, batch: int, put_batch: int = 1
):
    fields = ["reward", "length", "t"] + (["obs"] if large else [])
    obs = np.broadcast_to(LARGE, (put_batch, LARGE.size))

    def produce(i: int) -> None:
        samples = [_sample(j, large) for j in range(i, i + put_batch)]
        cols: dict[str, Any] = {k: [s[k] for s in samples] for k in ("reward", "length", "t")}
        if large:
            cols["obs"] = obs
        store.put("bench", cols, timeout=120)

    def consume() -> list[float]:
        out = []
        while True:
            try:
                b = store.get("train", fields, batch, "bench", timeout=120)
            except PartitionClosed:
                return out
            now = time.perf_counter()
            out.extend(now - t for t in b["t"])

    return _run(n, workers, produce, consume, lambda: store.close("bench"), step=put_batch)


def bench_queue(n: int, workers: int, large: bool, batch: int):
    q: queue.Queue[Any] = queue.Queue(maxsize=256)
    stop = object()

    def consume() -> list[float]:
        out = []
        while True:
            items = [q.get(timeout=120) for _ in range(batch)]
            now = time.perf_counter()
            for it in items:
                if it is stop:
                    return out
                out.append(now - it["t"])

    def finish() -> None:
        for _ in range(workers * batch):
            q.put(stop)

    return _run(n, workers, lambda i: q.put(_sample(i, large), timeout=120), consume, finish)


class _PlainActor:
    """The baseline: an async actor around an asyncio.Queue (payloads pass through it)."""

    def __init__(self) -> None:
        self.q: asyncio.Queue[Any] | None = None

    def _queue(self) -> asyncio.Queue[Any]:
        if self.q is None:
            self.q = asyncio.Queue(maxsize=256)
        return self.q

    async def put(self, item: Any) -> None:
        await self._queue().put(item)

    async def get(self, k: int) -> list[Any]:
        return [await self._queue().get() for _ in range(k)]


def bench_ray_actor(n: int, workers: int, large: bool, batch: int):
    import ray

    actor = ray.remote(num_cpus=0)(_PlainActor).remote()
    ray.get(actor.put.remote("warm-up"), timeout=120)  # do not time the actor's start-up
    ray.get(actor.get.remote(1), timeout=120)
    stop = "stop"

    def consume() -> list[float]:
        out = []
        while True:
            items = ray.get(actor.get.remote(batch), timeout=120)
            now = time.perf_counter()
            for it in items:
                if isinstance(it, str):
                    return out
                out.append(now - it["t"])

    def finish() -> None:
        ray.get([actor.put.remote(stop) for _ in range(workers * batch)], timeout=120)

    try:
        return _run(
            n,
            workers,
            lambda i: ray.get(actor.put.remote(_sample(i, large)), timeout=120),
            consume,
            finish,
        )
    finally:
        ray.kill(actor)


def bench_tensor_rows(
    store: SampleStore, n: int, workers: int, batch: int = 64, large: bool = False
) -> tuple[float, list[float]]:
    """The RL workload of issue #12: two tensor fields per sample (small: 8 tokens and 8
    log-probs; ``large``: a 1 MiB float32 observation and 8 log-probs), put and got in batches
    of ``batch`` rows (one put per batch, one get per batch). Latency is put start to get
    return of each batch, counted once per sample."""
    if large:
        tokens = torch.ones(batch, LARGE.size)
    else:
        tokens = torch.arange(batch * 8, dtype=torch.int64).reshape(batch, 8)
    logp = torch.zeros(batch, 8)
    put_at: dict[int, float] = {}

    def produce(i: int) -> None:
        ids = list(range(i, i + batch))
        put_at[i] = time.perf_counter()
        store.put("tensors", {"tokens": tokens, "logp": logp}, ids=ids, timeout=120)

    def consume() -> list[float]:
        out: list[float] = []
        while True:
            try:
                b = store.get("train", ["tokens", "logp"], batch, "tensors", timeout=120)
            except PartitionClosed:
                return out
            now = time.perf_counter()
            ids = b.ids
            lo = ids[0] - ids[0] % batch
            if ids == list(range(lo, lo + batch)):  # the rows of one put: one latency
                out.extend([now - put_at.get(lo, now)] * batch)
            else:
                out.extend(now - put_at.get(k - k % batch, now) for k in ids)

    return _run(n, workers, produce, consume, lambda: store.close("tensors"), step=batch)


def bench_tensor_queue(n: int, workers: int, batch: int = 64, capacity: int | None = 256):
    """The tensor workload through a ``queue.Queue`` of whole batches (one item per 64 rows,
    ``capacity`` rows as ``capacity // batch`` items, ``None``: unbounded): the floor of a
    thread hand-off, with none of the store's bookkeeping, to tell what 4x4 threads cost in
    this interpreter."""
    q: queue.Queue[Any] = queue.Queue(maxsize=0 if capacity is None else max(1, capacity // batch))
    tokens = torch.arange(batch * 8, dtype=torch.int64).reshape(batch, 8)
    logp = torch.zeros(batch, 8)
    stop = object()

    def produce(i: int) -> None:
        q.put((list(range(i, i + batch)), time.perf_counter(), tokens, logp), timeout=120)

    def consume() -> list[float]:
        out: list[float] = []
        while True:
            item = q.get(timeout=120)
            if item is stop:
                return out
            out.extend([time.perf_counter() - item[1]] * len(item[0]))

    def finish() -> None:
        for _ in range(workers):
            q.put(stop, timeout=120)

    return _run(n, workers, produce, consume, finish, step=batch)


def tensor_rows(args: argparse.Namespace, ray_store: SampleStore | None) -> list[tuple[str, ...]]:
    """Rows for the tensor workload: samples/s put+get and p99 latency, per backend (the Ray
    rows reuse the warm store actor of the other rows, capacity 256). The embedded store runs
    twice: without a capacity (the workload of issue #12, which has no backpressure) and with
    ``capacity=256`` (four batches: producers wait for room after every put), each in turns
    with a ``queue.Queue`` of whole batches bounded the same way, medians of ``--repeat``."""
    rows: list[tuple[str, ...]] = []
    n_by = {"embedded": 1024 if args.quick else 4096 * 4, "ray": 1024 if args.quick else 4096}
    configs: list[tuple[str, str, int | None]] = [
        ("embedded", "2 tensors x64", None),
        ("embedded", "2 tensors x64 cap 256", 256),
    ]
    if ray_store is not None:
        configs.append(("ray", "2 tensors x64", 256))
    for backend, label, capacity in configs:
        for workers in (1, 4):
            n = n_by[backend] - n_by[backend] % (workers * 64)
            turns: dict[str, list[tuple[float, list[float]]]] = {}
            for _ in range(args.repeat if backend == "embedded" else 1):
                if backend == "ray" and ray_store is not None:
                    store = ray_store
                    store.clear("tensors")
                else:
                    store = SampleStore("embedded", capacity=capacity, tasks=["train"])
                turns.setdefault("SampleStore", []).append(bench_tensor_rows(store, n, workers))
                if backend == "embedded":  # in turns, same threads, same bound
                    turns.setdefault("queue.Queue of batches", []).append(
                        bench_tensor_queue(n, workers, capacity=capacity)
                    )
            runs = {
                impl: sorted(ts, key=lambda t: t[0])[len(ts) // 2] for impl, ts in turns.items()
            }
            base = n / runs["queue.Queue of batches"][0] if backend == "embedded" else None
            for impl, (elapsed, lat) in runs.items():
                ms = np.asarray(lat) * 1e3
                rows.append(
                    (
                        backend,
                        label,
                        f"{workers}x{workers}",
                        impl,
                        str(n),
                        f"{n / elapsed:,.0f}",
                        f"{np.percentile(ms, 50):.2f}",
                        f"{np.percentile(ms, 99):.2f}",
                        "-" if base is None else f"{n / elapsed / base:.2f}",
                    )
                )
    return rows


def dataplane_rows(args: argparse.Namespace, ray_store: SampleStore) -> list[tuple[str, ...]]:
    """Ray data plane against the control plane carrying the bytes, one actor, same run: the
    default client (columns of at least ``inline_bytes`` go to the object store, the actor
    holds references, consumers fetch directly) and a client with ``inline_bytes`` out of
    reach (every column pickled through the actor, as before the data plane); for small
    columns, which the default keeps inline, also a client sending every column through the
    object store (``inline_bytes=1``). Small: 4,096
    samples (two small tensor fields) in batches of 64; large: 1 MiB samples in batches of
    16. ``thr. vs baseline``: against the through-the-actor client."""
    from meshfeed.queue.backends.ray import RayBackend

    actor = ray_store._backend.actor
    through = SampleStore._attach("ray", RayBackend(actor, 1 << 62), ray_store.options)
    direct = SampleStore._attach("ray", RayBackend(actor, 1), ray_store.options)
    rows: list[tuple[str, ...]] = []
    cases = [("2 tensors x64", 64, False, 512 if args.quick else 4096)]
    cases.append(("1 MiB+tensor x16", 16, True, 32 if args.quick else 512))
    for label, batch, large, n in cases:
        results = {}
        clients = [("through the actor", through), ("SampleStore", ray_store)]
        if not large:  # the default keeps small columns inline: also time the data plane
            clients.append(("object store always", direct))
        for impl, store in clients:
            store.clear("tensors")
            results[impl] = bench_tensor_rows(store, n, 1, batch, large)
        base = results["through the actor"][0]
        for impl, (elapsed, lat) in results.items():
            ms = np.asarray(lat) * 1e3
            rows.append(
                (
                    "ray",
                    label,
                    "1x1",
                    impl,
                    str(n),
                    f"{n / elapsed:,.0f}",
                    f"{np.percentile(ms, 50):.2f}",
                    f"{np.percentile(ms, 99):.2f}",
                    f"{base / elapsed:.2f}",
                )
            )
    return rows


# --- TransferQueue, measured on its own API in the same run as meshfeed's Ray store ---------

#: The tensor workloads of issue #12: (label, rows per put and per get, 1 MiB rows?, samples
#: in a full run, samples with --quick).
TQ_CASES = (("2 tensors x64", 64, False, 4096, 512), ("1 MiB+tensor x16", 16, True, 512, 32))


def _tensor_columns(batch: int, large: bool) -> dict[str, torch.Tensor]:
    """The columns :func:`bench_tensor_rows` puts (small: 8 int64 tokens and 8 float32
    log-probs per row; large: one 1 MiB float32 observation and 8 log-probs per row)."""
    first = (
        torch.ones(batch, LARGE.size)
        if large
        else torch.arange(batch * 8, dtype=torch.int64).reshape(batch, 8)
    )
    return {"tokens": first, "logp": torch.zeros(batch, 8)}


class TransferQueueBench:
    """TransferQueue 0.1.11 (``pip install transferqueue``: the ``bench`` extra) with the
    storage its own perftest script configures: ``tq.init`` with the default SimpleStorage
    backend (two storage units; ``total_storage_size`` set to the samples of one run). One
    ``TransferQueueClient`` per producer or consumer thread of this process (the perftest
    runs its two clients in Ray actors; meshfeed's clients here are threads too),
    ``client.put(TensorDict, partition_id=...)`` to write and ``client.get_meta(...,
    task_name=...)`` + ``client.get_data(meta)`` to read (each sample consumed once by the
    task). Unlike the SampleStore's, the TransferQueue consumers take a fixed share of the
    samples each (it has no close that ends a waiting consumer).

    The controller runs in polling mode: without it a ``get_meta`` that finds too few ready
    samples sleeps 5 s inside the controller and then raises ``TimeoutError``, so a consumer
    cannot wait for a producer. An empty answer is asked again after 1 ms (TransferQueue's
    own ``StreamingDataset`` sleeps 1 s), which favours TransferQueue."""

    POLL = 0.001

    def __init__(self, capacity: int, clients: int) -> None:
        import transfer_queue as tq
        from omegaconf import OmegaConf

        self.tq = tq
        conf = {
            "controller": {"polling_mode": True},
            "backend": {"SimpleStorage": {"total_storage_size": capacity}},
        }
        self.conf = tq.init(OmegaConf.create(conf))
        self.producers = [self._client(f"bench-producer-{w}") for w in range(clients)]
        self.consumers = [self._client(f"bench-consumer-{w}") for w in range(clients)]
        for prod, cons in zip(self.producers, self.consumers, strict=True):
            for batch, large in ((64, False), (16, True)):  # warm-up: sockets, first transfers
                self._put(prod, "warm-up", _tensor_columns(batch, large))
                self._get(cons, "warm-up", batch)
        self.producers[0].clear_partition("warm-up")

    def _client(self, name: str) -> Any:
        from transfer_queue import TransferQueueClient

        client = TransferQueueClient(client_id=name, controller_info=self.conf.controller.zmq_info)
        client.initialize_storage_manager(
            manager_type="SimpleStorage", config=self.conf.backend.SimpleStorage
        )
        return client

    def _put(self, client: Any, partition: str, columns: dict[str, torch.Tensor]) -> list[int]:
        from tensordict import TensorDict

        batch = len(next(iter(columns.values())))
        meta = client.put(TensorDict(columns, batch_size=batch), partition_id=partition)
        return list(meta.global_indexes)

    def _get(self, client: Any, partition: str, batch: int) -> list[int]:
        deadline = time.monotonic() + 120
        while True:
            meta = client.get_meta(
                data_fields=["tokens", "logp"],
                batch_size=batch,
                partition_id=partition,
                mode="fetch",
                task_name="train",
            )
            if meta.size:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"TransferQueue get of {batch} from {partition!r} timed out")
            time.sleep(self.POLL)
        data = client.get_data(meta)
        if data.batch_size[0] != batch:
            raise RuntimeError(f"TransferQueue returned {data.batch_size} rows, asked {batch}")
        return list(meta.global_indexes)

    def run(self, n: int, workers: int, batch: int, large: bool) -> tuple[float, list[float]]:
        """``workers`` producers put ``n`` samples, ``batch`` per put; ``workers`` consumers
        each get ``n / workers`` of them, ``batch`` per get. Latency is put start to get
        return, per sample (as in :func:`bench_tensor_rows`)."""
        columns = _tensor_columns(batch, large)
        partition = f"bench-{workers}x{workers}-{batch}-{time.monotonic_ns()}"
        put_at: dict[int, float] = {}
        got: list[tuple[list[int], float]] = []
        lock = threading.Lock()

        def producer(w: int) -> None:
            for _ in range(n // (workers * batch)):
                start = time.perf_counter()
                ids = self._put(self.producers[w], partition, columns)
                with lock:
                    put_at.update(dict.fromkeys(ids, start))

        def consumer(w: int) -> None:
            for _ in range(n // (workers * batch)):
                ids = self._get(self.consumers[w], partition, batch)
                now = time.perf_counter()
                with lock:
                    got.append((ids, now))

        threads = [threading.Thread(target=producer, args=(w,)) for w in range(workers)]
        threads += [threading.Thread(target=consumer, args=(w,)) for w in range(workers)]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
        elapsed = time.perf_counter() - start
        self.producers[0].clear_partition(partition)
        seen = [i for ids, _ in got for i in ids]
        if len(seen) != n or len(set(seen)) != n or set(seen) != set(put_at):
            raise RuntimeError(f"TransferQueue delivered {len(set(seen))} distinct of {n} samples")
        return elapsed, [now - put_at[i] for ids, now in got for i in ids]

    def close(self) -> None:
        for client in self.producers + self.consumers:
            client.close()
        self.tq.close()


def transferqueue_rows(args: argparse.Namespace, ray_store: SampleStore) -> list[tuple[str, ...]]:
    """meshfeed's Ray store and TransferQueue on the same tensor workloads, 1x1 and 4x4, in
    turns (each measured ``--repeat`` times, medians reported). ``thr. vs baseline`` is the
    ratio to TransferQueue's median throughput on the same row."""
    results: dict[tuple[str, str, str], list[tuple[float, list[float]]]] = {}
    counts: dict[tuple[str, str], int] = {}
    tqb = TransferQueueBench(capacity=max(c[4 if args.quick else 3] for c in TQ_CASES), clients=4)
    try:
        for _, batch, large, _, _ in TQ_CASES:  # warm-up, not timed: threads, first calls
            for workers in (1, 4):
                ray_store.clear("tensors")
                bench_tensor_rows(ray_store, 2 * workers * batch, workers, batch, large)
                tqb.run(2 * workers * batch, workers, batch, large)
        for _ in range(args.repeat):
            for label, batch, large, n_full, n_quick in TQ_CASES:
                for workers in (1, 4):
                    n = max(
                        workers * batch,
                        (n_quick if args.quick else n_full) // (workers * batch) * workers * batch,
                    )
                    counts[label, f"{workers}x{workers}"] = n
                    ray_store.clear("tensors")
                    ours = bench_tensor_rows(ray_store, n, workers, batch, large)
                    theirs = tqb.run(n, workers, batch, large)
                    for impl, res in (("SampleStore", ours), ("TransferQueue", theirs)):
                        results.setdefault((label, f"{workers}x{workers}", impl), []).append(res)
    finally:
        tqb.close()
    rows: list[tuple[str, ...]] = []
    for (label, shape), n in counts.items():
        med = {
            impl: float(np.median([n / e for e, _ in results[label, shape, impl]]))
            for impl in ("SampleStore", "TransferQueue")
        }
        for impl in ("SampleStore", "TransferQueue"):
            ms = np.concatenate([np.asarray(lat) for _, lat in results[label, shape, impl]]) * 1e3
            rows.append(
                (
                    "ray",
                    label,
                    shape,
                    impl,
                    str(n),
                    f"{med[impl]:,.0f}",
                    f"{np.percentile(ms, 50):.2f}",
                    f"{np.percentile(ms, 99):.2f}",
                    f"{med[impl] / med['TransferQueue']:.2f}",
                )
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small, fast version")
    parser.add_argument("--batch", type=int, default=8, help="samples per get")
    parser.add_argument("--put-batch", type=int, default=8, help="samples per put (batched row)")
    parser.add_argument("--no-ray", action="store_true", help="skip the Ray rows")
    parser.add_argument("--no-tq", action="store_true", help="skip the TransferQueue rows")
    parser.add_argument(
        "--repeat",
        type=int,
        default=None,
        help="turns of the meshfeed / TransferQueue rows (default: 3, 1 with --quick)",
    )
    args = parser.parse_args()
    if args.repeat is None:
        args.repeat = 1 if args.quick else 3
    if args.repeat < 1:
        raise ValueError(f"--repeat must be >= 1 (got {args.repeat=}); use --repeat 1 or more")
    tq_missing = None if args.no_ray or args.no_tq else _transferqueue_missing()
    scale = 0.2 if args.quick else 1.0
    sizes = {  # samples per run: (embedded, ray)
        "small": (int(20000 * scale), int(1500 * scale)),
        "large": (int(2000 * scale), int(300 * scale)),
    }
    rows: list[tuple[str, ...]] = []
    configs = [(b, s, w) for b in ("embedded", "ray") for s in ("small", "large") for w in (1, 4)]
    if args.no_ray:
        configs = [c for c in configs if c[0] == "embedded"]
    else:
        import ray

        # TransferQueue's controller and its two storage units ask for one CPU each.
        cpus = 2 if args.no_tq or tq_missing else 3
        ray.init(
            num_cpus=cpus, include_dashboard=False, log_to_driver=False, configure_logging=False
        )
        ray_store = SampleStore("ray", capacity=256, tasks=["train"])
        ray_store.put("warm", {"x": [0]})
        for workers in (1, 4):  # warm-up, not timed: the actor's and the threads' first calls
            bench_tensor_rows(ray_store, 2 * workers * 64, workers)
            ray_store.clear("tensors")
    with Progress(total=len(configs), desc="bench_queue", unit="config") as bar:
        for backend, size, workers in configs:
            n = sizes[size][0 if backend == "embedded" else 1]
            unit = workers * args.batch * args.put_batch  # whole puts and gets per thread
            n = max(unit, n - n % unit)  # never 0: --quick once ran the large rows with none
            large = size == "large"
            if backend == "embedded":
                store = SampleStore("embedded", capacity=256, tasks=["train"])
                ours = bench_store(store, n, workers, large, args.batch)
                store = SampleStore("embedded", capacity=256, tasks=["train"])
                batched = bench_store(store, n, workers, large, args.batch, args.put_batch)
                base = bench_queue(n, workers, large, args.batch)
                base_name = "queue.Queue"
            else:
                ray_store.clear("bench")
                ours = bench_store(ray_store, n, workers, large, args.batch)
                ray_store.clear("bench")
                batched = bench_store(ray_store, n, workers, large, args.batch, args.put_batch)
                base = bench_ray_actor(n, workers, large, args.batch)
                base_name = "plain Ray actor"
            results = (
                ("SampleStore", ours),
                (f"SampleStore put x{args.put_batch}", batched),
                (base_name, base),
            )
            for name, (elapsed, lat) in results:
                ms = np.asarray(lat) * 1e3
                rows.append(
                    (
                        backend,
                        size,
                        f"{workers}x{workers}",
                        name,
                        str(n),
                        f"{n / elapsed:,.0f}",
                        f"{np.percentile(ms, 50):.2f}",
                        f"{np.percentile(ms, 99):.2f}",
                        f"{base[0] / elapsed:.2f}",
                    )
                )
            bar.update()
    rows.extend(tensor_rows(args, None if args.no_ray else ray_store))
    if not args.no_ray:
        rows.extend(dataplane_rows(args, ray_store))
        if not args.no_tq and tq_missing is None:
            rows.extend(transferqueue_rows(args, ray_store))
    header = (
        "backend",
        "sample",
        "prod x cons",
        "impl",
        "samples",
        "samples/s",
        "p50 ms",
        "p99 ms",
        "thr. vs baseline",
    )
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, *rows]:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)))
    if tq_missing is not None:
        print(
            f"TransferQueue is not measured: {tq_missing}; install the bench extra "
            '(pip install "torch==<yours>" -e ".[bench]") to measure it beside the Ray store'
        )
    if not args.no_ray:
        ray_store.shutdown()
        ray.shutdown()


def _transferqueue_missing() -> str | None:
    """Why TransferQueue cannot be measured here (``None``: it can)."""
    try:
        import omegaconf  # noqa: F401
        import tensordict  # noqa: F401
        import transfer_queue  # noqa: F401
    except ImportError as exc:
        return f"{exc}"
    return None


if __name__ == "__main__":
    main()
