"""StreamLoader: the DataLoader of a :class:`ShardedStream`, under the name stream users know.

>>> stream = ShardedStream([lambda: range(0, 6), lambda: range(10, 16)])
>>> [b.tolist() for b in StreamLoader(stream, batch_size=3, shuffle=False)]
[[0, 1, 2], [3, 4, 5], [10, 11, 12], [13, 14, 15]]

A stream is planned like map-style data (see :mod:`meshfeed.sources.streams.stream`), so this is the
:class:`~meshfeed.DataLoader` itself, with every guarantee it has: each data rank takes its slice
of every global batch, every row is served once per epoch across ranks and workers, the ranks
stop together by construction, ``state_dict()`` is an epoch and a position that resumes exactly
on another data-parallel size (same global batch) or worker count, and a bad row is retried,
skipped or substituted by ``on_error`` like a bad sample. It also takes a
:class:`~meshfeed.sources.Mixture` of streams.

The one addition: rows a choice of the user leaves unread (``drop_last`` drops the last
incomplete global batch of each epoch; ``drop_last=False, pad_last=False`` truncates it to a
multiple of the data ranks) are counted in ``stats()["unread_rows"]`` (arithmetic over the
completed epochs, nothing stored) and warned about once.
"""

from __future__ import annotations

from collections.abc import Generator, Sized
from typing import Any

from meshfeed.errors import RankError
from meshfeed.loader import DataLoader
from meshfeed.loader_base import logger
from meshfeed.sources.streams.stream import ShardedStream

__all__ = ["StreamLoader", "StreamRankError"]


#: The error of the other ranks when one rank's batch fails (``on_error="raise"``): every
#: loader's :class:`~meshfeed.errors.RankError`, under the name stream users know.
StreamRankError = RankError


class StreamLoader(DataLoader):
    """A :class:`~meshfeed.DataLoader` over a :class:`ShardedStream` (module docstring)."""

    name = "StreamLoader"

    def __init__(self, dataset: Any, **kwargs: Any) -> None:
        if not _is_stream(dataset):
            raise TypeError(
                f"StreamLoader reads a meshfeed.sources.ShardedStream, a Mixture of them, a "
                f"LazyDataset over either or a function that builds one (got "
                f"{type(dataset).__name__}); use meshfeed.DataLoader for map-style datasets"
            )
        self._warned_unread = False
        super().__init__(dataset, **kwargs)

    def unread_rows(self, epoch: int | None = None) -> int:
        """Rows of the epochs before ``epoch`` (default: the current one) that no data rank
        was served: ``drop_last`` dropped the last incomplete global batch, or
        ``pad_last=False`` truncated it to a multiple of the data ranks (0 with
        ``drop_last=False`` and the default ``pad_last=True``, which serves every row)."""
        epochs = self._epoch if epoch is None else epoch
        return self.plan.unserved(epochs)

    def _iterate(self, walk: int) -> Generator[Any, None, None]:
        epoch = self._epoch
        yield from super()._iterate(walk)
        unread = self.unread_rows(epoch + 1) - self.unread_rows(epoch)
        if self._epoch == epoch + 1 and unread and not self._warned_unread:
            self._warned_unread = True
            if self.drop_last:
                why = "drop_last drops the last incomplete global batch"
                fix = "drop_last=False"
            else:
                why = (
                    f"pad_last=False truncates the last incomplete global batch to a multiple "
                    f"of the {self.data_world_size} data ranks"
                )
                fix = "pad_last=True (the default: the ranks' last batches may differ in length)"
            logger.warning(
                "StreamLoader: %d rows of epoch %d were not read by any data rank: %s (%d rows "
                "per epoch, global batch %d). Use %s to serve them; counted in "
                "stats()['unread_rows']",
                unread,
                epoch,
                why,
                self.order.epoch_length(epoch),
                self.global_batch_size,
                fix,
            )

    def load_state_dict(
        self, state: dict[str, Any], *, allow_global_batch_change: bool = False
    ) -> None:
        """As :meth:`meshfeed.DataLoader.load_state_dict`; a state of meshfeed 0.2's stream
        loader (per-slot shard cursors) is refused by version: it cannot be translated."""
        if isinstance(state, dict) and state.get("kind") in ("stream_loader", "stream"):
            raise ValueError(
                f"this is a stream loader state of meshfeed 0.2 or older (kind="
                f"{state.get('kind')!r}, version {state.get('version')!r}), which recorded "
                "per-worker shard cursors; streams are now planned like map-style data and "
                "such a state cannot be translated. Restart the epoch it was in (set_epoch) "
                "with this meshfeed, or resume with the meshfeed that wrote it"
            )
        super().load_state_dict(state, allow_global_batch_change=allow_global_batch_change)

    def stats(self) -> dict[str, Any]:
        out = super().stats()
        out["unread_rows"] = self.unread_rows()
        return out


def _is_stream(dataset: Any) -> bool:
    from meshfeed.sources.lazy import LazyDataset
    from meshfeed.sources.mixture import Mixture

    if isinstance(dataset, LazyDataset):  # per-row operations over a stream or a mixture
        dataset = dataset.source
    if isinstance(dataset, ShardedStream):
        return True
    if isinstance(dataset, type) or (callable(dataset) and not isinstance(dataset, Sized)):
        return True  # a function that builds the stream where batches are made (Ray actors)
    return isinstance(dataset, Mixture) and all(_is_stream(s) for s in dataset.sources)
