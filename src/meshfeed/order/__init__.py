"""Pure index arithmetic: permutations, global-batch plans and batch-size ramps."""

from meshfeed.order.permutation import Permutation, derive_seed, splitmix64
from meshfeed.order.rampup import BatchRampup

__all__ = ["BatchRampup", "Permutation", "derive_seed", "splitmix64"]
