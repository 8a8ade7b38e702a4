"""MDS column encodings: how MosaicML Streaming's MDS format stores each column of a sample,
decoded without ``streaming`` (see :mod:`meshfeed.sources.streams.mds` for what each one yields)."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from decimal import Decimal
from typing import Any

import numpy as np

__all__ = ["Decoder", "decoder"]

Decoder = Callable[[memoryview], Any]
_SCALARS = {n: np.dtype(n) for n in ("int8", "int16", "int32", "int64", "uint8", "uint16")}
_SCALARS |= {n: np.dtype(n) for n in ("uint32", "uint64", "float16", "float32", "float64")}
_IMAGES = {"pil", "jpeg", "png", "jpeg_array", "jpegarray", "list[pil]", "list[jpeg]", "list[png]"}
_SIMPLE: dict[str, Decoder] = {
    "bytes": bytes,
    "str": lambda m: str(m, "utf-8"),
    "int": lambda m: int(np.frombuffer(m, np.int64)[0]),
    "json": lambda m: json.loads(bytes(m)),
    "str_int": lambda m: int(str(m, "utf-8")),
    "str_float": lambda m: float(str(m, "utf-8")),
    "str_decimal": lambda m: Decimal(str(m, "utf-8")),
}
# MDS's ndarray header codes: value dtype (one byte), shape dtype (low two bits of the ndim byte).
_VALUE_DTYPES = {8: "uint8", 9: "int8", 16: "uint16", 17: "int16", 18: "float16", 32: "uint32"}
_VALUE_DTYPES |= {33: "int32", 34: "float32", 64: "uint64", 65: "int64", 66: "float64"}
_SHAPE_DTYPES = ("uint8", "uint16", "uint32", "uint64")


def _ndarray(spec: str) -> Decoder:
    """The decoder of ``ndarray[:dtype[:shape]]`` (MDS's NDArray layout: [dtype byte] [ndim<<2 |
    shape-dtype byte, shape] values)."""
    parts = spec.split(":")[1:]
    dtype = np.dtype(parts[0]) if parts and parts[0] else None
    shape = tuple(int(x) for x in parts[1].split(",")) if len(parts) > 1 else None

    def decode(m: memoryview) -> np.ndarray:
        at, dt, sh = 0, dtype, shape
        if dt is None:
            dt, at = np.dtype(_VALUE_DTYPES[m[0]]), 1
        if sh is None:
            ndim, code = m[at] >> 2, m[at] & 3
            sh = tuple(np.frombuffer(m, _SHAPE_DTYPES[code], ndim, at + 1).tolist())
            at += 1 + ndim * 2**code
        return np.frombuffer(m, dt, offset=at).reshape(sh)

    return decode


@functools.lru_cache(maxsize=256)
def decoder(encoding: str, column: str) -> Decoder:
    """The decoder of one column's bytes (a memoryview of them) for an MDS encoding; refuses
    ``pkl`` (unpickling runs arbitrary code) and unknown encodings with a ValueError."""
    if encoding in _SCALARS:
        dt = _SCALARS[encoding]
        return lambda m: np.frombuffer(m, dt)[0]
    if encoding in _SIMPLE:
        return _SIMPLE[encoding]
    if encoding == "ndarray" or encoding.startswith("ndarray:"):
        return _ndarray(encoding)
    if encoding in _IMAGES:
        return bytes  # as stored: decoding images is the caller's (see streams.mds)
    if encoding == "pkl":
        raise ValueError(
            f"MDS column {column!r} is encoded 'pkl': unpickling runs arbitrary code, so meshfeed "
            "does not read it; rewrite that column as 'json' or 'bytes'"
        )
    raise ValueError(f"MDS column {column!r} has an unknown encoding {encoding!r}")
