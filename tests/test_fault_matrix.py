"""The fault matrix of issues #11 and #20: one parametrised case per (fault, trials, outcome) row.

Each row injects one fault the way a user or an adversary would and checks the outcome the
README's "Reliability" table promises: refused by name, raised (never substituted), or
identical data. Every row must pass. Process faults (a killed loader, a killed, stopped or
late peer rank, a bad sample on one rank) run real processes (:mod:`tests.process_faults`).

Reproduce: ``python -m pytest -q tests/test_fault_matrix.py``.
"""

from __future__ import annotations

import math
import shutil
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from meshfeed import DataLoader
from meshfeed.curriculum import MetricIndex
from meshfeed.errors import NEVER_SUBSTITUTED, SourceError
from meshfeed.mesh import default_rank
from meshfeed.order import Permutation
from meshfeed.sources.tokens.indexed import IndexedFormatError, TokenCorpus
from meshfeed.sources.tokens.indexed_write import IndexedWriter, write_indexed
from tests.process_faults import (
    assert_raise_on_every_rank,
    assert_survivors_stop,
    assert_tree_dies,
)


@dataclass(frozen=True, kw_only=True, slots=True)
class Row:
    fault: str
    trials: int
    outcome: str
    run: Callable[[Path], None]
    slow: bool = False  # real processes


class _TookTooLong(Exception):
    pass


def _bounded(seconds: float, fn: Callable[[], object]) -> object:
    """Run ``fn`` with a hard wall-clock limit (a row that hangs fails, it does not stall)."""
    import signal

    def expire(signum: int, frame: object) -> None:
        raise _TookTooLong(f"did not return within {seconds}s")

    old = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        return fn()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _documents(corpus: TokenCorpus) -> list[list[int]]:
    return [corpus.document(i).tolist() for i in range(corpus.num_documents)]


# ----------------------------------------------------------------- trust (this area)
def rank_from_torchrun_env(tmp: Path) -> None:
    mp = pytest.MonkeyPatch()
    try:
        seen = []
        for rank in range(2):
            mp.setenv("RANK", str(rank))
            mp.setenv("WORLD_SIZE", "2")
            loader = DataLoader(list(range(16)), batch_size=2, mesh={"dp": 2}, seed=0)
            seen.append({int(x) for b in loader for x in b})
        assert seen[0].isdisjoint(seen[1]) and seen[0] | seen[1] == set(range(16))
    finally:
        mp.undo()


def rank_unknowable(tmp: Path) -> None:
    with pytest.raises(ValueError, match="cannot tell this process's rank"):
        default_rank(2, env={})
    mp = pytest.MonkeyPatch()
    try:  # the loaders ask with the mesh's world size, so a 2-rank mesh is refused too
        mp.delenv("RANK", raising=False)
        mp.delenv("WORLD_SIZE", raising=False)
        with pytest.raises(ValueError, match=r"2 processes \(from the mesh\).*rank=\.\.\."):
            DataLoader(list(range(16)), batch_size=2, mesh={"dp": 2}, seed=0)
    finally:
        mp.undo()


