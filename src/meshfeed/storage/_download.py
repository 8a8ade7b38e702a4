"""One download of the shard cache: a single streamed GET, checked against what the caller
expects (the server's size and MD5, or an index's size and content hash), the refusal of a file
that could never fit the cache, and the errors of the cache's own disk."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import inspect
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshfeed.errors import SourceError
from meshfeed.storage._follow import Follow
from meshfeed.storage._layout import checksum, hasher
from meshfeed.storage.urls import RemoteInfo


class TooLargeForCache(SourceError):
    """A file larger than ``cache_limit`` itself: it can never be cached whole within the limit."""

    def __init__(self, url: str, size: int, limit: int) -> None:
        super().__init__(
            f"{url} is {size} bytes, more than cache_limit={limit}: it cannot be cached whole "
            "within the limit; raise cache_limit, or read it by ranges (TokenCorpus, "
            "TokenWindows and ParquetSource do so by themselves unless ranged=False)"
        )
        self.url, self.size, self.limit = url, size, limit


class CacheDiskError(SourceError):
    """The cache's own disk failed (full, read-only, not writable): a storage fault, never a
    bad sample, so the loader raises it instead of substituting (see :mod:`meshfeed.errors`)."""


#: errno values that only the local disk gives (a remote client reports its own as other errors).
_FULL = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
_UNWRITABLE = frozenset({errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOTDIR})


def disk_error(cache_dir: Path, doing: str, e: OSError) -> CacheDiskError | None:
    """The clear error for ``e`` if it is a fault of the cache's disk, else None."""
    name = errno.errorcode.get(e.errno or 0, "")
    if e.errno in _FULL:
        fix = (
            "the disk is full: free space there, set cache_limit below the free space, or "
            "choose another cache_dir= (or MESHFEED_CACHE_DIR)"
        )
    elif e.errno in _UNWRITABLE:
        fix = "it is not writable: choose a writable cache_dir= (or set MESHFEED_CACHE_DIR)"
    else:
        return None
    return CacheDiskError(
        f"the shard cache at {cache_dir} cannot {doing} ({name}: {e.strerror or e}); {fix}"
    )


@contextlib.contextmanager
def on_disk(cache_dir: Path, doing: str) -> Iterator[None]:
    """Turn a fault of the cache's disk inside the block into :class:`CacheDiskError`."""
    try:
        yield
    except SourceError:
        raise
    except OSError as e:
        err = disk_error(cache_dir, doing, e)
        if err is None:
            raise
        raise err from e


def check_writable(cache_dir: Path) -> None:
    """Create ``cache_dir`` if needed and refuse one this process cannot write, by name."""
    with on_disk(cache_dir, "be created"):
        cache_dir.mkdir(parents=True, exist_ok=True)
    if not os.access(cache_dir, os.W_OK | os.X_OK):
        err = disk_error(cache_dir, "be written", PermissionError(errno.EACCES, "not writable"))
        if err is not None:
            raise err


@dataclass(frozen=True, slots=True)
class Want:
    """What a caller accepts as the file at a URL: a remote ``version`` (``SIZE-ETAG`` ...), or
    a content ``digest`` (``blake2b:HEX``, as an index records it) with its ``size``; None: any."""

    version: str | None = None
    digest: str | None = None
    size: int | None = None

    def fits(self, meta: dict[str, Any]) -> bool:
        """Whether a cached entry's sidecar is a copy of what the caller wants."""
        if self.version is not None and meta.get("version") != self.version:
            return False
        return self.digest is None or meta.get("checksum") == self.digest

    @property
    def known(self) -> bool:
        """Size and content are known: the download needs no metadata request first."""
        return self.digest is not None and self.size is not None


class Incomplete(ConnectionError):
    """A download that ended short or whose bytes disagree with the server's: retried."""


def one_request(fs: Any) -> dict[str, Any]:
    """get_file arguments for one streamed GET per file (s3fs would split big files)."""
    get = getattr(fs, "_get_file", None)
    try:
        takes = get is not None and "max_concurrency" in inspect.signature(get).parameters
    except (TypeError, ValueError):
        takes = False
    return {"max_concurrency": 1} if takes else {}


_CHUNK = 1 << 20  # bytes a read of an S3 body asks for (s3fs's get_file asks for 64 KiB)
_RESUMES = 5  # times one S3 download resumes a dropped body before the cache's retry takes over


class ETagChanged(ValueError):
    """The object at a URL no longer has the ETag a request named (HTTP 412)."""


def _is_s3fs(fs: Any) -> bool:
    """Whether ``fs`` is an s3fs filesystem (s3fs is imported then: it made ``fs``)."""
    s3fs = sys.modules.get("s3fs")
    return s3fs is not None and isinstance(fs, s3fs.S3FileSystem)


def _precondition_failed(e: BaseException) -> bool:
    for err in (e, e.__cause__):
        response = getattr(err, "response", None)
        if isinstance(response, dict):
            code = str(response.get("Error", {}).get("Code", ""))
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code in ("PreconditionFailed", "412") or status == 412:
                return True
    return False


def _keep(f: Any, hasher: Any, chunk: bytes) -> None:
    f.write(chunk)
    if hasher is not None:
        hasher.update(chunk)


