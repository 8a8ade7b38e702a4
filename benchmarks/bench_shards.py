"""meshfeed shards vs MosaicML Streaming (MDS) and litdata on the same samples, in one run.

Samples: ``{"tokens": int32[128..2048] (uniform length, ids < 50,000), "pixels": uint8[4096]
(values < 16: about 4 bits of entropy per byte)}``, generated from a fixed seed. For each
system and for compression off and zstd it measures:

- ``write s``: the write of every sample into ~64 MiB shards, in this process (meshfeed with
  ``num_workers=1``, MDSWriter, litdata ``optimize(num_workers=1)``); meshfeed also with 2
  workers;
- ``MiB``: bytes on disk of the written dataset (litdata / Mosaic index files included);
- ``take/s``: samples/s of shuffled batches of 32 drawn from the first ``--window`` rows (a
  window of a few shards, as a stream slot reads them), in this process: meshfeed ``take`` per
  shard of the batch, Mosaic and litdata ``dataset[i]``. Cold start included (first open,
  first decode; a compressed Mosaic / litdata shard is decompressed whole on first touch);
- ``iter/s``: the peers' own path, ``iter(StreamingDataset(shuffle=True))`` for as many
  samples, in this process (meshfeed's stream path is ``take``: the column before).

``--large`` measures the large-sample data set instead (``{"id", "image": uint8[80..120 kB],
"label"}``, 16 MiB shards, 0 and 2 workers, epoch 1 with the files dropped from the page
cache, epoch 2, and resume's first batch at 50 %, each in a fresh process; see
``large_samples.py``).

A peer that is not installed is skipped and said so. The peers' pins pull numpy < 2.2 and a
CUDA torchvision, so they live in their own environment here; MosaicML Streaming imports
torchvision's vision datasets at package import only, and where torchvision is absent the
benchmark stubs those names (unused by MDS).

    PYTHONPATH=src python benchmarks/bench_shards.py [--quick] [--rows 200000] [--window 32768]
    PYTHONPATH=src python benchmarks/bench_shards.py --large [--rows 6400] [--rounds 3]
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import tempfile
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from meshfeed.sources import ShardFormatReader, write_shards

# Mosaic's prepare threads, still running when a measured iteration stops early, log a
# teardown error per dataset through this logger.
logging.getLogger("concurrent.futures").setLevel(logging.CRITICAL)

SHARD_BYTES = 64 << 20
BATCH = 32


class Data:
    """The samples, held once as two flat arrays (a sample is two views)."""

    def __init__(self, rows: int, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.lengths = rng.integers(128, 2049, rows)
        self.offsets = np.concatenate([[0], np.cumsum(self.lengths)])
        self.tokens = rng.integers(0, 50_000, int(self.offsets[-1]), dtype=np.int32)
        self.pixels = rng.integers(0, 16, (rows, 4096), dtype=np.uint8)
        self.rows = rows

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        return {
            "tokens": self.tokens[self.offsets[i] : self.offsets[i + 1]],
            "pixels": self.pixels[i],
        }

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        return (self[i] for i in range(self.rows))


DATA: Data | None = None  # global, so litdata's forked worker sees it


def _sample(i: int) -> dict[str, np.ndarray]:
    assert DATA is not None
    return DATA[i]


def remove(path: Path) -> None:
    """rmtree that outlasts a peer's background thread still writing into ``path``."""
    for _ in range(20):
        shutil.rmtree(path, ignore_errors=True)
        if not path.exists():
            return
        time.sleep(0.5)


def disk_mib(path: Path) -> float:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 2**20


def batches(window: int, seed: int = 0) -> list[np.ndarray]:
    order = np.random.default_rng(seed).permutation(window)
    return [order[i : i + BATCH] for i in range(0, window, BATCH)]


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def check(sample: dict[str, Any], i: int) -> None:
    assert DATA is not None
    ref = DATA[i]
    assert np.array_equal(np.asarray(sample["tokens"]), ref["tokens"]), i
    assert np.array_equal(np.asarray(sample["pixels"]).reshape(-1), ref["pixels"]), i


