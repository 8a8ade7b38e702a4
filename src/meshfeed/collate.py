"""Collation, in one place: samples -> a batch (:func:`default_collate`, what loaders use),
variable-length samples -> a padded batch with its attention mask (:func:`pad_collate`), and
one field of many samples -> a column (:func:`collate_column`, what the sample store uses)."""

from __future__ import annotations

import contextlib
import copy
import os
import threading
from collections import UserDict, defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

__all__ = ["PadCollate", "collate_column", "collate_into_slot", "default_collate", "pad_collate"]


class _Slot(threading.local):
    """A worker's reply slot (meshfeed.runtime.worker sets ``take``): where collate_into_slot
    writes the batch's tensors; ``active`` only while it runs, so no other collation sees it.

    None by default on every thread (class attributes): read once or twice per batch, a
    thread-local attribute that is missing would cost an ``AttributeError`` each time."""

    take: Callable[[int], Any] | None = None
    active: Callable[[int], Any] | None = None


_SLOT = _Slot()
#: Tensors smaller than this are stacked as usual (small results travel through the pipe).
_IN_SLOT_MIN = 4096

_PAD_HINT = (
    "pad variable-length items with collate_fn=meshfeed.pad_collate(pad_id=...), or make "
    "them one length in the dataset"
)


def _shape(x: Any) -> tuple[int, ...]:
    return tuple(getattr(x, "shape", ()))


def _mismatch(items: Sequence[Any], path: str) -> ValueError:
    shapes = sorted({_shape(x) for x in items})
    where = f"key {path!r}" if path else "the samples"
    return ValueError(
        f"cannot stack {where}: shapes differ across the batch ({', '.join(map(str, shapes[:4]))}"
        f"{', ...' if len(shapes) > 4 else ''}); {_PAD_HINT}"
    )


def default_collate(items: Sequence[Any]) -> Any:
    """Stack a list of samples into a batch, as ``torch.utils.data.default_collate`` does.

    Tensors are stacked; numpy arrays and numpy scalars become one tensor; Python numbers
    become a 1-D tensor, typed by the first item as in torch: a ``float`` first gives float64,
    an ``int`` first gives ``torch.tensor(items)`` (int64, bool for bools, float32 if floats
    follow). Items of different dtypes (tensors, numpy arrays, numpy scalars) are promoted by
    torch's rules, as in torch (not numpy's). Mappings are collated key by key into the
    mapping's own type (an ``OrderedDict`` stays one; a type that cannot be rebuilt gives a
    ``dict``); namedtuples, tuples and lists position by position. Anything else (``str``,
    ``bytes``, numpy strings, objects) is returned as a list.

    Differences from torch: a tuple sample gives a tuple of fields (torch gives a list,
    "for backwards compatibility"); unpacking and indexing work alike. Mappings whose keys
    differ are refused naming the key and the sample (torch silently drops a key that only
    later samples have).

    Items of different shapes are refused naming the key; :func:`pad_collate` pads them. An
    item of another kind than the first (an int among dicts) and an empty batch are refused.

    >>> import torch
    >>> default_collate([{"x": torch.ones(2)}, {"x": torch.zeros(2)}])["x"].shape
    torch.Size([2, 2])
    """
    return _collate(items, "")


def stack_into(take: Callable[[int], Any] | None) -> None:
    """Where :func:`collate_into_slot` on this thread writes: ``take(nbytes)`` returns that
    many bytes of the reply slot (a uint8 array) or None (set by a worker process)."""
    _SLOT.take = take


# A process forked by a worker (a pool of its own, a user's subprocess) has no reply slot:
# what it stacked would land in its parent's shared memory.
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=lambda: stack_into(None))


def collate_into_slot(items: Sequence[Any]) -> Any:
    """:func:`default_collate`, stacking straight into the shared-memory slot of the
    worker's reply where one is open (what a worker's fetcher does without a ``collate_fn``;
    the same values, without a fresh allocation and a copy per batch). Elsewhere it is
    :func:`default_collate`."""
    take = _SLOT.take
    if take is None:
        return _collate(items, "")
    _SLOT.active = take
    try:
        return _collate(items, "")
    finally:
        _SLOT.active = None


