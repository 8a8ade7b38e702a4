"""meshfeed's batches as torch's: ``default_collate`` against ``torch.utils.data.default_collate``
(dtypes, numpy strings, mapping types), ``device=`` keeping every batch structure, and what a
``fetch_batch`` gets (a writable array of its own) and logs when it raises."""

from __future__ import annotations

import collections
import dataclasses
import logging
import pickle
import types
from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import default_collate as torch_collate

from meshfeed import DataLoader
from meshfeed.collate import default_collate
from meshfeed.delivery import _map, pin, to_device
from meshfeed.tasks import FetchTask


def _norm(x: Any) -> Any:
    """A batch as comparable plain data: types, dtypes and values."""
    if isinstance(x, torch.Tensor):
        return ("tensor", x.dtype, x.tolist())
    if isinstance(x, Mapping):
        extra = getattr(x, "default_factory", None)
        return (type(x), {k: _norm(v) for k, v in x.items()}, extra)
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return (type(x), [_norm(v) for v in x])
    if isinstance(x, (list, tuple)):
        return ("sequence", [_norm(v) for v in x])
    return (type(x), x)


class Items(collections.abc.Mapping):  # a read-only Mapping that is not a dict
    def __init__(self, d: dict[str, Any]) -> None:
        self._d = dict(d)

    def __getitem__(self, k: str) -> Any:
        return self._d[k]

    def __iter__(self) -> Iterator[str]:
        return iter(self._d)

    def __len__(self) -> int:
        return len(self._d)


class Encoding(collections.UserDict):  # Hugging Face's BatchEncoding is a UserDict
    pass


class TwoArgs(dict):  # no __init__(mapping): rebuilt by copy, as torch does
    def __init__(self, a: Any, b: Any) -> None:
        super().__init__(a=a, b=b)


Point = collections.namedtuple("Point", "x y")

AS_TORCH = {
    "python floats": [0.1, 1e300, 1_700_000_000.25],
    "float then int": [2.5, 1],
    "int then float": [1, 2.5],
    "bools": [True, False],
    "bool then int": [True, 2],
    "ints": [1, 2],
    "np.float64 (a float subclass)": [np.float64(0.1), np.float64(0.2)],
    "np.float32 then a float": [np.float32(1), 2.0],
    "a float then np.float32": [2.0, np.float32(1)],
    "np.int64 then a float": [np.int64(1), 2.5],
    "np.float16 then np.int64": [np.float16(1), np.int64(2)],
    "np scalars of one dtype": [np.int8(3), np.int8(4)],
    "np.str_": list(np.array(["cat", "dog"])),
    "np.bytes_": list(np.array([b"cat", b"dog"])),
    "str and bytes": [{"s": "a", "b": b"a"}, {"s": "b", "b": b"b"}],
    "arrays f16 then i64": [np.ones(2, np.float16), np.ones(2, np.int64)],
    "arrays i64 then f16": [np.ones(2, np.int64), np.ones(2, np.float16)],
    "arrays f32 then i32": [np.ones(2, np.float32), np.ones(2, np.int32)],
    "arrays i8 then u8": [np.ones(2, np.int8), np.ones(2, np.uint8)],
    "tensors f32 then i64": [torch.ones(2), torch.ones(2, dtype=torch.int64)],
    "OrderedDict": [collections.OrderedDict(b=1.5, a=2), collections.OrderedDict(b=2.5, a=3)],
    "defaultdict": [collections.defaultdict(list, x=1), collections.defaultdict(list, x=2)],
    "UserDict": [Encoding(x=torch.ones(2)), Encoding(x=torch.zeros(2))],
    "a Mapping": [Items({"x": 1}), Items({"x": 2})],
    "mappingproxy": [types.MappingProxyType({"x": 1}), types.MappingProxyType({"x": 2})],
    "dict subclass without __init__(mapping)": [TwoArgs(1, 2.0), TwoArgs(3, 4.0)],
    "namedtuple": [Point(1, 0.5), Point(2, 1.5)],
    "nested": [{"a": [{"r": 0.1}], "l": "x"}, {"a": [{"r": 0.2}], "l": "y"}],
}