def idx_bit_flips(tmp: Path) -> None:
    rng = np.random.default_rng(2024)
    docs = [rng.integers(0, 60000, rng.integers(0, 30)).tolist() for _ in range(40)]
    want = _documents(write_indexed(tmp / "good", docs))
    raw = (tmp / "good.idx").read_bytes()
    shutil.copy(tmp / "good.bin", tmp / "bad.bin")
    for _ in range(400):
        bit = int(rng.integers(0, len(raw) * 8))
        flipped = bytearray(raw)
        flipped[bit // 8] ^= 1 << (bit % 8)
        (tmp / "bad.idx").write_bytes(bytes(flipped))
        try:
            corpus = TokenCorpus.open(tmp / "bad")
        except IndexedFormatError:
            continue
        assert _documents(corpus) == want, f"bit {bit} opened with wrong tokens"


def idx_dtype_code_mismatch(tmp: Path) -> None:
    write_indexed(tmp / "c", [[1, 2, 3], [300, 400]], np.uint16)
    raw = bytearray((tmp / "c.idx").read_bytes())
    raw[17] = 1  # the dtype code byte: uint8 over uint16 data
    (tmp / "c.idx").write_bytes(bytes(raw))
    with pytest.raises(IndexedFormatError, match="dtype code 1 .* fit 2-byte tokens"):
        TokenCorpus.open(tmp / "c")


def idx_negative_size(tmp: Path) -> None:
    write_indexed(tmp / "c", [[1, 2], [3, 4]])
    raw = bytearray((tmp / "c.idx").read_bytes())
    raw[38:42] = struct.pack("<i", -1)
    (tmp / "c.idx").write_bytes(bytes(raw))
    with pytest.raises(IndexedFormatError, match="document 1 the negative size -1"):
        TokenCorpus.open(tmp / "c")


def bin_with_old_idx(tmp: Path) -> None:
    write_indexed(tmp / "a", [[1, 2], [3]])
    write_indexed(tmp / "b", [[1, 2], [3, 4, 5]])
    shutil.copy(tmp / "b.bin", tmp / "a.bin")
    with pytest.raises(IndexedFormatError, match=r"a\.bin is 10 bytes but .*accounts for 6"):
        TokenCorpus.open(tmp / "a")


def concurrent_writers(tmp: Path) -> None:
    corpora = [[[1, 2], [3]], [[4], [5, 6]]]  # equal sizes: a mixed pair would pass size checks
    import threading

    for _ in range(20):
        writers = [IndexedWriter(tmp / "c") for _ in corpora]
        for w, docs in zip(writers, corpora, strict=True):
            for d in docs:
                w.add(d)
        threads = [threading.Thread(target=w.close) for w in writers]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        assert _documents(TokenCorpus.open(tmp / "c")) in corpora
    assert sorted(p.name for p in tmp.iterdir()) == ["c.bin", "c.idx"]


def failed_write(tmp: Path) -> None:
    def docs():
        yield [1]
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        write_indexed(tmp / "deep" / "c", docs())
    assert list((tmp / "deep").iterdir()) == []  # parent created, no temp files left


def metric_index_interrupted_save(tmp: Path) -> None:
    fp = {"length": 5}
    MetricIndex.from_values("m", np.array([5, 1, 4, 2, 3]), fingerprint=fp).save(tmp / "i")
    other = tmp / "other"
    MetricIndex.from_values("m", np.array([9, 8, 7, 6, 0]), fingerprint=fp).save(other)
    shutil.copy(other / "values.npy", tmp / "i" / "values.npy")  # crash after one rename
    with pytest.raises(ValueError, match=r"values\.npy is not the file .*meta\.json recorded"):
        MetricIndex.load(tmp / "i")
    (tmp / "i" / "meta.json").write_text(
        (tmp / "i" / "meta.json").read_text().replace('"files"', '"old_files"')
    )  # an index saved before file records: the consistency check still refuses the mix
    with pytest.raises(ValueError, match="inconsistent"):
        MetricIndex.load(tmp / "i")


def seed_outside_64_bits(tmp: Path) -> None:
    with pytest.raises(ValueError, match=r"seed must be in \[0, 2\*\*64\)"):
        Permutation(100, 2**64)
    with pytest.raises(TypeError, match="seed must be an int"):
        Permutation(100, "0")  # type: ignore[arg-type]


def parquet_damaged_footer(tmp: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"id": list(range(32))}), tmp / "a.parquet")
    raw = bytearray((tmp / "a.parquet").read_bytes())
    footer = int.from_bytes(raw[-8:-4], "little")
    raw[len(raw) - 8 - footer : len(raw) - 8] = b"\xff" * footer
    (tmp / "a.parquet").write_bytes(bytes(raw))
    from meshfeed.sources.parquet import ParquetSource

    with pytest.raises(SourceError, match=r"a\.parquet"):
        ParquetSource(tmp / "a.parquet")


