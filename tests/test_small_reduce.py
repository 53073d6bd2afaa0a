"""The host backend's small-message path (numpy ufuncs) matches the native kernels bit for
bit, so a collective's result never depends on which path ran."""

from __future__ import annotations

import numpy as np
import pytest

from nccltree import _native
from nccltree.backends.host import _UFUNCS, _small_reduce


@pytest.mark.parametrize("dtype", ["float32", "float64", "int32", "int64"])
@pytest.mark.parametrize("op", ["sum", "prod", "max", "min"])
@pytest.mark.parametrize("k", [1, 2, 3, 5, 8])
@pytest.mark.slow
def test_small_path_is_bitwise_native(dtype, op, k):
    rng = np.random.default_rng(k)
    n = 1001
    if np.dtype(dtype).kind == "f":
        srcs = [rng.standard_normal(n).astype(dtype) for _ in range(k)]
        srcs[0][3] = np.nan  # NaN propagates the same way
    else:
        srcs = [rng.integers(-3, 4, n).astype(dtype) for _ in range(k)]
    want = np.empty(n, dtype)
    _native.reduce_n(want, srcs, op=op)
    got = np.empty(n, dtype)
    _small_reduce(got, srcs, _UFUNCS[op])
    assert got.tobytes() == want.tobytes()
    # in place, with the destination among the sources (first and last position)
    for pos in {0, k - 1}:
        a = [s.copy() for s in srcs]
        _small_reduce(a[pos], a, _UFUNCS[op])
        assert a[pos].tobytes() == want.tobytes()


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("k", [1, 2, 3, 5, 8])
def test_small_scaled_sum_is_bitwise_native(dtype, k):
    # a mean folded into its sum: the numpy path scales the same way as the kernel
    rng = np.random.default_rng(k)
    n = 1001
    srcs = [rng.standard_normal(n).astype(dtype) for _ in range(k)]
    srcs[0][5] = np.nan
    for alpha in (1 / 3, 0.125, -7.5):
        want = np.empty(n, dtype)
        _native.reduce_n(want, srcs, alpha=alpha)
        got = np.empty(n, dtype)
        _small_reduce(got, srcs, _UFUNCS["sum"], alpha)
        assert got.tobytes() == want.tobytes()
        for pos in {0, k - 1}:
            a = [s.copy() for s in srcs]
            _small_reduce(a[pos], a, _UFUNCS["sum"], alpha)
            assert a[pos].tobytes() == want.tobytes()
