"""Fuzz meshfeed's public constructors and state loading with hypothesis (issues #11 and #20).

For each target, hypothesis draws bad and good arguments; a call may succeed or raise a clear
``TypeError`` / ``ValueError`` / ``OSError`` (and their subclasses), but a bare ``IndexError``,
``KeyError``, ``ZeroDivisionError``, ``AttributeError`` or ``OverflowError`` escaping from the
library, or a call running past 10 s (a per-call alarm), is a finding. A last target flips
single bits of a ``.idx`` and requires each open to be refused or to return identical data.
``SampleStore.load`` is held to more: an edited checkpoint file is refused with ``ValueError``
only, or loads into a store whose next put adds a sample (never overwrites one).

    python scripts/fuzz_constructors.py --quick     # 25 examples per target, 100 bit flips
    python scripts/fuzz_constructors.py             # 300 examples per target, 400 bit flips

Exit status 1 when anything is found; each finding is printed with its shrunk arguments.
"""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st


class Finding(Exception):
    """Raised by a target that holds itself to a stricter rule than the typed refusals."""


FORBIDDEN = (IndexError, KeyError, ZeroDivisionError, AttributeError, OverflowError, Finding)
LIMIT_S = 10.0

ints = st.one_of(
    st.integers(-3, 10),
    st.sampled_from([0, 1, 2**31, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**64), 10**30]),
)
anything = st.one_of(
    ints,
    st.booleans(),
    st.none(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=4),
    st.lists(st.integers(-2, 5), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(-2, 5), max_size=2),
)


class TookTooLong(Exception):
    pass


def _expire(signum: int, frame: Any) -> None:
    raise TookTooLong(f"call ran past {LIMIT_S}s")


def call(fn: Callable[[], Any]) -> None:
    """Run one call under the alarm; raise AssertionError for a forbidden escape or a hang."""
    signal.setitimer(signal.ITIMER_REAL, LIMIT_S)
    try:
        fn()
    except Finding as e:
        raise AssertionError(str(e)) from e
    except FORBIDDEN as e:
        raise AssertionError(f"bare {type(e).__name__}: {e}") from e
    except TookTooLong as e:
        raise AssertionError(str(e)) from e
    except Exception:
        pass  # a clear, typed refusal is the expected outcome for bad arguments
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def targets() -> dict[str, Callable[..., Any]]:
    from meshfeed import DataLoader, DataMesh, Mixture, StreamLoader
    from meshfeed.balance import schedule_documents
    from meshfeed.curriculum.schedule import fixed_linear
    from meshfeed.order import Permutation

    def loader_state(loader_kwargs: dict[str, Any], state: Any) -> None:
        loader = DataLoader(list(range(16)), batch_size=2, **loader_kwargs)
        loader.load_state_dict(state)
        next(iter(loader))

    def stream_state(state: Any) -> None:
        loader = StreamLoader(_stream(), batch_size=2, seed=1)
        loader.load_state_dict(state)
        next(iter(loader))

    return {
        "Permutation": lambda n, seed: Permutation(n, seed)[0],
        "DataMesh.from_sizes": lambda dp, tp: DataMesh.from_sizes(dp=dp, tp=tp),
        "DataLoader": lambda bs, shuffle, seed, drop_last, timeout: next(
            iter(
                DataLoader(
                    list(range(16)),
                    batch_size=bs,
                    shuffle=shuffle,
                    seed=seed,
                    drop_last=drop_last,
                    timeout=timeout,
                )
            )
        ),
        "DataLoader.load_state_dict": loader_state,
        "Mixture": lambda wa, wb: Mixture(
            {"a": list(range(8)), "b": list(range(8))}, {"a": wa, "b": wb}
        ),
        "fixed_linear": lambda lo, hi, steps, at: fixed_linear(lo, hi, steps).difficulty(at),
        "schedule_documents": lambda lengths, ranks, tokens: schedule_documents(
            lengths, num_ranks=ranks, max_tokens=tokens
        ),
        "StreamLoader.load_state_dict": stream_state,
        "SampleStore.load": store_file,
    }