# --- meshfeed -------------------------------------------------------------------------------


def meshfeed_write(out: Path, compression: str | None, workers: int) -> None:
    assert DATA is not None
    write_shards(
        iter(DATA),
        out,
        bytes_per_shard=SHARD_BYTES,
        compression=compression,
        num_workers=workers,
    )


def meshfeed_read(out: Path, plan: list[np.ndarray]) -> int:
    reader = ShardFormatReader.from_index(out)
    paths = reader.shards
    starts = np.cumsum([0] + [reader.count(p) for p in paths])
    n = 0
    for rows in plan:
        shard = np.searchsorted(starts, rows, side="right") - 1
        for s in np.unique(shard).tolist():
            got = reader.take(paths[s], rows[shard == s] - starts[s])
            n += len(got)
    check(reader.take(reader.shards[0], np.array([5]))[0], 5)
    return n


# --- MosaicML Streaming ---------------------------------------------------------------------


def _stub_torchvision() -> None:
    """Mosaic imports torchvision's vision datasets at package import; MDS never uses them."""
    for name in [m for m in sys.modules if m.startswith("torchvision")]:
        del sys.modules[name]
    names = ("torchvision", "torchvision.datasets", "torchvision.transforms")
    for name in (*names, "torchvision.transforms.functional"):
        sys.modules[name] = types.ModuleType(name)
    sys.modules["torchvision.datasets"].VisionDataset = object  # type: ignore[attr-defined]
    sys.modules["torchvision.datasets"].CIFAR10 = object  # type: ignore[attr-defined]
    sys.modules["torchvision.transforms.functional"].to_tensor = None  # type: ignore[attr-defined]


def import_mosaic() -> tuple[Any, str]:
    try:
        import streaming
    except ImportError as e:
        if "streaming" in str(e) and "torchvision" not in str(e):
            return None, f"not installed ({e}); pip install mosaicml-streaming"
        _stub_torchvision()
        try:
            import streaming
        except ImportError as e2:
            return None, f"does not import ({e2})"
        return streaming, f"{streaming.__version__} (torchvision absent: its vision names stubbed)"
    return streaming, streaming.__version__


def mosaic_write(out: Path, compression: str | None) -> None:
    import streaming

    assert DATA is not None
    columns = {"tokens": "ndarray:int32", "pixels": "ndarray:uint8"}
    with streaming.MDSWriter(
        out=str(out), columns=columns, compression=compression, size_limit=SHARD_BYTES
    ) as w:
        for s in DATA:
            w.write(s)


def mosaic_dataset(out: Path, shuffle: bool) -> Any:
    import streaming
    from streaming.base.util import clean_stale_shared_memory

    clean_stale_shared_memory()
    return streaming.StreamingDataset(
        local=str(out), shuffle=shuffle, batch_size=BATCH, keep_zip=True
    )


def first(iterable: Any, n: int) -> int:
    got = 0
    for _ in iterable:
        got += 1
        if got == n:
            break
    return got


def mosaic_iter(out: Path, plan: list[np.ndarray]) -> int:
    return first(mosaic_dataset(out, shuffle=True), sum(len(b) for b in plan))


def mosaic_read(out: Path, plan: list[np.ndarray]) -> int:
    ds = mosaic_dataset(out, shuffle=False)
    n = 0
    for rows in plan:
        n += len([ds[int(i)] for i in rows])
    check(ds[5], 5)
    return n


# --- litdata --------------------------------------------------------------------------------


def import_litdata() -> tuple[Any, str]:
    try:
        import litdata
    except ImportError as e:
        return None, f"not installed ({e}); pip install litdata"
    return litdata, litdata.__version__


def litdata_write(out: Path, compression: str | None) -> None:
    import litdata

    assert DATA is not None
    litdata.optimize(
        fn=_sample,
        inputs=list(range(DATA.rows)),
        output_dir=str(out),
        chunk_bytes=SHARD_BYTES,
        compression=compression,
        num_workers=1,
        reorder_files=False,
        verbose=False,
        start_method="fork",
    )


