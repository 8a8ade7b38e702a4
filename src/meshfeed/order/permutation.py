"""A bijective pseudo-random permutation of ``range(n)``, computed per index.

A Feistel network over the smallest number of bits that covers ``n`` (halves of equal or
almost equal width, so the domain is under ``2n``), with cycle walking to stay inside
``range(n)``. Nothing proportional to ``n`` is ever stored: the
permutation is six 64-bit round keys, so shuffling 10**12 samples costs the same memory as
shuffling ten, and ``perm[p]`` for any position ``p`` is computed directly (resume is O(1)).

>>> perm = Permutation(10, seed=3)
>>> sorted(perm[np.arange(10)].tolist()) == list(range(10))
True
>>> perm.inverse(perm[7])
7
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, overload

import numpy as np

_M64 = (1 << 64) - 1
_ROUNDS = 6
_C1 = np.uint64(0xBF58476D1CE4E5B9)
_C2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)


def splitmix64(x: int) -> int:
    """One step of SplitMix64 on a Python int: a fast, well-mixed 64-bit hash."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def check_seed(seed: object, *, name: str = "seed") -> int:
    """``seed`` as an int in ``[0, 2**64)``; ``TypeError`` / ``ValueError`` naming it otherwise.

    Seeds are reduced to 64 bits inside, so ``2**64`` would silently give the order of ``0``;
    refusing it (and bools, floats, strings) keeps two different seeds from meaning one order.
    """
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise TypeError(
            f"{name} must be an int in [0, 2**64) (got {name}={seed!r} of type "
            f"{type(seed).__name__}); pass an integer such as {name}=0"
        )
    value = int(seed)
    if not 0 <= value <= _M64:
        raise ValueError(
            f"{name} must be in [0, 2**64) (got {name}={value!r}); larger or negative seeds "
            "would alias others after 64-bit reduction; reduce it yourself, e.g. seed % 2**64"
        )
    return value


def derive_seed(*parts: int) -> int:
    """Hash a tuple of integers (seed, epoch, op, ...) into one 63-bit seed.

    Every part must be an int (or numpy integer) in ``[0, 2**64)``: ``TypeError`` /
    ``ValueError`` naming the part otherwise.
    """
    h = 0x6A09E667F3BCC908
    for k, p in enumerate(parts):
        h = splitmix64(h ^ check_seed(p, name=f"derive_seed part {k}"))
    return h >> 1


def _mix(x: np.ndarray) -> np.ndarray:
    # SplitMix64 finaliser, vectorised; uint64 arithmetic wraps, which is what we want.
    x = (x ^ (x >> _S30)) * _C1
    x = (x ^ (x >> _S27)) * _C2
    return x ^ (x >> _S31)


