"""The kernels' entry points for arguments checked already (the host streams' ops)."""

from __future__ import annotations

import numpy as np
import pytest

from nccltree import _native
from nccltree._errors import NativeError


def test_fast_addr_is_the_array_address():
    a = np.arange(1000, dtype=np.float32)
    ro = a.copy()
    ro.flags.writeable = False
    for x in (a, a[3:], ro, ro[5:], np.empty(0, np.float32), a[:0]):
        assert _native._fast_addr(x) == x.ctypes.data


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64, np.int32, np.int64])
@pytest.mark.parametrize("k", [1, 2, 5, 8])
@pytest.mark.slow
def test_checked_reduce_and_copy_match_the_checked_wrappers(dtype, k):
    rng = np.random.default_rng(k)
    srcs = [(rng.standard_normal(40_001) * 50).astype(dtype) for _ in range(k)]
    for op in ("sum", "max"):
        want, got = np.empty_like(srcs[0]), np.empty_like(srcs[0])
        _native.reduce_n(want, srcs, op=op, nthreads=2)
        _native.reduce_n_checked(got, srcs, op, 2)
        assert got.tobytes() == want.tobytes()
    if np.dtype(dtype).kind == "f":
        want, got = np.empty_like(srcs[0]), np.empty_like(srcs[0])
        _native.reduce_n(want, srcs, nthreads=1, alpha=0.25)
        _native.reduce_n_checked(got, srcs, "sum", 1, 0.25)
        assert got.tobytes() == want.tobytes()
    out = np.empty_like(srcs[0])
    _native.copy_checked(out, srcs[-1], 2)
    assert out.tobytes() == srcs[-1].tobytes()


def test_the_library_still_refuses_a_partial_overlap():
    a = np.arange(10_000, dtype=np.float32)
    with pytest.raises((NativeError, ValueError)):
        _native.copy_checked(a[1:], a[:-1], 1)
    with pytest.raises((NativeError, ValueError)):
        _native.reduce_n_checked(a[1:], [a[:-1]], "sum", 1)
