"""The streaming tier: explicit-state iterator nodes (``next`` / ``next_many`` /
``state_dict`` / ``load_state_dict``, with the envelope of :mod:`meshfeed.state`)."""

from meshfeed.nodes.base import Deferred, ListNode, Node, materialize
from meshfeed.nodes.batch import Batcher
from meshfeed.nodes.shuffle import ShuffleBuffer

__all__ = ["Batcher", "Deferred", "ListNode", "Node", "ShuffleBuffer", "materialize"]