def _store_file() -> tuple[Path, Any, dict[str, Any]]:
    """A saved store (two partitions, groups, a hold, a shared plan, a consumed sample): its
    path, the file's blob and its parsed metadata and value codes."""
    import json

    import torch

    from meshfeed.queue import RankAwareSampler, SampleStore

    store = SampleStore()
    store.put("p", {"x": torch.arange(8).reshape(4, 2), "y": [np.arange(2)] * 4})
    store.put("p", {"z": [1, 2]}, ids=["a", "b"], groups=[0, 0])
    store.get("t", ["x"], 1, "p", timeout=1)
    store.get("t", ["x"], 1, "p", timeout=1, hold=True)
    lead = RankAwareSampler(data_rank=0, replica_rank=0, replica_size=2)
    store.get("r", ["z"], 1, "p", sampler=lead, timeout=1, batch_index=0)
    store.put("q", {"x": [1]})
    path = Path(tempfile.mkdtemp()) / "store"
    store.save(path)
    blob = torch.load(path, weights_only=True)
    return path, blob, {"meta": json.loads(blob["meta"]), "values": json.loads(blob["values"])}


_STORE: list[Any] = []


def store_file(path: tuple[Any, ...], value: Any) -> None:
    """Load a saved store with one value of its metadata or value codes replaced: refused
    with ``ValueError`` (anything else is a finding), or loaded, and then a put of a fresh
    sample adds one sample (never overwrites a held one)."""
    import copy
    import json

    import torch

    from meshfeed.queue import SampleStore

    file, blob, base = _store()
    parts = copy.deepcopy(base)
    target = parts
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    meta, values = json.dumps(parts["meta"]), json.dumps(parts["values"])
    torch.save({**blob, "meta": meta, "values": values}, file)
    try:
        store = SampleStore.load(file)
    except ValueError:
        return
    except Exception as exc:
        raise Finding(f"{type(exc).__name__} (not ValueError): {exc}") from exc
    held = store.stats()["held"]
    try:
        store.put("p", {"x": [torch.zeros(2)], "y": [np.zeros(2)], "z": [0]}, timeout=0.05)
    except (TimeoutError, ValueError):
        return  # a full or closed partition: the put is refused, nothing changed
    if store.stats()["held"] != held + 1:
        raise Finding(f"a fresh put after the load did not add one sample (held {held})")


def _store() -> tuple[Path, Any, dict[str, Any]]:
    if not _STORE:
        _STORE.append(_store_file())
    return _STORE[0]  # type: ignore[no-any-return]


def _stream() -> Any:
    from meshfeed.sources import ShardedStream

    return ShardedStream(
        [lambda: iter(range(10)), lambda: iter(range(100, 110))], shuffle_buffer=4, rows=[10, 10]
    )


