"""``distinct`` / ``distinct_inverse`` give ``np.unique``'s answers, without importing numpy.ma."""

from __future__ import annotations

import subprocess
import sys

import numpy as np

from meshfeed.order.distinct import distinct, distinct_inverse
from tests.optional import given, settings, st


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(-(2**62), 2**62), max_size=60), st.integers(1, 3))
def test_distinct_and_its_inverse_equal_np_unique(values, rows):
    arr = np.asarray(values * rows, dtype=np.int64)
    if arr.size % rows == 0 and arr.size:
        arr = arr.reshape(rows, -1)  # not only flat arrays: both flatten
    want, want_inverse = np.unique(arr.ravel(), return_inverse=True)
    got, inverse = distinct_inverse(arr)
    assert np.array_equal(distinct(arr), want) and np.array_equal(got, want)
    assert np.array_equal(inverse, want_inverse) and np.array_equal(got[inverse], arr.ravel())


def test_neither_imports_numpy_ma():
    code = (
        "import sys, numpy as np\n"
        "from meshfeed.order.distinct import distinct, distinct_inverse\n"
        "distinct(np.array([3, 1, 3])); distinct_inverse(np.array([2, 2, 0]))\n"
        "print('numpy.ma' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