def parquet_different_schemas(tmp: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    from meshfeed.sources.parquet import ParquetSource

    pq.write_table(pa.table({"id": [1], "text": ["a"]}), tmp / "a.parquet")
    pq.write_table(pa.table({"id": [2]}), tmp / "b.parquet")
    with pytest.raises(ValueError, match=r"b\.parquet has columns \{id: int64\}"):
        ParquetSource(tmp)


# ----------------------------------------------------------------- engine (fetcher, loader)
def _damaged_parquet_loader(tmp: Path) -> DataLoader:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    from meshfeed.sources.parquet import ParquetSource

    table = pa.table({"id": list(range(32))})
    pq.write_table(table, tmp / "a.parquet", row_group_size=16, compression="none")
    raw = bytearray((tmp / "a.parquet").read_bytes())
    chunk = pq.ParquetFile(tmp / "a.parquet").metadata.row_group(1).column(0)
    raw[chunk.data_page_offset : chunk.data_page_offset + 6] = b"\xff" * 6
    (tmp / "a.parquet").write_bytes(bytes(raw))
    return DataLoader(
        ParquetSource(tmp / "a.parquet"), batch_size=8, shuffle=False, on_error="substitute"
    )


def damaged_parquet_not_substituted(tmp: Path) -> None:
    with pytest.raises(SourceError, match=r"row group 1 of .*a\.parquet"):
        list(_damaged_parquet_loader(tmp))


class _Raises:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> int:
        if i == 3:
            raise self.exc
        return i


def _never_substituted(exc: BaseException) -> None:  # helper for the rows below
    loader = DataLoader(_Raises(exc), batch_size=8, shuffle=False, on_error="substitute")
    with pytest.raises(type(exc)):
        list(loader)


def memory_error_not_substituted(tmp: Path) -> None:
    assert MemoryError in NEVER_SUBSTITUTED
    _never_substituted(MemoryError())


def keyboard_interrupt_not_substituted(tmp: Path) -> None:
    _never_substituted(KeyboardInterrupt())


def system_exit_not_substituted(tmp: Path) -> None:
    _never_substituted(SystemExit(3))


def _refused(kwargs: dict[str, object], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        DataLoader(list(range(8)), **{"batch_size": 2, **kwargs})  # type: ignore[arg-type]


def loader_flag_strings(tmp: Path) -> None:
    _refused({"shuffle": "False"}, TypeError, "shuffle")
    _refused({"drop_last": "False"}, TypeError, "drop_last")


def loader_timeout_bool_and_nan(tmp: Path) -> None:
    _refused({"timeout": True}, TypeError, "timeout")
    _refused({"timeout": math.nan}, ValueError, "timeout")


def loader_seed_outside_64_bits(tmp: Path) -> None:
    _refused({"seed": 2**64}, ValueError, "seed")


def loader_path_string_dataset(tmp: Path) -> None:
    with pytest.raises((TypeError, ValueError), match="data/corpus"):
        DataLoader("data/corpus", batch_size=2)


# ----------------------------------------------------------------- orders (mixture, curriculum)
def mixture_tiny_weights(tmp: Path) -> None:
    from meshfeed import Mixture

    mix = Mixture({"a": list(range(10)), "b": list(range(10))}, {"a": 1e-7, "b": 3e-7})
    assert mix.shares == [{"a": 0.25, "b": 0.75}]  # only the ratio matters
    assert mix.counts(40) == {"a": 10, "b": 30}


def mixture_huge_int_weights(tmp: Path) -> None:
    from meshfeed import Mixture

    mix = Mixture({"a": list(range(10)), "b": list(range(10))}, {"a": 10**400, "b": 1})
    assert mix.shares == [{"a": 1.0, "b": 0.0}] and mix.counts(40) == {"a": 40, "b": 0}


def pacing_never_negative(tmp: Path) -> None:
    from meshfeed.curriculum.schedule import fixed_linear

    # Beyond +-2**52 the float arithmetic is not exact: refused by name, not wrapped around.
    with pytest.raises(ValueError, match=r"max_difficulty must lie within \+-2\*\*52"):
        fixed_linear(0, 2**63, 100)
    steps = np.arange(0, 201)
    for top in (2**52, 2**52 - 1, 10**15):
        got = fixed_linear(0, top, 100).difficulties(steps)
        assert (got >= 0).all() and got[-1] == top


# ----------------------------------------------------------------- balance
def plan_huge_budget(tmp: Path) -> None:
    from meshfeed.balance import schedule_documents

    with pytest.raises(ValueError, match="max_tokens"):
        _bounded(10, lambda: schedule_documents([10, 20], num_ranks=2, max_tokens=2**63))


def plan_too_many_ranks(tmp: Path) -> None:
    from meshfeed.balance import schedule_documents

    with pytest.raises(ValueError, match="num_ranks"):
        _bounded(10, lambda: schedule_documents([10, 20], num_ranks=10**6, max_tokens=100))


# ----------------------------------------------------------------- store
def store_timeout_nan(tmp: Path) -> None:
    from meshfeed.queue import SampleStore

    store = SampleStore(fields=["x"])
    with pytest.raises(ValueError, match="timeout"):
        _bounded(5, lambda: store.get("t", ["x"], 1, "p", timeout=math.nan))


def store_sampler_not_a_sampler(tmp: Path) -> None:
    from meshfeed.queue import SampleStore

    store = SampleStore(fields=["x"])
    with pytest.raises(TypeError, match="sampler"):
        _bounded(5, lambda: store.get("t", ["x"], 1, "p", sampler=5, timeout=0.1))  # type: ignore[arg-type]


# ----------------------------------------------------------------- files and bounds (issue #20)
def _doctored_store(tmp: Path, change: Callable[[dict], None]) -> Path:
    import json

    import torch

    from meshfeed.queue import SampleStore

    store = SampleStore()
    store.put("p", {"x": torch.arange(6).reshape(3, 2)})
    path = tmp / f"store-{change.__name__}.ckpt"
    store.save(path)
    blob = torch.load(path, weights_only=True)
    parts = {"meta": json.loads(blob["meta"]), "values": json.loads(blob["values"])}
    change(parts)
    blob["meta"], blob["values"] = json.dumps(parts["meta"]), json.dumps(parts["values"])
    torch.save(blob, path)
    return path


def _lower_next_id(parts: dict) -> None:
    parts["meta"]["partitions"][0]["next_id"] = 1


def _repeated_id(parts: dict) -> None:
    parts["meta"]["partitions"][0]["samples"][2][0] = 0


def _tensor_index_out_of_range(parts: dict) -> None:
    parts["values"][0][1]["x"]["t"] = 7


def _field_missing(parts: dict) -> None:
    del parts["values"][0][1]["x"]


def _counts_inconsistent(parts: dict) -> None:
    parts["meta"]["produced"] = 2


def store_file_bookkeeping(tmp: Path) -> None:
    from meshfeed.queue import SampleStore

    for change, message in [
        (_lower_next_id, "holds sample id 1 but its next_id is 1"),
        (_repeated_id, "lists sample id 0 twice"),
        (_tensor_index_out_of_range, "names tensor 7, outside the file's 3 tensors"),
        (_field_missing, r"lists fields \['x'\] but has values for \[\]"),
        (_counts_inconsistent, "holds 3 samples but counts only 2 produced"),
    ]:
        path = _doctored_store(tmp, change)
        with pytest.raises(ValueError, match=message) as info:
            SampleStore.load(path)
        assert str(path) in str(info.value)


def store_killed_save_on_dashed_host(tmp: Path) -> None:
    import os
    import socket
    import subprocess
    import sys

    from meshfeed.queue import SampleStore

    script = (
        "import os, socket, torch\n"
        "socket.gethostname = lambda: 'gpu-node-07'\n"
        "from meshfeed.queue import SampleStore\n"
        "def stop(*a, **k): os._exit(9)\n"
        "torch.save = stop\n"
        f"s = SampleStore(); s.put('p', {{'x': [1]}}); s.save({str(tmp / 's')!r})\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    assert subprocess.run([sys.executable, "-c", script], env=env, timeout=120).returncode == 9
    assert len([n for n in os.listdir(tmp) if n.endswith(".tmp")]) == 1  # killed mid-write
    mp = pytest.MonkeyPatch()
    try:
        mp.setattr(socket, "gethostname", lambda: "gpu-node-07")
        store = SampleStore()
        store.put("p", {"x": [1]})
        store.save(tmp / "s")
    finally:
        mp.undo()
    assert os.listdir(tmp) == ["s"]


_TRUNCATE = """
import os, sys, time
from meshfeed import DataLoader
from meshfeed.errors import SourceError
from meshfeed.sources.tokens.indexed_write import write_indexed
from meshfeed.sources.tokens.windows import TokenWindows
for workers in (0, 1):
    name = f"c{workers}"
    windows = TokenWindows(write_indexed(name, [list(range(3000))] * 64, "int32"), seq_len=128)
    it = iter(DataLoader(windows, batch_size=4, shuffle=False, num_workers=workers, timeout=60))
    next(it)
    time.sleep(0.5)  # a worker has filled its prefetch: no read in flight
    os.truncate(name + ".bin", 4096)
    try:
        list(it)
    except SourceError as exc:
        assert name + ".bin changed size while open" in str(exc), exc
        continue
    sys.exit(f"num_workers={workers}: no SourceError")
"""


def bin_truncated_while_open(tmp: Path) -> None:
    from tests.process_checks import run_python

    (tmp / "truncate.py").write_text(_TRUNCATE)
    done = run_python(tmp / "truncate.py", cwd=tmp, timeout=120)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])  # -7 would be SIGBUS


_TRUNCATE_MAPPED = """
import os, sys
import numpy as np
import pyarrow as pa
from meshfeed.curriculum import MetricIndex
from meshfeed.errors import SourceError
from meshfeed.sources.parquet import ArrowSource

MetricIndex.from_values("m", np.arange(10**5), fingerprint={"length": 10**5}).save("i")
index = MetricIndex.load("i")
table = pa.table({"a": list(range(10**5))})
with pa.ipc.new_file("t.arrow", table.schema) as w:
    w.write_table(table)
arrow = ArrowSource("t.arrow")
os.truncate("i/values.npy", 128)
os.truncate("t.arrow", 1024)
for name, read in (("values.npy", index.sorted_values), ("t.arrow", lambda: arrow[99_999])):
    try:
        read()
    except SourceError as exc:
        assert name in str(exc) and "changed size while open" in str(exc), exc
        continue
    sys.exit(f"{name}: no SourceError")
"""


def mapped_files_truncated_while_open(tmp: Path) -> None:
    pytest.importorskip("pyarrow")
    from tests.process_checks import run_python

    (tmp / "truncate.py").write_text(_TRUNCATE_MAPPED)
    done = run_python(tmp / "truncate.py", cwd=tmp, timeout=120)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])  # -7 would be SIGBUS


