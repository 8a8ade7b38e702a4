"""Streaming sample store for RL post-training: partitions, fields, per-task consumption.

See :class:`SampleStore` (embedded or Ray backend), the samplers in
:mod:`meshfeed.queue.samplers`, and :class:`StreamingDataLoader` for a per-rank iterator.
"""

from meshfeed.queue.core import PartitionClosed
from meshfeed.queue.loader import StreamingDataLoader, TransformError
from meshfeed.queue.samplers import (
    GroupSampler,
    LengthBalancedSampler,
    RankAwareSampler,
    SequentialSampler,
)
from meshfeed.queue.store import Batch, SampleStore

__all__ = [
    "Batch",
    "GroupSampler",
    "LengthBalancedSampler",
    "PartitionClosed",
    "RankAwareSampler",
    "SampleStore",
    "SequentialSampler",
    "StreamingDataLoader",
    "TransformError",
]
