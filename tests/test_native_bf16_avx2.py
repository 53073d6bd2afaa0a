"""The bfloat16 kernels' two builds agree bit for bit: AVX2 (x86-64 CPUs that have it, the
default there) and the baseline instruction set.

The other native tests check whichever is in use against numpy; these run both on the
same inputs: every bit pattern (NaNs, infinities, subnormals, ties), ragged tails,
misaligned and in-place operands, two thread counts, the streaming path, all four ops and
the scaled sum, scale and SGD.
"""

from __future__ import annotations

import numpy as np
import pytest

from nccltree import _native as nat
from nccltree.backends.base import BFLOAT16


def _has_avx2() -> bool:
    before = nat.use_avx2()
    try:
        return nat.use_avx2(True)
    finally:
        nat.use_avx2(before)


pytestmark = pytest.mark.skipif(not _has_avx2(), reason="this CPU has no AVX2")

SIZES = [1, 7, 8, 9, 15, 17, 4099, 300_001]
STREAM = 600_001  # bfloat16 elements: a destination over 1 MiB streams its stores


@pytest.fixture
def both():
    """``both(fn)`` runs ``fn`` on the baseline build and on AVX2; returns both results."""
    before = nat.use_avx2()

    def run(fn):
        out = []
        for on in (False, True):
            assert nat.use_avx2(on) is on
            out.append(fn())
        return out

    yield run
    nat.use_avx2(before)


def bf16(n: int, seed: int, every_pattern: bool = True) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if every_pattern:
        return rng.integers(0, 2**16, n + 1, dtype=np.uint16).view(BFLOAT16)
    return rng.uniform(0.5, 2.0, n + 1).astype(BFLOAT16)


def same(a: np.ndarray, b: np.ndarray) -> None:
    """Bitwise equal, except that a NaN only has to be a NaN: which operand's NaN an
    instruction passes on (and so its sign) may differ between the two builds."""
    with np.errstate(invalid="ignore"):
        nan_a, nan_b = np.isnan(a), np.isnan(b)
    np.testing.assert_array_equal(nan_a, nan_b)
    np.testing.assert_array_equal(a.view(np.uint16)[~nan_a], b.view(np.uint16)[~nan_b])


@pytest.mark.parametrize("op", ["sum", "prod", "max", "min"])
def test_reduce_every_size_and_source_count(both, op: str) -> None:
    for n in SIZES:
        for k in (1, 2, 3, 8):
            srcs = [bf16(n, seed=n * 10 + j)[1:] for j in range(k)]  # misaligned views
            a, b = both(lambda: nat.reduce_n(np.empty(n, BFLOAT16), srcs, op, nthreads=2))  # noqa: B023
            same(a, b)


def test_streaming_in_place_scaled_scale_and_sgd(both) -> None:
    srcs = [bf16(STREAM, seed=j, every_pattern=False)[:STREAM] for j in range(4)]
    a, b = both(lambda: nat.reduce_n(np.empty(STREAM, BFLOAT16), srcs, nthreads=2))
    same(a, b)
    a, b = both(lambda: nat.reduce_n(np.empty(STREAM, BFLOAT16), srcs, alpha=1 / 3))
    same(a, b)

    def in_place():
        own = [s.copy() for s in srcs]
        return nat.reduce_n(own[2], own, "max")

    same(*both(in_place))
    x = bf16(4099, seed=5)

    def scaled():
        return nat.scale(x.copy(), 1 / 3, nthreads=2)

    same(*both(scaled))
    w, g, v = (bf16(4099, seed=6 + j, every_pattern=False) for j in range(3))

    def sgd():
        wc, gc, vc = w.copy(), g.copy(), v.copy()
        nat.sgd_update(wc, gc, vc, 0.05, 0.9, 5e-4)
        return np.concatenate([wc, gc, vc])

    same(*both(sgd))
