"""StreamLoader ``stats()["unread_rows"]``: every row no data rank was served, whichever option
left it out (``drop_last`` dropping the last global batch, or ``drop_last=False,
pad_last=False`` truncating it to a multiple of the data ranks), and the warning naming it."""

from __future__ import annotations

import logging

import pytest

from meshfeed import StreamLoader
from meshfeed.sources import ShardedStream

ROWS = 42  # 2 shards of 21; global batch 16 on 4 data ranks: a last batch of 10 rows


def _epoch_on_every_rank(drop_last: bool, pad_last: bool, epochs: int = 1):
    served, unread = set(), []
    for rank in range(4):
        stream = ShardedStream([lambda: range(0, 21), lambda: range(21, ROWS)])
        loader = StreamLoader(stream, batch_size=4, mesh={"dp": 4}, rank=rank, shuffle=False,
                              drop_last=drop_last, pad_last=pad_last)  # fmt: skip
        for _ in loader.epochs(epochs):
            for batch in loader:
                served.update(batch.tolist())
        unread.append(loader.stats()["unread_rows"])
        loader.shutdown()
    return served, unread


@pytest.mark.parametrize(
    "drop_last, pad_last, never_served",
    [(True, True, 10), (False, False, 2), (False, True, 0)],
)
def test_unread_rows_counts_every_row_no_rank_was_served(caplog, drop_last, pad_last,
                                                          never_served):  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="meshfeed"):
        served, unread = _epoch_on_every_rank(drop_last, pad_last)
    assert ROWS - len(served) == never_served
    assert unread == [never_served] * 4
    warned = [r.getMessage() for r in caplog.records if "not read by any" in r.getMessage()]
    if not never_served:
        assert not warned
        return
    assert len(warned) == 4  # once per loader
    assert f"{never_served} rows of epoch 0" in warned[0]
    if drop_last:
        assert "drop_last drops" in warned[0] and "Use drop_last=False" in warned[0]
    else:
        assert "pad_last=False truncates" in warned[0] and "Use pad_last=True" in warned[0]


def test_truncated_rows_add_up_over_epochs():
    _, unread = _epoch_on_every_rank(False, False, epochs=2)
    assert unread == [4] * 4