async def _s3_get(fs: Any, path: str, tmp: Path, hasher: Any, etag: str | None) -> str | None:
    """Stream ``path`` to ``tmp`` in 1 MiB reads, each hashed in memory (``hasher``; None:
    not hashed); the object's ETag.

    With ``etag``, the server answers only while the object still has it (``If-Match``;
    else :class:`ETagChanged`). A body cut mid-way is resumed from the byte it reached,
    ``If-Match`` the ETag of the first answer, so a resumed download never splices two
    versions of an object (s3fs's own resume asks for the range alone); an object rewritten
    in between raises :class:`Incomplete` (the cache's retry downloads it again)."""
    from s3fs.core import S3_RETRYABLE_ERRORS

    loop = asyncio.get_running_loop()
    bucket, key, version = fs.split_path(path)
    base = {**getattr(fs, "req_kw", {}), **({"VersionId": version} if version else {})}
    got = cuts = 0
    with open(tmp, "wb") as f:
        while True:
            kw = dict(base, **({"IfMatch": etag} if etag else {}))
            if got:
                kw["Range"] = f"bytes={got}-"
            try:
                resp = await fs._call_s3("get_object", Bucket=bucket, Key=key, **kw)
            except Exception as e:  # s3fs translates a 412 to an OSError; others may not
                if etag is None or not _precondition_failed(e):
                    raise
                if got:  # rewritten mid-download: the cache's retry starts again
                    raise Incomplete(f"{path} changed during its download") from e
                raise ETagChanged(path) from e
            etag = etag or resp.get("ETag")
            body = resp["Body"]
            try:
                while chunk := await body.read(_CHUNK):
                    # off the event loop, which goes on receiving meanwhile (both release the GIL)
                    await loop.run_in_executor(None, _keep, f, hasher, chunk)
                    got += len(chunk)
                return etag
            except S3_RETRYABLE_ERRORS:
                cuts += 1
                if etag is None or cuts > _RESUMES:
                    raise
            finally:
                body.close()


def _download(
    fs: Any, path: str, tmp: Path, *, md5: bool, etag: str | None = None, **kwargs: Any
) -> tuple[str | None, str | None]:
    """Download ``path`` to ``tmp`` in one streamed GET (resumed where a body is cut): (the
    digest of its bytes, or None where the caller must hash the file; the object's ETag where
    the server gave it).

    From S3: :func:`_s3_get`, hashed as the bytes arrive, or not at all when ``etag`` (one
    this cache verified before) vouches for them. Any other filesystem: its ``get_file``,
    hashed by :class:`Follow` while it writes.
    """
    if _is_s3fs(fs):
        from fsspec.asyn import sync

        hashing = None if etag is not None else hasher(md5=md5)
        got_etag = sync(fs.loop, _s3_get, fs, path, tmp, hashing, etag)
        return (None if hashing is None else f"{hashing.name}:{hashing.hexdigest()}"), got_etag
    follow = Follow(tmp, md5=md5)
    try:
        fs.get_file(path, str(tmp), **kwargs)
    finally:
        follow.stop()
    return follow.digest(tmp.stat().st_size), None


def _indexed(url: str, size: int, digest: str) -> dict[str, Any]:
    """The sidecar of a download that matched its index (its version: size and digest)."""
    return {"url": url, "size": size, "version": f"{size}-{digest}", "checksum": digest}


def get_checked(
    fs: Any,
    path: str,
    tmp: Path,
    url: str,
    info: RemoteInfo | None,
    want: Want,
    vouch: dict[str, Any] | None = None,
    **kwargs: Any,
) -> dict[str, Any]:
    """Download ``path`` to ``tmp`` and check it; the entry's sidecar.

    Against ``info`` (a HEAD: size, and MD5 where the ETag is one; a mismatch raises
    :class:`Incomplete`, retried), or without one against ``want``'s size and digest: a
    mismatch there is the object itself disagreeing with its index, refused by name. The
    bytes are hashed as they arrive, except where ``vouch`` (this cache's record of an
    earlier download of the same URL that matched ``want``) names an ETag: the server then
    sends the object only if it still has that ETag, so it is the object checked before, and
    the sidecar says ``"vouched": true``. Where it no longer has it, the download is hashed
    and checked as a first one.
    """
    md5 = info is not None and info.md5 is not None
    tmp.unlink(missing_ok=True)  # a retry's writer starts anew: no stale bytes to follow
    etag = None
    if vouch is not None and info is None and want.fits(vouch) and vouch.get("size") == want.size:
        etag = vouch.get("etag")
    if etag is not None:
        try:
            _download(fs, path, tmp, md5=False, etag=str(etag))
            got = tmp.stat().st_size
            if got != want.size:
                raise Incomplete(f"downloaded {got} of {want.size} bytes of {url}")
            return {**_indexed(url, got, str(want.digest)), "etag": etag, "vouched": True}
        except ETagChanged:
            tmp.unlink(missing_ok=True)  # rewritten since: check it as a first download
    digest, etag = _download(fs, path, tmp, md5=md5, **kwargs)
    got = tmp.stat().st_size
    expected = want.digest if info is None else (f"md5:{info.md5}" if md5 else None)
    if digest is None or (expected is not None and digest != expected):
        digest = checksum(tmp, md5=md5)  # the verdict comes from the complete file
    if info is None:
        if got != want.size or digest != want.digest:
            raise SourceError(
                f"shard {url} does not match its index.json: {got} bytes, {digest} in the "
                f"bucket, where the index records {want.size} bytes, {want.digest}; the object "
                "was rewritten or damaged after its index was written: restore it or rewrite "
                "the dataset (index.json last)"
            )
        meta = _indexed(url, got, digest)
        return meta if etag is None else {**meta, "etag": etag}
    if got != info.size:
        raise Incomplete(f"downloaded {got} of {info.size} bytes of {url}")
    if md5 and digest != expected:
        raise Incomplete(f"the download of {url} has {digest}, its ETag {info.md5}")
    return {"url": url, "size": got, "version": info.version, "checksum": digest}
