"""Where :func:`~meshfeed.curriculum.analyze` writes: a local folder, or a URL.

Each metric goes to ``OUTPUT/<name>/``: a metric index (``values.npy``, ``order.npy``,
``percentiles.npy``, then ``meta.json``) or an accumulated array (``accumulated.npy``, then
``meta.json``). A local folder (or a ``file://`` URL) is written in place, file by file
atomically. Any other URL (``s3://bucket/metrics``, ``gs://...``, any fsspec protocol) is
written to a temporary local folder first, then uploaded one file at a time (an object appears
only once complete), every data file before any ``meta.json``. Readers open ``meta.json``
first and it records each data file's size and a hash of its ends, so a reader that finds it
finds the files it describes; a metric being overwritten (the old ``meta.json`` still up, some
new arrays already) is refused by name, never read mixed.

The URL is checked before the analysis runs (the protocol is known, the storage answers with
these credentials), so a typo or a missing credential fails in seconds, not after the passes;
an upload that fails afterwards raises :class:`~meshfeed.errors.SourceError` naming the URL.
Credentials and endpoint: ``storage_options`` (passed to fsspec) or the client's environment
variables (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ...).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from meshfeed.curriculum.index import MetricIndex, save_accumulated
from meshfeed.curriculum.index_files import META
from meshfeed.errors import SourceError
from meshfeed.storage import StorageOptions, is_url, local_path_of, upload_file
from meshfeed.storage.retry import RetryPolicy
from meshfeed.storage.urls import filesystem

__all__ = ["check_output", "save_results"]

Results = Mapping[str, MetricIndex | np.ndarray]

# object stores whose first path component is a bucket (checked to exist before the analysis)
_BUCKETED = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "oss"})

_ADVICE = (
    "check the URL (bucket and prefix) and the credentials and endpoint (storage_options= or "
    "the client's environment variables, e.g. AWS_ACCESS_KEY_ID / AWS_ENDPOINT_URL)"
)


def _remote(output: str | os.PathLike[str]) -> str | None:
    """The URL ``output`` names when it is one that needs uploading; None for a local folder."""
    out = os.fspath(output)
    return out.rstrip("/") if is_url(out) and local_path_of(out) is None else None


def check_output(
    output: str | os.PathLike[str],
    storage_options: StorageOptions | None = None,
    *,
    retry_timeout: float = 30.0,
) -> None:
    """Fail now, naming ``output``, if it is a URL the results could not be uploaded to.

    One or two metadata requests: an unknown protocol, a missing client library, missing
    credentials, an unreachable endpoint or (on object stores) a missing bucket raise here. A
    denied request is let through (write-only credentials); the upload then says what it finds.
    """
    url = _remote(output)
    if url is None:
        return
    try:
        fs, path = filesystem(url, storage_options)
    except ValueError as e:  # fsspec: "Protocol not known: ..."
        raise ValueError(
            f"analyze output {url}: {e}; give a local folder or a URL of an installed fsspec "
            "protocol (s3://, gs://, file://, ...)"
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
            f"cannot write the analysis to {url}: {type(e).__name__}: {e}; {_ADVICE}"
        ) from e
    if not found:
        raise FileNotFoundError(
            f"cannot write the analysis to {url}: the bucket {bucket!r} does not exist (or "
            "these credentials cannot see it); create it, or fix the URL or the endpoint"
        )


def _bucketed(fs: Any) -> bool:
    """Whether the first component of ``fs``'s paths is a bucket that writes do not create."""
    protocols = {fs.protocol} if isinstance(fs.protocol, str) else set(fs.protocol)
    return bool(protocols & _BUCKETED)


def save_results(
    result: Results,
    output: str | os.PathLike[str],
    fp: dict[str, Any],
    *,
    storage_options: StorageOptions | None = None,
) -> None:
    """Save every metric of ``result`` under ``output`` (a folder or a URL; see module doc)."""
    url = _remote(output)
    if url is None:
        _save_local(result, Path(local_path_of(os.fspath(output)) or output), fp)
        return
    with tempfile.TemporaryDirectory(prefix="meshfeed-analyze-") as staging:
        root = Path(staging)
        _save_local(result, root, fp)
        metas = sorted(root.glob(f"*/{META}"))
        data = sorted(p for p in root.glob("*/*") if p.is_file() and p.name != META)
        for local in data + metas:  # every meta.json last: readers start from it
            _upload(local, f"{url}/{local.parent.name}/{local.name}", storage_options)


def _save_local(result: Results, root: Path, fp: dict[str, Any]) -> None:
    for name, item in result.items():
        if isinstance(item, MetricIndex):
            item.save(root / name)
        else:
            save_accumulated(root / name, name, item, fp)


def _upload(local: Path, url: str, storage_options: StorageOptions | None) -> None:
    try:
        upload_file(local, url, storage_options=storage_options)
    except SourceError:
        raise
    except Exception as e:
        raise SourceError(f"cannot upload {url}: {type(e).__name__}: {e}; {_ADVICE}") from e
