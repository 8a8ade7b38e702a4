"""Writing Megatron indexed corpora: :class:`IndexedWriter` streams documents into ``PREFIX.bin`` /
``PREFIX.idx``; :func:`write_indexed` writes an iterable of documents in one call.

Both are imported from here or from :mod:`meshfeed.sources`; the format is described in
:mod:`meshfeed.sources.tokens.indexed`.
"""

from __future__ import annotations

import array
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path
from types import TracebackType

import numpy as np
from numpy.typing import ArrayLike, DTypeLike

from meshfeed.progress import Progress
from meshfeed.sources.tokens.indexed import TokenCorpus
from meshfeed.sources.tokens.indexed_format import (
    _HEADER,
    _INT32_MAX,
    MAGIC,
    VERSION,
    _paths,
    _publish_lock,
    dtype_code,
)
from meshfeed.storage import StorageOptions
from meshfeed.storage.output import Upload, upload_target
from meshfeed.storage.urls import local_only

__all__ = ["IndexedWriter", "write_indexed"]


class IndexedWriter:
    """Streams documents into ``PREFIX.bin`` / ``PREFIX.idx`` without holding the corpus in memory.

    Memory is 8 bytes per document (the sizes). Files are written under unique temporary names
    in the target folder (created if missing) and renamed on :meth:`close`, ``.bin`` first, so
    readers never see a half-written corpus; a failure (or leaving the ``with`` block through
    an exception) deletes them. Two writers to one prefix each publish a complete pair under a
    folder lock, so the result is one writer's corpus, never a mix. Each document becomes one
    sequence and one Megatron document (``document_indices = 0..n``).

    >>> with IndexedWriter("/tmp/demo", dtype="uint16") as w:  # doctest: +SKIP
    ...     w.add([1, 2, 3])
    """

    def __init__(self, prefix: str | os.PathLike[str], *, dtype: DTypeLike = np.uint16) -> None:
        given = os.fspath(prefix)
        prefix = local_only(
            prefix,
            what="IndexedWriter",
            fix="for a URL use write_indexed(url, documents) or meshfeed convert -o URL, "
            "which upload",
        )
        stem = os.fspath(prefix).removesuffix(".bin").removesuffix(".idx")
        if not stem or stem.endswith(("/", os.sep)) or Path(stem).name in ("", ".", ".."):
            raise ValueError(
                f"corpus prefix {given!r} names no file (it would write hidden {stem}.bin / "
                f"{stem}.idx); give a prefix such as 'out/corpus', which writes out/corpus.bin "
                "and out/corpus.idx"
            )
        self.dtype = np.dtype(dtype)
        self._code = dtype_code(self.dtype)
        self.idx_path, self.bin_path = _paths(prefix)
        self.prefix = os.fspath(self.idx_path)[: -len(".idx")]
        folder = self.bin_path.parent
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{self.bin_path.name}.", suffix=".tmp")
        self._tmp_bin = Path(tmp)
        self._tmp_idx: Path | None = None
        self._bin = os.fdopen(fd, "wb")
        self._sizes = array.array("q")
        self._limits = np.iinfo(self.dtype) if self.dtype.kind in "iu" else None
        self._done = False

    @property
    def num_documents(self) -> int:
        return len(self._sizes)

    def add(self, tokens: ArrayLike) -> None:
        """Append one document (any 1-D array-like of token ids that fits the dtype)."""
        arr = np.asarray(tokens)
        if arr.ndim != 1:
            raise ValueError(
                f"document {len(self._sizes)} has shape {arr.shape}; pass a 1-D sequence of "
                "token ids per document"
            )
        if arr.size > _INT32_MAX:
            raise ValueError(
                f"document {len(self._sizes)} has {arr.size} tokens, more than the int32 size "
                "field of the format allows; split it"
            )
        if self._limits is not None and arr.size:
            if arr.dtype.kind not in "iu":
                raise TypeError(
                    f"document {len(self._sizes)} has dtype {arr.dtype}; token ids must be "
                    f"integers (not booleans) for a {self.dtype} corpus"
                )
            lo, hi = int(arr.min()), int(arr.max())
            if lo < self._limits.min or hi > self._limits.max:
                raise ValueError(
                    f"document {len(self._sizes)} has token ids in [{lo}, {hi}], outside "
                    f"{self.dtype} [{self._limits.min}, {self._limits.max}]; choose a "
                    f"{_wider(self.dtype, lo, hi)}"
                )
        self._bin.write(np.ascontiguousarray(arr, dtype=self.dtype).tobytes())
        self._sizes.append(arr.size)

    def close(self) -> TokenCorpus:
        """Write the index, publish both files and return the opened corpus."""
        if self._done:
            raise ValueError(f"the writer of {self.prefix} is already closed; make a new one")
        try:
            self._bin.close()
            sizes = np.frombuffer(self._sizes, np.int64) if self._sizes else np.zeros(0, np.int64)
            pointers = (np.cumsum(sizes) - sizes) * self.dtype.itemsize
            n = sizes.shape[0]
            fd, tmp = tempfile.mkstemp(
                dir=self.idx_path.parent, prefix=f".{self.idx_path.name}.", suffix=".tmp"
            )
            self._tmp_idx = Path(tmp)
            with os.fdopen(fd, "wb") as f:
                f.write(_HEADER.pack(MAGIC, VERSION, self._code, n, n + 1))
                f.write(sizes.astype("<i4").tobytes())
                f.write(pointers.astype("<i8").tobytes())
                f.write(np.arange(n + 1, dtype="<i8").tobytes())
            for path in (self._tmp_bin, self._tmp_idx):
                os.chmod(path, 0o666 & ~_umask())  # mkstemp makes 0600; publish like open()
            with _publish_lock(self.idx_path.parent, exclusive=True):
                # .bin first: a reader without the lock that pairs the new .bin with the old
                # .idx is refused by the size check on open
                os.replace(self._tmp_bin, self.bin_path)
                os.replace(self._tmp_idx, self.idx_path)
        except BaseException:
            self.abort()
            raise
        self._done = True
        return TokenCorpus(self.prefix)

    def abort(self) -> None:
        """Discard everything written so far (the temporary files are removed)."""
        self._done = True
        self._bin.close()
        for p in (self._tmp_bin, self._tmp_idx):
            if p is not None:
                p.unlink(missing_ok=True)

    def __enter__(self) -> IndexedWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._done:
            return
        if exc_type is None:
            self.close()
        else:
            self.abort()


