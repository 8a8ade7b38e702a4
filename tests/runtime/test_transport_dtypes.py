"""Every torch dtype reaches the main process from a worker bit for bit (bfloat16, the float8
family, complex32, the bit and sub-byte types as the bits of an integer dtype of their width;
quantized tensors through torch's own pickling), as with ``num_workers=0``."""

import pickle
import warnings

import pytest
import torch

import meshfeed
from meshfeed.runtime.transport import bits_carrier, dumps, loads

# Every dtype torch has had; those this torch lacks are skipped.
NAMES = [
    "bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
    "float16", "bfloat16", "float32", "float64", "complex32", "complex64", "complex128",
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
    "float4_e2m1fn_x2", "bits8", "bits16", "bits1x8", "bits2x4", "bits4x2", "bit",
    "int1", "int2", "int3", "int4", "int5", "int6", "int7",
    "uint1", "uint2", "uint3", "uint4", "uint5", "uint6", "uint7",
]  # fmt: skip
DTYPES = {n: getattr(torch, n) for n in NAMES if isinstance(getattr(torch, n, None), torch.dtype)}
QUANTIZED = [n for n in ("qint8", "quint8", "qint32") if hasattr(torch, n)]
_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _make(dtype: torch.dtype, n: int, seed: int) -> torch.Tensor:
    """``n`` values of ``dtype`` from random bits (any bit pattern: NaNs, subnormals)."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    raw = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values as integers of its width (comparable with ``torch.equal``)."""
    if t.dtype == torch.complex128:
        return torch.view_as_real(t).view(torch.int64).contiguous()
    return t.view(_INT[t.itemsize]).contiguous()


def _same(a, b) -> None:
    assert type(a) is type(b)
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, list):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _same(x, y)
    elif a.is_quantized:
        assert b.is_quantized and (a.dtype, a.q_scale(), a.q_zero_point()) == (
            b.dtype,
            b.q_scale(),
            b.q_zero_point(),
        )
        assert torch.equal(a.int_repr(), b.int_repr())
    else:
        assert (a.dtype, a.shape) == (b.dtype, b.shape)
        assert torch.equal(_bits(a), _bits(b)), a.dtype


class AllDtypes:
    """Sample ``i``: a tensor of every dtype, ``n`` values each."""

    def __init__(self, n: int, extra: bool = False) -> None:
        self.n, self.extra = n, extra

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> dict:
        out = {
            name: _make(dtype, self.n, 10 * i + k) for k, (name, dtype) in enumerate(DTYPES.items())
        }
        if self.extra:  # not contiguous, 0-dim, quantized
            for name, dtype in DTYPES.items():
                out[f"{name}/strided"] = _make(dtype, 2 * self.n, i)[::2]
                out[f"{name}/scalar"] = _make(dtype, 1, i)[0]
            for name in QUANTIZED:
                x = torch.randn(self.n, generator=torch.Generator().manual_seed(i))
                out[name] = torch.quantize_per_tensor(x, 0.1, 3, getattr(torch, name))
        return out


def _as_list(items):
    return list(items)


def _load(dataset, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ComplexHalf is experimental
        with meshfeed.DataLoader(dataset, batch_size=4, seed=0, **kw) as loader:
            return list(loader)


def test_the_dtypes_tested_include_those_numpy_lacks():
    assert {"bfloat16", "complex32", "float8_e4m3fn", "float8_e5m2"} <= DTYPES.keys()
    assert bits_carrier(torch.float8_e4m3fn) == (torch.uint8, "float8_e4m3fn")
    assert bits_carrier(torch.bfloat16) == (torch.int16, "bfloat16")
    assert bits_carrier(torch.float32) is None and bits_carrier(torch.uint16) is None


@pytest.mark.parametrize("n", [1024, 2], ids=["through-a-slot", "through-the-pipe"])
def test_every_dtype_collated_in_a_worker_arrives_bit_exact(n):
    want = _load(AllDtypes(n))
    got = _load(AllDtypes(n), num_workers=2)
    assert len(got) == len(want) == 2
    _same(got, want)


def test_a_collate_fn_s_strided_scalar_and_quantized_tensors_of_every_dtype_arrive_bit_exact():
    want = _load(AllDtypes(64, extra=True), collate_fn=_as_list)
    got = _load(AllDtypes(64, extra=True), collate_fn=_as_list, num_workers=2)
    _same(got, want)


def test_the_encoding_round_trips_every_dtype_in_process():
    sample = AllDtypes(16, extra=True)[3]
    buffers: list[pickle.PickleBuffer] = []
    _same(loads(dumps(sample, buffers), buffers), sample)
    _same(loads(dumps(sample)), sample)
