"""How a worker's failure reads in the main process: a KeyError prints its text and worker
traceback on lines (still caught as KeyError), a result that cannot be pickled says what it was
and the fix, and a KeyboardInterrupt / SystemExit / GeneratorExit raised by a task comes back
as a WorkerError with its type and traceback rather than as a worker that exited."""

from __future__ import annotations

import pickle
import threading
from typing import ClassVar

import pytest

from meshfeed.runtime import WorkerError, WorkerPool, call
from meshfeed.runtime.failures import _reraise, error_text


def test_a_reraised_key_error_prints_its_text_and_stays_a_key_error():
    with pytest.raises(KeyError) as info:
        _reraise(KeyError, "'labels'", "(raised in w 0; worker traceback:)\nTraceback ...")
    text = str(info.value)
    assert text.startswith("'labels'\n\n(raised in w 0") and "\\n" not in text
    assert type(info.value).__name__ == "KeyError" and isinstance(info.value, LookupError)
    again = pickle.loads(pickle.dumps(info.value))  # travels as a plain KeyError
    assert type(again) is KeyError


def test_a_reraised_value_error_is_the_type_itself():
    with pytest.raises(ValueError) as info:
        _reraise(ValueError, "bad", "where")
    assert type(info.value) is ValueError and str(info.value) == "bad\n\nwhere"


class _Hooked(Exception):
    """A user's exception type whose subclasses are registered: never subclassed by us."""

    subclasses: ClassVar[list[type]] = []

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        _Hooked.subclasses.append(cls)

    def __str__(self) -> str:
        return f"hooked: {self.args[0]}"


def test_a_users_type_is_reraised_as_itself_even_where_its_str_differs():
    with pytest.raises(_Hooked) as info:
        _reraise(_Hooked, "bad", "where")
    assert type(info.value) is _Hooked and _Hooked.subclasses == []
    assert str(info.value) == "hooked: bad\n\nwhere"


class _StrExplodes(Exception):
    def __str__(self) -> str:
        raise RuntimeError("str exploded")


def test_error_text_survives_a_str_that_raises():
    assert error_text(ValueError("x")) == "x"
    assert error_text(_StrExplodes()) == "<_StrExplodes, whose str() raised RuntimeError>"


def _key_error() -> None:
    {"a": 1}["labels"]


def _unpicklable() -> dict:
    return {"lock": threading.Lock()}


def _raise_base(kind: str) -> None:
    if kind == "exit":
        raise SystemExit(3)
    if kind == "kbd":
        raise KeyboardInterrupt
    raise GeneratorExit


def test_a_key_error_in_a_worker_reads_on_lines_and_is_caught_as_key_error():
    with WorkerPool(1, timeout=30) as pool:
        pool.start(call)
        pool.submit((_key_error, ()))
        with pytest.raises(KeyError) as info:
            pool.result()
        text = str(info.value)
        assert text.startswith("'labels'\n\n(raised in") and "_key_error" in text


def test_a_result_that_cannot_be_pickled_says_what_it_was_and_the_fix():
    with WorkerPool(1, timeout=30) as pool:
        pool.start(call)
        pool.submit((_unpicklable, ()))
        with pytest.raises(TypeError, match=r"cannot pickle .*what collate_fn returned") as info:
            pool.result()
        assert "num_workers=0" in str(info.value)


def test_a_base_exception_in_a_worker_is_a_worker_error_with_its_type_and_traceback():
    with WorkerPool(1, timeout=30) as pool:
        pool.start(call)
        for kind, name in (
            ("exit", "SystemExit: 3"),
            ("kbd", "KeyboardInterrupt"),
            ("gen", "GeneratorExit"),
        ):
            pool.submit((_raise_base, (kind,)))
            with pytest.raises(WorkerError, match=name) as info:
                pool.result()
            assert "the worker reported it instead of exiting" in str(info.value)
            assert "worker traceback" in str(info.value) and "_raise_base" in str(info.value)
        pool.submit((pow, (3, 2)))
        assert pool.result() == 9  # the worker lives on