def litdata_dataset(out: Path, shuffle: bool) -> Any:
    import litdata

    shutil.rmtree(out.parent / "ld-cache", ignore_errors=True)
    return litdata.StreamingDataset(
        str(out), shuffle=shuffle, cache_dir=str(out.parent / "ld-cache")
    )


def litdata_iter(out: Path, plan: list[np.ndarray]) -> int:
    return first(litdata_dataset(out, shuffle=True), sum(len(b) for b in plan))


def litdata_read(out: Path, plan: list[np.ndarray]) -> int:
    ds = litdata_dataset(out, shuffle=False)
    n = 0
    for rows in plan:
        n += len([ds[int(i)] for i in rows])
    check(ds[5], 5)
    return n


# --- the run --------------------------------------------------------------------------------


def measure(read: Callable[..., int], out: Path, plan: list[np.ndarray], rounds: int) -> float:
    rates = []
    for _ in range(rounds):
        t, n = timed(lambda: read(out, plan))
        rates.append(n / t)
    return float(np.median(rates))


def main() -> None:
    global DATA
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--quick", action="store_true", help="20k samples, one read round (else the median of 3)"
    )
    p.add_argument("--rows", type=int, default=None, help="samples (default 200k; 20k --quick)")
    p.add_argument("--window", type=int, default=32_768, help="rows read in shuffled batches")
    p.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    p.add_argument("--large", action="store_true", help="the large-sample rows instead")
    p.add_argument("--rounds", type=int, default=None, help="--large: rounds (3; 1 --quick)")
    args = p.parse_args()
    if args.large:  # the large-sample rows instead (large_samples.py), local files
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import large_samples

        large_samples.report(args, [0] if args.quick else [0, 2])
        return
    rounds = 1 if args.quick else 3
    if args.rows is None:
        args.rows = 20_000 if args.quick else 200_000
    t, DATA = timed(lambda: Data(args.rows))
    raw = (DATA.tokens.nbytes + DATA.pixels.nbytes) / 2**20
    print(f"{args.rows} samples, {raw:.0f} MiB raw (made in {t:.1f} s); cpus {os.cpu_count()}")
    window = min(args.window, args.rows)
    plan = batches(window)
    # name, write(out, compression, workers), take-style read, native shuffled iteration
    systems: list[tuple[str, Callable[..., None], Callable[..., int], Any, list[int]]] = [
        ("meshfeed", meshfeed_write, meshfeed_read, None, [1, 2])
    ]
    for name, imp, write, read, native in (
        ("mosaic", import_mosaic, mosaic_write, mosaic_read, mosaic_iter),
        ("litdata", import_litdata, litdata_write, litdata_read, litdata_iter),
    ):
        mod, note = imp()
        print(f"{name}: {note}" if mod is not None else f"{name}: skipped, {note}")
        if mod is not None:
            systems.append((name, lambda o, c, w, f=write: f(o, c), read, native, [1]))
    root = Path(args.dir or tempfile.mkdtemp(prefix="bench-shards-"))
    print(
        f"\n{'system':<20}{'write s':>9}{'MiB':>8}{'take/s':>10}{'iter/s':>10}"
        f"   (batches of {BATCH} from the first {window} rows, shuffled; median of {rounds})"
    )
    try:
        for compression in (None, "zstd"):
            for name, write, read, native, worker_counts in systems:
                for w in worker_counts:
                    label = f"{name} {compression or 'raw'}" + (f" w={w}" if w > 1 else "")
                    out = root / f"{name}-{compression}-{w}"
                    t_write, _ = timed(lambda: write(out, compression, w))  # noqa: B023
                    row = f"{label:<20}{t_write:>9.1f}{disk_mib(out):>8.0f}"
                    if w == 1:
                        row += f"{measure(read, out, plan, rounds):>10.0f}"
                        it = "-" if native is None else f"{measure(native, out, plan, rounds):.0f}"
                        row += f"{it:>10}"
                    print(row, flush=True)
                    remove(out)
                    remove(root / "ld-cache")
    finally:
        if args.dir is None:
            remove(root)


if __name__ == "__main__":
    main()