def _umask() -> int:
    try:  # Linux: read it without the process-wide set-and-restore race
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_indexed(
    prefix: str | os.PathLike[str],
    documents: Iterable[ArrayLike],
    dtype: DTypeLike = np.uint16,
    *,
    progress: bool = False,
    cache_dir: str | os.PathLike[str] | None = None,
    storage_options: StorageOptions | None = None,
) -> TokenCorpus:
    """Write ``documents`` (an iterable of 1-D token-id sequences) as a Megatron indexed corpus.

    Streams: only the current document and 8 bytes per document are held in memory. Returns
    the opened :class:`TokenCorpus`. Token ids must fit ``dtype`` (``ValueError`` otherwise).

    >>> corpus = write_indexed("/tmp/tiny", [[1, 2, 3], [4, 5]], "uint16")  # doctest: +SKIP
    >>> corpus.document(1).tolist()  # doctest: +SKIP
    [4, 5]

    ``prefix`` may be a URL (``s3://bucket/corpus``): the corpus is written in the shard cache
    at ``cache_dir``, then uploaded, ``.bin`` before ``.idx``, and kept as the node's cached
    copy; the corpus returned reads it from the URL.
    """
    url = upload_target(prefix)
    if url is not None:
        url = url.removesuffix(".bin").removesuffix(".idx")
        with Upload(cache_dir, storage_options) as upload:
            upload.check(url, "the corpus")
            write_indexed(upload.staging / "corpus", documents, dtype, progress=progress)
            upload_corpus(upload, upload.staging / "corpus", url)
        options = upload.cache.storage_options
        return TokenCorpus.open(url, cache_dir=upload.cache.cache_dir, storage_options=options)
    writer = IndexedWriter(prefix, dtype=dtype)
    try:
        with Progress(desc=f"write {os.fspath(prefix)}", unit="doc", enabled=progress) as bar:
            for doc in documents:
                writer.add(doc)
                bar.update()
    except BaseException:
        writer.abort()
        raise
    return writer.close()


def upload_corpus(upload: Upload, local: str | os.PathLike[str], url: str) -> None:
    """Publish the corpus at local prefix ``local`` to the URL prefix ``url``: ``.bin`` first,
    ``.idx`` last, so a reader that finds the index finds its ``.bin`` complete."""
    for ext in (".bin", ".idx"):
        upload.publish(f"{os.fspath(local)}{ext}", url + ext)


def _wider(dtype: np.dtype, lo: int, hi: int) -> str:
    """Advice for ids ``[lo, hi]`` that ``dtype`` cannot hold: the narrowest integer dtype
    that can, or none."""
    for name in ("uint16", "int32", "int64"):
        info = np.iinfo(name)
        if info.min <= lo and hi <= info.max and np.dtype(name).itemsize > dtype.itemsize:
            return f"wider dtype ({name})"
    return "corpus of ids that fit int64 (no integer dtype holds these)"
