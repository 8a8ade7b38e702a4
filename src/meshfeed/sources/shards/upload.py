"""write_shards to a URL prefix: each shard uploaded once written, ``index.json`` last.

A rewrite (``overwrite=True``) names its shards anew, so the old dataset stays whole until the
new ``index.json`` replaces the old one in one write; then the old shards are deleted. A write
that fails deletes the shards it uploaded: no index names them, nothing is left behind.

A new prefix is claimed by the writer's first object: on S3 every object of a new dataset is
created conditionally (``If-None-Match: *``), so of two writers racing on one new prefix
exactly one creates ``shard-00000.mfs`` (or ``index.json``, writing no shard) and goes on; the
other raises ``FileExistsError`` before it overwrote anything and deletes only what it
created. On other stores (and on S3-compatible servers that answer the condition with 501 Not
Implemented) the objects are written plainly: the check that the prefix is empty is made once,
before the work, and is not atomic, so two writers racing there may clobber each other.
"""

from __future__ import annotations

import contextlib
import errno
import inspect
import json
import os
import uuid
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

from meshfeed.errors import SourceError
from meshfeed.sources.shards.encode import Options, encode_dataset
from meshfeed.sources.shards.format import INDEX_NAME, parse_index
from meshfeed.storage.output import Upload
from meshfeed.storage.retry import RetryPolicy
from meshfeed.storage.urls import filesystem, retried

__all__ = ["write_to_url"]

#: The user-metadata key that marks each object of a new dataset with its write's id.
_WRITER = "meshfeed-writer"


def write_to_url(
    samples: Iterable[Any], url: str, o: Options, overwrite: bool, upload: Upload
) -> str:
    """Upload each shard once written, then ``index.json``. Replacing a dataset, the new shards
    get new names: the old ``index.json`` and its shards stay valid until the new index
    replaces it in one write (a failed rewrite loses nothing), then the old shards go."""
    index_url = f"{url}/{INDEX_NAME}"
    old: list[str] = []
    with upload:
        upload.check(url, "the shards")
        fresh = not upload.exists(index_url)  # a new dataset: every object it writes is new
        if not fresh:
            if not overwrite:
                raise FileExistsError(
                    f"{url} holds a shard dataset ({INDEX_NAME}); pass overwrite=True to "
                    "replace it, or choose another prefix"
                )
            old = parse_index(json.loads(upload.read(index_url)), Path(INDEX_NAME)).files
            o = replace(o, stem=f"shard-{uuid.uuid4().hex[:8]}")
        elif upload.holds_anything(url):
            raise FileExistsError(
                f"{url} holds objects but no {INDEX_NAME} (not a shard dataset); choose "
                "another prefix (overwrite=True replaces only a shard dataset)"
            )

        published: list[str] = []
        writer = uuid.uuid4().hex  # marks this write's objects (a retried create finds its own)

        def publish(local: Path, *, shard: bool = True) -> None:
            target = f"{url}/{local.name}"
            if shard:  # a failed upload may still have landed: removed too
                published.append(target)
            if not fresh:
                upload.publish(local, target)
                return
            try:
                _create(upload, local, target, writer)
            except FileExistsError as e:
                if shard:
                    published.pop()  # another writer's object: never ours to remove
                raise FileExistsError(
                    errno.EEXIST,
                    f"another writer claimed {url} while this one was writing ({target} "
                    f"appeared there); nothing of this write was kept: "
                    + lost_fix(overwrite, "prefix"),
                    target,
                ) from e

        try:
            encode_dataset(samples, upload.staging, o, publish)
            publish(upload.staging / INDEX_NAME, shard=False)  # no shard: claims the prefix
        except BaseException:
            for done in published:  # no index names them: leave nothing behind
                if fresh and not _ours(upload, done, writer):
                    continue  # another writer's object (a create refused in a way not told)
                with contextlib.suppress(Exception):
                    upload.remove(done)
            raise
        for name in old:  # no index names them any more
            upload.remove(f"{url}/{name}")
    return index_url


