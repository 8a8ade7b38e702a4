"""URLs through fsspec: recognise them, reach them, and tell one version of an object from another.

fsspec (and ``s3fs`` for ``s3://``) come with ``pip install "meshfeed[remote]"``; ``gs://`` also
needs ``pip install gcsfs``, ``hf://`` ``pip install huggingface_hub``. They are imported on the
first URL, never by ``import meshfeed``. Credentials and endpoints are the client library's: its
environment variables (``AWS_ACCESS_KEY_ID``, ``AWS_ENDPOINT_URL``, ``GOOGLE_APPLICATION_CREDENTIALS``
...) or ``storage_options``, passed unchanged to ``fsspec.url_to_fs`` (for s3fs e.g.
``{"endpoint_url": "http://127.0.0.1:9000", "key": ..., "secret": ...}``).

Every call here that talks to the server retries transient failures for at most
``retry_timeout`` seconds (see :mod:`meshfeed.storage.retry`), then raises
:class:`~meshfeed.errors.SourceError` naming the URL.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, TypeVar

from meshfeed.errors import SourceError
from meshfeed.storage._inherit import remember
from meshfeed.storage.retry import RetryPolicy

__all__ = [
    "StorageOptions",
    "file_size",
    "file_version",
    "is_url",
    "list_files",
    "local_path_of",
    "open_url",
    "read_range",
    "remote_infos",
    "upload_file",
    "version_of",
]

#: Keyword arguments for the fsspec filesystem of a URL (``s3fs.S3FileSystem(**options)``).
StorageOptions = Mapping[str, Any]
T = TypeVar("T")

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*(://|::)")
_INSTALL = {
    "gs": "pip install gcsfs",
    "gcs": "pip install gcsfs",
    "hf": "pip install huggingface_hub",
    "az": "pip install adlfs",
    "abfs": "pip install adlfs",
}
_REMOTE_EXTRA = 'pip install "meshfeed[remote]"'


def is_url(path: object) -> bool:
    """True for ``scheme://...`` (and fsspec chains ``a::b://...``); False for local paths."""
    return isinstance(path, str) and _URL.match(path) is not None


def local_path_of(url: str) -> str | None:
    """The local path a ``file://`` URL names; None for any other URL."""
    if url.startswith("file://"):
        return url[len("file://") :] or "/"
    return None


def endpoint_of(url: str, storage_options: StorageOptions | None = None) -> str:
    """The server a URL's requests go to, for error messages: the ``endpoint_url`` of
    ``storage_options`` (or its ``client_kwargs``), else the environment's, else the scheme's
    default."""
    options = dict(storage_options or {})
    client = options.get("client_kwargs") or {}
    found = options.get("endpoint_url") or client.get("endpoint_url")
    if found:
        return str(found)
    scheme = url.split("://", 1)[0].split("::", 1)[-1]
    env = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if scheme in ("s3", "s3a") and env:
        return env
    return f"the default endpoint of {scheme}://"


def filesystem(url: str, storage_options: StorageOptions | None = None) -> tuple[Any, str]:
    """The fsspec filesystem of ``url`` and the path inside it (fsspec caches the instances)."""
    try:
        import fsspec
    except ImportError as e:
        raise ImportError(
            f"reading URLs needs fsspec (and s3fs for s3://); install them: {_REMOTE_EXTRA}"
        ) from e
    try:
        fs, path = fsspec.core.url_to_fs(url, **dict(storage_options or {}))
    except ImportError as e:
        scheme = url.split("://", 1)[0].split("::", 1)[0]
        raise ImportError(
            f"{url}: fsspec has no installed implementation of {scheme}:// ({e}); install it: "
            f"{_INSTALL.get(scheme, _REMOTE_EXTRA)}"
        ) from e
    remember(fs)  # a worker forked later must not close its connections (see _inherit)
    return fs, path


def retried(
    retry: RetryPolicy,
    fn: Callable[[], T],
    url: str,
    action: str,
    storage_options: StorageOptions | None,
    on_retry: Callable[[BaseException], Any] | None = None,
) -> T:
    """``fn()`` retried under ``retry``; past its bound the error names ``url`` and its server."""
    endpoint = endpoint_of(url, storage_options)
    return retry.call(fn, url=url, action=action, on_retry=on_retry, endpoint=endpoint)


@dataclass(frozen=True, kw_only=True, slots=True)
class RemoteInfo:
    """What one metadata request (HEAD) says about an object."""

    url: str
    size: int
    version: str
    md5: str | None  # the content's MD5 where the ETag is one (single-part uploads)
    modified: int = 0  # when the object was last written, ns since the epoch (0: unknown)


_MD5 = re.compile(r"^[0-9a-f]{32}$")


