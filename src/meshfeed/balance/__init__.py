"""Packing and balanced scheduling of variable-length documents over data x context-parallel ranks.

:func:`schedule_documents` is the pure scheduler (cost model -> CP degree, rank block and
micro-step for every document); :class:`BalancedBatches` runs it inside a training job: one
all-gather of lengths, the same placement on every rank, one fused all-to-all to reroute the
documents, zigzag CP split.
:func:`packed_document_loader` feeds it the documents of a token corpus, packed per rank by
:func:`pack_documents`; documents longer than the group holds (:func:`max_document_tokens`) are
refused, truncated or split (``long_documents=``). :class:`HybridCPDataLoader` is the drop-in for Megatron-LM's
``HybridCPDataLoaderWrapper`` (same input and output, meshfeed's schedule).
"""

from meshfeed.balance.balanced import BalancedBatches
from meshfeed.balance.baselines import BaselineResult, naive_slicing, token_balancing
from meshfeed.balance.cost import CostModel
from meshfeed.balance.documents import pack_documents, packed_document_loader
from meshfeed.balance.long_documents import max_document_tokens
from meshfeed.balance.megatron import HybridCPDataLoader
from meshfeed.balance.packing import pack, packing_efficiency
from meshfeed.balance.schedule import Placement, schedule_documents

__all__ = [
    "BalancedBatches",
    "BaselineResult",
    "CostModel",
    "HybridCPDataLoader",
    "Placement",
    "max_document_tokens",
    "naive_slicing",
    "pack",
    "pack_documents",
    "packed_document_loader",
    "packing_efficiency",
    "schedule_documents",
    "token_balancing",
]
