"""A round's parts computed on demand equal the materialised split; readers' progress."""

from __future__ import annotations

import pytest

from meshfeed.queue.rounds import Progress, Round, split_round
from tests.optional import given, settings, st


def _split_by_units(ids: list[int], parts: int, unit: int) -> list[list[int]]:
    """The rule spelled out: whole units, counts differing by at most one, larger first."""
    units = [ids[i : i + unit] for i in range(0, len(ids), unit)]
    q, r = divmod(len(units), parts)
    out, start = [], 0
    for i in range(parts):
        end = start + q + (1 if i < r else 0)
        out.append([k for u in units[start:end] for k in u])
        start = end
    return out


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 60), st.integers(1, 9), st.integers(1, 4))
def test_round_parts_follow_the_split_rule(n: int, parts: int, unit: int) -> None:
    ids = list(range(100, 100 + n))
    want = _split_by_units(ids, parts, unit)
    rnd = Round(ids, parts, unit)
    assert len(rnd) == parts
    assert [rnd[i] for i in range(parts)] == want
    assert list(rnd) == want == rnd.lists() == split_round(ids, parts, unit)
    assert rnd[-1] == want[-1] and rnd[1:3] == want[1:3]


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 60), st.integers(1, 9), st.integers(1, 4))
def test_a_round_over_a_range_gives_the_lists_of_one_over_a_list(
    n: int, parts: int, unit: int
) -> None:
    """A FIFO round's ids kept as a ``range`` (#32): every part, and every part list, is a
    list equal to the same round's over the ids as a list."""
    ids = range(100, 100 + n)
    rnd, listed = Round(ids, parts, unit), Round(list(ids), parts, unit)
    assert all(type(p) is list for p in rnd) and all(type(p) is list for p in rnd.lists())
    assert list(rnd) == list(listed) and rnd.lists() == listed.lists()
    assert rnd[-1] == listed[-1] and rnd[1:3] == listed[1:3]


def test_round_of_lists_keeps_uneven_parts_and_lists_are_made_once() -> None:
    rnd = Round.of([[3, 1], [7], [2, 9, 4]])
    assert rnd.ids == [3, 1, 7, 2, 9, 4]
    assert [rnd[i] for i in range(3)] == [[3, 1], [7], [2, 9, 4]]
    assert rnd.lists() is rnd.lists()  # shared by every reader, not copied per request
    assert Round.of(rnd) is rnd
    assert Round.of([[5, 6]]).ids == [5, 6]


def test_round_refuses_a_part_out_of_range_and_bad_sizes() -> None:
    with pytest.raises(IndexError, match="part 3 of a round of 3 parts"):
        Round([1, 2, 3], 3)[3]
    with pytest.raises(ValueError, match=r"parts >= 1 and unit >= 1 \(got parts=0"):
        Round([1], 0)


@settings(max_examples=100, deadline=None)
@given(
    st.integers(1, 6),
    st.lists(st.tuples(st.integers(0, 7), st.integers(0, 5)), max_size=60),
)
def test_progress_low_is_the_lowest_position_of_the_current_readers(
    readers: int, moves: list[tuple[int, int]]
) -> None:
    """Readers move forward by steps (a reader at or above ``readers`` is one that is gone
    after a resume on fewer ranks); the heap's answer equals a scan of every reader."""
    asked: dict[int, int] = {}
    progress = Progress(asked, readers)
    for reader, step in moves:
        old = asked.get(reader)
        asked[reader] = (old or 0) + step + (old is not None)
        progress.moved(asked, reader, old)
        current = [at for r, at in asked.items() if r < readers]
        want = min(current) if len(current) == readers else None
        assert progress.low(asked) == want
        assert Progress(asked, readers).low(asked) == want  # rebuilt from the record alike
