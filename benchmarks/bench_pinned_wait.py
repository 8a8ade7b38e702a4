"""The training loop's wait per 512 KiB batch when the data is ready: what pinning (and the
copy to the device) costs the loop's thread, by design, so that one GPU run decides the next.

    PYTHONPATH=src:. python benchmarks/bench_pinned_wait.py [--quick]

A step of 4 ms (a sleep: the GIL is free, as in a GPU step's kernel launches and syncs) is
longer than making a batch, so every wait is the loader's own cost on the loop's thread. The
wait of a row is what the loop spends per batch from asking for it to holding it pinned (or
on the device): ``next`` and whatever the loop does itself in that row. Rows, per worker count:

- ``pin_memory=True``: meshfeed's delivery thread pins ahead (the loop takes a pinned batch);
- ``device=cuda``: the same thread also issues the copy on a side stream;
- ``device=cuda, hand-over done ahead`` (an experiment, not a meshfeed option): the delivery
  thread waits for each copy's event itself and records the batch on the loop's stream, so the
  loop's thread makes no CUDA call per batch (each one lets another thread take the GIL);
- ``loop pins``: meshfeed unpinned, the loop calls ``batch.pin_memory()`` itself (what torch's
  DataLoader does with 0 workers): no second thread, but the pinning copy on the loop's thread;
- ``registered slots`` (workers only; an experiment, not a meshfeed option): the workers'
  shared-memory slots page-locked once with ``cudaHostRegister``, so a batch arrives pinned
  through the unpinned path: no thread, no copy. A batch copied out of its slot (the loop held
  more than the ring) arrives unpinned; the "pinned" column counts them;
- ``pin_memory=True, GIL switch 0.1 ms``: the first row with ``sys.setswitchinterval(1e-4)``
  (a diagnosis, not advice: if the wait's tail is the loop waiting for the GIL that another
  thread of the process holds, it shrinks here);
- ``torch pin_memory=True``: torch's DataLoader and its pin thread, for reference.

Without CUDA (``--quick`` in CI) it measures the hand-off alone: meshfeed with ``device="cpu"``
(the delivery thread, no copy) against ``device=None`` (no thread).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any, cast

import numpy as np
import torch
from torch.utils.data import DataLoader as TorchDataLoader

from meshfeed import DataLoader
from meshfeed.delivery import _Copier
from meshfeed.runtime.transport import SlotReader

STEP = 0.004
#: What a row patches while it runs (a context manager made per row).
Patch = Callable[[], contextlib.AbstractContextManager[Any]]
no_patch: Patch = contextlib.nullcontext


def _percentiles(waits: list[float]) -> tuple[float, float, float]:
    waits = sorted(waits)
    mean = sum(waits) / len(waits)
    return waits[len(waits) // 2] * 1e6, waits[int(len(waits) * 0.99)] * 1e6, mean * 1e6


def run(
    make: Callable[[], Any], take: Callable[[Iterator[Any]], Any], steps: int
) -> tuple[float, float, float, int]:
    """p50, p99 and mean wait (us) over ``steps`` (the first 20 not counted), and how many
    batches the loop held pinned or on the device."""
    loader = make()
    it = iter(loader)
    waits, pinned = [], 0
    for _ in range(steps):
        asked = time.perf_counter()
        batch = take(it)
        waits.append(time.perf_counter() - asked)
        pinned += batch.is_cuda or (torch.cuda.is_available() and batch.is_pinned())
        time.sleep(STEP)
    del it
    getattr(loader, "shutdown", lambda: None)()
    return (*_percentiles(waits[20:]), pinned)


class HandOverAhead:
    """While active, the delivery thread finishes each batch's hand-over itself: it waits for
    the copy (``event.synchronize()``, the GIL released) and records the batch's memory on the
    loop's current stream (read when this starts), so the loop's thread receives a batch with
    no event to wait for."""

    def __enter__(self) -> HandOverAhead:
        self.original = _Copier.prepare
        original = self.original
        loop_stream = torch.cuda.current_stream()

        def prepare(copier: _Copier, batch: Any) -> tuple[Any, Any, float, float]:
            batch, event, pin_s, copy_s = original(copier, batch)
            if event is not None:
                event.synchronize()
                batch.record_stream(loop_stream)  # this benchmark's batches are one tensor
            return batch, None, pin_s, copy_s

        _Copier.prepare = prepare  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        _Copier.prepare = self.original  # type: ignore[method-assign]


@contextlib.contextmanager
def switch_interval(seconds: float) -> Iterator[None]:
    """While active, ``sys.setswitchinterval(seconds)``."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(seconds)
    try:
        yield
    finally:
        sys.setswitchinterval(interval)


