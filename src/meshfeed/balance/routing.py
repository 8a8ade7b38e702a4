"""Reroute the documents of packed samples to the ranks a :class:`Placement` puts them on.

Pure functions, no collectives: :func:`build_send` turns this rank's packed sample into one
uint8 buffer holding every key of every outgoing piece (a piece is what one destination rank
keeps of one document: the whole padded document, or its two zigzag chunks), ordered by
destination; :func:`unpack` turns the received buffer into this rank's micro-steps. Between
them sits exactly one variable-size ``all_to_all_single`` (or :func:`route_local`, which runs
every rank in one process). Both sides derive the same layout from the placement, so no sizes or
offsets travel besides the lengths that built the placement.

A packed sample is a dict of 1-D tensors of equal length (``tokens``, ``labels``,
``loss_mask``, ``position_ids`` by default) plus ``cu_seqlens`` (document boundaries).
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from meshfeed.balance.document_fields import (
    build_field_send,
    byte_view,
    document_bytes,
    field_rows,
    field_specs,
    normalize_fields,
    ranges,
    specs_text,
    unpack_fields,
)
from meshfeed.balance.long_documents import piece_numbers
from meshfeed.balance.schedule import Placement, schedule_documents
from meshfeed.balance.zigzag import zigzag_positions
from meshfeed.keys import DEFAULT_KEYS, DEFAULT_PAD, DOCUMENT_IDS

__all__ = ["Layout", "build_send", "route_local", "unpack"]


def doc_lengths(sample: Mapping[str, Any], keys: Sequence[str]) -> np.ndarray:
    """Validate a packed sample and return its document lengths (from ``cu_seqlens``)."""
    missing = [k for k in (*keys, "cu_seqlens") if k not in sample]
    if missing:
        raise ValueError(
            f"packed sample lacks keys {missing} (has {sorted(sample)}); yield "
            f"{[*keys, 'cu_seqlens']} or pass keys=... naming the per-token keys"
        )
    total = None
    for k in keys:
        t = sample[k]
        if not isinstance(t, torch.Tensor) or t.ndim != 1:
            raise ValueError(f"sample[{k!r}] must be a 1-D tensor (got {type(t).__name__})")
        if total is not None and t.numel() != total:
            raise ValueError(f"sample[{k!r}] has {t.numel()} tokens, {keys[0]!r} has {total}")
        total = t.numel()
    cu = np.asarray(torch.as_tensor(sample["cu_seqlens"]).cpu(), dtype=np.int64).ravel()
    if cu.size == 0 or cu[0] != 0 or cu[-1] != total or np.any(np.diff(cu) < 0):
        raise ValueError(
            f"cu_seqlens must rise from 0 to the sample length {total} (got {cu.tolist()[:8]}...)"
        )
    return np.diff(cu)


def fields_signature(
    sample: Mapping[str, Any], keys: Sequence[str], document_fields: Sequence[str] = ()
) -> int:
    """A 31-bit hash of the keys and dtypes (and the document fields' dtypes and trailing
    shapes), to check that every rank sends the same layout."""
    text = ",".join(f"{k}:{sample[k].dtype}" for k in keys)
    if document_fields:
        text += ";" + specs_text(field_specs(sample, document_fields), document_fields)
    return zlib.crc32(text.encode()) & 0x7FFFFFFF


@dataclass(frozen=True, kw_only=True, slots=True)
class Layout:
    """Who sends which piece to whom: the placement plus where each document starts on its source.

    Documents are numbered in (source rank, position in the sample) order, the order the
    all-gather of lengths produces. Piece ``p`` is part ``part[p]`` of document ``doc[p]``,
    held by rank ``dst[p]``, ``rows[p]`` tokens long.
    """

    placement: Placement
    src: np.ndarray
    offset: np.ndarray
    doc: np.ndarray
    part: np.ndarray
    dst: np.ndarray
    rows: np.ndarray

    @classmethod
    def build(cls, p: Placement, counts: Sequence[int]) -> Layout:
        counts_arr = np.asarray(counts, dtype=np.int64)
        if int(counts_arr.sum()) != p.lengths.size:
            raise ValueError(
                f"counts sum to {int(counts_arr.sum())}, the placement has {p.lengths.size}"
            )
        src = np.repeat(np.arange(counts_arr.size), counts_arr)
        # Offset of each document inside its source's sample: global exclusive cumsum minus
        # the cumsum at the source's first document.
        excl = np.concatenate([[0], np.cumsum(p.lengths)])
        first = np.concatenate([[0], np.cumsum(counts_arr)])[:-1]
        doc, part = piece_numbers(p.cp_size)
        return cls(
            placement=p,
            src=src,
            offset=excl[:-1] - excl[first][src],
            doc=doc,
            part=part,
            dst=p.cp_start[doc] + part,
            rows=(p.padded // p.cp_size)[doc],
        )

    def outgoing(self, rank: int) -> np.ndarray:
        """Pieces this rank sends, in wire order (destination, then document)."""
        sel = np.flatnonzero(self.src[self.doc] == rank)
        return sel[np.lexsort((self.doc[sel], self.dst[sel]))]

    def incoming(self, rank: int) -> np.ndarray:
        """Pieces this rank receives, in wire order (source, then document)."""
        sel = np.flatnonzero(self.dst == rank)
        return sel[np.lexsort((self.doc[sel], self.src[self.doc[sel]]))]

    def send_splits(self, rank: int) -> list[int]:
        out = self.outgoing(rank)
        return self._rows_per_rank(self.dst[out], out)

    def recv_splits(self, rank: int) -> list[int]:
        inc = self.incoming(rank)
        return self._rows_per_rank(self.src[self.doc[inc]], inc)

    def byte_splits(self, rank: int, nbytes: np.ndarray) -> tuple[list[int], list[int]]:
        """What this rank sends to and receives from each rank when every piece carries
        ``nbytes[d]`` bytes of its document ``d`` (its document fields)."""
        out, inc = self.outgoing(rank), self.incoming(rank)
        n = self.placement.num_ranks
        send = np.bincount(self.dst[out], nbytes[self.doc[out]], n)
        recv = np.bincount(self.src[self.doc[inc]], nbytes[self.doc[inc]], n)
        return send.astype(int).tolist(), recv.astype(int).tolist()

    def local_documents(self) -> np.ndarray:
        """Each document's position in its source rank's sample."""
        return np.arange(self.src.size) - np.searchsorted(self.src, self.src)

    def _rows_per_rank(self, ranks: np.ndarray, pieces: np.ndarray) -> list[int]:
        """The rows of ``pieces`` summed per rank (``ranks[i]`` is piece ``i``'s peer)."""
        return np.bincount(ranks, self.rows[pieces], self.placement.num_ranks).astype(int).tolist()


def build_send(
    sample: Mapping[str, Any],
    rank: int,
    layout: Layout,
    keys: Sequence[str] = DEFAULT_KEYS,
    pad: Mapping[str, int | None] = DEFAULT_PAD,
) -> torch.Tensor:
    """One ``(rows, bytes_per_token)`` uint8 buffer: every key of every outgoing piece."""
    p = layout.placement
    index, filler, heads = [], [], []
    for piece in layout.outgoing(rank).tolist():
        d = int(layout.doc[piece])
        pos = zigzag_positions(int(p.padded[d]), int(p.cp_size[d]), int(layout.part[piece]))
        real = pos < p.lengths[d]
        index.append(np.where(real, layout.offset[d] + pos, -1))
        filler.append(pos)
        heads.append(np.full(pos.size, layout.offset[d], dtype=np.int64))
    idx = torch.from_numpy(np.concatenate(index)) if index else torch.zeros(0, dtype=torch.int64)
    pos_in_doc = torch.from_numpy(np.concatenate(filler)) if filler else idx
    doc_head = torch.from_numpy(np.concatenate(heads)) if heads else idx
    is_pad = idx < 0
    safe = idx.clamp(min=0)
    columns = []
    for k in keys:
        t = sample[k]
        v = t[safe] if t.numel() else torch.zeros(idx.shape, dtype=t.dtype)
        if bool(is_pad.any()):
            fill = pad.get(k, 0)
            if fill is None:  # continue the document's positions into its padding
                # the document's own first value: positions need not restart per document
                first = t[doc_head] if t.numel() else 0
                v = torch.where(is_pad, (first + pos_in_doc).to(t.dtype), v)
            else:
                v = v.masked_fill(is_pad, fill)
        columns.append(_as_bytes(v))
    if not columns:
        return torch.zeros((idx.numel(), 0), dtype=torch.uint8)
    return torch.cat(columns, dim=1)


def unpack(
    recv: torch.Tensor,
    rank: int,
    layout: Layout,
    dtypes: Sequence[torch.dtype],
    keys: Sequence[str] = DEFAULT_KEYS,
) -> list[dict[str, Any]]:
    """This rank's micro-steps from the received buffer, each with its ``cu_seqlens``."""
    p = layout.placement
    inc = layout.incoming(rank)
    starts = np.concatenate([[0], np.cumsum(layout.rows[inc])])
    where = {
        int(layout.doc[q]): (int(starts[j]), int(layout.rows[q]), int(layout.part[q]))
        for j, q in enumerate(inc.tolist())
    }
    steps = []
    for k, step in enumerate(p.microsteps[rank]):
        docs = [d for d, _ in step]
        spans = [where[d] for d in docs]
        rows = torch.from_numpy(ranges([a for a, _, _ in spans], [n for _, n, _ in spans]))
        out: dict[str, Any] = _unfuse(recv[rows], keys, dtypes)
        lengths = [n for _, n, _ in spans]
        out["cu_seqlens"] = torch.tensor(
            np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32
        )
        out["doc_ids"] = torch.tensor(docs, dtype=torch.int64)
        group = step[0][1] if step else (rank,)
        out["cp_group"] = group
        out["cp_rank"] = spans[0][2] if step and len(group) > 1 else 0
        out["microstep"], out["num_microsteps"] = k, p.num_microsteps
        steps.append(out)
    return steps


def route_local(
    samples: Sequence[Mapping[str, Any]],
    *,
    keys: Sequence[str] = DEFAULT_KEYS,
    pad: Mapping[str, int | None] = DEFAULT_PAD,
    document_fields: Sequence[str] = (),
    **plan_kwargs: Any,
) -> tuple[Placement, list[list[dict[str, Any]]]]:
    """Run the whole reroute for every rank in one process (tests, simulation, the CLI).

    ``samples[r]`` is rank r's packed sample; ``plan_kwargs`` go to :func:`schedule_documents` (its
    ``num_ranks`` is ``len(samples)``); ``document_fields`` travel with their documents as in
    :class:`~meshfeed.balance.BalancedBatches`. Returns the placement and every rank's micro-steps.
    """
    samples = [normalize_fields(s, document_fields, doc_lengths(s, keys).size) for s in samples]
    counts, lengths = _local_lengths(samples, keys, document_fields)
    p = schedule_documents(lengths, num_ranks=len(samples), **plan_kwargs)
    layout = Layout.build(p, counts)
    sends = [build_send(s, r, layout, keys, pad) for r, s in enumerate(samples)]
    dtypes = [samples[0][k].dtype for k in keys] if samples else []
    token_splits = [layout.send_splits(s) for s in range(len(samples))]
    out = [
        unpack(_received(sends, token_splits, r), r, layout, dtypes, keys)
        for r in range(len(samples))
    ]
    if document_fields:
        rows = np.concatenate(
            [field_rows(s, document_fields, n) for s, n in zip(samples, counts, strict=True)]
        )
        specs = field_specs(samples[0], document_fields)
        nbytes = document_bytes(rows, specs)
        field_sends = [
            build_field_send(s, document_fields, layout, r, rows, specs)
            for r, s in enumerate(samples)
        ]
        splits = [layout.byte_splits(s, nbytes)[0] for s in range(len(samples))]
        for r, steps in enumerate(out):
            recv = _received(field_sends, splits, r)
            unpack_fields(recv, layout, r, steps, document_fields, specs, rows)
    ids = _local_document_ids(samples)
    if ids is not None:
        for steps in out:
            for step in steps:
                step[DOCUMENT_IDS] = ids[step["doc_ids"]]
    return p, out


def _received(
    sends: Sequence[torch.Tensor], splits: Sequence[Sequence[int]], r: int
) -> torch.Tensor:
    """What rank ``r`` receives when rank ``s`` sends ``splits[s][r]`` rows of ``sends[s]`` to it."""
    parts = []
    for s, send in enumerate(sends):
        lo = sum(splits[s][:r])
        parts.append(send[lo : lo + splits[s][r]])
    return torch.cat(parts)


def _local_lengths(
    samples: Sequence[Mapping[str, Any]], keys: Sequence[str], document_fields: Sequence[str] = ()
) -> tuple[list[int], np.ndarray]:
    """Every rank's document count, and all ranks' document lengths in rank order; raises
    when the ranks' packed keys (or document fields) differ in dtype."""
    per_rank = [doc_lengths(s, keys) for s in samples]
    signatures = {fields_signature(s, keys, document_fields) for s in samples}
    if len(signatures) > 1:
        raise ValueError(
            "ranks disagree on the dtypes of the packed keys"
            + (
                f" or of document fields {list(document_fields)} and their row shapes"
                if document_fields
                else ""
            )
            + "; cast them the same"
        )
    lengths = np.concatenate(per_rank) if per_rank else np.zeros(0, dtype=np.int64)
    return [x.size for x in per_rank], lengths


def _local_document_ids(samples: Sequence[Mapping[str, Any]]) -> torch.Tensor | None:
    """All ranks' document ids in rank order, where every rank's sample has them."""
    if samples and all(DOCUMENT_IDS in s for s in samples):
        return torch.cat([torch.as_tensor(s[DOCUMENT_IDS]).long() for s in samples])
    return None


def _unfuse(
    rows: torch.Tensor, keys: Sequence[str], dtypes: Sequence[torch.dtype]
) -> dict[str, torch.Tensor]:
    """Each key's tensor from fused uint8 rows: the keys' bytes side by side (:func:`_as_bytes`)."""
    out, lo = {}, 0
    for key, dt in zip(keys, dtypes, strict=True):
        # clone: a fresh buffer at offset 0, so the byte view can widen to any dtype
        out[key] = rows[:, lo : lo + dt.itemsize].reshape(-1).clone().view(dt)
        lo += dt.itemsize
    return out


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as ``(elements, element size)`` rows (:func:`byte_view`)."""
    return byte_view(t).reshape(t.numel(), t.element_size())
