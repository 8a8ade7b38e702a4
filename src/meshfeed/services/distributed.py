"""The distributed reading service: ranks agree on the plan before the first batch."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from meshfeed.fetch import Fetcher, FetchEvents, FetchTask
from meshfeed.services.base import Service


def check_agreement(values: Mapping[str, int], group: Any = None) -> None:
    """All-gather ``values`` (small ints) over ``group`` and fail if any rank differs.

    One collective of a few int64s. Raises ValueError on every rank naming the field and the
    value each rank holds, so a misconfigured job stops at its first batch instead of hanging
    or training on overlapping shards.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    world = dist.get_world_size(group)
    if world == 1:
        return
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if dist.get_backend(group) == "nccl"
        else torch.device("cpu")
    )
    names = list(values)
    mine = torch.tensor([int(values[n]) for n in names], dtype=torch.int64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine, group=group)
    table = torch.stack(gathered).cpu()
    for j, name in enumerate(names):
        column = table[:, j].tolist()
        if len(set(column)) > 1:
            raise ValueError(
                f"data loaders disagree on {name}: rank i holds {column}; every rank must build "
                "its DataLoader with the same dataset, seed and global batch size"
            )


class DistributedService:
    """Wraps another service; checks once that all ranks agree, then delegates."""

    def __init__(self, inner: Service, *, agreement: Mapping[str, int], group: Any = None) -> None:
        self.inner = inner
        self.agreement = dict(agreement)
        self.group = group
        self._checked = False

    def start(self, fetcher: Fetcher) -> None:
        if not self._checked:
            check_agreement(self.agreement, self.group)
            self._checked = True
        self.inner.start(fetcher)

    def map(self, tasks: Iterator[FetchTask]) -> Iterator[tuple[Any, FetchEvents]]:
        return self.inner.map(tasks)

    def shutdown(self) -> None:
        self.inner.shutdown()
