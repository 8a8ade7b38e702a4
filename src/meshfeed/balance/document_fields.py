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
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from meshfeed.balance.routing import Layout

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


def normalize_fields(
    sample: Mapping[str, Any], names: Sequence[str], documents: int
) -> Mapping[str, Any]:
    """``sample`` with each field a tensor and its offsets int64 (one per document of
    ``cu_seqlens``, plus one), checked: ValueError naming the field and the fix otherwise.

    What every later step reads (the split of long documents, the header, the send), so a
    bad field is refused here, on its rank, before any collective that could wait for it."""
    if not names:
        return sample
    out = dict(sample)
    for name in names:
        value = _field(sample, name)
        offsets = sample.get(name + OFFSETS)
        if offsets is None:
            raise ValueError(
                f"the packed sample has {name!r} but no {name + OFFSETS!r}; a document field is "
                f"its documents' rows back to back plus {name + OFFSETS!r} (SampleFields("
                f"concat_fields=({name!r},)) and merge_rows give both)"
            )
        off = torch.as_tensor(np.asarray(offsets) if isinstance(offsets, list) else offsets)
        if (
            off.ndim != 1
            or off.dtype.is_floating_point
            or off.dtype.is_complex
            or off.dtype == torch.bool
        ):
            raise ValueError(
                f"sample[{name + OFFSETS!r}] must be a 1-D tensor of integers (got "
                f"{off.dtype} of shape {tuple(off.shape)}): where each document's rows of "
                f"{name!r} start, then their end"
            )
        off_np = off.cpu().numpy().astype(np.int64)
        rows = int(value.shape[0])
        if (
            off_np.size != documents + 1
            or off_np[0] != 0
            or off_np[-1] != rows
            or np.any(np.diff(off_np) < 0)
        ):
            raise ValueError(
                f"sample[{name + OFFSETS!r}] must rise from 0 to {name!r}'s {rows} rows in "
                f"{documents + 1} steps, one per document of cu_seqlens (got "
                f"{off_np.tolist()[:8]}{'...' if off_np.size > 8 else ''})"
            )
        out[name], out[name + OFFSETS] = value, torch.from_numpy(off_np)
    return out


def field_rows(sample: Mapping[str, Any], names: Sequence[str], documents: int) -> np.ndarray:
    """The rows each of ``documents`` documents holds of each field: int64 ``(documents, F)``
    (of a sample :func:`normalize_fields` checked)."""
    out = np.zeros((documents, len(names)), dtype=np.int64)
    for j, name in enumerate(names):
        out[:, j] = np.diff(_offsets(sample, name))
    return out


def _offsets(sample: Mapping[str, Any], name: str) -> np.ndarray:
    return np.asarray(sample[name + OFFSETS], dtype=np.int64)


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


def split_fields(sample: dict[str, Any], names: Sequence[str], doc: np.ndarray) -> None:
    """Give each piece ``p`` of a split document ``doc[p]`` all of that document's rows (of a
    sample :func:`normalize_fields` checked)."""
    for name in names:
        off = _offsets(sample, name)
        rows = np.diff(off)[doc]
        index = torch.from_numpy(ranges(off[doc], rows))
        sample[name] = torch.as_tensor(sample[name])[index]
        sample[name + OFFSETS] = torch.from_numpy(np.append(0, np.cumsum(rows)).astype(np.int64))


def document_bytes(rows: np.ndarray, specs: Sequence[tuple[torch.dtype, tuple[int, ...]]]) -> Any:
    """Bytes each document's fields take on the wire: ``rows`` (documents, F) times row size."""
    return rows @ _row_bytes(specs) if rows.size else np.zeros(rows.shape[0], dtype=np.int64)


def _row_bytes(specs: Sequence[tuple[torch.dtype, tuple[int, ...]]]) -> np.ndarray:
    return np.asarray([d.itemsize * math.prod(s) for d, s in specs], dtype=np.int64)