@pytest.mark.parametrize("name", AS_TORCH)
def test_default_collate_gives_torchs_types_dtypes_and_values(name):
    items = AS_TORCH[name]
    assert _norm(default_collate(items)) == _norm(torch_collate(items))


def test_python_floats_keep_float64_precision():
    batch = default_collate([{"reward": 0.1, "big": 1e300}, {"reward": 0.2, "big": 1.0}])
    assert batch["reward"].dtype == torch.float64 and batch["reward"].tolist() == [0.1, 0.2]
    assert batch["big"].tolist() == [1e300, 1.0]  # not inf


def test_numpy_strings_stay_a_list():
    labels = np.array(["cat", "dog", "cat"])
    batch = default_collate([{"x": np.float32(i), "label": labels[i]} for i in range(3)])
    assert batch["label"] == ["cat", "dog", "cat"] and batch["x"].dtype == torch.float32


def test_a_mapping_keeps_its_type_and_extras_and_tuples_stay_tuples():
    dd = default_collate([collections.defaultdict(list, x=1), collections.defaultdict(list, x=2)])
    assert type(dd) is collections.defaultdict and dd.default_factory is list
    assert type(default_collate([Encoding(x=1), Encoding(x=2)])) is Encoding
    assert type(default_collate([Items({"x": 1}), Items({"x": 2})])) is Items

    class Unbuildable(Items):
        def __init__(self, a: Any, b: Any) -> None:  # no __init__(mapping), not mutable
            super().__init__({"a": a, "b": b})

    plain = default_collate([Unbuildable(1, 2), Unbuildable(3, 4)])
    assert type(plain) is dict and plain["a"].tolist() == [1, 3]
    # The one documented difference: torch gives a list for tuple samples.
    pair = default_collate([(torch.ones(2), 1), (torch.zeros(2), 2)])
    assert type(pair) is tuple and pair[1].tolist() == [1, 2]
    assert "tuple" in (default_collate.__doc__ or "")


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_loader_collates_as_torch(num_workers):
    """In workers too: stacked into the reply slot (arrays >= 4 KiB) and sent back."""

    class Rows:
        def __len__(self) -> int:
            return 8

        def __getitem__(self, i: int) -> Any:
            dtype = np.float16 if i % 2 else np.int64
            return collections.OrderedDict(
                reward=0.1 * i, label=np.array(["a", "b"])[i % 2], big=np.full(1024, i, dtype)
            )

    rows = Rows()
    with DataLoader(rows, batch_size=4, shuffle=False, num_workers=num_workers) as loader:
        batches = list(loader)
    for k, batch in enumerate(batches):
        want = torch_collate([rows[i] for i in range(4 * k, 4 * k + 4)])
        assert _norm(batch) == _norm(want)
        assert batch["reward"].dtype == torch.float64


# ---------------------------------------------------------------------- device= (delivery)
@dataclasses.dataclass
class WithDerived:
    x: torch.Tensor
    n: int = dataclasses.field(init=False, default=7)


@dataclasses.dataclass(frozen=True)
class Frozen:
    x: torch.Tensor
    tag: str


class Pair(tuple):
    pass


def _od(items):
    return collections.OrderedDict(x=torch.stack(items), y=[torch.stack(items)])


def _dd(items):
    return collections.defaultdict(list, x=torch.stack(items))


def _userdict(items):
    return Encoding(x=torch.stack(items), ids=[1, 2])


def _mapping(items):
    return Items({"x": torch.stack(items)})


def _sort(items):
    return torch.sort(torch.stack(items))


def _pair(items):
    return Pair((torch.stack(items), torch.zeros(1)))


def _point(items):
    return Point(torch.stack(items), "p")


def _derived(items):
    out = WithDerived(torch.stack(items))
    out.n = len(items)
    return out


def _frozen(items):
    return Frozen(torch.stack(items), "f")


def _list_subclass(items):
    return Batches([torch.stack(items)])


class Batches(list):
    pass


STRUCTURES = [_od, _dd, _userdict, _mapping, _sort, _pair, _point, _derived, _frozen]
STRUCTURES += [_list_subclass]