def mesh_and_counts_beyond_plannable(tmp: Path) -> None:
    from meshfeed import DataMesh, Mixture

    with pytest.raises(ValueError, match=r"MAX_WORLD_SIZE = 2\*\*24"):
        _bounded(1, lambda: DataMesh.from_sizes(dp=10**8))
    _refused({"num_workers": 10**6}, ValueError, "MAX_WORKERS = 1024")
    with pytest.raises(ValueError, match=r"seed must be in \[0, 2\*\*64\)"):
        Mixture({"a": [1], "b": [2]}, {"a": 1, "b": 1}, seed=2**64)
    from meshfeed.balance import BalancedBatches

    with pytest.raises(ValueError, match="MAX_DOCS_PER_RANK"):
        BalancedBatches(iter([]), max_tokens=64, max_docs_per_rank=10**12)


def state_without_version(tmp: Path) -> None:
    state = DataLoader(list(range(16)), batch_size=2).state_dict()
    del state["version"]
    with pytest.raises(ValueError, match="malformed: it has no int 'version'"):
        DataLoader(list(range(16)), batch_size=2).load_state_dict(state)


# ----------------------------------------------------------------- convert and writers (#28)
def _convert_cli(argv: list[str]) -> tuple[int, str]:
    import contextlib
    import io

    from meshfeed.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(argv)
    return code, err.getvalue()