class RegisteredSlots:
    """While active, every shared-memory slot the main process maps for lending is
    page-locked with ``cudaHostRegister``; on leaving (the loader is shut down by then), each is
    unregistered before its mapping can go (registered memory must not be unmapped)."""

    def __enter__(self) -> RegisteredSlots:
        self.original = SlotReader._lendable
        cudart = torch.cuda.cudart()
        self.cudart, self.keep = cudart, []
        keep: list[np.ndarray] = self.keep
        original = self.original

        def lendable(reader: SlotReader, sid: int) -> Any:
            fresh = sid not in reader._lend_maps
            mapped = original(reader, sid)
            if fresh:
                view = np.frombuffer(mapped, dtype=np.uint8)
                err = cudart.cudaHostRegister(view.ctypes.data, view.nbytes, 0)
                if int(err) != 0:
                    raise RuntimeError(f"cudaHostRegister failed: {err}")
                keep.append(view)  # holds the mapping open while it is registered
            return mapped

        SlotReader._lendable = lendable
        return self

    def __exit__(self, *exc: object) -> None:
        SlotReader._lendable = self.original
        torch.cuda.synchronize()  # no copy from a slot still in flight
        for view in self.keep:
            self.cudart.cudaHostUnregister(view.ctypes.data)
        self.keep.clear()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer batches")
    cfg = parser.parse_args()
    data = np.zeros((8192, 2048), dtype=np.int64)  # 16 KiB samples: 512 KiB batches of 32
    steps = 60 if cfg.quick else 240
    cuda = torch.cuda.is_available()

    def mf(workers: int, **kw: Any) -> Callable[[], Any]:
        return lambda: DataLoader(
            data, batch_size=32, num_workers=workers, warn_wait_share=None, **kw
        )

    def torch_loader(workers: int) -> Callable[[], Any]:
        return lambda: TorchDataLoader(
            cast(Any, data), batch_size=32, num_workers=workers, pin_memory=True,
            persistent_workers=workers > 0, shuffle=True,
        )  # fmt: skip

    def plain(it: Iterator[Any]) -> Any:
        return next(it)

    def pins(it: Iterator[Any]) -> Any:
        return next(it).pin_memory()

    print("| workers | row | batches pinned | wait per batch p50 / p99 / mean us |")
    print("|---|---|---|---|")
    for workers in (0, 2, 8) if not cfg.quick else (0, 2):
        # (name, the loader, how the loop takes a batch, what is patched while it runs)
        rows: list[tuple[str, Callable[[], Any], Callable[[Iterator[Any]], Any], Patch]]
        if not cuda:
            rows = [
                ("device=None (no thread)", mf(workers), plain, no_patch),
                ("device=cpu (delivery thread)", mf(workers, device="cpu"), plain, no_patch),
            ]
        else:
            rows = [
                ("pin_memory=True", mf(workers, pin_memory=True), plain, no_patch),
                ("device=cuda", mf(workers, pin_memory=True, device="cuda"), plain, no_patch),
                (
                    "device=cuda, hand-over done ahead",
                    mf(workers, pin_memory=True, device="cuda"),
                    plain,
                    HandOverAhead,
                ),
                ("loop pins", mf(workers), pins, no_patch),
            ]
            if workers:
                rows.append(("registered slots", mf(workers), plain, RegisteredSlots))
            rows.append(
                (
                    "pin_memory=True, GIL switch 0.1 ms",
                    mf(workers, pin_memory=True),
                    plain,
                    partial(switch_interval, 1e-4),
                )
            )
            rows.append(("torch pin_memory=True", torch_loader(workers), plain, no_patch))
        for name, make, take, patch in rows:
            try:
                with patch():
                    p50, p99, mean, pinned = run(make, take, steps)
            except Exception as exc:  # an experiment that fails says so; the other rows go on
                print(f"| {workers} | {name} | failed: {exc!r} | |", flush=True)
                continue
            print(
                f"| {workers} | {name} | {pinned}/{steps} | {p50:,.0f} / {p99:,.0f} / {mean:,.0f} |",
                flush=True,
            )
    if not cuda:
        print("\nno CUDA on this machine: the pinned and device rows need it (run on a GPU)")


if __name__ == "__main__":
    main()
