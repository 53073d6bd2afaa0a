"""The float16 kernels' two implementations agree bit for bit: F16C (x86-64 CPUs that have
it, the default there) and the portable conversions.

The other native tests check whichever is in use against numpy; these run both on the
same inputs — every ragged tail length, misaligned and in-place operands, several thread
counts, the streaming path, all four ops and the scaled sum, scale and SGD.
"""

from __future__ import annotations

import numpy as np
import pytest

from nccltree import _native as nat


def _has_f16c() -> bool:
    before = nat.use_f16c()
    try:
        return nat.use_f16c(True)
    finally:
        nat.use_f16c(before)


pytestmark = pytest.mark.skipif(not _has_f16c(), reason="this CPU has no F16C")

SIZES = [0, 1, 7, 8, 9, 15, 17, 4099, 300_001]
STREAM = 600_001  # float16 elements: a destination over 1 MiB streams its stores


@pytest.fixture
def both():
    """``both(fn)`` runs ``fn`` on the portable code and on F16C; returns both results."""
    before = nat.use_f16c()

    def run(fn):
        out = []
        for on in (False, True):
            assert nat.use_f16c(on) is on
            out.append(fn())
        return out

    yield run
    nat.use_f16c(before)


def halves(n: int, seed: int, every_pattern: bool = True) -> np.ndarray:
    """float16 data: every bit pattern (NaN, inf, subnormals, ties) or normal values."""
    rng = np.random.default_rng(seed)
    if every_pattern:
        return rng.integers(0, 2**16, n + 1, dtype=np.uint16).view(np.float16)
    return rng.uniform(0.5, 2.0, n + 1).astype(np.float16)


def same(a: np.ndarray, b: np.ndarray) -> None:
    """Bitwise equal, except that a NaN only has to be a NaN."""
    nan_a, nan_b = np.isnan(a), np.isnan(b)
    np.testing.assert_array_equal(nan_a, nan_b)
    np.testing.assert_array_equal(a.view(np.uint16)[~nan_a], b.view(np.uint16)[~nan_b])


def test_switch() -> None:
    before = nat.use_f16c()
    try:
        assert nat.use_f16c(False) is False and nat.use_f16c() is False
        assert nat.use_f16c(True) is True and nat.use_f16c(None) is True
    finally:
        nat.use_f16c(before)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("op", ["sum", "prod", "max", "min"])
@pytest.mark.parametrize("k", [1, 2, 3, 8])
@pytest.mark.slow
def test_reduce(both, op: str, k: int, n: int) -> None:
    srcs = [halves(n, j, every_pattern=op != "prod")[:n] for j in range(k)]

    def run():
        dst = np.empty(n, np.float16)
        with np.errstate(all="ignore"):
            nat.reduce_n(dst, srcs, op)
        return dst

    same(*both(run))


@pytest.mark.parametrize("nthreads", [1, 2, 3])
@pytest.mark.parametrize("op", ["sum", "max"])
def test_streaming_threads_misaligned_in_place(both, op: str, nthreads: int) -> None:
    srcs = [halves(STREAM, j) for j in range(3)]

    def run():
        out = []
        dst = np.empty(STREAM + 1, np.float16)
        nat.reduce_n(dst[1:], [s[1:] for s in srcs], op, nthreads)  # misaligned, streams
        out.append(dst[1:])
        acc = srcs[0][:STREAM].copy()
        nat.reduce_n(acc, [acc, srcs[1][:STREAM], srcs[2][:STREAM]], op, nthreads)  # in place
        out.append(acc)
        return out

    (a1, a2), (b1, b2) = both(run)
    same(a1, b1)
    same(a2, b2)


@pytest.mark.parametrize("n", [9, 300_001, STREAM])
@pytest.mark.parametrize("k", [1, 2, 5, 8])
def test_scaled_sum(both, k: int, n: int) -> None:
    srcs = [halves(n, j)[:n] for j in range(k)]

    def run():
        dst = np.empty(n, np.float16)
        nat.reduce_n(dst, srcs, "sum", 2, alpha=1 / k)
        return dst

    same(*both(run))


@pytest.mark.parametrize("n", SIZES)
def test_scale_and_sgd(both, n: int) -> None:
    x, w, g, v = (halves(n, j, every_pattern=False)[:n] for j in range(4))

    def run():
        xs = x.copy()
        nat.scale(xs, 0.3)
        ws, gs, vs = w.copy(), g.copy(), v.copy()
        nat.sgd_update(ws, gs, vs, lr=0.01, momentum=0.9, weight_decay=5e-4)
        return [xs, ws, gs, vs]

    for a, b in zip(*both(run)):
        same(a, b)
