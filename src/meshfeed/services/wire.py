"""How batches cross a process boundary: one pickled byte string, CPU tensors as numpy.

A torch storage pickles through ``torch.save`` (costly for small batches), and torch's
shared-memory reductions hand file descriptors from process to process (a batch already sent
is lost if its sender dies). Encoding CPU tensors as numpy arrays costs one copy each way and
leaves a received batch independent of the process that made it.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch


def _tensor_from_numpy(array: Any) -> torch.Tensor:
    return torch.from_numpy(array)


class _BatchPickler(pickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        if (
            type(obj) is torch.Tensor
            and obj.device.type == "cpu"
            and obj.layout == torch.strided
            and not obj.requires_grad
            and obj.dtype != torch.bfloat16  # numpy has no bfloat16
            and not obj.is_conj()
        ):
            return _tensor_from_numpy, (obj.numpy(),)
        return NotImplemented


def dumps(obj: Any) -> bytes:
    """Serialise a batch (or any picklable object) for :func:`loads` in another process."""
    buffer = io.BytesIO()
    _BatchPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buffer.getvalue()


def loads(data: bytes) -> Any:
    return pickle.loads(data)
