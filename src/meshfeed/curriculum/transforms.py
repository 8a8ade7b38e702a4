"""DeepSpeed's transform-only curriculum metrics: sequence-length truncation and reshape.

They gate nothing; a schedule gives the current sequence length and the collated batch is cut
to it after loading (``Curriculum.postprocess`` calls them with the difficulty of the batch's
step). ``SeqlenTruncate`` keeps the first ``d`` positions of every sequence (DeepSpeed
``seqlen_truncate``); ``SeqlenReshape`` keeps every token by folding ``[B, S]`` into
``[B * (S // d), d]`` (DeepSpeed ``seqlen_reshape``; a tail of ``S % d`` tokens is dropped).
``ReportedDifficulty`` changes nothing: it is a DeepSpeed ``single_cluster`` metric whose
difficulty the model code reads (``Curriculum.difficulties(step)``, and the loader state).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from meshfeed.curriculum.schedule import Schedule, check_schedule
from meshfeed.keys import DEFAULT_KEYS

__all__ = ["SEQLEN_KEYS", "ReportedDifficulty", "SeqlenReshape", "SeqlenTruncate"]

#: The batch keys cut by default when the batch is a mapping (those present are cut):
#: meshfeed's per-token keys (:data:`meshfeed.keys.DEFAULT_KEYS`) plus the Hugging Face names
#: ``input_ids`` and ``attention_mask`` of the batches DeepSpeed's seqlen metrics cut.
SEQLEN_KEYS: tuple[str, ...] = (*DEFAULT_KEYS, "input_ids", "attention_mask")


@dataclass(frozen=True, kw_only=True, slots=True)
class _Seqlen:
    """What the two seqlen transforms share: the keys they cut and the checks of each tensor."""

    schedule: Schedule
    keys: tuple[str, ...] = SEQLEN_KEYS
    name: str

    def __post_init__(self) -> None:
        check_schedule(self.schedule)

    def __call__(self, batch: Any, difficulty: int | float) -> Any:
        d = int(difficulty)
        if isinstance(batch, Mapping):
            return {k: self._one(v, d) if k in self.keys else v for k, v in batch.items()}
        if hasattr(batch, "shape"):  # one array (torch tensor or numpy), without importing torch
            return self._one(batch, d)
        raise TypeError(
            f"seqlen transforms need a tensor or a mapping of tensors (got {type(batch).__name__}); "
            "collate into a dict of [batch, seq] tensors"
        )

    def _one(self, x: Any, d: int) -> Any:
        if len(x.shape) < 2:
            raise ValueError(
                f"{self.name} needs [batch, seq, ...] tensors (got shape {tuple(x.shape)})"
            )
        if d < 1:
            raise ValueError(f"{self.name} needs a positive sequence length (got difficulty {d})")
        s = int(x.shape[1])
        return x if d >= s else self._cut(x, d, s)

    def _cut(self, x: Any, d: int, s: int) -> Any:
        raise NotImplementedError


@dataclass(frozen=True, kw_only=True, slots=True)
class SeqlenTruncate(_Seqlen):
    """Cut every ``[B, S, ...]`` tensor to ``[B, min(S, d), ...]`` with ``d`` from ``schedule``."""

    name: str = "seqlen_truncate"

    def _cut(self, x: Any, d: int, s: int) -> Any:
        cut = x[:, :d]
        # A torch slice is a strided view: make it contiguous as the model expects; a numpy
        # slice has no contiguous() and is returned as the view it is.
        return cut.contiguous() if hasattr(cut, "contiguous") else cut


@dataclass(frozen=True, kw_only=True, slots=True)
class SeqlenReshape(_Seqlen):
    """Fold every ``[B, S, ...]`` tensor into ``[B * (S // d), d, ...]`` (drops ``S % d``)."""

    name: str = "seqlen_reshape"

    def _cut(self, x: Any, d: int, s: int) -> Any:
        return x[:, : (s // d) * d].reshape(x.shape[0] * (s // d), d, *x.shape[2:])


@dataclass(frozen=True, kw_only=True, slots=True)
class ReportedDifficulty:
    """A scheduled difficulty that gates and transforms nothing; it is only reported.

    DeepSpeed's ``single_cluster`` metrics other than the seqlen ones (e.g. the ``dummy_metric``
    of its own tests) work this way: the sampler's ``current_difficulties`` carries the value
    and the model's post-processing uses it.
    """

    schedule: Schedule
    name: str

    def __post_init__(self) -> None:
        check_schedule(self.schedule)

    def __call__(self, batch: Any, difficulty: int | float) -> Any:
        return batch
