"""Per-document fields (an image's ``pixel_values``, its grid size) that travel with their document.

A packed sample holds, besides its per-token keys, fields of rows per document: ``<name>`` is the
documents' rows back to back (any dtype, any trailing shape) and ``<name>_offsets`` (one more
than the documents) says where each document's rows start, the layout
:class:`~meshfeed.balance.SampleFields` ``concat_fields`` and :func:`merge_rows` give.
:class:`~meshfeed.balance.BalancedBatches` (``document_fields=``) moves them with their document:
every rank that holds a piece of a document (each rank of its CP group, each piece of a split
one) receives **all** of that document's rows, since an image encoder needs whole images whose
placeholder tokens a CP split may cut. Each micro-step then holds ``<name>`` for its documents
in ``doc_ids`` order, and ``<name>_offsets`` aligned with ``cu_seqlens``.

The functions here are pure (no collectives): :func:`field_rows` validates a sample's fields and
counts their rows per document, :func:`split_fields` repeats a split document's rows for each of
its pieces, :func:`build_field_send` / :func:`unpack_fields` are the bytes of the one extra
``all_to_all_single``. :func:`placeholder_ordinals` gives the per-token key that tells a rank
holding a CP chunk which of its document's placeholders each token is.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

__all__ = ["field_rows", "placeholder_ordinals"]

OFFSETS = "_offsets"
#: Names a micro-step already uses: a document field may not take them.
_RESERVED = frozenset(
    {"cu_seqlens", "doc_ids", "document_ids", "cp_group", "cp_rank", "microstep", "num_microsteps"}
)


def check_field_names(fields: Any, keys: Sequence[str]) -> tuple[str, ...]:
    """``fields`` as a tuple of names, or ValueError naming the clash and the fix."""
    if isinstance(fields, str) or not isinstance(fields, Sequence):
        raise ValueError(
            f"document_fields must be a sequence of field names (got {fields!r}); e.g. "
            "document_fields=('pixel_values', 'image_grid_thw')"
        )
    names = tuple(fields)
    bad = [n for n in names if not isinstance(n, str) or not n]
    if bad:
        raise ValueError(f"document_fields must be non-empty strings (got {bad!r})")
    if len(set(names)) != len(names):
        raise ValueError(f"document_fields names a field twice ({list(names)})")
    taken = sorted(
        {n for n in names if n in keys or n in _RESERVED}
        | {n + OFFSETS for n in names if n + OFFSETS in keys or n + OFFSETS in names}
    )
    if taken:
        raise ValueError(
            f"document_fields {taken} clash with the per-token keys (keys={list(keys)}) or a "
            f"name a micro-step uses ({sorted(_RESERVED)}); a field is per token (keys=) or per "
            "document (document_fields=), and '<name>_offsets' belongs to field <name>"
        )
    return names


def field_rows(sample: Mapping[str, Any], names: Sequence[str], documents: int) -> np.ndarray:
    """The rows each of ``documents`` documents holds of each field: int64 ``(documents, F)``.

    Raises ValueError naming the field and the fix where the sample lacks a field or its
    offsets, or where the offsets do not rise from 0 to the field's rows, one per document."""
    out = np.zeros((documents, len(names)), dtype=np.int64)
    for j, name in enumerate(names):
        value, offsets = _field(sample, name), sample.get(name + OFFSETS)
        if offsets is None:
            raise ValueError(
                f"the packed sample has {name!r} but no {name + OFFSETS!r}; a document field is "
                f"its documents' rows back to back plus {name + OFFSETS!r} (SampleFields("
                f"concat_fields=({name!r},)) and merge_rows give both)"
            )
        off = np.asarray(torch.as_tensor(offsets).cpu(), dtype=np.int64).ravel()
        rows = int(value.shape[0])
        if off.size != documents + 1 or off[0] != 0 or off[-1] != rows or np.any(np.diff(off) < 0):
            raise ValueError(
                f"sample[{name + OFFSETS!r}] must rise from 0 to {name!r}'s {rows} rows in "
                f"{documents + 1} steps, one per document of cu_seqlens (got "
                f"{off.tolist()[:8]}{'...' if off.size > 8 else ''})"
            )
        out[:, j] = np.diff(off)
    return out


def _field(sample: Mapping[str, Any], name: str) -> torch.Tensor:
    if name not in sample:
        raise ValueError(
            f"document_fields names {name!r}, which the packed sample lacks (it has "
            f"{sorted(map(str, sample))}); every rank's sample must carry every document field, "
            "with 0 rows where its documents have none"
        )
    value = sample[name]
    if isinstance(value, list):
        raise ValueError(
            f"sample[{name!r}] is a list (a SampleFields sample_fields field); BalancedBatches "
            f"routes document fields as one tensor plus {name + OFFSETS!r}: pack it with "
            f"SampleFields(concat_fields=({name!r},))"
        )
    t = torch.as_tensor(value)
    if t.ndim == 0:
        raise ValueError(f"sample[{name!r}] is a scalar; a document field has a row per item")
    return t


def field_specs(
    sample: Mapping[str, Any], names: Sequence[str]
) -> list[tuple[torch.dtype, tuple[int, ...]]]:
    """Each field's dtype and trailing shape (what every rank's rows must share)."""
    return [(t.dtype, tuple(t.shape[1:])) for t in (_field(sample, n) for n in names)]


def specs_text(specs: Sequence[tuple[torch.dtype, tuple[int, ...]]], names: Sequence[str]) -> str:
    """The fields' dtypes and trailing shapes, for the ranks' layout signature."""
    return ",".join(f"{n}:{d}:{list(s)}" for n, (d, s) in zip(names, specs, strict=True))