def _stamp(value: Any) -> str:
    if hasattr(value, "timestamp"):
        return str(int(value.timestamp() * 1e9))
    if isinstance(value, float):
        return str(int(value * 1e9))
    return str(value)


#: Where fsspec backends report an object's modification time.
_MODIFIED_KEYS = ("mtime", "LastModified", "Last-Modified", "last_modified", "updated", "modified")


def _version_of_info(url: str, info: Mapping[str, Any]) -> tuple[str, str | None]:
    """(version string, md5 or None) from an fsspec ``info`` dict, whatever the backend."""
    size = info.get("size")
    etag = info.get("ETag") or info.get("etag") or info.get("md5Hash") or info.get("md5")
    md5 = None
    if etag:
        etag = str(etag).strip('"')
        md5 = etag if _MD5.match(etag) else None
    for key in ("VersionId", "version_id", "generation"):
        if info.get(key) not in (None, "", "null"):
            return f"{size}-v{info[key]}", md5
    if etag:
        return f"{size}-{etag}", md5
    for key in ("crc32c", "checksum"):
        if info.get(key):
            return f"{size}-{info[key]}", None
    for key in (*_MODIFIED_KEYS, "created"):
        if info.get(key):
            return f"{size}-t{_stamp(info[key])}", None
    raise SourceError(
        f"{url} reports no ETag, version id or modification time (info keys: {sorted(info)}); "
        "meshfeed cannot tell whether it changes, so it refuses to cache it"
    )


def remote_info(
    url: str, storage_options: StorageOptions | None = None, *, retry: RetryPolicy | None = None
) -> RemoteInfo:
    """Size and version of the object at ``url``: one metadata request, retried under ``retry``
    (None: a single attempt, its error raised as is)."""
    fs, path = filesystem(url, storage_options)

    def head() -> dict[str, Any]:
        fs.invalidate_cache(path)  # the listing cache would hide a changed object
        return dict(fs.info(path))

    try:
        info = head() if retry is None else retried(retry, head, url, "stat", storage_options)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"{url} does not exist ({e}); check the bucket and key") from e
    if info.get("type") == "directory":
        raise IsADirectoryError(f"{url} is a directory; pass a file URL")
    version, md5 = _version_of_info(url, info)
    return RemoteInfo(
        url=url, size=int(info["size"]), version=version, md5=md5, modified=_modified_ns(info)
    )


def remote_infos(
    urls: list[str], storage_options: StorageOptions | None = None, *, retry: RetryPolicy
) -> dict[str, RemoteInfo]:
    """:func:`remote_info` of many objects: one listing per folder holding several of them
    (a listing page answers for up to a thousand objects), concurrent HEADs for the rest."""
    from concurrent.futures import ThreadPoolExecutor

    by_folder: dict[str, list[str]] = {}
    for url in dict.fromkeys(urls):
        by_folder.setdefault(url.rsplit("/", 1)[0], []).append(url)
    found: dict[str, RemoteInfo] = {}
    for folder, members in by_folder.items():
        if len(members) >= 4:
            found.update(_listed(folder, members, storage_options, retry))
    rest = [u for u in dict.fromkeys(urls) if u not in found]
    if len(rest) == 1:
        found[rest[0]] = remote_info(rest[0], storage_options, retry=retry)
    elif rest:
        with ThreadPoolExecutor(min(16, len(rest)), thread_name_prefix="meshfeed-head") as ex:
            infos = list(ex.map(lambda u: remote_info(u, storage_options, retry=retry), rest))
        found.update(zip(rest, infos, strict=True))
    return found


def _listed(
    folder: str, members: list[str], storage_options: StorageOptions | None, retry: RetryPolicy
) -> dict[str, RemoteInfo]:
    """The infos a listing of ``folder`` gives for ``members`` (those it names as files)."""
    fs, path = filesystem(folder, storage_options)

    def ls() -> list[dict[str, Any]]:
        fs.invalidate_cache(path)  # a cached listing would hide a changed object
        return list(fs.ls(path, detail=True))

    try:
        listing = retried(retry, ls, folder, "list", storage_options)
    except (FileNotFoundError, NotADirectoryError):
        return {}
    names = {fs.unstrip_protocol(str(i.get("name", ""))): i for i in listing}
    out = {}
    for url in members:
        info = names.get(url)
        if info is None or info.get("type") == "directory" or info.get("size") is None:
            continue
        try:
            version, md5 = _version_of_info(url, info)
        except SourceError:
            continue  # the HEAD may say more
        out[url] = RemoteInfo(
            url=url, size=int(info["size"]), version=version, md5=md5, modified=_modified_ns(info)
        )
    return out


def _modified_ns(info: Mapping[str, Any]) -> int:
    """When the object was last written, in ns since the epoch, from an fsspec ``info`` dict
    (0 where the backend does not say)."""
    for key in _MODIFIED_KEYS:
        value = info.get(key)
        stamp = getattr(value, "timestamp", None)
        if stamp is not None:
            return int(stamp() * 1e9)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return int(value * 1e9)
    return 0