def _collate(items: Sequence[Any], path: str) -> Any:
    # Dispatch on the first item, in the order of torch's default_collate: numpy scalars
    # before Python numbers (np.float64 is a float), numpy strings (np.str_ is a str) kept.
    try:
        first = items[0]
    except IndexError:
        raise ValueError(
            "cannot collate an empty batch (no samples); a collate function needs at least one"
        ) from None
    if isinstance(first, (torch.Tensor, np.ndarray)):
        return _collate_numbers(items, path)
    if isinstance(first, np.generic) and not isinstance(first, np.character):
        return _collate_scalars(items, path)
    try:
        if isinstance(first, float):  # torch: float64, whatever follows
            return torch.tensor(items, dtype=torch.float64)
        if isinstance(first, int):  # bools too: torch infers (bool, int64, float32 with floats)
            return torch.tensor(items)
    except (TypeError, ValueError, RuntimeError):
        _raise_if_mixed(items, path)
        raise
    if isinstance(first, Mapping):
        return _collate_mappings(items, path)
    if isinstance(first, (tuple, list)):
        return _collate_sequences(items, path)
    return list(items)


def _kind(x: Any) -> str:
    """What :func:`_collate` does with ``x``, in words (the branch it takes)."""
    if isinstance(x, torch.Tensor):
        return "a tensor"
    if isinstance(x, np.ndarray):
        return "a numpy array"
    if isinstance(x, (int, float)) or (
        isinstance(x, np.generic) and not isinstance(x, np.character)
    ):
        return "a number"
    if isinstance(x, Mapping):
        return "a mapping"
    if isinstance(x, (tuple, list)):
        return "a sequence"
    return "kept as a list"


def _raise_if_mixed(items: Sequence[Any], path: str) -> None:
    """A ValueError naming the first item that is of another kind than the first (a dict
    among numbers, an int among dicts), where there is one: called when collation failed."""
    kind = _kind(items[0])
    for position, item in enumerate(items):
        if _kind(item) != kind:
            where = f"key {path!r}" if path else "the batch"
            raise ValueError(
                f"cannot collate {where}: sample {position} of the batch is of type "
                f"{type(item).__name__} ({_kind(item)}) where sample 0 is of type "
                f"{type(items[0]).__name__} ({kind}); every sample of a batch must have the "
                "same structure: fix the dataset, or pass a collate_fn that handles both"
            ) from None


def _collate_mappings(items: Sequence[Any], path: str) -> Any:
    """Mappings, key by key, rebuilt as the first item's type where it can be (as torch's
    collate; :func:`rebuild_mapping`), else a dict. Every item must have the first's keys and
    no other (torch drops a key only later items have: meshfeed refuses to lose a field)."""
    first = items[0]
    try:
        fields = {key: _collate([item[key] for item in items], _join(path, key)) for key in first}
    except Exception:
        _check_keys(items, path)
        raise
    # Every item has the first's keys (else the reads above failed): one more key in any of
    # them shows in the total count, counted in C.
    if sum(map(len, items)) != len(first) * len(items):
        _check_keys(items, path)
    return rebuild_mapping(first, fields)


def _check_keys(items: Sequence[Any], path: str) -> None:
    """A ValueError naming the first item that is no mapping, or whose keys differ from the
    first item's (the key, and whether it is missing or extra), where there is one."""
    _raise_if_mixed(items, path)
    first = items[0]
    keys = set(first)
    for position, item in enumerate(items):
        if position == 0 or set(item) == keys:
            continue
        missing = [k for k in first if k not in item]
        key = missing[0] if missing else next(k for k in item if k not in keys)
        what = (
            f"lacks key {_join(path, key)!r}, which sample 0 has"
            if missing
            else f"has key {_join(path, key)!r}, which sample 0 lacks (collating sample 0's "
            "keys would drop it)"
        )
        raise ValueError(
            f"cannot collate the batch: sample {position} of the batch {what}; every sample "
            "of a batch must have the same keys: give every sample each key in the dataset "
            "(or drop the key from all), or pass a collate_fn that handles optional keys"
        ) from None


