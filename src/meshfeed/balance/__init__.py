"""Packing and balanced scheduling of variable-length documents over data x context-parallel ranks.

:func:`schedule_documents` is the pure scheduler (cost model -> CP degree, rank block and
micro-step for every document); :class:`BalancedBatches` runs it inside a training job: one
all-gather of lengths, the same placement on every rank, one fused all-to-all to reroute the
documents, zigzag CP split.
:func:`packed_document_loader` feeds it the documents of a token corpus, packed per rank by
:func:`pack_documents`. :class:`PackedSamples` packs any sample (a dict of per-token fields plus
per-sample tensors, e.g. SFT or multimodal) into rows planned from lengths alone, so the loader's
state stays a position; :func:`merge_rows` feeds its rows to BalancedBatches, whose
``document_fields=`` move per-document tensors (images) with their documents
(:func:`placeholder_ordinals` finds a placeholder's row on a CP rank). Documents longer than the group holds (:func:`max_document_tokens`) are
refused, truncated or split (``long_documents=``). :class:`HybridCPDataLoader` is the drop-in for Megatron-LM's
``HybridCPDataLoaderWrapper`` (same input and output, meshfeed's schedule).
"""

from meshfeed.balance.balanced import BalancedBatches
from meshfeed.balance.baselines import BaselineResult, naive_slicing, token_balancing
from meshfeed.balance.cost import CostModel
from meshfeed.balance.document_fields import placeholder_ordinals
from meshfeed.balance.documents import pack_documents, packed_document_loader
from meshfeed.balance.long_documents import max_document_tokens
from meshfeed.balance.megatron import HybridCPDataLoader
from meshfeed.balance.packed import PackedSamples, SampleLengths
from meshfeed.balance.packing import pack, pack_windows, packing_efficiency
from meshfeed.balance.samples import PackCollate, SampleFields, merge_rows, pack_samples
from meshfeed.balance.schedule import Placement, schedule_documents

__all__ = [
    "BalancedBatches",
    "BaselineResult",
    "CostModel",
    "HybridCPDataLoader",
    "PackCollate",
    "PackedSamples",
    "Placement",
    "SampleFields",
    "SampleLengths",
    "max_document_tokens",
    "merge_rows",
    "naive_slicing",
    "pack",
    "pack_documents",
    "pack_samples",
    "pack_windows",
    "packed_document_loader",
    "packing_efficiency",
    "placeholder_ordinals",
    "schedule_documents",
    "token_balancing",
]
