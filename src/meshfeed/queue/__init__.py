"""Streaming sample store for RL post-training: partitions, fields, per-task consumption.

See :class:`SampleStore` (embedded or Ray backend), the samplers in
:mod:`meshfeed.queue.samplers`, and :class:`StoreLoader` for a per-rank iterator.
"""

from meshfeed.queue.engine.core import PartitionClosed
from meshfeed.queue.engine.dynamic import Varies
from meshfeed.queue.engine.versions import StaleVersion
from meshfeed.queue.engine.wakeups import RequestCancelled
from meshfeed.queue.loading.loader import CollateError, StoreLoader
from meshfeed.queue.samplers import (
    GroupSampler,
    LengthBalancedSampler,
    RankAwareSampler,
    SequentialSampler,
)
from meshfeed.queue.store import Batch, SampleStore

__all__ = [
    "Batch",
    "CollateError",
    "GroupSampler",
    "LengthBalancedSampler",
    "PartitionClosed",
    "RankAwareSampler",
    "RequestCancelled",
    "SampleStore",
    "SequentialSampler",
    "StaleVersion",
    "StoreLoader",
    "Varies",
]
