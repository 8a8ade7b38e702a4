"""The streaming tier: explicit-state iterator nodes (``next`` / ``next_many`` /
``state_dict`` / ``load_state_dict``, with the envelope of :mod:`meshfeed.state`)."""

from meshfeed.nodes.base import ListNode, Node
from meshfeed.nodes.batch import Batcher
from meshfeed.nodes.shuffle import ShuffleBuffer

__all__ = ["Batcher", "ListNode", "Node", "ShuffleBuffer"]
