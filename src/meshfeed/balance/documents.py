"""From a token corpus to :class:`~meshfeed.balance.BalancedBatches`: pack documents per rank.

:func:`pack_documents` collates a list of variable-length documents into the packed sample
BalancedBatches reroutes (next-token inputs and labels, position ids restarting per document,
``cu_seqlens``); :func:`packed_document_loader` is a :class:`~meshfeed.DataLoader` over
:class:`~meshfeed.sources.TokenDocuments` with that collate, resumable through BalancedBatches.

>>> loader = packed_document_loader("corpus/prefix", batch_size=16, mesh={"dp": 4, "cp": 2})  # doctest: +SKIP
>>> for step in BalancedBatches(loader, max_tokens=32768):  # doctest: +SKIP
...     ...
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from meshfeed.keys import DOCUMENT_IDS
from meshfeed.loader import DataLoader
from meshfeed.mesh import DEFAULT_DATA_AXES, DataMesh, resolve_mesh
from meshfeed.order.distinct import distinct
from meshfeed.sources.tokens.windows import CorpusLike, TokenDocuments

__all__ = ["pack_documents", "packed_document_loader"]


def pack_documents(docs: Sequence[Any]) -> dict[str, torch.Tensor]:
    """Pack documents (1-D token arrays or tensors) into one next-token-prediction sample.

    An item may also be a ``(corpus_id, tokens)`` pair (what :func:`packed_document_loader`
    reads); the sample then carries ``document_ids`` (int64, one per packed document), which
    :class:`~meshfeed.balance.BalancedBatches` hands on to its micro-steps.

    Per document of ``n`` tokens: ``tokens`` gets ``doc[:-1]``, ``labels`` gets ``doc[1:]``
    (int64; documents of any other dtype than integers are refused), ``loss_mask`` ones
    (float32), ``position_ids`` ``0 .. n-2`` (int64);
    ``cu_seqlens`` (int32) holds the ``n - 1``-token boundaries. Documents with fewer than two
    tokens carry no prediction and are left out. One concatenation, no per-token Python.

    >>> pack_documents([np.array([5, 6, 7]), np.array([8, 9])])["cu_seqlens"].tolist()
    [0, 2, 3]
    """
    ids = None
    if docs and isinstance(docs[0], tuple):
        ids = np.asarray([int(i) for i, _ in docs], dtype=np.int64)
        docs = [d for _, d in docs]
    arrays = [np.asarray(d) for d in docs]
    bad = next((a.shape for a in arrays if a.ndim != 1), None)
    if bad is not None:
        raise ValueError(f"documents must be 1-D token arrays (got shape {bad})")
    k = next((k for k, a in enumerate(arrays) if a.size and a.dtype.kind not in "iu"), None)
    if k is not None:  # a float token id would be truncated to another token
        raise TypeError(
            f"documents must hold integer token ids (document {k} has dtype "
            f"{arrays[k].dtype}); cast them to an integer dtype where they are whole numbers"
        )
    lengths = np.fromiter((a.shape[0] for a in arrays), np.int64, len(arrays))
    flat = np.concatenate(arrays).astype(np.int64) if arrays else np.zeros(0, np.int64)
    ends = np.cumsum(lengths)
    nonempty = lengths > 0
    is_last = np.zeros(flat.size, bool)
    is_last[ends[nonempty] - 1] = True
    is_first = np.zeros(flat.size, bool)
    is_first[(ends - lengths)[nonempty]] = True
    # a document's boundary repeats when it has < 2 tokens: unique drops it
    cu = distinct(np.concatenate([[0], np.cumsum(np.maximum(lengths - 1, 0))]))
    sizes = np.diff(cu)
    tokens = torch.from_numpy(flat[~is_last])
    out = {
        "tokens": tokens,
        "labels": torch.from_numpy(flat[~is_first]),
        "loss_mask": torch.ones(tokens.shape[0], dtype=torch.float32),
        "position_ids": torch.from_numpy(np.arange(cu[-1]) - np.repeat(cu[:-1], sizes)),
        "cu_seqlens": torch.from_numpy(cu.astype(np.int32)),
    }
    if ids is not None:
        out[DOCUMENT_IDS] = torch.from_numpy(ids[lengths > 1])
    return out


class NumberedDocuments:
    """``documents[i]`` as ``(i, tokens)``: packed samples then know their corpus ids."""

    def __init__(self, documents: TokenDocuments) -> None:
        self.documents = documents

    def __len__(self) -> int:
        return len(self.documents)

    @property
    def fingerprint(self) -> str:
        return f"numbered:{self.documents.fingerprint}"

    def __getitem__(self, i: int) -> tuple[int, np.ndarray]:
        return int(i), self.documents[i]

    def __getitems__(self, indices: Sequence[int]) -> list[tuple[int, np.ndarray]]:
        docs = self.documents.__getitems__(indices)
        return [(int(i), d) for i, d in zip(indices, docs, strict=True)]


def packed_document_loader(
    corpus_or_documents: CorpusLike | TokenDocuments,
    *,
    batch_size: int,
    mesh: Any = None,
    rank: int | None = None,
    seed: int = 0,
    num_workers: int = 0,
) -> DataLoader:
    """A DataLoader yielding one :func:`pack_documents` sample of ``batch_size`` documents per step.

    Made for ``BalancedBatches(packed_document_loader(...), max_tokens=...)``, which
    checkpoints and restores through the loader's ``state_dict`` / ``load_state_dict``. Each
    sample carries the corpus ids of its documents (``document_ids``), which BalancedBatches
    puts on its micro-steps and names in its errors. Every rank BalancedBatches balances must read distinct documents, so a mesh
    given as a dict shards over ``cp`` too (``{"dp": 4, "cp": 2}`` is 8 data ranks); a
    ``DataMesh`` with a ``cp`` axis must list it in ``data_axes``. One epoch per ``iter()``.
    """
    documents = (
        corpus_or_documents
        if isinstance(corpus_or_documents, TokenDocuments)
        else TokenDocuments(corpus_or_documents)
    )
    if isinstance(mesh, Mapping):
        mesh = DataMesh.from_sizes(data_axes=DEFAULT_DATA_AXES | {"cp"}, **dict(mesh))
    resolved = resolve_mesh(mesh)
    if "cp" in resolved.axis_names and "cp" not in resolved.data_axes:
        raise ValueError(
            f"mesh {dict(zip(resolved.axis_names, resolved.axis_sizes, strict=True))} "
            "replicates data over cp, so context-parallel peers would pack the same documents "
            "and BalancedBatches would train them twice; build it with data_axes including 'cp'"
        )
    return DataLoader(
        NumberedDocuments(documents),
        batch_size=batch_size,
        mesh=resolved,
        rank=rank,
        seed=seed,
        num_workers=num_workers,
        collate_fn=pack_documents,
    )