def convert_malformed_input(tmp: Path) -> None:
    import re

    from tests.sources.test_sources_convert_input import MALFORMED

    for to in ("corpus", "shards"):
        for name, make, message in MALFORMED:
            make(tmp / name)
            out = tmp / f"out-{to}-{name}" / "o"
            code, err = _convert_cli(["convert", str(tmp / name), "--to", to, "-o", str(out), "-q"])
            assert code == 2 and err.count("\n") == 1 and re.search(message, err), err
            assert not out.parent.exists() or not any(out.parent.iterdir())


def convert_to_shards_at_an_s3_url(tmp: Path) -> None:
    boto3 = pytest.importorskip("boto3")
    moto_server = pytest.importorskip("moto.server")
    pytest.importorskip("s3fs")
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    mp = pytest.MonkeyPatch()
    try:
        host, port = server.get_host_and_port()
        env = {
            "AWS_ENDPOINT_URL": f"http://{host}:{port}",
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
        }
        for k, v in env.items():
            mp.setenv(k, v)
        mp.chdir(tmp)
        client = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"])
        client.create_bucket(Bucket="bucket")
        (tmp / "in.jsonl").write_text("".join(f'{{"ids": [{n}, 7]}}\n' for n in range(50)))
        argv = ["convert", "in.jsonl", "--to", "shards", "-o", "s3://bucket/prefix"]
        code, err = _convert_cli([*argv, "--rows-per-shard", "20", "--cache-dir", str(tmp / "c")])
        assert code == 0, err
        keys = {o["Key"] for o in client.list_objects_v2(Bucket="bucket")["Contents"]}
        assert keys == {"prefix/index.json"} | {f"prefix/shard-0000{n}.mfs" for n in range(3)}
        assert not (tmp / "s3:").exists()
    finally:
        mp.undo()
        import s3fs

        s3fs.S3FileSystem.clear_instance_cache()
        server.stop()


