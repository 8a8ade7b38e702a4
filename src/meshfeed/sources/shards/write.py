"""Writing meshfeed shards: :func:`write_shards` (the format is in :mod:`.format`, the
encoder in :mod:`.encode`).

The write is atomic: everything goes into a hidden temporary directory beside ``out_dir``
(each file fsynced, ``index.json`` last), which is then renamed into place. A write that
raises (a bad sample, a failing iterator, a full disk) removes the temporary directory, so no
half-written dataset is ever seen as complete. A process killed mid-write can leave a
``.<name>.tmp-*`` directory behind; it is never mistaken for a dataset, and it blocks no
later write.

That rename is also the claim on a new folder: two writers racing on one (``overwrite=False``)
both pass the first check, but a directory is renamed only onto an absent or empty one, so
exactly one lands; the other raises ``FileExistsError`` naming the folder and removes its own
temporary directory, leaving the winner's dataset whole.

Replacing a dataset (``overwrite=True``) touches nothing but that dataset: the new shards get
new names and are moved in beside the old ones (a name already taken is refused, nothing is
clobbered), the new ``index.json`` replaces the old one in one rename, then the shards the old
index named are deleted. Any other file in the folder stays.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import uuid
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

from meshfeed.errors import SourceError
from meshfeed.sources.shards.encode import Options, encode_dataset, fsync_dir, zstd_level
from meshfeed.sources.shards.format import INDEX_NAME, read_index
from meshfeed.sources.shards.upload import lost_fix, write_to_url
from meshfeed.storage import StorageOptions, local_path_of
from meshfeed.storage.output import Upload, upload_target

__all__ = ["replaced_files", "write_shards"]


def _check_options(
    rows_per_shard: int | None,
    bytes_per_shard: int | None,
    compression: str | None,
    block_rows: int | None,
    num_workers: int,
) -> None:
    if rows_per_shard is None and bytes_per_shard is None:
        raise ValueError("give rows_per_shard, bytes_per_shard or both (a shard ends at either)")
    for name, v in (
        ("rows_per_shard", rows_per_shard),
        ("bytes_per_shard", bytes_per_shard),
        ("block_rows", block_rows),
    ):
        if v is not None and (not isinstance(v, int) or v < 1):
            raise ValueError(f"{name} must be a positive int or None (got {v!r})")
    zstd_level(compression)
    if not isinstance(num_workers, int) or num_workers < 1:
        raise ValueError(f"num_workers must be an int >= 1 (got {num_workers!r})")


def _prepare(out: Path, overwrite: bool) -> list[str] | None:
    """Check ``out`` can take a dataset; the files of the dataset it holds (the ones
    ``overwrite`` replaces: its shards and index), or None when it is absent or empty."""
    taken = out.exists() and (not out.is_dir() or any(out.iterdir()))
    if taken and not (overwrite and (out / INDEX_NAME).is_file()):
        raise FileExistsError(
            f"{out} exists and is not an empty directory; pass overwrite=True to replace "
            "a shard dataset (one with an index.json), or choose another directory"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    return replaced_files(out) if taken else None


def replaced_files(out: str | os.PathLike[str]) -> list[str]:
    """The files ``write_shards(..., out, overwrite=True)`` deletes from the folder ``out``
    once the new dataset is in place: the shards its ``index.json`` names, and the index."""
    try:
        index = read_index(out, check_files=False)
    except SourceError as e:
        raise SourceError(
            f"{e}; overwrite replaces only the files a readable index names, so it cannot "
            f"tell the dataset in {out} from other files: remove the old dataset yourself, "
            "or choose another directory"
        ) from e
    return [*index.files, INDEX_NAME]


def _install(tmp: Path, out: Path, overwrite: bool) -> None:
    """Rename the finished ``tmp`` into ``out`` (absent or an empty directory): the atomic
    claim on ``out``. A writer that lost the race to ``out`` raises ``FileExistsError``."""
    try:
        os.rename(tmp, out)
    except OSError as e:
        if e.errno not in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR):
            raise
        raise FileExistsError(
            errno.EEXIST,
            f"another writer claimed {out} while this one was writing (it is no longer an "
            f"absent or empty directory); nothing of this write was kept: "
            + lost_fix(overwrite, "folder"),
            str(out),
        ) from e
    fsync_dir(out.parent)


def _replace(tmp: Path, out: Path, old: list[str]) -> None:
    """Move the finished ``tmp``'s shards into ``out`` beside the old dataset, swap the index
    in one rename, then delete the old shards (``old``, named by the old index) and ``tmp``."""
    new = read_index(tmp, check_files=False).files
    for name in new:  # fresh names: a taken one is some other file, never clobbered
        if (out / name).exists() or (out / name).is_symlink():
            raise FileExistsError(
                errno.EEXIST,
                f"{out / name} exists and is no file of the shard dataset being replaced; "
                "move it out of the way or write into another directory",
                str(out / name),
            )
    moved: list[Path] = []
    try:
        for name in new:
            os.rename(tmp / name, out / name)
            moved.append(out / name)
        fsync_dir(out)
        os.replace(tmp / INDEX_NAME, out / INDEX_NAME)  # the new dataset, whole, in one step
    except BaseException:
        for path in moved:  # no index names them
            with contextlib.suppress(OSError):
                path.unlink()
        raise
    fsync_dir(out)
    for name in old:
        if name != INDEX_NAME and name not in new:  # no index names them any more
            with contextlib.suppress(FileNotFoundError):
                (out / name).unlink()
    shutil.rmtree(tmp, ignore_errors=True)


def write_shards(
    samples: Iterable[Any],
    out_dir: str | os.PathLike[str],
    *,
    rows_per_shard: int | None = None,
    bytes_per_shard: int | None = 64 << 20,
    compression: str | None = None,
    block_rows: int | None = None,
    num_workers: int = 1,
    overwrite: bool = False,
    cache_dir: str | os.PathLike[str] | None = None,
    storage_options: StorageOptions | None = None,
) -> Path | str:
    """Write ``samples`` as meshfeed shards into ``out_dir``; return the ``index.json`` path.

    A sample is a dict of fields (the same names and kinds in every sample) or one bare value;
    a field is a torch tensor or numpy array of a numeric dtype (any shape, varying from row to
    row or not), a numpy scalar, ``int`` (int64), ``float``, ``bool``, ``str`` or ``bytes``.
    Anything else raises ``TypeError`` naming the row and field (nothing is pickled). A shard
    ends after ``rows_per_shard`` rows or once it holds ``bytes_per_shard`` raw bytes,
    whichever comes first. ``compression="zstd"`` (level 1; ``"zstd:N"`` for level N; needs
    ``meshfeed[zstd]``) compresses blocks of ``block_rows`` rows per column (default: about
    1 MiB of raw data per block);
    ``num_workers=1`` encodes in one background thread (overlapping the next shard's
    samples); more start that many processes, with the same bytes whatever the count (they
    pay for pickling each shard's samples across). Arrays are referenced, not copied, until
    their shard is written: do not mutate a sample after yielding it. ``out_dir`` must be
    absent or empty, or a shard dataset with ``overwrite=True``: then only that dataset is
    replaced (the shards its ``index.json`` names, and the index; the new shards get new
    names, a name already taken is refused), every other file in ``out_dir`` stays.

    ``out_dir`` may be a URL prefix (``s3://bucket/shards``; credentials and endpoint from
    ``storage_options`` or the client's environment): each shard is uploaded as soon as it is
    written (from a staging folder in the shard cache at ``cache_dir``, where it stays as the
    node's cached copy), ``index.json`` last, so a reader never takes a partial upload for a
    dataset; the URL of ``index.json`` is returned. With ``overwrite=True`` the new shards
    get new names, the old dataset stays whole until the new ``index.json`` replaces its
    index (a failed rewrite loses nothing), then the old shards are deleted.

    Of two writers racing on one new ``out_dir`` (``overwrite=False``), exactly one succeeds
    and the other raises ``FileExistsError``, leaving the winner's dataset whole: locally
    through the final rename, on S3 through conditional creates (``If-None-Match: *``). On
    other object stores the emptiness check before the work is all there is (not atomic).

        >>> write_shards(({"ids": np.arange(n), "text": "x" * n} for n in range(1, 9)),
        ...              tmp / "ds", rows_per_shard=4)                       # doctest: +SKIP
    """
    _check_options(rows_per_shard, bytes_per_shard, compression, block_rows, num_workers)
    if compression is not None:
        from meshfeed.sources.shards.open_shard import zstd_module

        zstd_module()  # fail before writing anything when zstandard is missing
    options = Options(
        rows_per_shard=rows_per_shard,
        bytes_per_shard=bytes_per_shard,
        compression=compression,
        block_rows=block_rows,
        num_workers=num_workers,
    )
    url = upload_target(out_dir)
    if url is not None:
        return write_to_url(samples, url, options, overwrite, Upload(cache_dir, storage_options))
    out = Path(local_path_of(os.fspath(out_dir)) or out_dir)
    old = _prepare(out, overwrite)
    if old is not None:  # new names: the old dataset stays whole until the index swap
        options = replace(options, stem=f"shard-{uuid.uuid4().hex[:8]}")
    tmp = out.with_name(f".{out.name}.tmp-{uuid.uuid4().hex}")
    tmp.mkdir()
    try:
        encode_dataset(samples, tmp, options, None)
        if old is None:
            _install(tmp, out, overwrite)
        else:
            _replace(tmp, out, old)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out / INDEX_NAME
