"""Collation, in one place: samples -> a batch (:func:`default_collate`, what loaders use) and
one field of many samples -> a column (:func:`collate_column`, what the sample store uses)."""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["collate_column", "default_collate"]


def default_collate(items: Sequence[Any]) -> Any:
    """Stack a list of samples into a batch.

    Tensors are stacked; numpy arrays and numpy scalars become one tensor; Python ints, floats
    and bools become a 1-D tensor; mappings and tuples/lists are collated field by field;
    anything else (strings, objects) is returned as a list.

    >>> import torch
    >>> default_collate([{"x": torch.ones(2)}, {"x": torch.zeros(2)}])["x"].shape
    torch.Size([2, 2])
    """
    import torch  # imported here so that collate_column users never pay for it

    first = items[0]
    if isinstance(first, torch.Tensor):
        return torch.stack(list(items))
    if isinstance(first, np.ndarray):
        return torch.from_numpy(np.stack(items))
    if isinstance(first, np.generic):
        return torch.from_numpy(np.asarray(items))
    if isinstance(first, (bool, int, float)) and not isinstance(first, np.generic):
        return torch.tensor(items)
    if isinstance(first, (str, bytes)):
        return list(items)
    if isinstance(first, Mapping):
        return {key: default_collate([item[key] for item in items]) for key in first}
    if isinstance(first, tuple) and hasattr(first, "_fields"):  # namedtuple
        return type(first)(*(default_collate(field) for field in zip(*items, strict=True)))
    if isinstance(first, (tuple, list)):
        lengths = {len(item) for item in items}
        if len(lengths) != 1:
            raise ValueError(
                f"cannot collate sequences of different lengths {sorted(lengths)}; "
                "pad them in the dataset or pass a collate_fn"
            )
        fields = [default_collate(list(field)) for field in zip(*items, strict=True)]
        return tuple(fields) if isinstance(first, tuple) else fields
    return list(items)


def collate_column(values: Sequence[Any]) -> Any:
    """One field of many samples: stack equal-shape tensors (or arrays), else keep a list.

    Unlike :func:`default_collate` it never converts (arrays stay numpy) and never raises on
    ragged values (variable-length rows stay a list): a store's fields are often ragged.
    It does not import torch where torch was never imported (cheap in Ray workers).

    >>> collate_column([np.zeros(2), np.ones(2)]).shape
    (2, 2)
    >>> collate_column([np.zeros(2), np.ones(3)])[1].tolist()
    [1.0, 1.0, 1.0]
    """
    values = list(values)
    if not values:
        return values
    first = values[0]
    torch_module = sys.modules.get("torch")
    if torch_module is not None and all(isinstance(v, torch_module.Tensor) for v in values):
        if all(v.shape == first.shape and v.dtype == first.dtype for v in values):
            return torch_module.stack(values)
    elif all(isinstance(v, np.ndarray) for v in values) and all(
        v.shape == first.shape and v.dtype == first.dtype for v in values
    ):
        return np.stack(values)
    return values