def ranges(starts: Any, counts: Any) -> np.ndarray:
    """``concatenate([arange(a, a + n) for a, n in zip(starts, counts)])``, without the loop."""
    counts = np.asarray(counts, dtype=np.int64)
    total = int(counts.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    first = np.cumsum(counts) - counts
    return np.repeat(np.asarray(starts, dtype=np.int64) - first, counts) + np.arange(total)


def _runs(ranks: np.ndarray) -> list[tuple[int, int]]:
    """``(first, stop)`` of each run of equal values of ``ranks`` (sorted): the pieces of a
    wire-ordered buffer that go to (or come from) one peer."""
    cut = (np.flatnonzero(np.diff(ranks)) + 1).tolist()
    return list(zip([0, *cut], [*cut, ranks.size], strict=True)) if ranks.size else []


def build_field_send(
    sample: Mapping[str, Any],
    names: Sequence[str],
    layout: Layout,
    rank: int,
    rows: np.ndarray,
    specs: Sequence[tuple[torch.dtype, tuple[int, ...]]],
) -> torch.Tensor:
    """``(bytes, 1)`` uint8: for each destination rank in turn, each field's rows of the
    documents of the pieces it receives from this rank (in their wire order).

    ``rows`` holds every document's rows per field (global numbering, :func:`field_rows`
    of every rank's sample)."""
    out = layout.outgoing(rank)
    docs, dst = layout.doc[out], layout.dst[out]
    local = layout.local_documents()[docs]
    row_bytes = _row_bytes(specs)
    per_field = []  # each field's bytes for every outgoing piece, and where each piece's end
    for j, name in enumerate(names):
        index = torch.from_numpy(ranges(_offsets(sample, name)[local], rows[docs, j]))
        edge = np.concatenate([[0], np.cumsum(rows[docs, j] * row_bytes[j])])
        per_field.append((byte_view(torch.as_tensor(sample[name])[index]), edge))
    parts = [data[edge[a] : edge[b]] for a, b in _runs(dst) for data, edge in per_field]
    if not parts:
        return torch.zeros((0, 1), dtype=torch.uint8)
    return torch.cat(parts).reshape(-1, 1)


def unpack_fields(
    recv: torch.Tensor,
    layout: Layout,
    rank: int,
    steps: Sequence[dict[str, Any]],
    names: Sequence[str],
    specs: Sequence[tuple[torch.dtype, tuple[int, ...]]],
    rows: np.ndarray,
) -> None:
    """Add each field and its offsets to this rank's micro-steps from the received bytes
    (:func:`build_field_send`'s layout, from every source rank in turn)."""
    inc = layout.incoming(rank)
    docs, src = layout.doc[inc], layout.src[layout.doc[inc]]
    row_bytes = _row_bytes(specs)
    flat = recv.reshape(-1)
    pieces: list[list[torch.Tensor]] = [[] for _ in names]
    pos = 0
    for a, b in _runs(src):  # from each source rank: each field's rows of its pieces
        for j in range(len(names)):
            nbytes = int(rows[docs[a:b], j].sum() * row_bytes[j])
            pieces[j].append(flat[pos : pos + nbytes])
            pos += nbytes
    where = np.full(rows.shape[0], -1, dtype=np.int64)
    where[docs] = np.arange(docs.size)
    for j, (name, (dtype, shape)) in enumerate(zip(names, specs, strict=True)):
        # cat: a fresh buffer at offset 0, so the byte view can widen to any dtype
        data = torch.cat([*pieces[j], torch.zeros(0, dtype=torch.uint8)])
        held = rows[docs, j]
        table = data.view(dtype).reshape(int(held.sum()), *shape)
        start = np.cumsum(held) - held  # each received piece's first row
        for step in steps:
            mine = step["doc_ids"].numpy()
            counts = rows[mine, j]
            step[name] = table[torch.from_numpy(ranges(start[where[mine]], counts))]
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
    if t.ndim != 1:
        raise ValueError(
            f"tokens must be a packed sample's 1-D token ids (got shape {tuple(t.shape)})"
        )
    ids = torch.from_numpy(np.asarray(token_id, dtype=np.int64).reshape(-1))  # one or several
    hit = torch.isin(t.to(torch.int64), ids).to(torch.int64)
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


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes, 1-D (a fresh copy where its memory is not one dense run; bool as
    uint8)."""
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    flat = t.reshape(-1)
    if flat.numel() and flat.stride(0) != 1:  # e.g. one element of a strided view
        flat = flat.clone(memory_format=torch.contiguous_format)
    return flat.view(torch.uint8)
