"""``meshfeed index PATH_OR_URL``: (re)write a shard dataset's ``index.json`` in the current
version, so a dataset written by an older meshfeed opens in time that grows with the shards a
rank reads, not with all of them (#32).

The index is read (version 1 or 2), every shard is checked against it (a local shard: its size
by one ``stat``; a URL dataset: one listing gives every size), and a shard written after its
index (a newer mtime; in a bucket a later last-modified time) is hashed, as a reader does, so a
shard changed in place is not made to look as old as a new index; with ``--verify`` every shard
is hashed (a full read or download). Then the index is written in version 2 and replaces the
old one in one step (a rename; a single upload for a URL). A shard
that does not match is refused by name and nothing is written. Sizes, row counts and hashes
are taken from the old index, never recomputed from shards that might have changed since.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

from meshfeed.errors import SourceError
from meshfeed.sources.shards.format import (
    INDEX_NAME,
    ShardIndex,
    check_file,
    parse_index,
    read_index,
    write_index,
)
from meshfeed.storage import StorageOptions, is_url

__all__ = ["add_subcommand", "reindex"]

_log = logging.getLogger("meshfeed")


def reindex(
    path: str | os.PathLike[str],
    *,
    verify: bool = False,
    storage_options: StorageOptions | None = None,
) -> ShardIndex:
    """Check the shard dataset at ``path`` (its folder or ``index.json``, local or a URL)
    against its index and write the index in the current version; returns the index.

    Raises :class:`~meshfeed.errors.SourceError` naming the first shard that is missing or
    of another size (or, with ``verify``, another hash), before anything is written."""
    where = os.fspath(path)
    if is_url(where):
        return _reindex_url(where.removesuffix(INDEX_NAME).rstrip("/"), verify, storage_options)
    if storage_options is not None:
        raise ValueError(
            f"storage_options are for a dataset at a URL (got the local path {where!r}); "
            "leave them out"
        )
    index = read_index(where, check_files=False)
    written = (index.root / INDEX_NAME).stat().st_mtime_ns
    for i in range(len(index)):  # a shard newer than its index is hashed, as a reader does
        check_file(index.root / index.files[i], index.entry(i), verify=verify, written_ns=written)
    tmp = index.root / f".{INDEX_NAME}.tmp-{os.getpid()}"
    try:
        write_index(index, tmp)
        os.replace(tmp, index.root / INDEX_NAME)
    finally:
        tmp.unlink(missing_ok=True)
    return index


def _reindex_url(base: str, verify: bool, options: StorageOptions | None) -> ShardIndex:
    from meshfeed.storage.retry import RetryPolicy
    from meshfeed.storage.urls import filesystem, remote_infos

    fs, root = filesystem(base, options)
    index_url = f"{base}/{INDEX_NAME}"
    index = parse_index(json.loads(fs.cat_file(f"{root}/{INDEX_NAME}")), Path(INDEX_NAME))
    urls = [f"{base}/{name}" for name in index.files]
    infos = remote_infos([index_url, *urls], options, retry=RetryPolicy())  # one listing
    written = infos[index_url].modified
    for i, url in enumerate(urls):
        info, want = infos[url], int(index.sizes[i])
        if info.size != want:
            raise SourceError(
                f"shard {url} has {info.size} bytes but its index.json records {want}: the "
                "object was replaced; rewrite the dataset"
            )
        hashed = verify or info.modified > written  # written after its index: hash it
        if hashed and (got := _hash_remote(fs, f"{root}/{index.files[i]}")) != index.hashes[i]:
            raise SourceError(
                f"shard {url} has content hash {got} but its index.json records "
                f"{index.hashes[i]}: the object is damaged; rewrite the dataset"
            )
    with tempfile.TemporaryDirectory() as tmp:
        write_index(index, Path(tmp) / INDEX_NAME)
        fs.put_file(str(Path(tmp) / INDEX_NAME), f"{root}/{INDEX_NAME}")
    return index


def _hash_remote(fs: Any, path: str) -> str:
    h = hashlib.blake2b(digest_size=16)
    with fs.open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()


def add_subcommand(subparsers: Any) -> None:
    """Register ``meshfeed index``."""
    p = subparsers.add_parser(
        "index",
        help="check a shard dataset against its index.json and rewrite it in the current version",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("path", help="the dataset's folder or index.json, or a URL (s3://bucket/ds)")
    p.add_argument("--verify", action="store_true", help="also hash every shard (reads every byte)")
    p.add_argument(
        "-q",
        "--quiet",
        action="store_true",
        help="no progress (index shows none; as every command)",
    )
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    index = reindex(args.path, verify=args.verify)
    checked = "sizes and hashes" if args.verify else "sizes"
    print(
        f"indexed {args.path}: {len(index)} shards, {index.num_rows} rows ({checked} checked); "
        f"{INDEX_NAME} is version 2"
    )
    return 0