def rebuild_mapping(like: Mapping[Any, Any], values: dict[Any, Any]) -> Any:
    """``values`` as a mapping of ``like``'s type where that is safe, else a dict: a
    ``defaultdict`` with ``like``'s factory, a ``UserDict`` (e.g. Hugging Face's
    ``BatchEncoding``) a copy of it holding ``values`` (its other attributes kept), a dict
    subclass a copy updated, another type ``type(like)(values)``. ``like`` itself is never changed: torch's copy-and-update
    writes the batch into a mapping that shares its dict with the copy."""
    if type(like) is dict:
        return values
    try:
        if isinstance(like, defaultdict):
            return type(like)(like.default_factory, values)
        if isinstance(like, UserDict):
            clone = copy.copy(like)  # UserDict.__copy__ copies its data: nothing shared
            clone.data = values
            return clone
        if isinstance(like, dict):  # a copy of a dict subclass is a dict of its own
            copied = copy.copy(like)
            copied.update(values)
            return copied
        return type(like)(values)  # type: ignore[call-arg]
    except TypeError:  # no __init__(mapping)
        return values


def _collate_scalars(items: Sequence[Any], path: str) -> torch.Tensor:
    """numpy scalars: numpy's array of them, or where their dtypes differ (or Python numbers
    are mixed in) torch's ``as_tensor``, which promotes as torch's default_collate does."""
    try:
        array = np.asarray(items)
        if array.dtype != items[0].dtype:
            return torch.as_tensor(items)
    except (TypeError, ValueError, RuntimeError):
        _raise_if_mixed(items, path)
        raise
    return torch.from_numpy(array)


def _collate_numbers(items: Sequence[Any], path: str) -> Any:
    """Tensors or numpy arrays, stacked into one tensor."""
    first = items[0]
    take = _SLOT.active
    # Stack first, and look at the shapes only when stacking fails: comparing every item's
    # shape up front costs more than the stack of a small batch.
    try:
        if isinstance(first, torch.Tensor):
            if take is not None and (out := _tensor_out(items, take)) is not None:
                with contextlib.suppress(RuntimeError):  # refused there: stacked as usual
                    return torch.stack(list(items), out=out)
            return torch.stack(list(items))
        if take is not None and (array := _array_out(items, take)) is not None:
            with contextlib.suppress(TypeError, ValueError):  # e.g. dtypes that differ
                return torch.from_numpy(np.stack(items, out=array, casting="no"))
        stacked = np.stack(items)
        if stacked.dtype != first.dtype:  # dtypes differ: torch's promotion, as torch's collate
            with contextlib.suppress(RuntimeError):  # torch promotes no uint16/32/64: numpy's
                return torch.stack([torch.from_numpy(np.ascontiguousarray(a)) for a in items])
        return torch.from_numpy(stacked)
    except (RuntimeError, TypeError, ValueError):
        _raise_if_mixed(items, path)
        if len({_shape(x) for x in items}) > 1:
            raise _mismatch(items, path) from None
        raise


def _tensor_out(items: Sequence[Any], take: Callable[[int], Any]) -> torch.Tensor | None:
    """Room in the reply slot for the stack of ``items`` (CPU tensors of one dtype), or None."""
    first = items[0]
    dtype = first.dtype
    if first.device.type != "cpu" or first.requires_grad:
        return None
    if any(not isinstance(t, torch.Tensor) or t.dtype != dtype for t in items):
        return None  # stack promotes dtypes; a stack into ``out`` would cast to the first's
    nbytes = first.numel() * first.element_size() * len(items)
    raw = take(nbytes) if nbytes >= _IN_SLOT_MIN else None
    return None if raw is None else torch.from_numpy(raw).view(dtype).view(len(items), *first.shape)


def _array_out(items: Sequence[Any], take: Callable[[int], Any]) -> np.ndarray | None:
    """Room in the reply slot for the stack of ``items`` (arrays), or None."""
    first = items[0]
    if first.dtype.hasobject:
        return None
    nbytes = first.nbytes * len(items)
    raw = take(nbytes) if nbytes >= _IN_SLOT_MIN else None
    return None if raw is None else raw.view(first.dtype).reshape(len(items), *first.shape)


