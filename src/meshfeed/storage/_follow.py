"""A download's checksum computed while its bytes arrive, off the download's critical path.

The shard cache checks every download (its size, and its MD5 or an index's blake2b). Hashing
the file once it is complete read it again, 60-80 ms per 16 MiB shard on a busy machine, after
the last byte arrived (#29). :class:`Follow` hashes the file in a thread while the download
writes it: reads and ``hashlib`` release the GIL on large blocks, so the hash overlaps the
network, and what is left at the end is the last block. The download writes front to back (one
streamed GET); a digest that does not match what the caller expects is computed again from the
complete file before anything is refused, so a writer that does not (or a bug here) can cost a
second read, never a wrong verdict.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from meshfeed.storage._layout import hasher

_BLOCK = 1 << 20
_PAUSE = 0.005  # seconds between looks at a file that has not grown
_JOIN = 60.0  # seconds to finish hashing a complete local file, at most


class Follow:
    """The ``md5:HEX`` or ``blake2b:HEX`` digest of ``path``, hashed while another thread
    writes it from the start; :meth:`digest` once the writer is done."""

    def __init__(self, path: Path, *, md5: bool) -> None:
        self._path = path
        self._hash: Any = hasher(md5=md5)
        self._read = 0
        self._failed = False
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="meshfeed-hash", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._path.exists():  # the writer has not created it yet
                if self._done.wait(_PAUSE) and not self._path.exists():
                    self._failed = True
                    return
            with open(self._path, "rb") as f:
                while True:
                    final = self._done.is_set()  # before the read: a later write is seen
                    block = f.read(_BLOCK)
                    if block:
                        self._hash.update(block)
                        self._read += len(block)
                    elif final:
                        return
                    else:
                        self._done.wait(_PAUSE)
        except OSError:
            self._failed = True

    def digest(self, size: int) -> str | None:
        """The digest of the first ``size`` bytes written (the file's size once the writer is
        done); None where it could not follow them (the caller hashes the file itself)."""
        self.stop()
        if self._thread.is_alive() or self._failed or self._read != size:
            return None
        return f"{self._hash.name}:{self._hash.hexdigest()}"

    def stop(self) -> None:
        """The writer is done (or failed): hash what is left, then end the thread."""
        self._done.set()
        self._thread.join(timeout=_JOIN)