def changed(url: str, *, found: str, expected: str, cached: bool = False) -> SourceError:
    """The error for an object whose version is not the one a job recorded when it started."""
    where = "the cached copy is" if cached else "the bucket holds"
    return SourceError(
        f"{url} changed: {where} version {found!r} but this job expects {expected!r} "
        "(recorded when it started); the object was rewritten, so resuming would read other "
        "data: restore the object or start a new run"
    )


def file_size(
    url: str, *, storage_options: StorageOptions | None = None, retry_timeout: float = 30.0
) -> int:
    """Size in bytes of the object at ``url``."""
    return remote_info(url, storage_options, retry=RetryPolicy(timeout=retry_timeout)).size


def file_version(
    url: str, *, storage_options: StorageOptions | None = None, retry_timeout: float = 30.0
) -> str:
    """A short string that changes when the object changes: ``SIZE-vVERSIONID``, ``SIZE-ETAG``
    or ``SIZE-tMTIME_NS``, whichever the backend reports first."""
    return remote_info(url, storage_options, retry=RetryPolicy(timeout=retry_timeout)).version


def version_of(
    path_or_url: str | os.PathLike[str],
    *,
    storage_options: StorageOptions | None = None,
    retry_timeout: float = 30.0,
) -> str:
    """The version of a local file (``SIZE-MTIME_NS``) or of a URL (:func:`file_version`).

    A checkpoint stores it per file; on resume a different value means the file changed.
    """
    if isinstance(path_or_url, str) and is_url(path_or_url):
        local = local_path_of(path_or_url)
        if local is None:
            return file_version(
                path_or_url, storage_options=storage_options, retry_timeout=retry_timeout
            )
        path_or_url = local
    st = os.stat(path_or_url)
    return f"{st.st_size}-{st.st_mtime_ns}"


def open_url(
    url: str,
    mode: str = "rb",
    *,
    storage_options: StorageOptions | None = None,
    retry_timeout: float = 30.0,
) -> IO[Any]:
    """An fsspec file object for ``url`` (opening retried; reads through it are not)."""
    fs, path = filesystem(url, storage_options)
    retry = RetryPolicy(timeout=retry_timeout)
    return retried(retry, lambda: fs.open(path, mode), url, "open", storage_options)


def read_range(
    url: str,
    start: int,
    stop: int,
    *,
    storage_options: StorageOptions | None = None,
    retry_timeout: float = 30.0,
) -> bytes:
    """Bytes ``[start, stop)`` of the object at ``url`` (one ranged GET, retried)."""
    if isinstance(start, bool) or isinstance(stop, bool) or not 0 <= start <= stop:
        raise ValueError(f"need 0 <= start <= stop (got {start=}, {stop=}) to read {url}")
    if start == stop:
        return b""
    fs, path = filesystem(url, storage_options)

    def get() -> bytes:
        return bytes(fs.cat_file(path, start=start, end=stop))

    return retried(RetryPolicy(timeout=retry_timeout), get, url, "read a range of", storage_options)


def list_files(
    url: str, *, suffix: str = "", storage_options: StorageOptions | None = None
) -> list[str]:
    """``url`` itself if it is a file, else the files directly under it ending in ``suffix``
    (sorted full URLs)."""
    fs, path = filesystem(url, storage_options)
    if fs.isfile(path):
        return [url]
    found = sorted(p for p in fs.ls(path, detail=False) if p.endswith(suffix) and fs.isfile(p))
    if not found:
        raise FileNotFoundError(f"{url} is neither a file nor a folder holding *{suffix} files")
    return [fs.unstrip_protocol(p) for p in found]


def upload_file(
    local: str | os.PathLike[str],
    url: str,
    *,
    storage_options: StorageOptions | None = None,
    retry_timeout: float = 60.0,
) -> None:
    """Copy a local file to ``url`` (retried). On object stores the object appears only once
    complete, so readers never see part of it."""
    fs, path = filesystem(url, storage_options)
    retry = RetryPolicy(timeout=retry_timeout)
    retried(retry, lambda: fs.put_file(os.fspath(local), path), url, "upload to", storage_options)
    fs.invalidate_cache(path)


def local_only(path: str | os.PathLike[str], *, what: str, fix: str) -> Path:
    """``path`` as a local ``Path`` (``file://`` URLs too); any other URL raises ``ValueError``
    naming ``what`` and ``fix``, so a local writer never makes a folder named ``s3:``."""
    text = os.fspath(path)
    if is_url(text) and local_path_of(text) is None:
        raise ValueError(f"{what} takes a local path (got {text!r}, a URL); {fix}")
    return Path(local_path_of(text) or text)