def _paths(state: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every key path into the nested dicts and lists of a state."""
    out = [prefix] if prefix else []
    if isinstance(state, dict):
        for k, v in state.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(state, list):
        for i, v in enumerate(state):
            out += _paths(v, (*prefix, i))
    return out


def stream_state_dicts() -> st.SearchStrategy[Any]:
    """A StreamLoader state two batches in, with one value anywhere in it replaced."""
    import copy
    import json

    from meshfeed import StreamLoader

    loader = StreamLoader(_stream(), batch_size=2, seed=1)
    it = iter(loader)
    next(it), next(it)
    base = json.loads(json.dumps(loader.state_dict()))

    def mutate(path: tuple[Any, ...], value: Any) -> Any:
        state = copy.deepcopy(base)
        target = state
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
        return state

    return st.one_of(anything, st.builds(mutate, st.sampled_from(_paths(base)), anything))


def state_dicts() -> st.SearchStrategy[Any]:
    from meshfeed import DataLoader

    base = DataLoader(list(range(16)), batch_size=2).state_dict()

    def mutate(key: str, value: Any) -> dict[str, Any]:
        state = dict(base)
        state[key] = value
        return state

    return st.one_of(
        anything,
        st.builds(mutate, st.sampled_from(sorted(base)), anything),
    )


STRATEGIES: dict[str, tuple[st.SearchStrategy[Any], ...]] = {
    "Permutation": (ints, anything),
    "DataMesh.from_sizes": (anything, anything),
    "DataLoader": (anything, anything, anything, anything, anything),
    "Mixture": (
        st.one_of(anything, st.floats(1e-300, 1e300), st.sampled_from([1e-7, 10**400])),
        st.one_of(anything, st.floats(1e-300, 1e300)),
    ),
    "fixed_linear": (anything, anything, anything, ints),
    "schedule_documents": (st.one_of(anything, st.lists(ints, max_size=5)), anything, anything),
}


def fuzz_target(name: str, fn: Callable[..., Any], examples: int) -> str | None:
    if name == "DataLoader.load_state_dict":
        strategies: tuple[st.SearchStrategy[Any], ...] = (st.fixed_dictionaries({}), state_dicts())
    elif name == "StreamLoader.load_state_dict":
        strategies = (stream_state_dicts(),)
    elif name == "SampleStore.load":
        strategies = (st.sampled_from(_paths(_store()[2])), anything)
    else:
        strategies = STRATEGIES[name]

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
        print_blob=False,
    )
    @given(st.tuples(*strategies))
    def run(args: tuple[Any, ...]) -> None:
        call(lambda: fn(*args))

    try:
        run()
    except AssertionError as e:
        return f"{name}: {e}"
    except Exception as group:  # an exception group: hypothesis found several failures
        parts = getattr(group, "exceptions", [group])
        return f"{name}: " + "; ".join(str(e).splitlines()[0] for e in parts)
    return None


def bit_flips(trials: int, seed: int = 11) -> tuple[int, int, list[str]]:
    from meshfeed.sources.tokens.indexed import IndexedFormatError, TokenCorpus
    from meshfeed.sources.tokens.indexed_write import write_indexed

    rng = np.random.default_rng(seed)
    docs = [rng.integers(0, 60000, rng.integers(0, 40)).tolist() for _ in range(50)]
    refused = identical = 0
    wrong: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        good = write_indexed(Path(tmp) / "good", docs)
        want = [good.document(i).tolist() for i in range(good.num_documents)]
        raw = (Path(tmp) / "good.idx").read_bytes()
        (Path(tmp) / "bad.bin").write_bytes((Path(tmp) / "good.bin").read_bytes())
        for _ in range(trials):
            bit = int(rng.integers(0, len(raw) * 8))
            flipped = bytearray(raw)
            flipped[bit // 8] ^= 1 << (bit % 8)
            (Path(tmp) / "bad.idx").write_bytes(bytes(flipped))
            try:
                corpus = TokenCorpus.open(Path(tmp) / "bad")
            except IndexedFormatError:
                refused += 1
                continue
            except Exception as e:  # any other error is a finding too
                wrong.append(f"bit {bit}: {type(e).__name__}: {e}")
                continue
            got = [corpus.document(i).tolist() for i in range(corpus.num_documents)]
            if got == want:
                identical += 1
            else:
                wrong.append(f"bit {bit}: opened with different tokens")
    return refused, identical, wrong


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="25 examples per target")
    parser.add_argument("--examples", type=int, default=None)
    args = parser.parse_args()
    examples = args.examples or (25 if args.quick else 300)
    signal.signal(signal.SIGALRM, _expire)
    findings = []
    for name, fn in targets().items():
        found = fuzz_target(name, fn, examples)
        print(f"{name:28s} {examples} examples: {'FOUND ' + found if found else 'ok'}")
        if found:
            findings.append(found)
    trials = 100 if args.quick else 400
    refused, identical, wrong = bit_flips(trials)
    print(
        f"{'.idx single-bit flips':28s} {trials} trials: {refused} refused, {identical} "
        f"identical, {len(wrong)} wrong"
    )
    findings.extend(wrong)
    for f in findings:
        print("finding:", f)
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
