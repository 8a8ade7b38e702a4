"""Two ``write_shards(..., overwrite=False)`` racing on one new local folder: exactly one wins.

Both writers pass the first check (the folder is absent) before either installs: the samples
wait on a barrier that only opens once both writers iterate them, i.e. after the check.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from meshfeed.sources import ShardFormatReader, write_shards


def _rows(index: Path | str) -> list[Any]:
    reader = ShardFormatReader.from_index(index)
    return [int(row) for path in reader.shards for row in reader(path)]


def race(
    out: Path | str,
    *,
    rows: int = 7,
    overwrite: bool = False,
    options: Callable[[int], dict[str, Any]] = lambda k: {},
) -> dict[int, Any]:
    """Writers 1 and 2 each write ``rows`` samples (``k * 1000 + i``) to ``out`` at once,
    both past the first check before either installs; each one's result or error, by ``k``.
    ``options(k)``: writer ``k``'s other keywords (its cache, its storage options)."""
    both_checked = threading.Barrier(2, timeout=10)
    result: dict[int, Any] = {}

    def writer(k: int) -> None:
        def samples() -> Iterator[int]:
            both_checked.wait()
            yield from range(k * 1000, k * 1000 + rows)

        try:
            result[k] = write_shards(
                samples(), out, rows_per_shard=3, overwrite=overwrite, **options(k)
            )
        except BaseException as e:
            result[k] = e

    threads = [threading.Thread(target=writer, args=(k,)) for k in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return result


@pytest.mark.parametrize("existing", ["absent", "empty"])
def test_two_writers_racing_on_one_new_folder_exactly_one_wins(
    tmp_path: Path, existing: str
) -> None:
    for trial in range(15):
        out = tmp_path / f"t{trial}" / "ds"
        if existing == "empty":
            out.mkdir(parents=True)
        result = race(out)
        won = [k for k, r in result.items() if not isinstance(r, BaseException)]
        lost = [r for r in result.values() if isinstance(r, BaseException)]
        assert len(won) == 1 and len(lost) == 1, result
        assert isinstance(lost[0], FileExistsError)
        message = str(lost[0])
        assert f"another writer claimed {out}" in message
        assert "write to another folder, or pass overwrite=True" in message
        k = won[0]
        assert _rows(out / "index.json") == list(range(k * 1000, k * 1000 + 7))
        assert sorted(p.name for p in out.parent.iterdir()) == ["ds"]  # no temporary left


def test_a_writer_killed_mid_way_does_not_block_a_later_write(tmp_path: Path) -> None:
    out = tmp_path / "ds"
    killed = tmp_path / ".ds.tmp-0123456789abcdef"  # what a killed writer leaves behind
    killed.mkdir()
    (killed / "shard-00000.mfs").write_bytes(b"half a shard")
    index = write_shards(range(4), out, rows_per_shard=3)
    assert _rows(index) == [0, 1, 2, 3]


def test_a_writer_that_asked_to_overwrite_and_lost_the_race_is_told_to_write_again(
    tmp_path: Path,
) -> None:
    """Both passed overwrite=True to a new folder: the loser's advice is not "pass
    overwrite=True" (it did), but to write again, which now replaces the winner's dataset."""
    out = tmp_path / "ds"
    result = race(out, overwrite=True)
    lost = [r for r in result.values() if isinstance(r, BaseException)]
    assert len(lost) == 1 and isinstance(lost[0], FileExistsError)
    assert "write again (overwrite=True now replaces the shard dataset there)" in str(lost[0])
    assert "pass overwrite=True" not in str(lost[0])
    k = next(k for k, r in result.items() if not isinstance(r, BaseException))
    assert _rows(out / "index.json") == list(range(k * 1000, k * 1000 + 7))
    write_shards(range(3), out, rows_per_shard=3, overwrite=True)  # the advice works
    assert _rows(out / "index.json") == [0, 1, 2]
