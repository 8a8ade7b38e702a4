"""The one set of default per-token keys of a sample, and how each is padded.

Megatron's names: its GPT datasets yield ``tokens``, ``labels``, ``loss_mask`` and
``position_ids``, and so do meshfeed's token packers (``pack_documents``, token windows), so a
Megatron training loop needs no renaming. Parts that take keys (balancing, curriculum seqlen
transforms) default to these and accept ``keys=...`` for other names (e.g. ``input_ids``).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

__all__ = ["DEFAULT_KEYS", "DEFAULT_PAD", "DOCUMENT_IDS"]

#: The per-token keys of a (packed) sample, in the order meshfeed writes them.
DEFAULT_KEYS: tuple[str, ...] = ("tokens", "labels", "loss_mask", "position_ids")

#: Fill value of each default key when a sample is padded; ``None`` continues the document's
#: positions (position ids), -100 is the label ignored by ``torch.nn.CrossEntropyLoss``.
DEFAULT_PAD: Mapping[str, int | None] = MappingProxyType(
    {"tokens": 0, "labels": -100, "loss_mask": 0, "position_ids": None}
)

#: Per-document key of a packed sample and of a balanced micro-step: the corpus id of each
#: document (aligned with ``cu_seqlens``; every piece of a split document carries its id).
DOCUMENT_IDS = "document_ids"