def lost_fix(overwrite: bool, where: str) -> str:
    """What a writer that lost the race to a new folder or prefix (``where``) can do."""
    if overwrite:  # it asked to replace: the dataset there now is what a new try replaces
        return (
            f"write again (overwrite=True now replaces the shard dataset there), or to another "
            f"{where}"
        )
    return (
        f"write to another {where}, or pass overwrite=True to replace the shard dataset now there"
    )


def _create(upload: Upload, local: Path, url: str, writer: str) -> None:
    """:meth:`Upload.publish` that creates ``url`` only where no object is: S3's conditional
    PUT (``If-None-Match: *``), raising ``FileExistsError`` when another writer's object is
    there (each object carries ``writer``, this write's id, in its metadata: a retried PUT
    that finds its own earlier try landed goes on). Elsewhere, or where the server does not
    implement the condition (501), a plain upload."""
    options = upload.cache.storage_options
    fs, path = filesystem(url, options)
    protocols = {fs.protocol} if isinstance(fs.protocol, str) else set(fs.protocol)
    put_file = getattr(fs, "_put_file", None)
    if not protocols & {"s3", "s3a"} or not _takes_mode(put_file):
        upload.publish(local, url)  # no conditional create here (or an s3fs before it)
        return

    def put() -> bool:
        try:
            fs.put_file(os.fspath(local), path, mode="create", Metadata={_WRITER: writer})
        except OSError as e:
            if not isinstance(e, FileExistsError) and not _precondition_failed(e):
                if e.errno == errno.ENOSYS:  # s3fs's 501 Not Implemented: no conditional PUT
                    return False
                raise
            # An object is there. An earlier try of this very put may have landed with its
            # reply lost: the object then carries this write's mark, and is this write's.
            fs.invalidate_cache(path)
            if _mark(fs, path) != writer:
                raise FileExistsError(errno.EEXIST, f"{url} exists", url) from e
        except Exception as e:  # a client too old for IfNoneMatch refuses the parameter
            if type(e).__name__ == "ParamValidationError" and "IfNoneMatch" in str(e):
                return False
            raise
        return True

    try:
        created = retried(RetryPolicy(timeout=60.0), put, url, "upload to", options)
    except (FileExistsError, SourceError, ImportError):
        raise
    except Exception as e:  # the client's own errors, named as Upload.publish names them
        raise SourceError(f"cannot upload {url}: {type(e).__name__}: {e}") from e
    if not created:
        upload.publish(local, url)
        return
    fs.invalidate_cache(path)
    upload.cache.adopt(url, local)


def _precondition_failed(error: BaseException) -> bool:
    """Whether ``error`` (or what caused it) is the server's 412 Precondition Failed: s3fs
    tells ``FileExistsError`` only where the reply names the condition."""
    seen: BaseException | None = error
    while seen is not None:
        reply = getattr(seen, "response", None)
        if isinstance(reply, dict):
            code = reply.get("Error", {}).get("Code")
            status = reply.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code == "PreconditionFailed" or status == 412:
                return True
        seen = seen.__cause__ or seen.__context__
    return False


def _ours(upload: Upload, url: str, writer: str) -> bool:
    """Whether the object at ``url`` is this write's to remove: it carries ``writer``'s mark,
    or none is there. One that cannot be read, or without the mark, is kept."""
    fs, path = filesystem(url, upload.cache.storage_options)
    fs.invalidate_cache(path)
    try:
        meta = fs.metadata(path)
    except FileNotFoundError:
        return True
    except Exception:
        return False
    return _marked(meta) == writer


def _mark(fs: Any, path: str) -> str | None:
    """The writer id in the metadata of the object at ``path`` (None: none, or unreadable)."""
    try:
        meta = fs.metadata(path)
    except Exception:  # gone again, or no metadata call: not this write's
        return None
    return _marked(meta)


def _marked(meta: Any) -> str | None:
    """The writer id in an object's user metadata, if any."""
    return {str(k).lower(): v for k, v in (meta or {}).items()}.get(_WRITER)


def _takes_mode(put_file: Any) -> bool:
    """Whether an fsspec ``_put_file`` takes ``mode=`` (s3fs's conditional create)."""
    try:
        return "mode" in inspect.signature(put_file).parameters
    except (TypeError, ValueError):
        return False
