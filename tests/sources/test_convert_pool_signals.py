"""``convert``'s worker pool and a caller that handles SIGTERM in Python (``meshfeed convert``
does): the workers take SIGTERM's default action, and the pool ends without signals.

A forked worker inherited the caller's handler, and a SIGTERM that reached it before its
interpreter was ready was lost: ``Pool.terminate()`` then left it waiting for a task, and the
pool's join hung (seen in the suite, under load)."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from meshfeed.sources.converters import convert as convert_module


def _handler_is_default(_: object) -> bool:
    return signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


@pytest.fixture
def python_sigterm_handler():
    before = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


def test_pool_workers_take_sigterms_default_action_from_their_start(python_sigterm_handler):
    job = convert_module._Job.__new__(convert_module._Job)  # not read by this task
    with convert_module._pool("fork", 2, job) as pool:
        assert all(pool.map(_handler_is_default, range(8), chunksize=1))
        # inherited at fork, before any of the pool's own code ran in the worker
        assert pool.apply(signal.getsignal, (signal.SIGTERM,)) == signal.SIG_DFL
    assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL  # the caller's is back


def test_the_pool_ends_with_close_and_join_not_terminate(monkeypatch, python_sigterm_handler):
    terminated = []
    job = convert_module._Job.__new__(convert_module._Job)
    with convert_module._pool("fork", 2, job) as pool:
        monkeypatch.setattr(pool, "terminate", lambda: terminated.append(True))
        pool.map(_handler_is_default, range(4))
    assert not terminated
    with pytest.raises(KeyError), convert_module._pool("fork", 2, job) as pool:
        real = pool.terminate
        monkeypatch.setattr(pool, "terminate", lambda: (terminated.append(True), real()))
        raise KeyError("an error while converting")
    assert terminated == [True]  # an error terminates it


def test_convert_with_workers_under_a_sigterm_handler(tmp_path: Path, python_sigterm_handler):
    src = tmp_path / "d.jsonl"
    src.write_text("".join(f'{{"text": "doc {i} {"x" * i}"}}\n' for i in range(40)))
    corpus = convert_module.convert(
        src, tmp_path / "c", tokenizer="bytes", num_workers=2, progress=False
    )
    assert len(corpus) == 40
