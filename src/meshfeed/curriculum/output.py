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
from meshfeed.storage import StorageOptions, local_path_of
from meshfeed.storage.output import check_writable, upload, upload_target

__all__ = ["check_output", "save_results"]

Results = Mapping[str, MetricIndex | np.ndarray]


def check_output(
    output: str | os.PathLike[str],
    storage_options: StorageOptions | None = None,
    *,
    retry_timeout: float = 30.0,
) -> None:
    """Fail now, naming ``output``, if it is a URL the results could not be uploaded to (see
    :func:`meshfeed.storage.output.check_writable`)."""
    url = upload_target(output)
    if url is not None:
        check_writable(url, storage_options, what="the analysis", retry_timeout=retry_timeout)


def save_results(
    result: Results,
    output: str | os.PathLike[str],
    fp: dict[str, Any],
    *,
    storage_options: StorageOptions | None = None,
) -> None:
    """Save every metric of ``result`` under ``output`` (a folder or a URL; see module doc)."""
    url = upload_target(output)
    if url is None:
        _save_local(result, Path(local_path_of(os.fspath(output)) or output), fp)
        return
    with tempfile.TemporaryDirectory(prefix="meshfeed-analyze-") as staging:
        root = Path(staging)
        _save_local(result, root, fp)
        metas = sorted(root.glob(f"*/{META}"))
        data = sorted(p for p in root.glob("*/*") if p.is_file() and p.name != META)
        for local in data + metas:  # every meta.json last: readers start from it
            upload(local, f"{url}/{local.parent.name}/{local.name}", storage_options)


def _save_local(result: Results, root: Path, fp: dict[str, Any]) -> None:
    for name, item in result.items():
        if isinstance(item, MetricIndex):
            item.save(root / name)
        else:
            save_accumulated(root / name, name, item, fp)
