"""Any sample, packed: per-token fields concatenated, per-sample tensors carried with offsets.

A sample is a mapping of fields. :class:`SampleFields` names them: ``token_fields`` have one
entry per token along their first dimension (``input_ids``, ``labels``, ``loss_mask``, any
other) and are concatenated; ``sample_fields`` (an image's ``pixel_values``, its grid size)
travel as one list entry per sample; ``concat_fields`` are concatenated along their first
dimension and get ``<name>_offsets`` (int64, one more than the samples) saying where each
sample's part starts. :func:`pack_samples` builds one packed row; :func:`merge_rows` joins
rows into the one packed sample a step of :class:`~meshfeed.balance.BalancedBatches` takes.

>>> import torch
>>> row = pack_samples([{"input_ids": torch.tensor([1, 2, 3]), "labels": torch.tensor([-100, 2, 3])},
...                     {"input_ids": torch.tensor([4, 5]), "labels": torch.tensor([-100, 5])}],
...                    SampleFields(token_fields=("input_ids", "labels")))
>>> row["cu_seqlens"].tolist(), row["position_ids"].tolist()
([0, 3, 5], [0, 1, 2, 0, 1])
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from meshfeed.keys import DOCUMENT_IDS

__all__ = ["PackCollate", "SampleFields", "merge_rows", "pack_samples"]

POSITION_IDS = "position_ids"
CU_SEQLENS = "cu_seqlens"
_OFFSETS = "_offsets"


@dataclass(frozen=True, kw_only=True, slots=True)
class SampleFields:
    """Which fields of a sample are per token, and which per sample (see the module doc).

    The first token field counts the sample's tokens; every token field must have that many
    rows. ``position_ids`` is made (restarting at 0 per sample) unless it is a token field.
    """

    token_fields: tuple[str, ...] = ("input_ids", "labels")
    sample_fields: tuple[str, ...] = ()
    concat_fields: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("token_fields", "sample_fields", "concat_fields"):
            value = getattr(self, name)
            if isinstance(value, str) or not all(isinstance(v, str) for v in value):
                raise TypeError(
                    f"SampleFields.{name} must be a tuple of field names (got {value!r}); "
                    f'e.g. {name}=("{value if isinstance(value, str) else "input_ids"}",)'
                )
            object.__setattr__(self, name, tuple(value))
        if not self.token_fields:
            raise ValueError("SampleFields.token_fields is empty; name the per-token fields")
        names = self.token_fields + self.sample_fields + self.concat_fields
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"fields {twice} are named more than once in SampleFields")
        reserved = {CU_SEQLENS, DOCUMENT_IDS} & set(names)
        reserved |= {POSITION_IDS} & set(self.sample_fields + self.concat_fields)
        if reserved:
            raise ValueError(
                f"fields {sorted(reserved)} are written by packing; rename them "
                "(position_ids may be a token field, taken as given)"
            )
        offsets = sorted({f"{c}_offsets" for c in self.concat_fields} & set(names))
        if offsets:
            raise ValueError(
                f"fields {offsets} are written by packing (the offsets of concat field(s) "
                f"{[n[: -len('_offsets')] for n in offsets]}); rename them"
            )
        # merge_rows joins "<name>_offsets" as offsets wherever a row also holds "<name>", so
        # no field may be named after another key of a packed row plus "_offsets".
        keys = set(names) | {POSITION_IDS, CU_SEQLENS, DOCUMENT_IDS}
        keys |= {f"{c}_offsets" for c in self.concat_fields}
        clash = sorted(n for n in names if n.endswith(_OFFSETS) and n[: -len(_OFFSETS)] in keys)
        if clash:
            raise ValueError(
                f"fields {clash} are named as the offsets of {[n[: -len(_OFFSETS)] for n in clash]}"
                " (a field or key of the packed row), so merge_rows would join them as a concat "
                f"field's offsets; rename them, e.g. {clash[0][: -len(_OFFSETS)] + '_starts'!r}"
            )

    @property
    def carried(self) -> bool:
        """Whether samples carry per-sample tensors (which cannot be cut into pieces)."""
        return bool(self.sample_fields or self.concat_fields)

    def as_mapping(self, sample: Any, index: int) -> Mapping[str, Any]:
        """``sample`` as a mapping of fields: a bare 1-D array or tensor (a token corpus's
        document) is the one token field, as int64 (what ``pack_documents`` gives), when only
        one is named."""
        if isinstance(sample, Mapping):
            return sample
        one = len(self.token_fields) == 1 and not self.carried
        if one and isinstance(sample, np.ndarray) and sample.ndim == 1:
            return {self.token_fields[0]: sample.astype(np.int64)}
        if one and isinstance(sample, torch.Tensor) and sample.ndim == 1:
            return {self.token_fields[0]: sample.to(torch.int64)}
        raise TypeError(
            f"sample {index} is a {type(sample).__name__}, not a mapping of fields; "
            f"return a dict with the token fields {list(self.token_fields)}"
        )

    def length(self, sample: Any, index: int) -> int:
        """Tokens of ``sample`` (dataset index ``index``), after checking every field by name."""
        sample = self.as_mapping(sample, index)
        missing = [
            n
            for n in self.token_fields + self.sample_fields + self.concat_fields
            if n not in sample
        ]
        if missing:
            raise KeyError(
                f"sample {index} has no field {missing[0]!r} (it has {sorted(sample)}); "
                "give every sample every field named in SampleFields"
            )
        sizes = {n: _rows(sample[n], n, index) for n in self.token_fields}
        if len(set(sizes.values())) > 1:
            raise ValueError(
                f"sample {index} has fields of unequal length {sizes}; every token field "
                "needs one entry per token"
            )
        return sizes[self.token_fields[0]]


def _rows(value: Any, name: str, index: int) -> int:
    shape = getattr(value, "shape", None)
    if shape is None:
        try:
            return len(value)
        except TypeError:
            raise TypeError(
                f"sample {index}'s field {name!r} is a {type(value).__name__} without a "
                "length; give per-token fields as tensors, arrays or lists"
            ) from None
    if len(shape) == 0:
        raise ValueError(f"sample {index}'s field {name!r} is a scalar; it needs one row per token")
    return int(shape[0])


def _tensor(value: Any) -> torch.Tensor:
    return value if isinstance(value, torch.Tensor) else torch.as_tensor(np.asarray(value))


def pack_samples(
    samples: Sequence[Mapping[str, Any]],
    fields: SampleFields,
    *,
    ids: Sequence[int] | None = None,
    spans: Sequence[tuple[int, int]] | None = None,
) -> dict[str, Any]:
    """One packed row of ``samples``: token fields concatenated, ``cu_seqlens``, ``position_ids``.

    ``ids`` (the samples' dataset indices) become ``document_ids`` and name a bad sample in
    errors (without them: no ``document_ids``, and the sample's place in the list is named).
    ``spans`` takes tokens ``[start, stop)`` of each sample (a piece of a split sample; its
    position ids keep counting from ``start``). Per-sample fields follow the module doc. Every
    field is checked first: a missing or short field is an error naming the sample.
    """
    named = list(range(len(samples))) if ids is None else [int(i) for i in ids]
    samples = [fields.as_mapping(s, i) for s, i in zip(samples, named, strict=True)]
    lengths = [fields.length(s, i) for s, i in zip(samples, named, strict=True)]
    if spans is None:
        spans = [(0, n) for n in lengths]
    return assemble(samples, fields, ids=ids, spans=spans)


def assemble(
    samples: Sequence[Mapping[str, Any]],
    fields: SampleFields,
    *,
    ids: Sequence[int] | None,
    spans: Sequence[tuple[int, int]],
) -> dict[str, Any]:
    """:func:`pack_samples` of samples already checked (``fields.length``), spans given."""
    sizes = np.asarray([b - a for a, b in spans], dtype=np.int64)
    cu = np.zeros(len(samples) + 1, np.int64)
    np.cumsum(sizes, out=cu[1:])
    out: dict[str, Any] = {}
    for name in fields.token_fields:
        parts = [s[name][a:b] for s, (a, b) in zip(samples, spans, strict=True)]
        out[name] = _join_field(name, parts, ids, "token")
    if POSITION_IDS not in out:
        starts = np.asarray([a for a, _ in spans], dtype=np.int64)
        pos = np.arange(int(cu[-1]), dtype=np.int64) - np.repeat(cu[:-1] - starts, sizes)
        out[POSITION_IDS] = torch.from_numpy(pos)
    out[CU_SEQLENS] = torch.from_numpy(cu.astype(np.int32))
    if ids is not None:
        out[DOCUMENT_IDS] = torch.from_numpy(np.asarray(ids, dtype=np.int64))
    for name in fields.sample_fields:
        out[name] = [s[name] for s in samples]
    for name in fields.concat_fields:
        parts = [_tensor(s[name]) for s in samples]
        offsets = np.zeros(len(parts) + 1, np.int64)
        np.cumsum([int(p.shape[0]) if p.ndim else 1 for p in parts], out=offsets[1:])
        out[name] = _join_field(name, [p.reshape(-1, *p.shape[1:]) for p in parts], ids, "concat")
        out[f"{name}{_OFFSETS}"] = torch.from_numpy(offsets)
    return out


def _concat(parts: list[Any]) -> torch.Tensor:
    """One tensor of ``parts`` (numpy arrays join in numpy: no tensor per part)."""
    if not parts:
        return torch.zeros(0, dtype=torch.int64)
    if all(isinstance(p, np.ndarray) for p in parts):
        return torch.from_numpy(np.concatenate(parts))
    return torch.cat([_tensor(p) for p in parts])


def _join_field(name: str, parts: list[Any], ids: Sequence[int] | None, kind: str) -> torch.Tensor:
    """:func:`_concat` of field ``name``'s parts; parts whose shapes past the first dimension
    differ are an error naming the field and the samples (looked at only once joining fails)."""
    try:
        return _concat(parts)
    except (RuntimeError, ValueError):
        shapes = [tuple(getattr(p, "shape", ())) for p in parts]
        if len({s[1:] for s in shapes}) < 2:
            raise
        named = list(range(len(parts))) if ids is None else [int(i) for i in ids]
        first: dict[tuple[int, ...], tuple[int, tuple[int, ...]]] = {}
        for i, shape in zip(named, shapes, strict=True):
            first.setdefault(shape[1:], (i, shape))
        seen = ", ".join(f"sample {i} has shape {shape}" for i, shape in list(first.values())[:4])
        fix = "" if kind == "token" else ", or carry it as a list with sample_fields=..."
        raise ValueError(
            f"{kind} field {name!r} cannot be concatenated: its shape past the first dimension "
            f"differs across the samples ({seen}); give every sample's {name!r} the same "
            f"trailing shape (pad or reshape it in the dataset){fix}"
        ) from None


@runtime_checkable
class ColumnBatch(Protocol):
    """A batch handed out as columns, one entry per sample (the sample store's ``Batch``)."""

    @property
    def columns(self) -> Mapping[str, Any]: ...

    def __len__(self) -> int: ...


@dataclass(frozen=True, slots=True)
class PackCollate:
    """A loader's collate that packs a step's samples into one packed sample (picklable).

    For streams, the sample store (its batches of columns) and any loader whose samples have
    no lengths up front: the step's samples are the window, so the loader's state is the
    packing's state too. The packed sample is what :class:`~meshfeed.balance.BalancedBatches`
    takes; it plans micro-steps of ``max_tokens`` with equal counts on every rank.

    A step holds at least one sample (meshfeed's loaders and the store's samplers never hand a
    rank an empty batch): an empty one is a mistake of the caller and raises ``ValueError``.
    """

    fields: SampleFields = SampleFields()

    def __call__(self, samples: Sequence[Mapping[str, Any]] | ColumnBatch) -> dict[str, Any]:
        if len(samples) == 0:
            raise ValueError(
                f"PackCollate got no samples (an empty {type(samples).__name__}); call it with "
                "a step's samples, at least one: a list of sample mappings, or a sample "
                "store's Batch (meshfeed's loaders never hand a rank an empty batch)"
            )
        if isinstance(samples, ColumnBatch):
            columns = samples.columns
            samples = [{k: col[i] for k, col in columns.items()} for i in range(len(samples))]
        return pack_samples(samples, self.fields)


def merge_rows(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Packed rows joined into one packed sample (a collate for a loader of packed rows).

    Per-token tensors and ``document_ids`` are concatenated, ``cu_seqlens`` shifted and joined,
    lists extended, ``<name>_offsets`` shifted and joined with their ``<name>`` tensors (a
    concat field's offsets: only where the rows also hold ``<name>``; any other field whose
    name ends in ``_offsets`` is a field like the rest, and :class:`SampleFields` refuses a
    field named ``<name>_offsets`` beside a field or packing key ``<name>``, so the rows
    :func:`pack_samples` and :class:`~meshfeed.balance.PackedSamples` make are never misread).
    One row comes back as it is. This is what :class:`~meshfeed.balance.BalancedBatches` takes
    (per-token fields as ``keys=``, concat fields as ``document_fields=``, which travel with
    their documents; it refuses list fields, which it cannot route across ranks).
    """
    if len(rows) == 1:
        return dict(rows[0])
    if not rows:
        raise ValueError("merge_rows got no rows; a loader step holds at least one")
    out: dict[str, Any] = {}
    first_row = rows[0]
    for key, first in first_row.items():
        values = [r[key] for r in rows]
        if key == CU_SEQLENS or (key.endswith("_offsets") and key[: -len("_offsets")] in first_row):
            out[key] = _join_offsets([torch.as_tensor(v) for v in values])
        elif isinstance(first, list):
            out[key] = [x for v in values for x in v]
        else:
            out[key] = torch.cat([torch.as_tensor(v) for v in values])
    return out


def _join_offsets(parts: list[torch.Tensor]) -> torch.Tensor:
    shift, pieces = 0, [parts[0][:1]]
    for p in parts:
        pieces.append(p[1:] + shift)
        shift += int(p[-1])
    return torch.cat(pieces).to(parts[0].dtype)
