"""check_mapped: a .npy truncated under a memory-mapped reader is a SourceError naming it.

The truncations run in a fresh interpreter: a missing check would end it with SIGBUS (-7),
which fails the test instead of killing pytest.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np

from meshfeed.mapped import check_mapped
from tests.process_checks import run_python


def test_in_memory_arrays_and_whole_files_pass(tmp_path: Path) -> None:
    check_mapped(np.arange(10))
    np.save(tmp_path / "a.npy", np.arange(5000, dtype=np.int64))
    mapped = np.load(tmp_path / "a.npy", mmap_mode="r")
    check_mapped(mapped)
    check_mapped(np.asarray(mapped)[10:20][::2])
    np.save(tmp_path / "b.npy", np.arange(3))
    (tmp_path / "b.npy").replace(tmp_path / "a.npy")  # replaced by rename: the old stays mapped
    check_mapped(mapped)
    assert int(mapped[4999]) == 4999


def test_truncated_npy_under_an_index_an_order_and_convert_is_a_source_error(
    tmp_path: Path,
) -> None:
    script = tmp_path / "truncate.py"
    script.write_text(
        textwrap.dedent(
            """
            import os, sys
            import numpy as np
            from meshfeed.curriculum import MetricIndex
            from meshfeed.curriculum.order import GatedOrder
            from meshfeed.errors import SourceError

            def expect(what, fn, name):
                try:
                    fn()
                except SourceError as exc:
                    assert name in str(exc) and "changed size while open" in str(exc), exc
                    print(what, "ok")
                    return
                raise SystemExit(f"{what}: no SourceError")

            n = 200_000
            fp = {"length": n}
            MetricIndex.from_values("m", np.arange(n)[::-1].copy(), fingerprint=fp).save("i")
            index = MetricIndex.load("i")
            os.truncate("i/order.npy", 128)
            expect("sorted_values", index.sorted_values, "order.npy")

            np.save("pool.npy", np.arange(n, dtype=np.int64))
            pool = np.asarray(np.load("pool.npy", mmap_mode="r"))[: n - 10]
            order = GatedOrder(pool_order=pool, entry_steps=np.zeros(n - 10, np.int64),
                               global_batch_size=8, samples_per_epoch=n - 10, seed=0)
            assert order.indices(0, np.arange(8)).shape == (8,)
            os.truncate("pool.npy", 4096)
            expect("GatedOrder.indices", lambda: order.indices(0, np.arange(n - 20, n - 12)),
                   "pool.npy")

            import meshfeed.sources.converters.inputs
            conv = sys.modules["meshfeed.sources.converters.inputs"]
            conv.CHUNK_RECORDS = 64  # several chunks of 64-byte rows
            np.save("ids.npy", np.arange(64_000, dtype=np.int64).reshape(4000, 16))
            records = conv._npy_chunks(__import__("pathlib").Path("ids.npy"))
            assert next(records).items[0][1].tolist() == list(range(16))
            os.truncate("ids.npy", 8192)
            expect("convert .npy", lambda: list(records), "ids.npy")
            """
        )
    )
    done = run_python(script, cwd=tmp_path, timeout=120)
    assert done.returncode == 0, (done.returncode, done.stdout, done.stderr[-3000:])
    assert done.stdout.split() == [
        *("sorted_values", "ok", "GatedOrder.indices", "ok", "convert", ".npy", "ok")
    ]
