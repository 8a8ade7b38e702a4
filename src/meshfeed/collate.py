"""Default collation: stack tensors and arrays, recurse into dicts, tuples and lists."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch


def default_collate(items: Sequence[Any]) -> Any:
    """Stack a list of samples into a batch.

    Tensors are stacked; numpy arrays and numpy scalars become one tensor; Python ints, floats
    and bools become a 1-D tensor; mappings and tuples/lists are collated field by field;
    anything else (strings, objects) is returned as a list.

    >>> default_collate([{"x": torch.ones(2)}, {"x": torch.zeros(2)}])["x"].shape
    torch.Size([2, 2])
    """
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
