"""A worker forked from a process that has read URLs must not cut that process off its own
pooled connections (#29): against a real S3 API (moto), through the counting proxy."""

from __future__ import annotations

import os
import time
from typing import Any

from meshfeed.storage.urls import filesystem
from tests.storage.conftest import S3, options_for


async def _collect() -> None:
    import asyncio
    import gc

    gc.collect()
    await asyncio.sleep(0.2)  # the tasks the collection started run


def _child(url: str, options: dict[str, Any]) -> None:
    """As a worker's first requests: its first filesystem makes fsspec drop the parent's
    instances in this process, and a collection on its event loop's thread (where a worker's
    requests run) finalizes them."""
    from fsspec.asyn import sync

    fs, _ = filesystem(url, options)
    sync(fs.loop, _collect)


def test_a_forked_child_leaves_the_parent_s_pooled_connections_alone(s3: S3) -> None:
    """The child used to finalize the parent's s3fs client, unregistering its pooled sockets
    from the epoll instance both processes share: the parent's next GET on such a connection
    heard nothing until its read timeout, and s3fs sent the whole GET again."""
    import multiprocessing as mp

    url = s3.put("inherit/shard.bin", os.urandom(1 << 20))
    timeout = 8.0
    options = options_for(s3.proxy.endpoint, read_timeout=timeout)
    # no reference here: in a loader only fsspec's instance cache keeps the client
    filesystem(url, options)[0].cat_file(url, start=0, end=10)  # a pooled connection
    ctx = mp.get_context("fork")
    children = [ctx.Process(target=_child, args=(url, options)) for _ in range(2)]
    for c in children:
        c.start()
    for c in children:
        c.join(timeout=60)
        assert c.exitcode == 0
    s3.proxy.reset()
    start = time.monotonic()
    data = filesystem(url, options)[0].cat_file(url)  # over the pooled connection
    took = time.monotonic() - start
    assert len(data) == 1 << 20
    assert took < timeout / 2, took  # never stalled until the read timeout
    assert dict(s3.proxy.object_gets) == {f"/{s3.bucket}/inherit/shard.bin": 1}  # no retry
