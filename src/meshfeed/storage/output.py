"""Writers whose output is a URL: write locally, then upload one file at a time.

:func:`upload_target` tells a URL that needs uploading from a local path (``file://`` URLs are
local). :class:`Upload` stages files in a hidden folder inside the shard cache and publishes
each one: uploaded (an object appears only once complete, so a reader never sees part of one),
then adopted as the node's cached copy (a rename, so the readers of this node never download
what it wrote). Writers publish their metadata file last (``index.json``, ``.idx``), so a
reader that finds it finds every file it names. :func:`check_writable` fails in seconds, naming
the URL, where an upload could not succeed (unknown protocol, no credentials, no bucket), so a
writer checks before its work; :func:`upload` names the URL when an upload fails.
:func:`~meshfeed.sources.converters.convert.convert`, :func:`~meshfeed.sources.write_indexed`,
:func:`~meshfeed.sources.write_shards` and ``meshfeed analyze``'s output share this code.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from meshfeed.errors import SourceError
from meshfeed.storage.cache import ShardCache
from meshfeed.storage.retry import RetryPolicy
from meshfeed.storage.urls import (
    StorageOptions,
    filesystem,
    is_url,
    local_only,
    local_path_of,
    upload_file,
)

__all__ = ["Upload", "check_writable", "upload", "upload_target"]


def upload_target(output: str | os.PathLike[str]) -> str | None:
    """The URL ``output`` names when writing there means uploading; None for a local path."""
    out = os.fspath(output)
    return out.rstrip("/") if is_url(out) and local_path_of(out) is None else None


_ADVICE = (
    "check the URL (bucket and prefix) and the credentials and endpoint (storage_options= or "
    "the client's environment variables, e.g. AWS_ACCESS_KEY_ID / AWS_ENDPOINT_URL)"
)
# object stores whose first path component is a bucket (checked to exist before a write)
_BUCKETED = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "oss"})


def upload(local: str | os.PathLike[str], url: str, storage_options: StorageOptions | None) -> None:
    """Upload one file (retried); a failure raises :class:`SourceError` naming ``url``."""
    try:
        upload_file(local, url, storage_options=storage_options)
    except (SourceError, ImportError):
        raise
    except Exception as e:  # the client's own errors (no bucket, credentials, endpoint)
        raise SourceError(f"cannot upload {url}: {type(e).__name__}: {e}; {_ADVICE}") from e


def check_writable(
    url: str,
    storage_options: StorageOptions | None = None,
    *,
    what: str,
    retry_timeout: float = 30.0,
) -> None:
    """Fail now, naming ``url``, if files could not be uploaded there (``what``: "the shards").

    One or two metadata requests: an unknown protocol, a missing client library, missing
    credentials, an unreachable endpoint or (on object stores) a missing bucket raise here, so
    a writer fails in seconds rather than after its work. A denied request is let through
    (write-only credentials); the upload then says what it finds.
    """
    try:
        fs, path = filesystem(url, storage_options)
    except ValueError as e:  # fsspec: "Protocol not known: ..."
        raise ValueError(
            f"cannot write {what} to {url}: {e}; give a local folder or a URL of an installed "
            "fsspec protocol (s3://, gs://, file://, ...)"
        ) from e
    retry = RetryPolicy(timeout=retry_timeout)
    try:
        if retry.call(lambda: fs.exists(path), url=url, action="reach") or not _bucketed(fs):
            return
        bucket = path.split("/", 1)[0]
        found = retry.call(lambda: fs.exists(bucket), url=url, action="reach")
    except PermissionError:
        return  # write-only credentials may not list: the upload says what it finds
    except SourceError:
        raise
    except Exception as e:
        raise SourceError(
            f"cannot write {what} to {url}: {type(e).__name__}: {e}; {_ADVICE}"
        ) from e
    if not found:
        raise FileNotFoundError(
            f"cannot write {what} to {url}: the bucket {bucket!r} does not exist (or these "
            "credentials cannot see it); create it, or fix the URL or the endpoint"
        )


def _bucketed(fs: Any) -> bool:
    """Whether the first component of ``fs``'s paths is a bucket that writes do not create."""
    protocols = {fs.protocol} if isinstance(fs.protocol, str) else set(fs.protocol)
    return bool(protocols & _BUCKETED)


class Upload:
    """A staging folder in the shard cache whose files are published to URLs one at a time.

    ``with Upload(cache_dir, storage_options) as up: ...; up.publish(local, url)``. The staging
    folder (``cache_dir/.upload-*``) is removed on exit, whatever happened; nothing is uploaded
    that was not published, so a writer that fails before its metadata file leaves no object a
    reader would take for a dataset.
    """

    def __init__(
        self,
        cache_dir: str | os.PathLike[str] | None = None,
        storage_options: StorageOptions | None = None,
    ) -> None:
        if cache_dir is not None:  # the staging folder lives there: never a folder "s3:"
            cache_dir = local_only(cache_dir, what="cache_dir", fix="give a local folder")
        self.cache = ShardCache(cache_dir, storage_options=storage_options)
        self.staging = Path(tempfile.mkdtemp(dir=self.cache.cache_dir, prefix=".upload-"))

    def __enter__(self) -> Upload:
        return self

    def __exit__(self, *exc: object) -> None:
        shutil.rmtree(self.staging, ignore_errors=True)

    def publish(self, local: str | os.PathLike[str], url: str) -> None:
        """Upload ``local`` to ``url``, then keep it as the cached copy of ``url``."""
        upload(local, url, self.cache.storage_options)
        self.cache.adopt(url, local)

    def check(self, url: str, what: str) -> None:
        """:func:`check_writable` with this upload's storage options: fail before the work."""
        check_writable(url, self.cache.storage_options, what=what)

    def exists(self, url: str) -> bool:
        """Whether an object is at ``url`` (one metadata request)."""
        fs, path = filesystem(url, self.cache.storage_options)
        return bool(fs.exists(path))

    def read(self, url: str) -> bytes:
        """The bytes of the (small) object at ``url``, read past the cache."""
        fs, path = filesystem(url, self.cache.storage_options)
        fs.invalidate_cache(path)
        return bytes(fs.cat_file(path))

    def holds_anything(self, url: str) -> bool:
        """Whether any object lies under the prefix ``url`` (one listing request)."""
        fs, path = filesystem(url, self.cache.storage_options)
        try:
            return bool(fs.ls(path, detail=False))
        except FileNotFoundError:
            return False

    def remove(self, url: str) -> None:
        """Delete the object at ``url`` if it is there."""
        fs, path = filesystem(url, self.cache.storage_options)
        with contextlib.suppress(FileNotFoundError):
            fs.rm_file(path)
        fs.invalidate_cache(path)
