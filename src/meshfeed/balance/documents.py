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

import reprlib
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
    items, ids = docs, None
    pairs = bool(docs) and isinstance(docs[0], tuple)
    try:
        if pairs:
            id_list = [i for i, _ in docs]
            docs = [d for _, d in docs]
            ids = _fast_ids(id_list)
        arrays = [np.asarray(d) for d in docs]
    except (TypeError, ValueError):  # numpy's words for a mixed or malformed list
        _refuse_items(items, pairs)
        raise
    if pairs and ids is None:  # an id of another type (refused by name) or past int64
        _refuse_items(items, pairs)
        ids = np.asarray([int(i) for i in id_list], dtype=np.int64)  # e.g. 0-d int tensors
    bad = next((a.shape for a in arrays if a.ndim != 1), None)
    if bad is not None:
        _refuse_items(items, pairs)
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


#: Scalar types of a corpus id read in one numpy call (a value past int64 is sorted out there).
_INT_TYPES = frozenset({int, *(np.dtype(c).type for c in np.typecodes["AllInteger"])})
_INT64 = np.iinfo(np.int64)


def _fast_ids(id_list: list[Any]) -> np.ndarray | None:
    """The corpus ids as int64 when each is an int or numpy integer within int64 (one numpy
    call), else None: :func:`_refuse_items` then names the item, or accepts it (a 0-d tensor)."""
    if not set(map(type, id_list)) <= _INT_TYPES:
        return None
    try:
        return np.asarray(id_list, dtype=np.int64)
    except OverflowError:
        return None


def _describe(x: Any) -> str:
    """What an item of ``pack_documents``'s list is, in words (for its errors)."""
    if isinstance(x, tuple):
        return f"a tuple of {len(x)} element(s)"
    if isinstance(x, np.ndarray):
        return f"a {x.ndim}-D numpy array of shape {x.shape} and dtype {x.dtype}"
    if isinstance(x, torch.Tensor):
        return f"a {x.dim()}-D tensor of shape {tuple(x.shape)} and dtype {x.dtype}"
    name = type(x).__name__
    return f"{'an' if name[:1] in 'aeiou' else 'a'} {name} ({reprlib.repr(x)})"


def _is_corpus_id(x: Any) -> bool:
    """An int, numpy integer or 0-d integer array / tensor (not a bool)."""
    if isinstance(x, (bool, np.bool_)):
        return False
    if isinstance(x, (int, np.integer)):
        return True
    if isinstance(x, np.ndarray) and x.ndim == 0:
        return x.dtype.kind in "iu"
    if isinstance(x, torch.Tensor) and x.dim() == 0:
        return not (x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool)
    return False


def _refuse_items(items: Sequence[Any], pairs: bool) -> None:
    """Raise TypeError / ValueError naming the first malformed item of ``pack_documents``'s
    list (its index, what it is and the fix); return if every item is well formed.

    Only called once the fast path failed: the normal path pays nothing for it."""
    first = "a (corpus_id, tokens) pair" if pairs else _describe(items[0])
    either = (
        "pack_documents takes either (corpus_id, tokens) pairs for every item or plain token "
        "arrays for every item"
    )
    for k, item in enumerate(items):
        if isinstance(item, (str, bytes)):
            raise TypeError(
                f"item {k} of the documents is {_describe(item)}: documents are 1-D integer "
                "token arrays or (corpus_id, tokens) pairs; tokenize text first"
            )
        tokens, what = item, f"item {k} of the documents is"
        if pairs:
            if not isinstance(item, tuple):
                raise TypeError(
                    f"item {k} of the documents is {_describe(item)}, but item 0 is {first}: "
                    f"{either}; give item {k} its corpus id, as (corpus_id, tokens), or pass "
                    "every item without one"
                )
            if len(item) != 2:
                raise TypeError(
                    f"item {k} of the documents is {_describe(item)}; a document with its "
                    "corpus id is a pair (corpus_id, tokens)"
                )
            cid, tokens = item
            what = f"the tokens of item {k} are"
            if not _is_corpus_id(cid):
                raise TypeError(
                    f"the corpus id of item {k} is {_describe(cid)}; a corpus id is an int "
                    f"(the document's number in its corpus): pass (int(id), tokens) if it is "
                    "a whole number"
                )
            if not _INT64.min <= int(cid) <= _INT64.max:
                raise ValueError(
                    f"the corpus id of item {k} is {int(cid)}, outside int64 (document_ids "
                    "are int64); number the documents below 2**63 (e.g. a uint64 hash h as "
                    "int(np.uint64(h).view(np.int64)))"
                )
        try:
            a = np.asarray(tokens)
        except (TypeError, ValueError) as e:
            if not pairs and isinstance(item, tuple) and len(item) == 2:
                raise TypeError(
                    f"item {k} of the documents is {_describe(item)}, a (corpus_id, tokens) "
                    f"pair, but item 0 is {first}: {either}; give every item its corpus id, "
                    f"or pass item {k}'s tokens alone"
                ) from None
            raise TypeError(
                f"{what} {_describe(tokens)}, which numpy cannot read as a 1-D token array "
                f"({e}); pass a 1-D integer array or tensor"
            ) from None
        if a.ndim != 1:
            raise ValueError(
                f"documents must be 1-D token arrays (got shape {a.shape}): {what} "
                f"{_describe(tokens)}; pass each document as its own 1-D array (e.g. "
                "list(batch) for the rows of a 2-D batch)"
            )


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
