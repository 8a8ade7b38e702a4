"""WebDataset tar shards as a sharded stream, read by sample index.

A WebDataset shard is a plain (uncompressed) tar in which the files of one sample sit next to
each other and share a key: ``000017.jpg``, ``000017.cls``, ``000017.json`` are the sample
``"000017"``. :class:`TarReader` makes each such group a row::

    {"__key__": "000017", "jpg": b"...", "cls": b"3", "json": b"{...}"}

The key is the member's path up to the first dot of its file name, the extension the rest
(lowercased), as ``webdataset`` splits them; directories, files without an extension and
``__...__`` metadata members are skipped, and a key repeated later in the tar starts a new
sample, also as ``webdataset`` does. Values are the members' bytes: decode them in your map or
collate (``PIL.Image.open(io.BytesIO(s["jpg"]))``, ``torch.load``, ...). With ``decode=True``
three cheap conveniences apply by the last dot-part of the extension: ``txt`` -> str,
``json`` -> the parsed value, ``cls`` -> int; everything else stays bytes.

Each tar is indexed once per process (member offsets, one pass over its headers through
``tarfile``); rows are then read by seeking, one read per contiguous run of wanted samples.
``count`` is the number of samples, ``version`` the file's size, mtime and edge hash. A
truncated or damaged tar is a :class:`~meshfeed.errors.SourceError` naming it. All I/O goes
through ``open_file`` (see :mod:`meshfeed.sources.streams.files`).

    from meshfeed import StreamLoader
    from meshfeed.sources.streams.webdataset import wds_stream

    stream = wds_stream("/data/shards/train-{000000..000127}.tar", shuffle_buffer=5_000)
    loader = StreamLoader(stream, batch_size=64, collate_fn=my_decode_and_collate)
"""

from __future__ import annotations

import json
import os
import re
import tarfile
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from meshfeed.errors import ShardRowsError, SourceError
from meshfeed.sources.streams.files import (
    HandleCache,
    OpenFile,
    file_size,
    open_shard,
    read_at,
    shard_version,
)
from meshfeed.sources.streams.readers import rows_by_take
from meshfeed.sources.streams.stream import ShardedStream

__all__ = ["TarReader", "expand_shards", "wds_stream"]

_KEY = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")  # webdataset's base_plus_ext
_META = re.compile(r"__[^/]*__($|/)")
_BLOCK = 512
#: One sample of an index: its key and its members as (extension, data offset, size).
_Sample = tuple[str, tuple[tuple[str, int, int], ...]]


def _decode(ext: str, data: bytes) -> Any:
    last = ext.rsplit(".", 1)[-1]
    if last == "txt":
        return data.decode("utf-8")
    if last == "json":
        return json.loads(data)
    if last == "cls":
        return int(data.decode("ascii").strip())
    return data


def _member_key(info: tarfile.TarInfo) -> tuple[str, str] | None:
    """(key, extension) of a member that belongs to a sample, None for one skipped."""
    name = info.name
    if not info.isreg() or _META.match(name):
        return None
    m = _KEY.match(name)
    return (m.group(1), m.group(2).lower()) if m else None


def _group(shard: str, tf: tarfile.TarFile) -> list[_Sample]:
    """The samples of an open tar: runs of consecutive members that share a key."""
    samples: list[_Sample] = []
    key: str | None = None
    members: list[tuple[str, int, int]] = []
    for info in tf:
        split = _member_key(info)
        if split is None:
            continue
        if split[0] != key:
            if key is not None:
                samples.append((key, tuple(members)))
            key, members = split[0], []
        elif any(ext == split[1] for ext, _, _ in members):
            raise SourceError(
                f"tar shard {shard!r}: sample {key!r} has two {split[1]!r} members ({info.name})"
            )
        members.append((split[1], info.offset_data, info.size))
    if key is not None:
        samples.append((key, tuple(members)))
    return samples


