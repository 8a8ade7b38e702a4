"""A meshfeed shard that changes while open, or cannot be read, is refused by name.

A shard is memory-mapped when first read. Truncated while open, the next read past its new
end ended the process (SIGBUS) with no error; written in place at the same size, it served
other rows; unreadable (permissions, I/O), its rows were substituted as bad samples.
"""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import numpy as np
import pytest

from meshfeed import StreamLoader
from meshfeed.errors import SourceError
from meshfeed.sources import ShardedStream, ShardFormatReader, write_shards
from tests.process_checks import run_python

ROOT = Path(__file__).resolve().parents[2]


def _dataset(tmp_path: Path) -> tuple[Path, Path]:
    samples = [{"x": np.full(1000, i, dtype=np.int64)} for i in range(40)]
    index = write_shards(samples, tmp_path / "ds", rows_per_shard=20, block_rows=4)
    return index, tmp_path / "ds" / "shard-00000.mfs"


def test_a_shard_truncated_while_open_is_refused_not_a_crash(tmp_path: Path) -> None:
    _, shard = _dataset(tmp_path)
    script = tmp_path / "truncate.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import os
            import numpy as np
            from meshfeed.errors import SourceError
            from meshfeed.sources import ShardFormatReader

            reader = ShardFormatReader()
            assert int(reader.take({str(shard)!r}, np.array([0]))[0]["x"][0]) == 0  # mapped
            os.truncate({str(shard)!r}, 4096)
            try:
                reader.take({str(shard)!r}, np.array([19]))
            except SourceError as e:
                print("refused:", e)
            """
        )
    )
    proc = run_python(script, cwd=ROOT, timeout=120.0)
    assert proc.returncode == 0, f"rc {proc.returncode}: {proc.stdout} {proc.stderr[-2000:]}"
    assert "refused: shard" in proc.stdout and "changed while open" in proc.stdout
    assert "bytes when opened, 4096 now" in proc.stdout


def test_a_shard_written_in_place_while_open_is_refused(tmp_path: Path) -> None:
    _, shard = _dataset(tmp_path)
    reader = ShardFormatReader()
    assert int(reader.take(shard, np.array([0]))[0]["x"][0]) == 0
    raw = bytearray(shard.read_bytes())
    raw[-8:] = b"\x07" * 8  # the last row's last value, same size
    with open(shard, "r+b") as f:  # in place: the map sees it
        f.write(raw)
    st = shard.stat()
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    with pytest.raises(SourceError, match="its size kept, its content hash changed"):
        reader.take(shard, np.array([19]))


def test_a_touched_shard_reads_on(tmp_path: Path) -> None:
    _, shard = _dataset(tmp_path)
    reader = ShardFormatReader()
    assert int(reader.take(shard, np.array([0]))[0]["x"][0]) == 0
    st = shard.stat()
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # same bytes, new mtime
    assert int(reader.take(shard, np.array([19]))[0]["x"][-1]) == 19


def test_an_unreadable_shard_is_a_source_error_never_a_substituted_sample(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Permissions are not enforced for root (as the tests may run), so opening the shard's
    file is made to fail as it does for another user."""
    import builtins

    from meshfeed.sources.shards import open_shard

    index, _ = _dataset(tmp_path)

    def denied(path, *args, **kwargs):  # type: ignore[no-untyped-def]
        if os.fspath(path).endswith(".mfs"):
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return builtins.open(path, *args, **kwargs)

    monkeypatch.setattr(open_shard, "open", denied, raising=False)
    loader = StreamLoader(ShardedStream.from_index(index), batch_size=4)
    with pytest.raises(SourceError, match=r"cannot read shard .*\.mfs: \[Errno 13\] Permission"):
        next(iter(loader))
    assert loader.stats()["substituted"] == 0


def test_a_shard_replaced_by_rename_or_deleted_while_open_reads_on_from_its_map(
    tmp_path: Path,
) -> None:
    """Replacing a file by rename (or deleting it) leaves the mapped file whole: the reader
    goes on with what it opened, as token corpora do."""
    _, shard = _dataset(tmp_path)
    reader = ShardFormatReader()
    assert int(reader.take(shard, np.array([0]))[0]["x"][0]) == 0
    other = shard.with_name("other.mfs")
    other.write_bytes(b"\0" * 100)
    os.replace(other, shard)  # another file at the path now
    assert int(reader.take(shard, np.array([19]))[0]["x"][-1]) == 19
    shard.unlink()
    assert int(reader.take(shard, np.array([7]))[0]["x"][0]) == 7
