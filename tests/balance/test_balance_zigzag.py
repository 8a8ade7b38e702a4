from __future__ import annotations

import numpy as np
import pytest

from meshfeed.balance.zigzag import pad_unit, padded_length, zigzag_positions


@pytest.mark.parametrize(("cp", "tp"), [(1, 1), (1, 2), (2, 1), (3, 1), (4, 2)])
def test_zigzag_ranks_hold_complementary_chunks_covering_the_padded_document(cp, tp):
    padded = padded_length(37, cp, tp)
    assert padded >= 37 and padded % (2 * cp * tp if cp > 1 else tp) == 0
    held = [zigzag_positions(padded, cp, r) for r in range(cp)]
    assert sorted(np.concatenate(held).tolist()) == list(range(padded))
    assert len({len(h) for h in held}) == 1
    if cp > 1:
        chunk = padded // (2 * cp)
        assert held[0][0] == 0 and held[0][-1] == padded - 1  # rank 0: first and last chunk
        assert held[cp - 1][0] == (cp - 1) * chunk and held[cp - 1][-1] == (cp + 1) * chunk - 1


def test_zigzag_rejects_an_unpadded_document():
    with pytest.raises(ValueError, match="multiple of 4"):
        zigzag_positions(10, cp=2, cp_rank=0)


def test_pad_unit_is_2c_times_tp_for_split_documents_and_tp_otherwise():
    assert pad_unit(1) == 1 and pad_unit(1, tp=4) == 4
    assert pad_unit(3) == 6 and pad_unit(3, tp=2) == 12
    assert padded_length(np.asarray([1, 12, 13]), np.asarray([1, 3, 3])).tolist() == [1, 12, 18]