def split_fields(
    sample: dict[str, Any], names: Sequence[str], doc: np.ndarray, documents: int
) -> None:
    """Give each piece ``p`` of a split document ``doc[p]`` all of that document's rows."""
    for name in names:
        value = _field(sample, name)
        off = np.asarray(torch.as_tensor(sample[name + OFFSETS]).cpu(), dtype=np.int64).ravel()
        if off.size != documents + 1:
            return  # field_rows names the mismatch when the header is built
        rows = np.diff(off)[doc]
        spans = [np.arange(off[d], off[d + 1]) for d in doc.tolist()]
        index = np.concatenate(spans) if spans else np.zeros(0, dtype=np.int64)
        sample[name] = value[torch.from_numpy(index.astype(np.int64))]
        sample[name + OFFSETS] = torch.from_numpy(np.append(0, np.cumsum(rows)).astype(np.int64))


def document_bytes(rows: np.ndarray, specs: Sequence[tuple[torch.dtype, tuple[int, ...]]]) -> Any:
    """Bytes each document's fields take on the wire: ``rows`` (documents, F) times row size."""
    size = np.asarray([d.itemsize * math.prod(s) for d, s in specs], dtype=np.int64)
    return rows @ size if rows.size else np.zeros(rows.shape[0], dtype=np.int64)


def build_field_send(
    sample: Mapping[str, Any],
    names: Sequence[str],
    pieces: np.ndarray,
    local_doc: np.ndarray,
) -> torch.Tensor:
    """``(bytes, 1)`` uint8: each outgoing piece's document fields, in wire order.

    ``pieces`` are the outgoing pieces' documents (global numbers) and ``local_doc`` maps a
    global document to its position in this rank's sample."""
    parts: list[torch.Tensor] = []
    offsets = {n: torch.as_tensor(sample[n + OFFSETS]).tolist() for n in names}
    for d in pieces.tolist():
        i = int(local_doc[d])
        for n in names:
            a, b = offsets[n][i], offsets[n][i + 1]
            if b > a:
                parts.append(_as_bytes(torch.as_tensor(sample[n])[a:b]))
    if not parts:
        return torch.zeros((0, 1), dtype=torch.uint8)
    return torch.cat(parts).reshape(-1, 1)


def unpack_fields(
    recv: torch.Tensor,
    incoming: np.ndarray,
    steps: Sequence[dict[str, Any]],
    names: Sequence[str],
    specs: Sequence[tuple[torch.dtype, tuple[int, ...]]],
    rows: np.ndarray,
) -> None:
    """Add each field and its offsets to this rank's micro-steps from the received bytes.

    ``incoming`` are the received pieces' documents in wire order, ``rows`` every document's
    rows per field (global numbering)."""
    flat = recv.reshape(-1)
    sizes = document_bytes(rows[incoming], specs)
    starts = np.concatenate([[0], np.cumsum(sizes)])
    where = {int(d): int(starts[j]) for j, d in enumerate(incoming.tolist())}
    for step in steps:
        docs = step["doc_ids"].tolist()
        for j, (name, (dtype, shape)) in enumerate(zip(names, specs, strict=True)):
            chunks = []
            for d in docs:
                lo = where[d] + int(document_bytes(rows[d : d + 1, :j], specs[:j])[0])
                n = int(rows[d, j])
                nbytes = n * dtype.itemsize * math.prod(shape)
                # clone: a fresh buffer at offset 0, so the byte view can widen to any dtype
                chunks.append(flat[lo : lo + nbytes].clone().view(dtype).reshape(n, *shape))
            step[name] = torch.cat(chunks) if chunks else torch.zeros((0, *shape), dtype=dtype)
            counts = rows[docs, j] if docs else np.zeros(0, dtype=np.int64)
            step[name + OFFSETS] = torch.from_numpy(
                np.append(0, np.cumsum(counts)).astype(np.int64)
            )


def placeholder_ordinals(
    tokens: torch.Tensor, cu_seqlens: Any, token_id: int | Sequence[int]
) -> torch.Tensor:
    """Per token: which placeholder of its document it is (0, 1, ...), or -1 for other tokens.

    Add it as a per-token key before balancing (``keys=(..., "image_index")``, pad -1): a rank
    holding zigzag chunks of a document then finds the encoder output row of each of its
    placeholder tokens among the document's rows (``<name>_offsets``), which it receives whole.

    >>> placeholder_ordinals(torch.tensor([9, 5, 9, 9, 5, 9]), [0, 3, 6], 9).tolist()
    [0, -1, 1, 0, -1, 1]
    """
    t = torch.as_tensor(tokens)
    ids = [token_id] if isinstance(token_id, int) else list(token_id)
    hit = torch.isin(t, torch.as_tensor(ids, dtype=t.dtype)).to(torch.int64)
    cu = torch.as_tensor(cu_seqlens, dtype=torch.int64).ravel()
    if cu.numel() == 0 or cu[0] != 0 or cu[-1] != t.numel() or bool((torch.diff(cu) < 0).any()):
        raise ValueError(
            f"cu_seqlens must rise from 0 to the {t.numel()} tokens (got {cu.tolist()[:8]}"
            f"{'...' if cu.numel() > 8 else ''}); pass the packed sample's own cu_seqlens"
        )
    running = torch.cumsum(hit, 0)
    before = torch.cat([torch.zeros(1, dtype=torch.int64), running])[cu[:-1]]
    base = torch.repeat_interleave(before, torch.diff(cu), output_size=t.numel())
    return torch.where(hit.bool(), running - base - 1, torch.full_like(running, -1))


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    return t.reshape(-1).view(torch.uint8)
