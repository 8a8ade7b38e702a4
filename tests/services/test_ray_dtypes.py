"""Tensors of every dtype through the Ray door and the Ray store, bit for bit: uint16 /
uint32 / uint64, float8 and complex32 among them (torch's own pickling, which Ray would use,
cannot load those)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from meshfeed import DataLoader
from meshfeed.queue import SampleStore
from meshfeed.queue.engine.columns import Bits, Chunk, Gathered, signature, transportable
from meshfeed.services.ray import RayService

NAMES = [
    "bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
    "float16", "bfloat16", "float32", "float64", "complex32", "complex64", "complex128",
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
]  # fmt: skip
DTYPES = {n: getattr(torch, n) for n in NAMES if isinstance(getattr(torch, n, None), torch.dtype)}
_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _make(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Random bits of ``dtype`` (any pattern: NaNs, subnormals)."""
    g = torch.Generator().manual_seed(seed)
    n = int(np.prod(shape))
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    raw = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)


def _bits(t: torch.Tensor) -> torch.Tensor:
    if t.dtype == torch.complex128:
        return torch.view_as_real(t).view(torch.int64)
    return t.view(_INT[t.itemsize])


def _same(got: torch.Tensor, want: torch.Tensor, what: str = "") -> None:
    assert (got.dtype, got.shape) == (want.dtype, want.shape), what
    assert torch.equal(_bits(got), _bits(want)), what


class AllDtypes:
    """Sample ``i``: a tensor of every dtype, a numpy array and a string."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> dict:
        out = {n: _make(d, (5,), 10 * i + k) for k, (n, d) in enumerate(DTYPES.items())}
        return {**out, "array": np.arange(3, dtype=np.uint16) + i, "text": f"row {i}"}


def _batches(**kw) -> list:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ComplexHalf is experimental
        loader = DataLoader(
            AllDtypes if "service" in kw else AllDtypes(), batch_size=4, seed=0, **kw
        )
        got = list(loader)
        loader.shutdown()
    return got


@pytest.mark.ray
def test_every_dtype_comes_back_from_a_loader_actor_bit_exact_and_writable(ray_session):
    want = _batches()
    got = [ray_session.get(rb.for_rank(0)) for rb in _batches(service=RayService(num_actors=1))]
    assert len(got) == len(want) == 2
    for g, w in zip(got, want, strict=True):
        assert g.keys() == w.keys() and g["text"] == w["text"]
        np.testing.assert_array_equal(g["array"], w["array"])
        for name in DTYPES:
            _same(g[name], w[name], name)
    g = got[0]["int64"]
    g += 1  # the batch's own memory, not the object store's
    assert torch.equal(g, want[0]["int64"] + 1)


@pytest.fixture(scope="module")
def ray_store(ray_session):
    store = SampleStore("ray")
    yield store
    store.shutdown()


STORE_DTYPES = [n for n in ("uint16", "bfloat16", "complex32", "float8_e4m3fn", "float8_e5m2")
                if n in DTYPES]  # fmt: skip


@pytest.mark.ray
@pytest.mark.parametrize("name", STORE_DTYPES)
def test_a_column_of_any_dtype_goes_through_the_ray_store_bit_exact(ray_store, name):
    dtype = DTYPES[name]
    store = ray_store
    large = _make(dtype, (6, 20000), 1)  # >= inline_bytes: through the object store
    small = _make(dtype, (6, 3), 2)  # travels with the call
    more = _make(dtype, (2, 20000), 3)  # a small put of the large column's field
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        store.put(name, {"x": large, "s": small}, ids=list(range(6)))
        store.put(name, {"x": more, "s": small[:2]}, ids=[6, 7])
        store.close(name)
        # the second batch: rows of the object store's chunk and of the small put's
        got = [store.get("t", ["x", "s"], 4, name, timeout=20) for _ in range(2)]
    x, s = torch.cat([large, more]), torch.cat([small, small[:2]])
    for batch in got:
        _same(batch["x"], x[batch.ids], name)
        _same(batch["s"], s[batch.ids], name)
    assert sorted(i for b in got for i in b.ids) == list(range(8))


def test_a_tensor_numpy_lacks_is_sent_as_its_bits_and_rebuilt_bit_exact():
    import pickle

    t = _make(torch.float8_e4m3fn, (4, 3), 0)
    bits = transportable(t)
    assert type(bits) is Bits and bits.array.dtype == np.uint8 and bits.dtype == "float8_e4m3fn"
    assert signature(bits) == signature(t)
    _same(pickle.loads(pickle.dumps(Chunk(t))).data, t)
    _same(pickle.loads(pickle.dumps(Gathered(t[1:3]))).data, t[1:3])
    assert isinstance(transportable(t.to(torch.float32)), np.ndarray)