class Permutation:
    """A seeded bijection of ``range(n)`` for ``1 <= n < 2**63`` and ``0 <= seed < 2**64``.

    ``perm[i]`` maps a position to an element, for an int or a numpy integer array (the
    array form is vectorised); ``perm.inverse(x)`` maps back. Memory is O(1) in ``n``; a
    lookup costs six Feistel rounds plus, on average, fewer than four cycle-walking steps.
    """

    __slots__ = ("_keys", "_widths", "n", "seed")

    def __init__(self, n: int, seed: int = 0) -> None:
        if not isinstance(n, (int, np.integer)) or not 1 <= n < 2**63:
            raise ValueError(f"Permutation needs 1 <= n < 2**63 (got {n=}); pass a positive size")
        self.n = int(n)
        self.seed = check_seed(seed)
        bits = max(2, (self.n - 1).bit_length())
        # (left, right) widths; an unbalanced split keeps the domain under 2n, so cycle
        # walking needs fewer than two steps on average (a balanced one could need four).
        self._widths = (bits // 2, bits - bits // 2)
        self._keys = [np.uint64(splitmix64(derive_seed(self.seed, r))) for r in range(_ROUNDS)]

    def __repr__(self) -> str:
        return f"Permutation(n={self.n}, seed={self.seed})"

    def __len__(self) -> int:
        return self.n

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        return _encrypt_many(x, self._keys, np.asarray(self._widths, dtype=np.uint64))

    def _decrypt(self, y: np.ndarray) -> np.ndarray:
        wl, wr = self._widths
        if len(self._keys) % 2:
            wl, wr = wr, wl
        left, right = y >> np.uint64(wr), y & np.uint64((1 << wr) - 1)
        for k in reversed(self._keys):
            # inverse of the round above: (L', R') of widths (wl, wr) -> (R' ^ F(L'), L')
            f = _mix(left ^ k) & np.uint64((1 << wr) - 1)
            left, right = right ^ f, left
            wl, wr = wr, wl
        return (left << np.uint64(wr)) | right

    def _walk(self, x: np.ndarray, f: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
        n = np.uint64(self.n)
        y = f(x)
        out = y >= n
        while out.any():
            # Cycle walking: keep applying the permutation of the covering domain until the
            # value falls back into range(n). Restricted this way it stays a bijection.
            idx = np.flatnonzero(out)
            y[idx] = f(y[idx])
            out[idx] = y[idx] >= n
        return y

    def _apply(
        self, positions: int | np.ndarray, step: Callable[[np.ndarray], np.ndarray]
    ) -> int | np.ndarray:
        arr = np.asarray(positions)
        if arr.dtype.kind not in "iu":
            raise TypeError(f"positions must be integers (got dtype {arr.dtype})")
        if arr.size and (arr.min() < 0 or arr.max() >= self.n):
            raise IndexError(
                f"position out of range for a permutation of n={self.n} "
                f"(got values in [{arr.min()}, {arr.max()}])"
            )
        y = self._walk(np.atleast_1d(arr).astype(np.uint64), step).astype(np.int64)
        if arr.ndim == 0:
            return int(y[0])
        return y.reshape(arr.shape)

    @overload
    def __getitem__(self, positions: int) -> int: ...
    @overload
    def __getitem__(self, positions: np.ndarray) -> np.ndarray: ...
    def __getitem__(self, positions: int | np.ndarray) -> int | np.ndarray:
        return self._apply(positions, self._encrypt)

    @overload
    def inverse(self, values: int) -> int: ...
    @overload
    def inverse(self, values: np.ndarray) -> np.ndarray: ...
    def inverse(self, values: int | np.ndarray) -> int | np.ndarray:
        """The position of ``values`` in the permutation (``perm.inverse(perm[i]) == i``)."""
        return self._apply(values, self._decrypt)


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_ONE = np.uint64(1)
# derive_seed's start; 1-D: numpy warns on 0-d values that wrap
_H0 = np.array([0x6A09E667F3BCC908], dtype=np.uint64)


def _splitmix64_array(x: np.ndarray) -> np.ndarray:
    """:func:`splitmix64` of every element of a uint64 array (it wraps as the Python one masks)."""
    return _mix(x + _GOLDEN)


def derive_seeds(*parts: int | np.ndarray) -> np.ndarray:
    """:func:`derive_seed` elementwise: each part an int or an array of ints in ``[0, 2**64)``
    (arrays broadcast); the same values as ``derive_seed`` of each element's parts."""
    h = _H0
    for k, p in enumerate(parts):
        if isinstance(p, np.ndarray):
            if p.size and p.dtype.kind == "i" and int(p.min()) < 0:
                raise ValueError(f"derive_seeds part {k} has negative values; seeds are >= 0")
            h = _splitmix64_array(h ^ p.astype(np.uint64))
        else:
            h = _splitmix64_array(h ^ np.uint64(check_seed(p, name=f"derive_seeds part {k}")))
    return h >> _ONE


def _bit_length(v: np.ndarray) -> np.ndarray:
    """``int.bit_length`` of every element of a uint64 array."""
    v = v.copy()
    out = np.zeros(v.shape, dtype=np.uint64)
    for s in (32, 16, 8, 4, 2, 1):
        big = v >= (_ONE << np.uint64(s))
        v[big] >>= np.uint64(s)
        out[big] += np.uint64(s)
    return out + (v > 0).astype(np.uint64)


def permute_many(sizes: np.ndarray, seeds: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """``Permutation(sizes[i], seeds[i])[positions[i]]`` for every ``i``, in one vectorised pass.

    The same values as the class (``tests/test_permutation.py`` compares them), for callers
    that draw from a different permutation nearly every element: a mixture of 10,000 sources
    built one :class:`Permutation` per source a batch touched (#32). ``sizes`` >= 1, ``seeds``
    in ``[0, 2**64)`` (e.g. from :func:`derive_seeds`), ``0 <= positions < sizes``.
    """
    n = np.asarray(sizes, dtype=np.int64)
    x = np.asarray(positions, dtype=np.int64)
    if n.size and (int(n.min()) < 1 or int(x.min()) < 0 or bool((x >= n).any())):
        raise IndexError(
            f"positions must lie in [0, size) of sizes >= 1 (got sizes in [{int(n.min())}, "
            f"{int(n.max())}], positions in [{int(x.min())}, {int(x.max())}])"
        )
    # Permutation's round keys: splitmix64(derive_seed(seed, r)), the seed step shared
    first_h = _splitmix64_array(_H0 ^ np.asarray(seeds).astype(np.uint64))
    keys = np.stack(
        [
            _splitmix64_array(_splitmix64_array(first_h ^ np.uint64(r)) >> _ONE)
            for r in range(_ROUNDS)
        ]
    )
    bits = np.maximum(np.uint64(2), _bit_length((n - 1).astype(np.uint64)))
    widths = np.stack([bits // np.uint64(2), bits - bits // np.uint64(2)])
    size = n.astype(np.uint64)
    y = _encrypt_many(x.astype(np.uint64), keys, widths)
    out = y >= size
    while out.any():  # cycle walking, as Permutation._walk
        idx = np.flatnonzero(out)
        y[idx] = _encrypt_many(y[idx], keys[:, idx], widths[:, idx])
        out[idx] = y[idx] >= size[idx]
    return y.astype(np.int64)


def _encrypt_many(x: np.ndarray, keys: Iterable[Any], widths: np.ndarray) -> np.ndarray:
    """The Feistel rounds of ``keys`` on ``x`` (uint64), ``widths`` the (left, right) half
    widths: a key per round and a width pair for all elements (:class:`Permutation`), or for
    each element its own (:func:`permute_many`)."""
    wl, wr = widths[0], widths[1]
    left, right = x >> wr, x & ((_ONE << wr) - _ONE)
    for k in keys:
        # (L, R) of widths (wl, wr) -> (R, L ^ F(R)) of widths (wr, wl)
        f = _mix(right ^ k) & ((_ONE << wl) - _ONE)
        left, right = right, left ^ f
        wl, wr = wr, wl
    return (left << wr) | right
