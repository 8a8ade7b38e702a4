"""write_shards to a URL prefix: each shard uploaded once written, ``index.json`` last.

A rewrite (``overwrite=True``) names its shards anew, so the old dataset stays whole until the
new ``index.json`` replaces the old one in one write; then the old shards are deleted. A write
that fails deletes the shards it uploaded: no index names them, nothing is left behind.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

from meshfeed.sources.shards.encode import Options, encode_dataset
from meshfeed.sources.shards.format import INDEX_NAME, parse_index
from meshfeed.storage.output import Upload

__all__ = ["write_to_url"]


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
        if upload.exists(index_url):
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

        def publish(shard: Path) -> None:
            published.append(f"{url}/{shard.name}")
            upload.publish(shard, published[-1])

        try:
            encode_dataset(samples, upload.staging, o, publish)
            upload.publish(upload.staging / INDEX_NAME, index_url)
        except BaseException:
            for done in published:  # no index names them: leave nothing behind
                with contextlib.suppress(Exception):
                    upload.remove(done)
            raise
        for name in old:  # no index names them any more
            upload.remove(f"{url}/{name}")
    return index_url