class Rows8:
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([3.0, 1.0, float(i)])


def _same(a: Any, b: Any) -> None:
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    elif dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            _same(getattr(a, f.name), getattr(b, f.name))
    elif isinstance(a, Mapping):
        assert list(a) == list(b)
        for k in a:
            _same(a[k], b[k])
        assert getattr(a, "default_factory", None) == getattr(b, "default_factory", None)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _same(x, y)
    else:
        assert a == b


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("collate", STRUCTURES, ids=lambda f: f.__name__)
def test_device_keeps_every_batch_structure(collate, num_workers):
    kwargs = {"batch_size": 4, "seed": 0, "collate_fn": collate, "num_workers": num_workers}
    with DataLoader(Rows8(), device="cpu", **kwargs) as loader:
        delivered = list(loader)
    with DataLoader(Rows8(), **kwargs) as loader:
        plain = list(loader)
    assert len(delivered) == len(plain) == 2
    for a, b in zip(delivered, plain, strict=True):
        _same(a, b)


@pytest.mark.parametrize("collate", STRUCTURES, ids=lambda f: f.__name__)
def test_to_device_and_pin_keep_every_batch_structure(collate):
    batch = collate([Rows8()[i] for i in range(4)])
    _same(to_device(batch, torch.device("cpu")), batch)
    _same(pin(batch), batch)  # unchanged without CUDA; with it, pinned copies alike
    seen: list[torch.Tensor] = []
    copied = _map(batch, lambda t: seen.append(t) or t.clone())
    _same(copied, batch)
    assert seen and all(any(t is s for s in seen) for t in _tensors(batch))


