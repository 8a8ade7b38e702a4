"""Per-sample tensor values of every torch dtype through the Ray store, bit for bit.

A list column's values travel one by one: small ones with the put call, large ones (at least
``inline_bytes``) through Ray's object store. torch's own pickling, which Ray would use,
cannot load uint16 / uint32 / uint64, float8, complex32 or the bit and sub-byte dtypes (see
``meshfeed.queue.backends.ray_dataplane._TensorValue``), nor such tensors inside a dict, list or
tuple value (a column holding one travels pickled as one: ``_NestedColumn``). Stacked columns:
see ``tests/services/test_ray_dtypes.py``.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any, NamedTuple

import pytest
import torch

from meshfeed.queue import SampleStore, StoreLoader
from meshfeed.queue.engine.core import StoreOptions
from meshfeed.testing import reset_store

#: Every dtype this torch has (aliases such as ``torch.half`` once), by name.
_FOUND = [getattr(torch, name, None) for name in dir(torch)]
DTYPES = {
    str(d).removeprefix("torch."): d
    for d in sorted({d for d in _FOUND if isinstance(d, torch.dtype)}, key=str)
}
LARGE = 70_000  # bytes: more than the store's default inline_bytes (64 KiB)


def _quantized(dtype: torch.dtype) -> bool:
    return torch.empty(0, dtype=dtype).is_quantized


def _make(dtype: torch.dtype, n: int, seed: int) -> torch.Tensor:
    """``n`` values of ``dtype`` of random bits (any pattern: NaNs, subnormals)."""
    g = torch.Generator().manual_seed(seed)
    if _quantized(dtype):
        return torch.quantize_per_tensor(torch.randn(n, generator=g), 0.05, 2, dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    raw = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype)


def _values(dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    """A small value, a strided view of a larger tensor, a 0-d one and a large one."""
    return [
        _make(dtype, 6, seed),
        _make(dtype, 20, seed + 1).reshape(4, 5)[:, 1:4],  # not contiguous
        _make(dtype, 1, seed + 2).reshape(()),
        _make(dtype, LARGE // dtype.itemsize + 8, seed + 3),  # through the object store
    ]


def _raw(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` (a view: sub-byte dtypes have no copy kernel)."""
    return (t.reshape(1) if t.dim() == 0 else t).view(torch.uint8)


def _same(got: Any, want: torch.Tensor, what: str) -> None:
    assert isinstance(got, torch.Tensor), what
    assert (got.dtype, got.shape) == (want.dtype, want.shape), what
    if want.is_quantized:
        assert (got.q_scale(), got.q_zero_point()) == (want.q_scale(), want.q_zero_point())
        assert torch.equal(got.int_repr(), want.int_repr()), what
    else:
        assert torch.equal(_raw(got), _raw(want)), what


class Pair(NamedTuple):
    first: Any
    second: Any


def _containers(dtype: torch.dtype, seed: int) -> list[Any]:
    """Dict, list, tuple and nested values holding tensors of ``dtype`` (those of
    :func:`_values`: strided, 0-d, one larger than ``inline_bytes``) among other values."""
    small, strided, scalar, large = _values(dtype, seed)
    return [
        {"ids": small, "n": 3, "name": "a"},
        [strided, 1.5, None],
        (scalar, b"x"),
        {"outer": [(small, {"deep": large}), {"k": scalar}], "pair": Pair(strided, 2)},
        [small, *range(30)],
        {"plain": [1, "b"], "empty": (), "nothing": {}},  # no tensor
        large,  # through the object store, in the same column
        7,
    ]