def local_writers_given_a_url(tmp: Path) -> None:
    from meshfeed.queue import SampleStore

    mp = pytest.MonkeyPatch()
    mp.chdir(tmp)
    try:
        for argv in (["plan", "--plot", "s3://b/p.png"], ["plan", "--lengths", "s3://b/l.npy"]):
            with pytest.raises(SystemExit) as exit_:
                _convert_cli(argv)
            assert exit_.value.code == 2
        fp = {"length": 3, "hash": "t"}
        with pytest.raises(ValueError, match="takes a local path"):
            MetricIndex.from_values("m", np.arange(3), fingerprint=fp).save("s3://b/m")
        with pytest.raises(ValueError, match="takes a local path"):
            SampleStore().save("s3://b/store")
        with pytest.raises(ValueError, match="takes a local path"):
            IndexedWriter("s3://b/corpus")
        assert list(tmp.iterdir()) == []
    finally:
        mp.undo()


def analyze_seqlen_over_windows(tmp: Path) -> None:
    import logging

    write_indexed(tmp / "c", [np.arange(1, 40) % 7] * 5, "uint16")
    argv = ["analyze", str(tmp / "c"), "--windows", "8", "-o", str(tmp / "m"), "-m", "seqlen"]
    logger = logging.getLogger("meshfeed")
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    logger.addHandler(handler)
    try:
        code, _ = _convert_cli([*argv, "-q", "-j", "0"])
    finally:
        logger.removeHandler(handler)
    assert code == 2 and "gives every window the same value" in " ".join(seen)
    assert not (tmp / "m").exists()


# ----------------------------------------------------------------- process faults (#20)
def loader_process_killed(tmp: Path) -> None:
    assert_tree_dies("DataLoader", tmp)


def peer_killed_mid_epoch(tmp: Path) -> None:
    assert_survivors_stop("stream", "kill", tmp)


def peer_stopped_mid_epoch(tmp: Path) -> None:
    assert_survivors_stop("stream", "stop", tmp)


def peer_never_reaches_first_batch(tmp: Path) -> None:
    assert_survivors_stop("map", "late", tmp)


