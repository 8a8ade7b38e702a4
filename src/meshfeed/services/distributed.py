"""The distributed reading service: ranks agree on the plan, and on where each walk starts.

The loader asks :meth:`DistributedService.agree` at every walk start (each ``iter()``, so also
after ``set_epoch`` and ``load_state_dict``): one all-gather of a few ints checks the plan (seed,
global batch, dataset, ...) and where the walk starts (epoch, position, the order's state)
together. Ranks that start at different places would serve overlapping samples or a different
number of steps (a job hangs in its next all-reduce); they raise ``ValueError`` on every rank
instead, naming each rank's values and the fix. The agreement check itself is
:func:`meshfeed.dist.check_agreement` (re-exported here).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from meshfeed.dist import DEFAULT_TIMEOUT, check_agreement, gather_agreement, refuse_disagreement
from meshfeed.protocols import Fetch
from meshfeed.services.base import Service
from meshfeed.tasks import FetchEvents, FetchTask

__all__ = ["DistributedService", "check_agreement", "check_walk_start"]


class DistributedService:
    """Wraps another service; checks that all ranks agree (once at the start, or at every
    walk start the loader announces with :meth:`agree`), then delegates.

    The agreement waits at most ``timeout`` seconds for the other ranks (the loader passes its
    own ``timeout``): a rank that never reaches its first batch is an error, not a hang.
    """

    def __init__(
        self,
        inner: Service,
        *,
        agreement: Mapping[str, int],
        group: Any = None,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> None:
        self.inner = inner
        self.agreement = dict(agreement)
        self.group = group
        self.timeout = timeout
        self._checked = False

    def agree(self, walk: Mapping[str, int]) -> None:
        """Check, in one all-gather, the plan and where this walk starts (``walk``: ``epoch``,
        ``position``, ...) on every rank; ``ValueError`` on every rank when they differ."""
        columns = gather_agreement({**self.agreement, **walk}, self.timeout, group=self.group)
        refuse_disagreement({name: columns[name] for name in self.agreement})
        check_walk_start({name: columns[name] for name in walk})
        self._checked = True

    def start(self, fetcher: Fetch) -> None:
        if not self._checked:
            check_agreement(self.agreement, self.timeout, group=self.group)
            self._checked = True
        self.inner.start(fetcher)

    def map(self, tasks: Iterator[FetchTask]) -> Iterator[tuple[Any, FetchEvents]]:
        return self.inner.map(tasks)

    def shutdown(self) -> None:
        self.inner.shutdown()


def check_walk_start(columns: Mapping[str, list[int]]) -> None:
    """``ValueError`` when the ranks start a walk at different places: ``columns`` holds each
    rank's ``epoch``, ``position`` and further facts (e.g. ``order``), in rank order."""
    if all(len(set(column)) == 1 for column in columns.values()):
        return
    differ = [name for name in columns if len(set(columns[name])) > 1]
    if {"mesh", "data_world_size"} & set(differ):
        sizes = columns.get("data_world_size")
        raise ValueError(
            "the ranks' data loaders were built with different meshes (the axes, their sizes "
            "or order, the data axes or the rank table differ"
            + (f"; data-parallel sizes by rank: {list(sizes)}" if sizes is not None else "")
            + "): ranks would read the same samples, or skip some. Build every rank's loader "
            "with the same mesh (e.g. DataMesh.from_sizes(...) with the same sizes and order, "
            "or the job's DeviceMesh)"
        )
    shown = [name for name in columns if name in ("epoch", "position") or name in differ]
    ranks = len(next(iter(columns.values())))
    held = ", ".join(
        f"rank {r}: " + " ".join(f"{name}={columns[name][r]}" for name in shown)
        for r in range(ranks)
    )
    raise ValueError(
        f"the ranks' data loaders start this iteration at different places ({held}; they "
        f"differ in {', '.join(differ)}): they would serve overlapping samples or a different "
        "number of steps, and a job would hang in its next collective. Every rank must continue "
        "from the same point: call set_epoch(e) with the same epoch on every rank, and "
        "load_state_dict with the same checkpoint on every rank (or on none), then iterate"
    )