def _collate_sequences(items: Sequence[Any], path: str) -> Any:
    """Namedtuples, tuples or lists, collated position by position."""
    first = items[0]
    if isinstance(first, tuple) and hasattr(first, "_fields"):  # namedtuple
        return type(first)(
            *(
                _collate(list(f), _join(path, name))
                for name, f in zip(first._fields, zip(*items, strict=True), strict=True)
            )
        )
    try:
        lengths = {len(item) for item in items}
    except TypeError:
        _raise_if_mixed(items, path)
        raise
    if len(lengths) != 1:
        where = f"key {path!r}" if path else "the samples"
        raise ValueError(
            f"cannot collate {where}: sequences of different lengths {sorted(lengths)}; {_PAD_HINT}"
        )
    fields = [
        _collate(list(f), _join(path, str(i))) for i, f in enumerate(zip(*items, strict=True))
    ]
    return tuple(fields) if isinstance(first, tuple) else fields


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def collate_column(values: Sequence[Any]) -> Any:
    """One field of many samples: stack equal-shape tensors (or arrays), else keep a list.

    Unlike :func:`default_collate` it never converts (arrays stay numpy) and never raises on
    ragged values (variable-length rows stay a list): a store's fields are often ragged.

    >>> collate_column([np.zeros(2), np.ones(2)]).shape
    (2, 2)
    >>> collate_column([np.zeros(2), np.ones(3)])[1].tolist()
    [1.0, 1.0, 1.0]
    """
    values = list(values)
    if not values:
        return values
    first = values[0]
    if all(isinstance(v, torch.Tensor) for v in values):
        if all(v.shape == first.shape and v.dtype == first.dtype for v in values):
            return torch.stack(values)
    elif all(isinstance(v, np.ndarray) for v in values) and all(
        v.shape == first.shape and v.dtype == first.dtype for v in values
    ):
        return np.stack(values)
    return values


#: Default fill of a padded key: labels are ignored by ``torch.nn.CrossEntropyLoss`` at -100.
DEFAULT_PAD_VALUES: Mapping[str, int] = {"labels": -100, "attention_mask": 0, "loss_mask": 0}
#: Keys whose length sets ``attention_mask`` and ``position_ids``, first found first.
MAIN_KEYS = ("input_ids", "tokens")