def _same_tree(got: Any, want: Any, what: str) -> None:
    """``got`` has the structure types, keys and values of ``want``, tensors bit for bit."""
    assert type(got) is type(want), f"{what}: {type(got)} for {type(want)}"
    if isinstance(want, torch.Tensor):
        _same(got, want, what)
    elif isinstance(want, dict):
        assert list(got) == list(want), what
        for key in want:
            _same_tree(got[key], want[key], f"{what}[{key!r}]")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), what
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            _same_tree(g, w, f"{what}[{i}]")
    else:
        assert got == want, what


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    """The tensors in ``value``, at any depth."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (dict, list, tuple)):
        for v in value.values() if isinstance(value, dict) else value:
            yield from _tensors(v)


@pytest.fixture
def store(ray_store: SampleStore) -> Iterator[SampleStore]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ComplexHalf is experimental; quantized deprecated
        yield reset_store(ray_store, StoreOptions())


@pytest.mark.ray
@pytest.mark.parametrize("name", list(DTYPES))
def test_a_value_of_any_dtype_goes_through_the_ray_store_bit_exact(store, name):
    dtype = DTYPES[name]
    values = _values(dtype, 7)
    store.put("p", {"x": values})
    assert store.stats()["bytes_in_object_store"] >= LARGE  # the large one went there
    got = store.get("t", ["x"], len(values), "p", timeout=20)["x"]
    assert isinstance(got, list) and len(got) == len(values)
    for i, (g, w) in enumerate(zip(got, values, strict=True)):
        _same(g, w, f"{name} value {i}")
    if not _quantized(dtype):
        for g in got:  # the reader's own memory: not the object store's, not the actor's
            _raw(g).bitwise_not_()
    again = store.get("u", ["x"], len(values), "p", timeout=20)["x"]
    for i, (g, w) in enumerate(zip(again, values, strict=True)):
        _same(g, w, f"{name} value {i}, read again")


@pytest.mark.ray
@pytest.mark.parametrize("name", list(DTYPES))
def test_tensors_of_any_dtype_inside_a_dict_list_or_tuple_go_through_the_ray_store(store, name):
    dtype = DTYPES[name]
    values = _containers(dtype, 11)
    store.put("p", {"x": values})
    got = store.get("t", ["x"], len(values), "p", timeout=20)["x"]
    assert isinstance(got, list) and len(got) == len(values)
    for i, (g, w) in enumerate(zip(got, values, strict=True)):
        _same_tree(g, w, f"{name} value {i}")
    if not _quantized(dtype):
        for g in got:  # the reader's own memory
            for t in _tensors(g):
                _raw(t).bitwise_not_()
    again = store.get("u", ["x"], len(values), "p", timeout=20)["x"]
    for i, (g, w) in enumerate(zip(again, values, strict=True)):
        _same_tree(g, w, f"{name} value {i}, read again")


@pytest.mark.ray
def test_values_holding_tensors_of_every_dtype_survive_a_ray_store_checkpoint(store):
    values = [{"v": [_make(d, 5, i)], "dtype": n} for i, (n, d) in enumerate(DTYPES.items())]
    store.put("p", {"x": values})
    meta, payload = store._backend.dump(with_payload=True)
    store = reset_store(store, StoreOptions())
    store._backend.restore(meta, payload)  # the values go back to the store actor
    got = store.get("t", ["x"], len(values), "p", timeout=20)["x"]
    for g, w in zip(got, values, strict=True):
        _same_tree(g, w, w["dtype"])


@pytest.mark.ray
@pytest.mark.parametrize("name", [n for n in DTYPES if DTYPES[n].is_complex])
def test_a_conjugate_view_goes_through_the_ray_store_as_its_values(store, name):
    dtype = DTYPES[name]
    values = [_make(dtype, n, 3).conj() for n in (6, LARGE // dtype.itemsize)]
    store.put("p", {"x": [*values, {"z": values[0]}, [values[1]]]})
    got = store.get("t", ["x"], 4, "p", timeout=20)["x"]
    for g, w in zip([*got[:2], got[2]["z"], got[3][0]], values * 2, strict=True):
        _same(g.resolve_conj(), w.resolve_conj(), name)


@pytest.mark.ray
def test_a_store_loader_over_a_ray_store_serves_values_of_every_dtype(store):
    samples = [
        {name: _make(d, n + 3 if n < 3 else LARGE // d.itemsize, n) for name, d in DTYPES.items()}
        for n in range(4)
    ]  # lengths differ: list columns (sub-byte dtypes cannot be stacked); the last sample's
    # values go through the object store
    for i, sample in enumerate(samples):
        store.put("p", {name: [v] for name, v in sample.items()}, ids=[i])
    store.close("p")
    loader = StoreLoader(
        store,
        task="t",
        fields=list(DTYPES),
        partition="p",
        batch_size=2,  # full batches: ragged, so never stacked
        mesh={"dp": 1},
        rank=0,
        timeout=60,
    )
    with loader:
        batches = list(loader)
    assert sorted(i for b in batches for i in b.ids) == [0, 1, 2, 3] and len(batches) == 2
    for batch in batches:
        for name in DTYPES:
            for k, i in enumerate(batch.ids):
                _same(batch[name][k], samples[i][name], f"{name} of sample {i}")
