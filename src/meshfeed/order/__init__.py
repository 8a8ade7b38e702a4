"""Pure index arithmetic: permutations and global-batch plans."""

from meshfeed.order.permutation import Permutation, derive_seed, splitmix64

__all__ = ["Permutation", "derive_seed", "splitmix64"]
