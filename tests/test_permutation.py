import numpy as np
import pytest

from meshfeed.order import Permutation, derive_seed
from meshfeed.order.permutation import derive_seeds, permute_many
from tests.optional import given, settings, st


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7, 8, 9, 100, 255, 256, 257, 1000, 4097])
@pytest.mark.parametrize("seed", [0, 1, 12345])
def test_exhaustive_bijection_small_n(n, seed):
    perm = Permutation(n, seed)
    values = perm[np.arange(n)]
    assert sorted(values.tolist()) == list(range(n))
    assert np.array_equal(perm.inverse(values), np.arange(n))


@settings(max_examples=40, deadline=None)
@given(n=st.integers(min_value=2**40, max_value=2**63 - 1), seed=st.integers(0, 2**63 - 1))
def test_sampled_bijection_huge_n(n, seed):
    perm = Permutation(n, seed)
    rng = np.random.default_rng(seed % 2**32)
    positions = np.unique(rng.integers(0, n, size=2000, dtype=np.int64))
    values = perm[positions]
    assert values.min() >= 0 and values.max() < n
    assert len(np.unique(values)) == len(positions)  # injective on the sample
    assert np.array_equal(perm.inverse(values), positions)


def test_int_and_array_lookups_agree():
    perm = Permutation(10**9, seed=3)
    arr = perm[np.array([0, 5, 10**9 - 1])]
    assert [perm[0], perm[5], perm[10**9 - 1]] == arr.tolist()
    assert isinstance(perm[5], int)


def test_no_positional_correlation():
    n = 100_000
    values = Permutation(n, seed=11)[np.arange(n)].astype(float)
    corr = np.corrcoef(np.arange(n), values)[0, 1]
    assert abs(corr) < 0.02
    # neighbours are not close to each other either
    assert abs(np.corrcoef(values[:-1], values[1:])[0, 1]) < 0.02


def test_first_position_is_uniform_over_seeds():
    n, trials = 10, 20_000
    firsts = np.array([Permutation(n, seed=s)[0] for s in range(trials)])
    counts = np.bincount(firsts, minlength=n)
    expected = trials / n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 30.0  # 9 degrees of freedom: p ~ 4e-4 at 30


def test_seeds_give_different_orders():
    a = Permutation(1000, 0)[np.arange(1000)]
    b = Permutation(1000, 1)[np.arange(1000)]
    assert not np.array_equal(a, b)


@pytest.mark.parametrize("bad", [0, -1, 2**63])
def test_invalid_sizes(bad):
    with pytest.raises(ValueError, match="1 <= n < 2\\*\\*63"):
        Permutation(bad)


def test_out_of_range_positions():
    with pytest.raises(IndexError, match="out of range"):
        Permutation(10)[np.array([10])]


@pytest.mark.parametrize("seed", [2**64, -1, 2**70])
def test_permutation_refuses_seeds_outside_64_bits(seed):
    with pytest.raises(ValueError, match=r"seed must be in \[0, 2\*\*64\)"):
        Permutation(10, seed)


@pytest.mark.parametrize("seed", [True, 1.0, "3", None])
def test_permutation_refuses_non_int_seeds(seed):
    with pytest.raises(TypeError, match="seed must be an int"):
        Permutation(10, seed)


def test_largest_seed_is_accepted_and_differs_from_zero():
    top = Permutation(1000, 2**64 - 1)[np.arange(1000)]
    assert sorted(top.tolist()) == list(range(1000))
    assert not np.array_equal(top, Permutation(1000, 0)[np.arange(1000)])
    assert Permutation(1000, np.uint64(2**64 - 1)).seed == 2**64 - 1


@pytest.mark.parametrize(
    ("parts", "error"),
    [((2**64,), ValueError), ((1, -1), ValueError), ((1.5,), TypeError), ((False,), TypeError)],
)
def test_derive_seed_refuses_bad_parts_by_position(parts, error):
    with pytest.raises(error, match=f"derive_seed part {len(parts) - 1}"):
        derive_seed(*parts)


@settings(max_examples=25, deadline=None)
@given(
    sizes=st.lists(
        st.one_of(st.integers(1, 300), st.integers(2**40, 2**63 - 1)), min_size=1, max_size=60
    ),
    seed=st.integers(0, 2**64 - 1),
)
def test_permute_many_gives_each_element_its_own_permutations_value(sizes, seed):
    """The vectorised fast path (#32) against the class, element by element."""
    rng = np.random.default_rng(seed % 2**32)
    n = np.array(sizes, dtype=np.int64)
    positions = (rng.random(n.size) * n).astype(np.int64).clip(0, n - 1)
    epochs = rng.integers(0, 4, n.size)
    seeds = derive_seeds(seed, 7, np.arange(n.size), epochs)
    assert [int(s) for s in seeds] == [
        derive_seed(seed, 7, i, int(e)) for i, e in enumerate(epochs.tolist())
    ]
    got = permute_many(n, seeds, positions)
    want = [
        Permutation(int(k), int(s))[int(p)] for k, s, p in zip(n, seeds, positions, strict=True)
    ]
    assert got.tolist() == want


def test_permute_many_refuses_a_position_out_of_range_by_name():
    with pytest.raises(IndexError, match=r"positions in \[0, 5\]"):
        permute_many(np.array([3, 5]), np.array([1, 2], dtype=np.uint64), np.array([0, 5]))
    with pytest.raises(ValueError, match="part 1 has negative values"):
        derive_seeds(1, np.array([-1]))