def on_error_raise_on_one_rank(tmp: Path) -> None:
    assert_raise_on_every_rank(tmp)


ROWS = [
    Row(
        fault="RANK=k from torchrun, no process group",
        trials=2,
        outcome="each rank its own data",
        run=rank_from_torchrun_env,
    ),
    Row(
        fault="world > 1, no process group, no RANK",
        trials=2,
        outcome="ValueError naming the fix",
        run=rank_unknowable,
    ),
    Row(
        fault="single-bit flip anywhere in a .idx",
        trials=400,
        outcome="refused or identical data (0 wrong)",
        run=idx_bit_flips,
    ),
    Row(
        fault=".idx dtype code uint8 over uint16 .bin",
        trials=1,
        outcome="IndexedFormatError",
        run=idx_dtype_code_mismatch,
    ),
    Row(
        fault="negative document size in .idx",
        trials=1,
        outcome="IndexedFormatError naming the document",
        run=idx_negative_size,
    ),
    Row(
        fault="new .bin beside old .idx",
        trials=1,
        outcome="IndexedFormatError",
        run=bin_with_old_idx,
    ),
    Row(
        fault="two writers to one prefix",
        trials=20,
        outcome="one writer's corpus, no temp files",
        run=concurrent_writers,
    ),
    Row(
        fault="write_indexed fails mid-way, missing folder",
        trials=1,
        outcome="folder created, no temp files",
        run=failed_write,
    ),
    Row(
        fault="MetricIndex save interrupted between files",
        trials=2,
        outcome="ValueError on load",
        run=metric_index_interrupted_save,
    ),
    Row(
        fault="Permutation seed 2**64 / '0'",
        trials=2,
        outcome="ValueError / TypeError",
        run=seed_outside_64_bits,
    ),
    Row(
        fault="corrupt Parquet footer",
        trials=1,
        outcome="SourceError naming the file",
        run=parquet_damaged_footer,
    ),
    Row(
        fault="Parquet files of different columns",
        trials=1,
        outcome="ValueError on open",
        run=parquet_different_schemas,
    ),
    Row(
        fault="corrupt Parquet page, on_error=substitute",
        trials=1,
        outcome="SourceError, not substituted",
        run=damaged_parquet_not_substituted,
    ),
    Row(
        fault="MemoryError in __getitem__",
        trials=1,
        outcome="raised, not substituted",
        run=memory_error_not_substituted,
    ),
    Row(
        fault="KeyboardInterrupt in __getitem__",
        trials=1,
        outcome="raised, not substituted",
        run=keyboard_interrupt_not_substituted,
    ),
    Row(
        fault="SystemExit in __getitem__",
        trials=1,
        outcome="raised, not substituted",
        run=system_exit_not_substituted,
    ),
    Row(
        fault='shuffle="False", drop_last="False"',
        trials=2,
        outcome="TypeError",
        run=loader_flag_strings,
    ),
    Row(
        fault="timeout=True, timeout=nan",
        trials=2,
        outcome="TypeError / ValueError",
        run=loader_timeout_bool_and_nan,
    ),
    Row(
        fault="DataLoader seed=2**64",
        trials=1,
        outcome="ValueError",
        run=loader_seed_outside_64_bits,
    ),
    Row(
        fault='DataLoader("data/corpus")',
        trials=1,
        outcome="error naming the path",
        run=loader_path_string_dataset,
    ),
    Row(
        fault="mixture weights 1e-7 and 3e-7",
        trials=1,
        outcome="no ZeroDivisionError",
        run=mixture_tiny_weights,
    ),
    Row(
        fault="mixture weight 10**400",
        trials=1,
        outcome="normalised, no OverflowError",
        run=mixture_huge_int_weights,
    ),
    Row(
        fault="fixed_linear(0, 2**63, 100); max 2**52",
        trials=4,
        outcome="ValueError naming the bound; else difficulty >= 0",
        run=pacing_never_negative,
    ),
    Row(
        fault="schedule_documents(max_tokens=2**63)",
        trials=1,
        outcome="ValueError",
        run=plan_huge_budget,
    ),
    Row(
        fault="schedule_documents(num_ranks=10**6)",
        trials=1,
        outcome="ValueError up front",
        run=plan_too_many_ranks,
    ),
    Row(
        fault="SampleStore.get(timeout=nan)",
        trials=1,
        outcome="ValueError",
        run=store_timeout_nan,
    ),
    Row(
        fault="SampleStore.get(sampler=5)",
        trials=1,
        outcome="TypeError",
        run=store_sampler_not_a_sampler,
    ),
    Row(
        fault="SampleStore file: lower next_id, repeated id, tensor index, field, counts",
        trials=5,
        outcome="ValueError naming the fault and the file",
        run=store_file_bookkeeping,
    ),
    Row(
        fault="SampleStore.save killed on a host named with '-'",
        trials=1,
        outcome="next save removes the temp file",
        run=store_killed_save_on_dashed_host,
    ),
    Row(
        fault=".bin truncated while open (num_workers 0 and 1)",
        trials=2,
        outcome="SourceError naming the file, no SIGBUS",
        run=bin_truncated_while_open,
    ),
    Row(
        fault="metric index .npy / Arrow file truncated while open",
        trials=2,
        outcome="SourceError naming the file, no SIGBUS",
        run=mapped_files_truncated_while_open,
    ),
    Row(
        fault="DataMesh dp=10**8, num_workers=10**6, Mixture seed=2**64, max_docs 10**12",
        trials=4,
        outcome="ValueError naming the limit, up front",
        run=mesh_and_counts_beyond_plannable,
    ),
    Row(
        fault="loader state without version",
        trials=1,
        outcome="ValueError: malformed",
        run=state_without_version,
    ),
    Row(
        fault="meshfeed convert: truncated / CRC / not-gzip .gz, deep JSON, booleans, ragged",
        trials=12,
        outcome="one line naming the file (and line), exit 2, no output",
        run=convert_malformed_input,
    ),
    Row(
        fault="meshfeed convert --to shards -o s3://bucket/prefix",
        trials=1,
        outcome="uploaded (index.json last), no local folder named s3:",
        run=convert_to_shards_at_an_s3_url,
    ),
    Row(
        fault="a URL given to a local writer (plan --plot/--lengths, MetricIndex, store, .idx)",
        trials=5,
        outcome="refused naming the URL, no folder made",
        run=local_writers_given_a_url,
    ),
    Row(
        fault="meshfeed analyze -m seqlen --windows N",
        trials=1,
        outcome="refused by name (a constant metric), nothing written",
        run=analyze_seqlen_over_windows,
    ),
    Row(
        fault="loader process SIGKILLed mid-epoch, num_workers=1 (fork)",
        trials=1,
        outcome="whole process tree gone within 2 s",
        run=loader_process_killed,
        slow=True,
    ),
    Row(
        fault="peer rank SIGKILLed mid-epoch (3 gloo ranks)",
        trials=1,
        outcome="CollectiveError 'connection closed'; survivors exit within timeout + 5 s",
        run=peer_killed_mid_epoch,
        slow=True,
    ),
    Row(
        fault="peer rank stopped (SIGSTOP) mid-epoch",
        trials=1,
        outcome="CollectiveError 'timed out' at timeout; survivors exit within timeout + 5 s",
        run=peer_stopped_mid_epoch,
        slow=True,
    ),
    Row(
        fault="peer rank never reaches its first batch",
        trials=1,
        outcome="CollectiveError at timeout (not 300 s); survivors exit",
        run=peer_never_reaches_first_batch,
        slow=True,
    ),
    Row(
        fault='on_error="raise", bad sample on 1 of 4 ranks',
        trials=1,
        outcome="its error there, RankError on the others, all at step 0",
        run=on_error_raise_on_one_rank,
        slow=True,
    ),
]


@pytest.mark.parametrize(
    "row",
    [pytest.param(r, id=r.run.__name__, marks=[pytest.mark.slow] if r.slow else []) for r in ROWS],
)
def test_fault_matrix(row: Row, tmp_path: Path) -> None:
    row.run(tmp_path)
