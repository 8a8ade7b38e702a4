"""The streaming tier: explicit-state iterator nodes (next / get_state / restore)."""

from meshfeed.nodes.base import ListNode, Node
from meshfeed.nodes.batch import Batcher
from meshfeed.nodes.shuffle import ShuffleBuffer

__all__ = ["Batcher", "ListNode", "Node", "ShuffleBuffer"]