def _tensors(batch: Any) -> list[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        return [batch]
    if dataclasses.is_dataclass(batch):
        return [t for f in dataclasses.fields(batch) for t in _tensors(getattr(batch, f.name))]
    if isinstance(batch, Mapping):
        return [t for v in batch.values() for t in _tensors(v)]
    if isinstance(batch, (list, tuple)):
        return [t for v in batch for t in _tensors(v)]
    return []


def test_map_moves_the_tensors_inside_a_userdict_and_keeps_its_attributes():
    enc = Encoding(x=torch.ones(2))
    enc.extra = "kept"  # e.g. BatchEncoding's _encodings
    out = _map(enc, lambda t: t * 2)
    assert type(out) is Encoding and out.extra == "kept" and out["x"].tolist() == [2.0, 2.0]
    assert enc["x"].tolist() == [1.0, 1.0]  # the original is not changed


class OwnPin:
    """A custom batch type with torch's documented hook: its own ``pin_memory()``."""

    def __init__(self, x: torch.Tensor, pinned: bool = False) -> None:
        self.x, self.pinned = x, pinned

    def pin_memory(self) -> OwnPin:
        return OwnPin(self.x, pinned=True)


def test_pin_calls_a_custom_batch_types_own_pin_memory(monkeypatch):
    """As torch's DataLoader: an object pin cannot look inside is pinned by its own method,
    at any depth (with CUDA; here its availability is faked and no tensor is in the batch)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    out = pin({"a": OwnPin(torch.ones(1)), "b": [OwnPin(torch.ones(1)), "text", 3]})
    assert out["a"].pinned and out["b"][0].pinned and out["b"][1:] == ["text", 3]
    assert pin(OwnPin(torch.ones(1))).pinned
    assert pin(OwnPin).__name__ == "OwnPin"  # a class is not called


# ---------------------------------------------------------------------- fetch_batch's indices
class Offset:
    """fetch_batch shifts ``indices`` in place; __getitem__ (the fallback) gives -1."""

    def __init__(self) -> None:
        self.base = np.arange(1000)

    def __len__(self) -> int:
        return 40

    def fetch_batch(self, idx: np.ndarray) -> Any:
        writable = idx.flags.writeable
        idx += 100
        return {"x": torch.from_numpy(self.base[idx]), "writable": writable}

    def __getitem__(self, i: int) -> Any:
        return {"x": -1, "writable": None}


def test_fetch_batch_gets_a_writable_array_in_every_process():
    batches = {}
    for num_workers in (0, 2):
        with DataLoader(Offset(), batch_size=4, seed=0, num_workers=num_workers) as loader:
            batches[num_workers] = [b["x"].tolist() for b in loader]
            assert all(b["writable"] for b in loader)
    assert batches[0] == batches[2] and len(batches[0]) == 10
    assert all(100 <= v < 140 for b in batches[0] for v in b)


def test_a_task_sent_to_a_worker_has_writable_arrays_as_in_process():
    task = FetchTask(0, 3, np.arange(4), np.arange(10, 14))
    sent = pickle.loads(pickle.dumps(task))
    assert sent.indices.flags.writeable and sent.positions.flags.writeable
    assert sent.indices.tolist() == [0, 1, 2, 3] and sent.positions.tolist() == [10, 11, 12, 13]


class EditsThenRaises:
    """fetch_batch corrupts ``indices`` in place and raises: the fallback reads the right ones."""

    def __len__(self) -> int:
        return 16

    def fetch_batch(self, idx: np.ndarray) -> Any:
        idx[:] = 10_000
        raise RuntimeError("fetch_batch bug")

    def __getitem__(self, i: int) -> int:
        return i


def test_an_edit_of_the_indices_does_not_reach_the_loader_or_the_fallback(caplog):
    kwargs = {"batch_size": 4, "shuffle": False}
    with caplog.at_level(logging.WARNING, logger="meshfeed"):
        got = [b.tolist() for b in DataLoader(EditsThenRaises(), **kwargs)]
    assert got == [list(range(k, k + 4)) for k in range(0, 16, 4)]


# ---------------------------------------------------------------------- fetch_batch raising
class BuggyBatch:
    """fetch_batch always raises; every sample reads fine through __getitem__."""

    def __len__(self) -> int:
        return 40

    def fetch_batch(self, idx: np.ndarray) -> Any:
        raise KeyError("no column 'tokens'")

    def __getitem__(self, i: int) -> int:
        return i


def _fallback_warnings(records: list[logging.LogRecord]) -> list[str]:
    return [
        r.getMessage() for r in records if r.name == "meshfeed" and "fetch_batch" in r.getMessage()
    ]


def test_a_fetch_batch_that_raises_on_healthy_samples_is_logged_once(caplog):
    clean = DataLoader(list(range(40)), batch_size=4, seed=1)
    list(clean)
    loader = DataLoader(BuggyBatch(), batch_size=4, seed=1)
    with caplog.at_level(logging.WARNING, logger="meshfeed"):
        batches = list(loader)
    assert sorted(v for b in batches for v in b.tolist()) == list(range(40))
    (message,) = _fallback_warnings(caplog.records)  # once for ten batches
    assert "BuggyBatch.fetch_batch raised KeyError" in message and "no column 'tokens'" in message
    assert "one by one through __getitem__" in message and "every batch" in message
    assert loader.stats().keys() == clean.stats().keys()  # no new stats keys
    assert loader.stats()["failures"] == [] and loader.stats()["substituted"] == 0


def test_a_fetch_batch_that_raises_on_a_bad_sample_is_not_called_a_bug(caplog):
    class BadSample(BuggyBatch):
        def fetch_batch(self, idx: np.ndarray) -> Any:
            return torch.as_tensor([self[i] for i in idx.tolist()])

        def __getitem__(self, i: int) -> int:
            if i == 5:
                raise OSError("corrupt record")
            return i

    with caplog.at_level(logging.WARNING, logger="meshfeed"):
        list(DataLoader(BadSample(), batch_size=4, seed=1))
    assert not _fallback_warnings(caplog.records)  # the bad-sample warning tells this story
    assert any("bad sample" in r.getMessage() for r in caplog.records)


def test_each_worker_logs_a_raising_fetch_batch_once(tmp_path):
    """Worker processes log on their own (nothing carries their records to the parent): a
    handler the forked workers inherit collects them."""
    path = tmp_path / "workers.log"
    handler = logging.FileHandler(path)
    log = logging.getLogger("meshfeed")
    log.addHandler(handler)
    try:
        kwargs = {"batch_size": 4, "seed": 1, "num_workers": 2}
        with DataLoader(BuggyBatch(), multiprocessing_context="fork", **kwargs) as loader:
            batches = list(loader)
    finally:
        log.removeHandler(handler)
        handler.close()
    assert sorted(v for b in batches for v in b.tolist()) == list(range(40))
    lines = [line for line in path.read_text().splitlines() if "fetch_batch raised" in line]
    assert 1 <= len(lines) <= 2, lines  # ten batches, once per worker


# ---------------------------------------------------------------------- review of the above


@pytest.mark.parametrize(
    "dtypes", [(np.uint16, np.int64), (np.uint16, np.int32), (np.uint32, np.int64)]
)
def test_unsigned_arrays_mixed_with_signed_ones_collate_as_numpy_promotes(dtypes):
    """torch promotes no uint16/32/64 (its collate raises); meshfeed keeps numpy's promotion
    there, as it did before collation followed torch's promotion elsewhere."""
    items = [np.arange(3, dtype=dtypes[0]), np.arange(3, dtype=dtypes[1])]
    out = default_collate(items)
    assert out.dtype == torch.from_numpy(np.stack(items)).dtype
    assert out.tolist() == [[0, 1, 2], [0, 1, 2]]


class Wrapped(MutableMapping):
    """A mutable mapping over a dict of its own (a copy.copy would share that dict)."""

    def __init__(self, data: dict | None = None) -> None:
        self._d = dict(data or {})

    def __getitem__(self, k: Any) -> Any:
        return self._d[k]

    def __setitem__(self, k: Any, v: Any) -> None:
        self._d[k] = v

    def __delitem__(self, k: Any) -> None:
        del self._d[k]

    def __iter__(self) -> Any:
        return iter(self._d)

    def __len__(self) -> int:
        return len(self._d)


def test_collating_or_moving_a_mapping_never_changes_the_sample():
    samples = [Wrapped({"x": torch.full((2,), float(i))}) for i in range(3)]
    out = default_collate(samples)
    assert type(out) is Wrapped and out["x"].shape == (3, 2)
    assert samples[0]["x"].shape == (2,)  # the batch was written into sample 0 before
    moved = to_device(out, torch.device("cpu"))
    assert type(moved) is Wrapped and moved is not out and moved["x"] is not None
    seen: list[torch.Tensor] = []
    _map(out, lambda t: seen.append(t) or t.clone())
    assert out["x"] is seen[0]  # the batch itself keeps its tensor


@dataclasses.dataclass
class Derived:
    input_ids: torch.Tensor
    attention_mask: torch.Tensor = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.attention_mask = self.input_ids != 0


@dataclasses.dataclass
class WithPost:
    input_ids: torch.Tensor

    def __post_init__(self) -> None:
        self.attention_mask = self.input_ids != 0  # derived, not a field


def test_a_dataclass_moved_by_device_runs_its_post_init_again_where_it_can():
    """All fields init=True: __init__ and __post_init__ run again (derived values follow the
    moved ones), as dataclasses.replace did before; init=False fields are set on a copy."""
    batch = WithPost(torch.tensor([1, 0, 2]))
    moved = _map(batch, lambda t: t.to(torch.float64))
    assert (
        moved.input_ids.dtype == torch.float64 and moved.attention_mask is not batch.attention_mask
    )
    assert moved.attention_mask.tolist() == [True, False, True]
    derived = _map(Derived(torch.tensor([1, 0, 2])), lambda t: t.to(torch.float32))
    assert derived.input_ids.dtype == torch.float32
    assert derived.attention_mask.dtype == torch.float32


@dataclasses.dataclass
class OwnPinRecord:
    x: torch.Tensor
    pinned: bool = False

    def pin_memory(self) -> OwnPinRecord:
        return OwnPinRecord(self.x, pinned=True)


def test_pin_calls_a_dataclass_batchs_own_pin_memory(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert pin([OwnPinRecord(torch.ones(1))])[0].pinned