def _is_sequence(x: Any) -> bool:
    if isinstance(x, (torch.Tensor, np.ndarray)):
        return x.ndim >= 1
    return isinstance(x, (list, tuple)) and all(
        isinstance(v, (int, float, bool, np.generic)) for v in x
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class PadCollate:
    """The collate :func:`pad_collate` returns (picklable, so worker processes can use it)."""

    pad_id: int = 0
    max_len: int | None = None
    truncate: bool = False
    side: str = "right"
    pad_values: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.side not in ("right", "left"):
            raise ValueError(f"side must be 'right' or 'left' (got {self.side!r})")
        if self.max_len is not None and (
            isinstance(self.max_len, bool) or not isinstance(self.max_len, int) or self.max_len < 1
        ):
            raise ValueError(f"max_len must be a positive int or None (got {self.max_len!r})")

    def __call__(self, items: Sequence[Any]) -> dict[str, Any]:
        if not items:
            raise ValueError("cannot collate an empty batch")
        first = items[0]
        if not isinstance(first, Mapping):
            return self([{"input_ids": x} for x in items])
        items = list(items)
        seq_keys = [k for k in first if _is_sequence(first[k])]
        if not seq_keys:
            raise ValueError(
                f"pad_collate found no variable-length field in items with keys {sorted(first)}; "
                "give 1-D token sequences (tensors, arrays or lists of ints)"
            )
        main = next((k for k in MAIN_KEYS if k in seq_keys), seq_keys[0])
        try:
            tensors = {k: [self._tensor(item[k], k) for item in items] for k in seq_keys}
            lengths = [t.shape[0] for t in tensors[main]]
            width = self._width(tensors, lengths, main)
            out = self._fields(items, tensors, width)
        except Exception:
            _check_keys(items, "")
            raise
        if sum(map(len, items)) != len(first) * len(items):  # a key only later items have
            _check_keys(items, "")
        self._add_defaults(out, lengths, width, out[main].device)
        return out

    def _fields(
        self, items: list[Any], tensors: Mapping[str, list[Any]], width: int
    ) -> dict[str, Any]:
        """Every field of the items: variable-length ones padded to ``width``, the rest
        collated as :func:`default_collate` does."""
        out: dict[str, Any] = {}
        for key in items[0]:
            if key in tensors:
                out[key] = self._pad(tensors[key], width, self._fill(key), key)
            else:
                out[key] = _collate([item[key] for item in items], key)
        return out

    def _add_defaults(
        self, out: dict[str, Any], lengths: list[int], width: int, device: torch.device
    ) -> None:
        """An attention mask and position ids where the items gave none, on ``device`` (the
        tokens')."""
        if "attention_mask" not in out:
            ones = [torch.ones(n, dtype=torch.int64, device=device) for n in lengths]
            out["attention_mask"] = self._pad(ones, width, 0, "attention_mask")
        if "position_ids" not in out:
            ids = [torch.arange(n, dtype=torch.int64, device=device) for n in lengths]
            out["position_ids"] = self._pad(ids, width, 0, "position_ids")

    def _fill(self, key: str) -> int:
        if key in self.pad_values:
            return int(self.pad_values[key])
        return int(DEFAULT_PAD_VALUES.get(key, self.pad_id))

    def _tensor(self, x: Any, key: str) -> Any:
        t = x if isinstance(x, torch.Tensor) else torch.as_tensor(np.asarray(x))
        if self.max_len is not None and t.shape[0] > self.max_len:
            if not self.truncate:
                raise ValueError(
                    f"an item's {key!r} has {t.shape[0]} entries, more than max_len="
                    f"{self.max_len}; raise max_len or pass truncate=True to cut items"
                )
            t = t[: self.max_len]
        return t

    def _width(self, tensors: Mapping[str, list[Any]], lengths: list[int], main: str) -> int:
        for key, ts in tensors.items():
            if key != main and [t.shape[0] for t in ts] != lengths:
                raise ValueError(
                    f"pad_collate: {key!r} and {main!r} differ in length within an item; "
                    "every variable-length field of an item must be as long as its tokens"
                )
        return self.max_len if self.max_len is not None else max(lengths)

    def _pad(self, ts: list[Any], width: int, fill: int, key: str) -> Any:
        rest = {tuple(t.shape[1:]) for t in ts}
        if len(rest) > 1:
            raise _mismatch(ts, key)
        shape = (len(ts), width, *ts[0].shape[1:])  # on the items' device (CUDA items stay)
        out = torch.full(shape, fill, dtype=ts[0].dtype, device=ts[0].device)
        for i, t in enumerate(ts):
            n = t.shape[0]
            if self.side == "right":
                out[i, :n] = t
            elif n:
                out[i, width - n :] = t
        return out


def pad_collate(
    *,
    pad_id: int = 0,
    max_len: int | None = None,
    truncate: bool = False,
    side: str = "right",
    pad_values: Mapping[str, int] | None = None,
) -> PadCollate:
    """A collate for variable-length items: pads them into one batch, as language models expect.

    Items are 1-D token sequences (tensors, numpy arrays or lists of ints) or dicts of them.
    Returns a dict of tensors, each ``[batch, length]``:

    - the item's keys (a bare sequence becomes ``input_ids``), padded with ``pad_id`` (``labels``
      with -100, ``loss_mask`` and ``attention_mask`` with 0; ``pad_values`` overrides per key);
      fields that are not sequences (scalars, strings) are collated by :func:`default_collate`;
    - ``attention_mask``: 1 on real tokens, 0 on padding (int64);
    - ``position_ids``: ``0 .. n-1`` on each item's tokens, 0 on padding (int64).

    The length is the longest item, or ``max_len`` for every batch (fixed shapes); an item
    longer than ``max_len`` is an error unless ``truncate=True`` keeps its first ``max_len``.
    ``side="left"`` pads on the left (generation). Lengths come from ``input_ids`` (or
    ``tokens``); every sequence field of an item must be that long.

    >>> batch = pad_collate(pad_id=0)([[5, 6, 7], [8]])
    >>> batch["input_ids"].tolist(), batch["attention_mask"].tolist()
    ([[5, 6, 7], [8, 0, 0]], [[1, 1, 1], [1, 0, 0]])
    >>> batch["position_ids"].tolist()
    [[0, 1, 2], [0, 0, 0]]
    """
    return PadCollate(
        pad_id=pad_id,
        max_len=max_len,
        truncate=truncate,
        side=side,
        pad_values=dict(pad_values or {}),
    )
