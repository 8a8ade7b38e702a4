"""URLs and the node-local shard cache: data in object storage, read as local files.

Readers take local paths; this package turns a URL (``s3://``, ``gs://``, ``hf://``,
``file://`` and any fsspec protocol) into one, so a reader never knows where its bytes came
from. ``pip install "meshfeed[remote]"`` brings fsspec and s3fs (``gs://`` also needs
``pip install gcsfs``); they are imported on the first URL. Credentials and endpoints are the
client library's: its environment variables, or ``storage_options`` passed unchanged to fsspec
(for s3fs: ``{"endpoint_url": ..., "key": ..., "secret": ...}``).

For readers and the stream engine, two calls carry everything:

- ``resolve(path_or_url, *, cache, version=None) -> str``: a local path as is; a URL through
  ``cache`` (a :class:`ShardCache`), downloaded once per node, atomically, held (never evicted)
  until ``cache.release(url)``. ``version`` makes a changed object fail by name.
- ``version_of(path_or_url, *, storage_options=None) -> str``: ``SIZE-MTIME_NS`` for a local
  file, ``SIZE-ETAG`` / ``SIZE-vVERSIONID`` for a URL. Store it in a checkpoint; on resume
  pass it back as ``version=`` (or compare), and a rewritten shard is refused, naming it.

:class:`ShardCache` (``cache_dir``, ``cache_limit`` bytes) adds download-ahead
(``prefetch(urls)``; under the limit, in order, as readers free room: ``finished(url)``),
ranged reads without the whole file (``open_range(url, start, stop)``),
LRU eviction of entries no process holds, retries with backoff and jitter bounded by
``retry_timeout`` (then :class:`~meshfeed.errors.SourceError` naming the URL), and counters
(``stats()``: downloads, hits, bytes, GET requests, retries, evictions, and ``vouched``: S3
downloads of an object the cache checked before, sent ``If-Match`` its recorded ETag and not
hashed again); a file larger than
``cache_limit`` itself is refused (:class:`TooLargeForCache`). :class:`RangedFile` reads one
object by blocks of ranged GETs with a bounded in-memory LRU (:class:`RangeReads`), for files
that cannot or need not be cached whole. The single-object
helpers :func:`open_url`, :func:`file_size`, :func:`file_version`, :func:`read_range`,
:func:`list_files` and :func:`upload_file` talk to the server directly, with the same retries.

>>> from meshfeed.storage import ShardCache, resolve, version_of
>>> cache = ShardCache("/tmp/shards", cache_limit=50 << 30)  # doctest: +SKIP
>>> path = resolve("s3://bucket/train/shard-00000.bin", cache=cache)  # doctest: +SKIP
"""

from meshfeed.storage.cache import (
    CacheDiskError,
    ShardCache,
    TooLargeForCache,
    default_cache_dir,
    resolve,
)
from meshfeed.storage.ranged import Ranged, RangedFile, RangeReads, local_or_ranged
from meshfeed.storage.retry import RetryPolicy, is_transient
from meshfeed.storage.urls import (
    StorageOptions,
    file_size,
    file_version,
    is_url,
    list_files,
    local_path_of,
    open_url,
    read_range,
    upload_file,
    version_of,
)

__all__ = [
    "CacheDiskError",
    "RangeReads",
    "Ranged",
    "RangedFile",
    "RetryPolicy",
    "ShardCache",
    "StorageOptions",
    "TooLargeForCache",
    "default_cache_dir",
    "file_size",
    "file_version",
    "is_transient",
    "is_url",
    "list_files",
    "local_or_ranged",
    "local_path_of",
    "open_url",
    "read_range",
    "resolve",
    "upload_file",
    "version_of",
]
