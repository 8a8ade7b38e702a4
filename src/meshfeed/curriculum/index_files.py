"""The files of a saved metric: ``meta.json``, atomic writes, and the folder a reader opens.

A metric folder holds data files (``.npy``) and ``meta.json``, written last, which records
each data file's size and a hash of its ends (:func:`file_id`); a reader starts from
``meta.json`` and refuses a data file that is not the one recorded, so an interrupted save or
upload is an error naming the file, never a mix of two analyses. :class:`Folder` is that
folder for a reader: a local path as is, or a URL whose files come through the node's shard
cache (:class:`~meshfeed.storage.ShardCache`), ``meta.json`` first.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from meshfeed.errors import SourceError
from meshfeed.storage import ShardCache, StorageOptions, is_url, local_path_of

__all__ = ["META", "VERSION", "Folder", "atomic_write", "file_id"]

VERSION = 1
META = "meta.json"


class Folder:
    """A saved metric's folder: a local path as is, a URL through the node's shard cache."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        cache_dir: str | os.PathLike[str] | None,
        cache_limit: int | None,
        options: StorageOptions | None,
    ) -> None:
        p = os.fspath(path)
        p = (local_path_of(p) or p) if is_url(p) else p
        self.where = p.rstrip("/") or p
        self.cache: ShardCache | None = None
        self.root = Path(p)
        if is_url(p):
            self.cache = ShardCache(cache_dir, cache_limit=cache_limit, storage_options=options)

    def close(self) -> None:
        if self.cache is not None:
            self.cache.close()

    def meta(self) -> dict[str, Any]:
        if self.cache is not None:
            self.root = Path(self._fetch(META)).parent  # the cache keeps a folder's files together
        meta_path = self.root / META
        if not meta_path.is_file():
            raise ValueError(
                f"{self.where} is not a meshfeed metric index (no {META}); create one with "
                "`meshfeed analyze` or meshfeed.curriculum.analyze(...)"
            )
        meta: dict[str, Any] = json.loads(meta_path.read_text())
        if meta.get("version") != VERSION:
            raise ValueError(
                f"{self.where} has metric index version {meta.get('version')!r}; this meshfeed "
                f"reads version {VERSION}; rerun `meshfeed analyze`"
            )
        return meta

    def files(self, meta: dict[str, Any], names: tuple[str, ...]) -> Path:
        """The local folder holding ``names`` and the files ``meta.json`` records, each checked
        against its record (an interrupted save or upload is refused, naming the file)."""
        recorded = dict(meta.get("files", {}))
        if self.cache is not None:
            for name in sorted(set(names) | set(recorded)):
                self._fetch(name)
        for name, expected in recorded.items():
            if file_id(self.root / name) != expected:
                raise ValueError(
                    f"{self.where}/{name} is not the file {self.where}/{META} recorded (a save "
                    f"or upload was interrupted or is under way, or the files were mixed"
                    f"{self._cache_hint()}); rerun `meshfeed analyze`"
                )
        return self.root

    def _cache_hint(self) -> str:
        if self.cache is None:
            return ""
        return (
            f"; the shard cache at {self.cache.cache_dir} keeps the copies it downloaded "
            "first, so write each analysis under a new URL"
        )

    def _fetch(self, name: str) -> str:
        assert self.cache is not None  # internal invariant: only for URLs
        url = f"{self.where}/{name}"
        try:
            return self.cache.local_path(url)
        except FileNotFoundError as e:
            if name == META:
                raise ValueError(
                    f"{self.where} is not a meshfeed metric index ({url} does not exist); "
                    "create one with `meshfeed analyze -o URL` or meshfeed.curriculum.analyze"
                ) from e
            raise FileNotFoundError(
                f"{url} does not exist though {self.where}/{META} records it: the analysis "
                "was deleted in part or is being rewritten; rerun `meshfeed analyze`"
            ) from e
        except (SourceError, ImportError):
            raise
        except Exception as e:  # credentials, endpoint, a denied request: name the URL
            raise SourceError(
                f"cannot read the metric index {self.where}: {type(e).__name__}: {e}; check "
                "the URL and the credentials and endpoint (storage_options= or the client's "
                "environment variables, e.g. AWS_ACCESS_KEY_ID / AWS_ENDPOINT_URL)"
            ) from e


def atomic_write(target: Path, write: Any) -> None:
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def file_id(path: Path) -> list[Any]:
    """Size and a hash of the first and last 4 KB: cheap, and different for another save."""
    if not path.is_file():
        return [None, None]
    size = path.stat().st_size
    h = hashlib.blake2b(digest_size=12)
    with open(path, "rb") as f:
        h.update(f.read(4096))
        f.seek(max(0, size - 4096))
        h.update(f.read())
    return [size, h.hexdigest()]