class TarReader:
    """Reads WebDataset tar shards by sample index (the ``ShardedStream`` reader protocol:
    ``take``, ``count``, ``version`` and ``reader(shard, start, stop)``); see the module
    docstring. Picklable: open files and tar indexes stay in the process that made them."""

    #: Shards may be URLs: this reader reads them itself (HTTP byte ranges through
    #: ``open_file``), so a ShardedStream does not route them through the shard cache.
    reads_urls = True

    def __init__(self, *, open_file: OpenFile | None = None, decode: bool = False) -> None:
        self.open_file = open_file or open_shard
        self.decode = bool(decode)
        self.__setstate__(self.__getstate__())

    def __getstate__(self) -> dict[str, Any]:
        return {"open_file": self.open_file, "decode": self.decode}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._handles = HandleCache(self.open_file)
        self._indexes: dict[str, list[_Sample]] = {}

    # ------------------------------------------------------------------ the reader protocol
    def count(self, shard: Any) -> int:
        return len(self._index(os.fspath(shard)))

    def version(self, shard: Any) -> str:
        return shard_version(os.fspath(shard), self.open_file)

    def __call__(self, shard: Any, start: int, stop: int | None) -> Iterator[dict[str, Any]]:
        n = self.count(shard)
        return rows_by_take(self.take, shard, start, n if stop is None else min(stop, n))

    def take(self, shard: Any, rows: np.ndarray | Sequence[int]) -> list[dict[str, Any]]:
        """The samples at these row indices of ``shard`` (any order, repeats allowed): one
        read per contiguous run of wanted samples."""
        name = os.fspath(shard)
        index = self._index(name)
        rows = np.asarray(rows, dtype=np.int64)
        if rows.size and (rows.min() < 0 or rows.max() >= len(index)):
            raise ShardRowsError(
                f"rows out of range for tar shard {name!r} of {len(index)} samples (got "
                f"values in [{rows.min()}, {rows.max()}]); if a stream asked for them, the "
                "shard changed after its rows were counted, or rows= overstates it"
            )
        uniq = np.unique(rows)
        found: dict[int, dict[str, Any]] = {}
        f = self._handles.get(name)
        for run in np.split(uniq, np.flatnonzero(np.diff(uniq) != 1) + 1) if uniq.size else []:
            a, b = int(run[0]), int(run[-1])
            lo = index[a][1][0][1]
            _, off, size = index[b][1][-1]
            block = read_at(f, lo, off + size - lo, shard=name, what=f"samples {a}..{b}")
            for r in range(a, b + 1):
                key, members = index[r]
                sample: dict[str, Any] = {"__key__": key}
                for ext, o, n in members:
                    data = block[o - lo : o - lo + n]
                    sample[ext] = _decode(ext, data) if self.decode else data
                found[r] = sample
        return [found[r] for r in rows.tolist()]

    # ------------------------------------------------------------------ the index
    def _index(self, name: str) -> list[_Sample]:
        index = self._indexes.get(name)
        if index is None:
            index = self._indexes[name] = self._scan(name)
        return index

    def _scan(self, name: str) -> list[_Sample]:
        """One pass over the tar's headers; a tar that does not end in its end-of-archive
        block (truncated, or a damaged header that stopped the pass) is refused."""
        f = self._handles.get(name)
        size = file_size(f, shard=name)
        try:
            f.seek(0)
            with tarfile.open(fileobj=f, mode="r:") as tf:
                samples = _group(name, tf)
                end = tf.offset
        except (tarfile.TarError, OSError, EOFError) as exc:
            raise SourceError(
                f"cannot read tar shard {name!r}: {exc} (WebDataset shards are plain, "
                "uncompressed tar files)"
            ) from exc
        tail = read_at(f, end, min(_BLOCK, max(size - end, 0)), shard=name, what="its end")
        if len(tail) != _BLOCK or tail.count(0) != _BLOCK:
            raise SourceError(
                f"tar shard {name!r} is truncated or damaged: its headers stop at byte {end} of "
                f"{size} without the end-of-archive block; rewrite the shard"
            )
        return samples


def expand_shards(pattern: str) -> list[str]:
    """WebDataset's shard notation: ``"train-{000..127}.tar"`` (zero-padded numeric ranges)
    and ``"{a,b}"`` alternatives, expanded left to right."""
    m = re.search(r"\{([^{}]*)\}", pattern)
    if m is None:
        return [pattern]
    body, head, rest = m.group(1), pattern[: m.start()], pattern[m.end() :]
    r = re.fullmatch(r"(\d+)\.\.(\d+)", body)
    if r:
        lo, hi = r.group(1), r.group(2)
        width = len(lo) if lo.startswith("0") else 0
        parts = [str(i).zfill(width) for i in range(int(lo), int(hi) + 1)]
    else:
        parts = body.split(",")
    return [s for p in parts for s in expand_shards(head + p + rest)]


def wds_stream(
    shards: str | Sequence[str | os.PathLike[str]],
    *,
    open_file: OpenFile | None = None,
    decode: bool = False,
    **stream_kwargs: Any,
) -> ShardedStream:
    """A :class:`ShardedStream` of WebDataset tar shards (a list of paths or URLs, or one
    pattern in shard notation, see :func:`expand_shards`), read by a :class:`TarReader`.
    ``stream_kwargs`` go to ``ShardedStream`` (``shuffle_buffer``, ``seed``, ``rows`` to skip
    indexing every tar up front, ``samples_per_epoch``)."""
    names = expand_shards(shards) if isinstance(shards, str) else list(shards)
    return ShardedStream(names, TarReader(open_file=open_file, decode=decode), **stream_kwargs)
