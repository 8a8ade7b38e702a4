"""A download's checksum computed while its bytes arrive (#29)."""

from __future__ import annotations

import hashlib
import os
import threading
import time
from pathlib import Path

import pytest

from meshfeed.storage._download import Want, get_checked
from meshfeed.storage._follow import Follow


def _write_slowly(path: Path, data: bytes, *, pieces: int = 16, pause: float = 0.01) -> None:
    step = -(-len(data) // pieces)
    with open(path, "wb") as f:
        for i in range(0, len(data), step):
            f.write(data[i : i + step])
            f.flush()
            time.sleep(pause)


@pytest.mark.parametrize("md5", [False, True])
def test_follow_hashes_a_file_while_another_thread_writes_it(tmp_path: Path, md5: bool) -> None:
    data = os.urandom(5 << 20)
    path = tmp_path / "part"
    follow = Follow(path, md5=md5)
    writer = threading.Thread(target=_write_slowly, args=(path, data))
    writer.start()
    writer.join(timeout=60)
    h = hashlib.md5(data, usedforsecurity=False) if md5 else hashlib.blake2b(data, digest_size=16)
    assert follow.digest(len(data)) == f"{h.name}:{h.hexdigest()}"


def test_follow_gives_no_digest_for_bytes_it_did_not_see(tmp_path: Path) -> None:
    path = tmp_path / "part"
    follow = Follow(path, md5=False)
    _write_slowly(path, b"x" * 1000, pieces=4, pause=0.0)
    assert follow.digest(1001) is None  # the caller hashes the file itself
    assert Follow(tmp_path / "never-written", md5=False).digest(0) is None


def test_a_streamed_digest_that_disagrees_is_computed_again_before_any_verdict(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A writer that did not write front to back would mislead the follower: the verdict on
    the object must come from the complete file, never from that digest alone."""
    import fsspec

    data = os.urandom(3 << 20)
    src = tmp_path / "src.bin"
    src.write_bytes(data)
    digest = f"blake2b:{hashlib.blake2b(data, digest_size=16).hexdigest()}"
    monkeypatch.setattr(Follow, "digest", lambda self, size: "blake2b:" + "0" * 32)
    fs = fsspec.filesystem("file")
    meta = get_checked(
        fs, str(src), tmp_path / "tmp", "s3://b/src.bin", None, Want(digest=digest, size=len(data))
    )
    assert meta["checksum"] == digest and meta["size"] == len(data)
