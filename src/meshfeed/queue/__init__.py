"""Streaming sample store for RL post-training: partitions, fields, per-task consumption.

See :class:`SampleStore` (embedded or Ray backend), the samplers in
:mod:`meshfeed.queue.samplers`, and :class:`StoreLoader` for a per-rank iterator.
"""

from meshfeed.queue.core import PartitionClosed
from meshfeed.queue.dynamic import Varies
from meshfeed.queue.loader import CollateError, StoreLoader
from meshfeed.queue.samplers import (
    GroupSampler,
    LengthBalancedSampler,
    RankAwareSampler,
    SequentialSampler,
)
from meshfeed.queue.store import Batch, SampleStore
from meshfeed.queue.versions import StaleVersion
from meshfeed.queue.wakeups import RequestCancelled

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
