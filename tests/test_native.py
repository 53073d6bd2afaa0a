"""The host kernel library against numpy: every op, dtype, source count and size,
aliasing, thread counts, float16 rounding, and every bad argument."""

from __future__ import annotations

import ctypes
import functools
import os
import subprocess
import sys

import numpy as np
import pytest

from nccltree import BackendUnavailable, NativeError
from nccltree import _native as nat
from nccltree.backends.base import BFLOAT16, HALF_DTYPES
from nccltree.comm._ops import reference as ops_reference

BF16 = BFLOAT16.type
DTYPES = [np.float16, np.float32, np.float64, np.int32, np.int64, BF16, np.int8, np.uint8]
FLOATS = [np.float16, np.float32, np.float64, BF16]
SIZES = [0, 1, 7, 8, 1023, 4099, 300_001]
BIG = max(SIZES)
KERNEL_OPS = ("sum", "prod", "max", "min")


@functools.cache
def pool(dtype: type, op: str = "sum") -> tuple[np.ndarray, ...]:
    """Eight read-only source arrays of BIG + 1 elements (the +1 allows misaligned views)."""
    rng = np.random.default_rng([DTYPES.index(dtype), list(KERNEL_OPS).index(op)])
    out = []
    for _ in range(nat.MAX_SOURCES):
        if np.dtype(dtype).kind in "iu":
            info = np.iinfo(dtype)
            # the full range, so integer sums and products wrap around
            a = rng.integers(info.min, info.max, BIG + 1, dtype=dtype, endpoint=True)
        elif op == "prod":
            # near 1 so that 8-way float16 products stay mostly finite
            a = rng.uniform(0.5, 2.0, BIG + 1).astype(dtype)
        else:
            a = rng.standard_normal(BIG + 1).astype(dtype)
        a.flags.writeable = False
        out.append(a)
    return tuple(out)


# the package's one numpy reference, with the kernels' rounding: left-to-right op in the
# dtype, float16 accumulated in float32 and rounded once (test_cuda_kernels uses it too)
reference = functools.partial(ops_reference, rounding="kernel")


def assert_bitwise(got: np.ndarray, want: np.ndarray) -> None:
    """Equal bit patterns; NaNs only need to be NaN in the same places."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if got.dtype in nat.FLOAT_DTYPES:
        with np.errstate(invalid="ignore"):  # ml_dtypes' isnan warns on NaN
            nan_got, nan_want = np.isnan(got), np.isnan(want)
        np.testing.assert_array_equal(nan_got, nan_want)
        bits = np.dtype(f"u{got.dtype.itemsize}")
        got, want = got[~nan_got].view(bits), want[~nan_want].view(bits)
    np.testing.assert_array_equal(got, want)


# ---- results ----


@pytest.mark.parametrize("k", range(1, nat.MAX_SOURCES + 1))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("op", list(KERNEL_OPS))
@pytest.mark.slow
def test_reduce_n_matches_numpy(op: str, dtype: type, k: int) -> None:
    src = pool(dtype, op)
    for n in SIZES:
        srcs = [s[:n] for s in src[:k]]
        dst = np.full(n, 3, dtype)
        assert nat.reduce_n(dst, srcs, op) is dst
        assert_bitwise(dst, reference(op, srcs))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_sum_n_and_sum_into(dtype: type) -> None:
    src = pool(dtype)
    for n in SIZES:
        srcs = [s[:n] for s in src[:5]]
        dst = np.empty(n, dtype)
        nat.sum_n(dst, srcs)
        assert_bitwise(dst, reference("sum", srcs))
        acc = srcs[0].copy()
        assert nat.sum_into(acc, srcs[1]) is acc
        assert_bitwise(acc, reference("sum", srcs[:2]))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("op", list(KERNEL_OPS))
@pytest.mark.slow
def test_dst_may_be_a_source(op: str, dtype: type) -> None:
    src = pool(dtype, op)
    for n in (1, 1023, 4099, BIG):
        for where in (0, 2, 3):
            srcs = [s[:n].copy() for s in src[:4]]
            want = reference(op, srcs)
            nat.reduce_n(srcs[where], srcs, op, nthreads=2)
            assert_bitwise(srcs[where], want)
        # the same array twice, and as the destination: x = op(x, x, y)
        x, y = src[0][:n].copy(), src[1][:n]
        want = reference(op, [x, x, y])
        nat.reduce_n(x, [x, x, y], op)
        assert_bitwise(x, want)
        # sum_into onto itself doubles
        z = src[2][:n].copy()
        want = reference("sum", [z, z])
        nat.sum_into(z, z)
        assert_bitwise(z, want)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_misaligned_views(dtype: type) -> None:
    # one-element offsets defeat 16-byte alignment, so the vector loop's peeling is used
    src = pool(dtype)
    for n in (5, 1023, 4099):
        srcs = [src[0][1 : n + 1], src[1][:n], src[2][1 : n + 1]]
        buf = np.zeros(n + 1, dtype)
        dst = buf[1:]
        nat.reduce_n(dst, srcs, "sum")
        assert_bitwise(dst, reference("sum", srcs))
        assert buf[0] == 0


@pytest.mark.parametrize("nthreads", [1, 2, 3])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.slow
def test_thread_counts(dtype: type, nthreads: int) -> None:
    src = pool(dtype)
    for n in (4099, 3 * 16384 + 1, BIG):
        srcs = [s[:n] for s in src[:4]]
        canary = np.full(n + 64, 7, dtype)
        dst = canary[:n]
        nat.reduce_n(dst, srcs, "sum", nthreads=nthreads)
        assert_bitwise(dst, reference("sum", srcs))
        assert (canary[n:] == 7).all()
        out = np.empty(n, dtype)
        nat.copy(out, srcs[3], nthreads=nthreads)
        assert_bitwise(out, srcs[3])


@pytest.mark.parametrize("shape", [(0,), (3, 5), (2, 3, 4)])
def test_multidimensional_arrays_are_flat(shape: tuple[int, ...]) -> None:
    a = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    dst = np.empty(shape, np.float32)
    nat.reduce_n(dst, [a, a, a], "sum")
    np.testing.assert_array_equal(dst, 3 * a)


def test_integer_wraparound() -> None:
    big = np.array([np.iinfo(np.int32).max, np.iinfo(np.int32).min], np.int32)
    one = np.array([1, -1], np.int32)
    dst = np.empty(2, np.int32)
    nat.reduce_n(dst, [big, one], "sum")
    np.testing.assert_array_equal(dst, [np.iinfo(np.int32).min, np.iinfo(np.int32).max])
    two = np.full(1, 2**62, np.int64)
    out = np.empty(1, np.int64)
    nat.reduce_n(out, [two, np.full(1, 4, np.int64)], "prod")
    assert out[0] == 0


@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("op", ["max", "min"])
def test_max_min_propagate_nan(op: str, dtype: type) -> None:
    n = 37
    a = np.arange(n, dtype=dtype)
    b = a[::-1].copy()
    c = np.ones(n, dtype)
    a[3] = b[10] = c[20] = np.nan
    dst = np.empty(n, dtype)
    nat.reduce_n(dst, [a, b, c], op)
    assert_bitwise(dst, reference(op, [a, b, c]))
    assert np.isnan(dst[[3, 10, 20]]).all() and np.isnan(dst).sum() == 3


def test_float16_round_trip_is_exact() -> None:
    every = np.arange(2**16, dtype=np.uint16).view(np.float16)
    out = np.empty_like(every)
    nat.reduce_n(out, [every], "sum")
    assert_bitwise(out, every)


def test_float16_rounding_matches_numpy() -> None:
    # pairs of halves summed in float32 land on ties, subnormals, overflow and NaN/inf
    rng = np.random.default_rng(1)
    bits = rng.integers(0, 2**16, 2**18, dtype=np.uint16)
    a, b = bits.view(np.float16), np.roll(bits, 1).view(np.float16)
    out = np.empty_like(a)
    nat.reduce_n(out, [a, b], "sum")
    assert_bitwise(out, reference("sum", [a, b]))
    edge = np.array([65504, 65504, 2.0**-24, 2.0**-25, -0.0, 1.0], np.float16)
    tiny = np.array([8, 16, 2.0**-25, 2.0**-25, -0.0, 2.0**-11], np.float16)
    out = np.empty_like(edge)
    nat.reduce_n(out, [edge, tiny], "sum")
    assert_bitwise(out, reference("sum", [edge, tiny]))
    assert np.isinf(out[1]) and out[0] == 65504 and np.signbit(out[4])


def test_bfloat16_round_trip_is_exact() -> None:
    every = np.arange(2**16, dtype=np.uint16).view(BFLOAT16)
    out = np.empty_like(every)
    nat.reduce_n(out, [every], "sum")
    assert_bitwise(out, every)
    # NaNs come back as the quiet NaN of their sign, as ml_dtypes narrows them
    with np.errstate(invalid="ignore"):
        nan = np.isnan(every)
    want = np.where(np.signbit(every[nan]), 0xFFC0, 0x7FC0).astype(np.uint16)
    np.testing.assert_array_equal(out[nan].view(np.uint16), want)


def test_bfloat16_rounding_matches_ml_dtypes() -> None:
    # random bit patterns summed in float32 land on ties (to even), subnormals, overflow
    # to infinity and NaN; three sources so that rounding once differs from rounding twice
    rng = np.random.default_rng(2)
    bits = rng.integers(0, 2**16, 2**18, dtype=np.uint16)
    a, b, c = (np.roll(bits, j).view(BFLOAT16) for j in range(3))
    out = np.empty_like(a)
    nat.reduce_n(out, [a, b, c], "sum")
    assert_bitwise(out, reference("sum", [a, b, c]))
    with np.errstate(all="ignore"):
        twice = (a + b) + c  # numpy with ml_dtypes: rounds after each add
    assert (out.view(np.uint16) != twice.view(np.uint16)).sum() > 100
    edge = np.array([3.3895e38, 1.0, 2.0**-133, -0.0, 1.0, 256.0], BFLOAT16)
    tiny = np.array([3e36, 2.0**-9, 2.0**-133, -0.0, 3 * 2.0**-8, 1.0], BFLOAT16)
    out = np.empty_like(edge)
    nat.reduce_n(out, [edge, tiny], "sum")
    assert_bitwise(out, reference("sum", [edge, tiny]))
    # overflow, below half a unit (1 + 2^-9 -> 1), the smallest subnormal doubled,
    # -0 + -0, and two ties to even: 1 + 1.5 units -> 1 + 2 units, 256 + 1 -> 256
    assert np.isinf(out[0]) and out[1] == 1.0 and out[2] == 2.0**-132
    assert np.signbit(out[3]) and out[4] == 1.0 + 2.0**-6 and out[5] == 256.0


@pytest.mark.parametrize("dtype", [np.int8, np.uint8])
def test_8bit_integers_wrap(dtype: type) -> None:
    info = np.iinfo(dtype)
    a = np.array([info.max, info.min, 100, 16, 3], dtype)
    b = np.array([1, info.max, 100, 16, info.max], dtype)
    dst = np.empty_like(a)
    nat.reduce_n(dst, [a, b], "sum")
    np.testing.assert_array_equal(dst, (a.astype(np.int64) + b).astype(dtype))
    nat.reduce_n(dst, [a, b, b], "prod")
    np.testing.assert_array_equal(dst, (a.astype(np.int64) * b * b).astype(dtype))
    nat.reduce_n(dst, [a, b], "max")
    np.testing.assert_array_equal(dst, np.maximum(a, b))
    nat.reduce_n(dst, [a, b], "min")
    np.testing.assert_array_equal(dst, np.minimum(a, b))


# ---- large calls: the streaming-store path ----

# Mirrors of csrc/nccltree_host.c: from these destination sizes a reduction whose dst is not
# one of its sources, and a copy, write dst with non-temporal stores (where SSE2 exists):
# ordinary stores up to dst's first 64-byte line boundary, whole lines streamed from a
# small tile, ordinary stores for the last partial line.  Only the store instruction may
# differ from the plain path, so everything is checked bit for bit, with guard elements on
# both sides of dst to catch a head or tail written past its end.
STREAM_REDUCE_BYTES = 1 << 20
STREAM_COPY_BYTES = 2 << 20
LINE = 64
GUARD = 2 * LINE  # guard bytes on each side of a destination


def stream_n(dtype: type) -> int:
    """Elements of the smallest destination that streams."""
    return STREAM_REDUCE_BYTES // np.dtype(dtype).itemsize


@functools.cache
def big_pool(dtype: type) -> tuple[np.ndarray, ...]:
    """Eight read-only arrays a little over the streaming size, values fit for every op:
    floats of either sign with magnitude in [0.5, 2) (8-way float16 products stay finite)
    and a few NaNs, integers over the full range (sums and products wrap)."""
    n = stream_n(dtype) + 4 * LINE
    rng = np.random.default_rng([7, DTYPES.index(dtype)])
    out = []
    for j in range(nat.MAX_SOURCES):
        if np.dtype(dtype).kind in "iu":
            info = np.iinfo(dtype)
            a = rng.integers(info.min, info.max, n, dtype=dtype, endpoint=True)
        else:
            sign = rng.choice(np.array([-1.0, 1.0]), n)
            a = (sign * rng.uniform(0.5, 2.0, n)).astype(dtype)
            a[[3 + j, n // 2 + j, n - 5 - j]] = np.nan  # head, body and tail of a line run
        a.flags.writeable = False
        out.append(a)
    return tuple(out)


def guarded(n: int, dtype: type, offset: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(buffer, dst): dst = n elements at element ``offset`` inside a buffer whose other
    elements hold a sentinel bit pattern."""
    pad = GUARD // np.dtype(dtype).itemsize
    buf = np.full((n + 2 * pad) * np.dtype(dtype).itemsize, 0xA5, np.uint8).view(dtype)
    return buf, buf[pad + offset : pad + offset + n]


def assert_guards_intact(buf: np.ndarray, dst: np.ndarray) -> None:
    raw = buf.view(np.uint8)
    start = dst.__array_interface__["data"][0] - buf.__array_interface__["data"][0]
    outside = np.concatenate([raw[:start], raw[start + dst.nbytes :]])
    assert outside.size > 0 and (outside == 0xA5).all(), "a store landed outside dst"


@pytest.mark.parametrize("k", range(1, nat.MAX_SOURCES + 1))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("op", list(KERNEL_OPS))
@pytest.mark.slow
def test_large_reduce_matches_numpy(op: str, dtype: type, k: int) -> None:
    src = big_pool(dtype)
    base = stream_n(dtype)
    # (elements, dst offset, first source offset): line-aligned dst of exactly the
    # threshold; an odd size with dst one element past a line boundary (a[1:]) and the
    # sources at other offsets, so a head, whole lines, a partial last tile and a tail run
    for n, d_off, s_off in ((base, 0, 0), (base + 2 * LINE + 1, 1, 3)):
        srcs = [s[s_off + j % 3 : s_off + j % 3 + n] for j, s in enumerate(src[:k])]
        buf, dst = guarded(n, dtype, d_off)
        assert nat.reduce_n(dst, srcs, op) is dst
        assert_bitwise(dst, reference(op, srcs))
        assert_guards_intact(buf, dst)


@pytest.mark.parametrize("nthreads", [2, 3])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.slow
def test_large_reduce_threads(dtype: type, nthreads: int) -> None:
    # an unaligned dst gives every parallel block its own head and tail, written by
    # whichever thread takes the neighbouring block
    src = big_pool(dtype)
    n = stream_n(dtype) + 3 * LINE - 1
    for k, d_off in ((2, 0), (2, 1), (5, 3)):
        srcs = [s[j % 2 : j % 2 + n] for j, s in enumerate(src[:k])]
        buf, dst = guarded(n, dtype, d_off)
        nat.reduce_n(dst, srcs, "sum", nthreads=nthreads)
        assert_bitwise(dst, reference("sum", srcs))
        assert_guards_intact(buf, dst)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("op", list(KERNEL_OPS))
@pytest.mark.slow
def test_large_reduce_in_place(op: str, dtype: type) -> None:
    # dst among the sources (first, middle, last) takes the plain path; same results
    src = big_pool(dtype)
    n = stream_n(dtype) + 5
    for where in (0, 2, 3):
        buf, dst = guarded(n, dtype, 1)
        srcs = [s[:n] for s in src[:4]]
        dst[...] = srcs[where]
        want = reference(op, srcs)
        srcs[where] = dst
        nat.reduce_n(dst, srcs, op, nthreads=2)
        assert_bitwise(dst, want)
        assert_guards_intact(buf, dst)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int64])
def test_large_reduce_dst_not_element_aligned(dtype: type) -> None:
    # a dst one byte off its element size never reaches a line boundary on an element,
    # so it cannot stream and must fall back to ordinary stores
    src = big_pool(dtype)
    n = stream_n(dtype) + 3
    itemsize = np.dtype(dtype).itemsize
    raw = bytearray(n * itemsize + 1)
    dst = np.frombuffer(raw, dtype, count=n, offset=1)
    assert dst.flags.writeable and dst.__array_interface__["data"][0] % itemsize
    srcs = [s[:n] for s in src[:3]]
    nat.reduce_n(dst, srcs, "sum", nthreads=2)
    assert_bitwise(dst, reference("sum", srcs))


@pytest.mark.parametrize("nthreads", [1, 2, 3])
def test_large_copy(nthreads: int) -> None:
    rng = np.random.default_rng(3)
    data = rng.integers(0, 256, STREAM_COPY_BYTES + 3 * LINE, dtype=np.uint8)
    # exactly the threshold, line-aligned; odd sizes with dst and src at unrelated offsets
    for nbytes, d_off, s_off in (
        (STREAM_COPY_BYTES, 0, 0),
        (STREAM_COPY_BYTES + LINE + 1, 1, 0),
        (STREAM_COPY_BYTES + 7, 17, 5),
        (STREAM_COPY_BYTES + 2 * LINE - 1, LINE - 1, 2),
    ):
        src = data[s_off : s_off + nbytes]
        buf, dst = guarded(nbytes, np.uint8, d_off)
        assert nat.copy(dst, src, nthreads=nthreads) is dst
        np.testing.assert_array_equal(dst, src)
        assert_guards_intact(buf, dst)
    # typed and unaligned: float16 a[1:]
    h = data[: STREAM_COPY_BYTES + 2].view(np.float16)
    out = np.empty(h.size - 1, np.float16)
    nat.copy(out, h[1:], nthreads=nthreads)
    assert_bitwise(out, h[1:])


# ---- scale and SGD ----


@pytest.mark.parametrize("nthreads", [1, 3])
@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: np.dtype(d).name)
def test_scale(dtype: type, nthreads: int) -> None:
    wide = np.float32 if dtype in HALF_DTYPES else dtype
    for n in SIZES:
        for alpha in (0.25, 1 / 3, -7.5):
            x = pool(dtype)[0][:n].copy()
            want = (x.astype(wide) * wide(alpha)).astype(dtype)
            assert nat.scale(x, alpha, nthreads=nthreads) is x
            assert_bitwise(x, want)


@pytest.mark.parametrize("nthreads", [1, 2, 3])
@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: np.dtype(d).name)
def test_sgd_update_matches_caffe_rule(dtype: type, nthreads: int) -> None:
    wide = np.float32 if dtype in HALF_DTYPES else dtype
    lr, mom, wd = 0.05, 0.9, 5e-4
    src = pool(dtype)
    for n in SIZES:
        w, g, v = (s[:n].copy() for s in src[:3])
        wf, gf, vf = (a.astype(wide) for a in (w, g, v))
        gf = gf + wide(wd) * wf
        vf = wide(mom) * vf + wide(lr) * gf
        wf = wf - vf
        assert nat.sgd_update(w, g, v, lr, mom, wd, nthreads=nthreads) is w
        assert_bitwise(g, gf.astype(dtype))
        assert_bitwise(v, vf.astype(dtype))
        assert_bitwise(w, wf.astype(dtype))


@pytest.mark.parametrize("dtype", [np.uint8, np.float32, np.complex64, np.int64])
def test_copy_any_dtype(dtype: type) -> None:
    for n in (0, 1, 13, 100_003):
        src = (np.arange(n) % 251).astype(dtype)
        dst = np.zeros(n, dtype)
        assert nat.copy(dst, src, nthreads=2) is dst
        np.testing.assert_array_equal(dst, src)
    same = np.arange(10.0)
    nat.copy(same, same)
    np.testing.assert_array_equal(same, np.arange(10.0))


# ---- scaled sum (a mean in one pass) ----

ALPHAS = (1 / 3, 0.25, -7.5)


def two_pass(srcs: list[np.ndarray], alpha: float, nthreads: int = 1) -> np.ndarray:
    """The form the scaled sum replaces: the sum, then a scale pass over it."""
    out = np.empty_like(srcs[0])
    nat.reduce_n(out, srcs, nthreads=nthreads)
    return nat.scale(out, alpha, nthreads=nthreads)


def one_rounding(srcs: list[np.ndarray], alpha: float) -> np.ndarray:
    """float16: the float32 sum times float32(alpha), rounded to float16 once."""
    return reference("sum", srcs, alpha=alpha)


@pytest.mark.parametrize("k", range(1, nat.MAX_SOURCES + 1))
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=lambda d: np.dtype(d).name)
def test_scaled_sum_is_bitwise_sum_then_scale(dtype: type, k: int) -> None:
    srcs = list(pool(dtype)[:k])
    for n in SIZES:
        part = [s[:n] for s in srcs]
        for alpha in ALPHAS:
            dst = np.empty(n, dtype)
            assert nat.reduce_n(dst, part, alpha=alpha) is dst
            assert_bitwise(dst, two_pass(part, alpha))
    # in place, dst one of the sources, several threads
    n = 4099
    own = [s[:n].copy() for s in srcs]
    want = two_pass(own, 1 / 3)
    nat.reduce_n(own[-1], own, alpha=1 / 3, nthreads=3)
    assert_bitwise(own[-1], want)


@pytest.mark.parametrize("nthreads", [1, 2])
@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: np.dtype(d).name)
@pytest.mark.slow
def test_large_scaled_sum_streams_with_the_same_result(dtype: type, nthreads: int) -> None:
    # out of place from 1 MiB: the streaming-store path; an element offset puts the line
    # boundary inside the range, and guards catch stores outside dst
    n = stream_n(dtype) + 2 * LINE + 3
    for k in range(1, nat.MAX_SOURCES + 1):
        srcs = [s[:n] for s in big_pool(dtype)[:k]]
        buf, dst = guarded(n, dtype, offset=k % 3)
        alpha = 0.125 if k % 2 else 1 / 3
        nat.reduce_n(dst, srcs, nthreads=nthreads, alpha=alpha)
        want = one_rounding(srcs, alpha) if dtype in HALF_DTYPES else two_pass(srcs, alpha)
        assert_bitwise(dst, want)
        assert_guards_intact(buf, dst)


@pytest.mark.parametrize("k", [1, 2, 5, 8])
def test_scaled_sum_float16_rounds_once(k: int) -> None:
    srcs = [s[:300_001] for s in pool(np.float16)[:k]]
    for alpha in ALPHAS:
        dst = np.empty(300_001, np.float16)
        nat.reduce_n(dst, srcs, alpha=alpha, nthreads=2)
        assert_bitwise(dst, one_rounding(srcs, alpha))
        # the two-pass form rounds the sum to float16 first: at most one unit apart
        two = two_pass(srcs, alpha).astype(np.float32)
        exact = sum(s.astype(np.float64) for s in srcs) * alpha
        np.testing.assert_allclose(dst.astype(np.float32), two, rtol=2e-3, atol=2e-3)
        # and never further from the exact value
        err_one = np.abs(dst.astype(np.float64) - exact)
        err_two = np.abs(two.astype(np.float64) - exact)
        assert err_one.max() <= err_two.max()


def test_scaled_sum_refuses_integers_and_other_ops() -> None:
    i32 = np.zeros(8, np.int32)
    with pytest.raises(TypeError, match="accepted: float16, float32, float64, bfloat16$"):
        nat.reduce_n(i32, [i32], alpha=0.5)
    with pytest.raises(TypeError, match="accepted: float16, float32, float64, bfloat16$"):
        nat.reduce_n(np.zeros(8, np.int8), [np.zeros(8, np.int8)], alpha=0.5)
    with pytest.raises(ValueError, match="op='sum'"):
        nat.reduce_n(F32.copy(), [F32], op="max", alpha=0.5)
    with pytest.raises(TypeError, match="alpha"):
        nat.reduce_n(F32.copy(), [F32], alpha="0.5")
    with pytest.raises(TypeError, match="alpha"):
        nat.reduce_n(F32.copy(), [F32], alpha=True)
    lib = nat.library()
    a, b = np.zeros(8, np.float32), np.ones(8, np.float32)
    pa = a.ctypes.data
    cases = [
        (lib.nt_reduce_n_scaled(0, 3, pa, _ptrs(b), 1, 8, 0.5, 1), nat.ERR_UNSUPPORTED),
        (lib.nt_reduce_n_scaled(0, 4, pa, _ptrs(b), 1, 8, 0.5, 1), nat.ERR_UNSUPPORTED),
        (lib.nt_reduce_n_scaled(0, 6, pa, _ptrs(b), 1, 8, 0.5, 1), nat.ERR_UNSUPPORTED),
        (lib.nt_reduce_n_scaled(0, 7, pa, _ptrs(b), 1, 8, 0.5, 1), nat.ERR_UNSUPPORTED),
        (lib.nt_reduce_n_scaled(0, 8, pa, _ptrs(b), 1, 8, 0.5, 1), nat.ERR_DTYPE),
        (lib.nt_reduce_n_scaled(0, 9, pa, _ptrs(b), 1, 8, 0.5, 1), nat.ERR_DTYPE),
        (lib.nt_reduce_n_scaled(1, 1, pa, _ptrs(b), 1, 8, 0.5, 1), nat.ERR_OP),
        (lib.nt_reduce_n_scaled(2, 1, pa, _ptrs(b), 1, 8, 0.5, 1), nat.ERR_OP),
        (lib.nt_reduce_n_scaled(4, 1, pa, _ptrs(b), 1, 8, 0.5, 1), nat.ERR_OP),
        (lib.nt_reduce_n_scaled(0, 1, pa, _ptrs(b), 0, 8, 0.5, 1), nat.ERR_NSOURCES),
        (lib.nt_reduce_n_scaled(0, 1, pa, _ptrs(b), 1, -1, 0.5, 1), nat.ERR_SIZE),
        (lib.nt_reduce_n_scaled(0, 1, None, _ptrs(b), 1, 8, 0.5, 1), nat.ERR_NULL),
        (lib.nt_reduce_n_scaled(0, 1, pa, _ptrs(b), 1, 8, 0.5, 0), nat.ERR_THREADS),
        (lib.nt_reduce_n_scaled(0, 1, pa + 4, _ptrs(a), 1, 4, 0.5, 1), nat.ERR_OVERLAP),
    ]
    for i, (status, want) in enumerate(cases):
        assert status == want, f"case {i}: status {status}, expected {want}"
    np.testing.assert_array_equal(a, 0)
    assert lib.nt_reduce_n_scaled(0, 1, None, None, 1, 0, 0.5, 1) == nat.OK
    assert lib.nt_reduce_n_scaled(0, 1, pa, _ptrs(b), 1, 8, 0.5, 1) == nat.OK
    np.testing.assert_array_equal(a, 0.5)


def test_alpha_one_is_the_plain_reduce(monkeypatch) -> None:
    lib = nat.library()

    def refuse(*args):
        raise AssertionError("alpha=1 must not call the scaled kernel")

    monkeypatch.setattr(lib, "nt_reduce_n_scaled", refuse)
    for dtype in DTYPES:
        srcs = [s[:1023] for s in pool(dtype)[:3]]
        for op in KERNEL_OPS:
            dst = np.empty(1023, dtype)
            nat.reduce_n(dst, srcs, op=op, alpha=1.0)
            assert_bitwise(dst, reference(op, srcs))
    ints = [s[:7] for s in pool(np.int32)[:2]]
    nat.reduce_n(np.empty(7, np.int32), ints, alpha=1)  # an int 1 is alpha 1 too


# ---- bad arguments: Python checks ----

F32 = np.zeros(8, np.float32)


def ro(a: np.ndarray) -> np.ndarray:
    a = a.copy()
    a.flags.writeable = False
    return a


@pytest.mark.parametrize(
    ("call", "exc", "match"),
    [
        (lambda: nat.reduce_n([0.0] * 8, [F32]), TypeError, "numpy.ndarray"),
        (lambda: nat.reduce_n(np.zeros(16, np.float32)[::2], [F32]), ValueError, "C-contiguous"),
        (
            lambda: nat.reduce_n(np.zeros((4, 2), np.float32, order="F"), [F32]),
            ValueError,
            "C-contiguous",
        ),
        (lambda: nat.reduce_n(ro(F32), [F32]), ValueError, "writeable"),
        (
            lambda: nat.reduce_n(np.zeros(8, np.uint16), [np.zeros(8, np.uint16)]),
            TypeError,
            "accepted: float16",
        ),
        (lambda: nat.reduce_n(F32.copy(), [np.zeros(8, np.float64)]), TypeError, "dtype"),
        (lambda: nat.reduce_n(F32.copy(), [np.zeros(9, np.float32)]), ValueError, "elements"),
        (lambda: nat.reduce_n(F32.copy(), []), ValueError, "1 to 8 sources"),
        (lambda: nat.reduce_n(F32.copy(), [F32] * 9), ValueError, "1 to 8 sources"),
        (lambda: nat.reduce_n(F32.copy(), F32), TypeError, "list or tuple"),
        (lambda: nat.reduce_n(F32.copy(), [F32[::2].repeat(2)[::-1]]), ValueError, "C-contiguous"),
        (lambda: nat.reduce_n(F32.copy(), [F32], op="mean"), ValueError, "sum, prod, max, min"),
        (lambda: nat.reduce_n(F32.copy(), [F32], op=0), ValueError, "one of"),
        (lambda: nat.reduce_n(F32.copy(), [F32], nthreads=0), ValueError, "nthreads"),
        (lambda: nat.reduce_n(F32.copy(), [F32], nthreads=1.5), TypeError, "nthreads"),
        (lambda: nat.reduce_n(F32.copy(), [F32], nthreads=True), TypeError, "nthreads"),
        (lambda: nat.sum_into(F32.copy(), np.zeros(8, np.int32)), TypeError, "dtype"),
        (
            lambda: nat.scale(np.zeros(4, np.int32), 2.0),
            TypeError,
            "accepted: float16, float32, float64",
        ),
        (lambda: nat.scale(F32.copy(), "2"), TypeError, "alpha"),
        (lambda: nat.scale(ro(F32), 2.0), ValueError, "writeable"),
        (
            lambda: nat.sgd_update(F32.copy(), F32.copy(), np.zeros(7, np.float32), 0.1, 0.9, 0.0),
            ValueError,
            "elements",
        ),
        (
            lambda: nat.sgd_update(F32.copy(), F32.copy(), F32.copy(), None, 0.9, 0.0),
            TypeError,
            "lr",
        ),
        (
            lambda: nat.sgd_update(
                np.zeros(8, np.int64), np.zeros(8, np.int64), np.zeros(8, np.int64), 0.1, 0.9, 0.0
            ),
            TypeError,
            "accepted",
        ),
        (lambda: nat.copy(F32.copy(), np.zeros(8, np.int32)), TypeError, "dtype"),
        (lambda: nat.copy(F32.copy(), np.zeros(4, np.float32)), ValueError, "elements"),
    ],
)
def test_bad_arguments(call, exc: type[Exception], match: str) -> None:
    with pytest.raises(exc, match=match):
        call()


def test_overlap_is_rejected_but_identity_allowed() -> None:
    buf = np.arange(16, dtype=np.float32)
    with pytest.raises(ValueError, match="overlap"):
        nat.reduce_n(buf[1:9], [buf[:8]])
    with pytest.raises(ValueError, match="overlap"):
        nat.copy(buf[:8], buf[4:12])
    with pytest.raises(ValueError, match="non-overlapping"):
        nat.sgd_update(buf[:8], buf[8:], buf[:8], 0.1, 0.9, 0.0)
    with pytest.raises(ValueError, match="non-overlapping"):
        nat.sgd_update(buf[:8], buf[4:12], np.zeros(8, np.float32), 0.1, 0.9, 0.0)
    np.testing.assert_array_equal(buf, np.arange(16, dtype=np.float32))


# ---- bad arguments: C statuses and check() ----


def _ptrs(*arrays: np.ndarray):
    return (ctypes.c_void_p * len(arrays))(*(a.ctypes.data for a in arrays))


def test_c_statuses_map_to_exceptions() -> None:
    lib = nat.library()
    a, b = np.zeros(8, np.float32), np.ones(8, np.float32)
    pa, pb = a.ctypes.data, b.ctypes.data
    cases = [
        (lib.nt_reduce_n(0, 9, pa, _ptrs(b), 1, 8, 1), nat.ERR_DTYPE, TypeError),
        (lib.nt_reduce_n(4, 1, pa, _ptrs(b), 1, 8, 1), nat.ERR_OP, ValueError),
        (lib.nt_reduce_n(-1, 1, pa, _ptrs(b), 1, 8, 1), nat.ERR_OP, ValueError),
        (lib.nt_reduce_n(0, 1, pa, _ptrs(b), 0, 8, 1), nat.ERR_NSOURCES, ValueError),
        (lib.nt_reduce_n(0, 1, pa, _ptrs(*[b] * 9), 9, 8, 1), nat.ERR_NSOURCES, ValueError),
        (lib.nt_reduce_n(0, 1, pa, _ptrs(b), 1, -1, 1), nat.ERR_SIZE, ValueError),
        (lib.nt_reduce_n(0, 1, None, _ptrs(b), 1, 8, 1), nat.ERR_NULL, ValueError),
        (lib.nt_reduce_n(0, 1, pa, None, 1, 8, 1), nat.ERR_NULL, ValueError),
        (
            lib.nt_reduce_n(0, 1, pa, (ctypes.c_void_p * 2)(pb, None), 2, 8, 1),
            nat.ERR_NULL,
            ValueError,
        ),
        (lib.nt_reduce_n(0, 1, pa, _ptrs(b), 1, 8, 0), nat.ERR_THREADS, ValueError),
        (lib.nt_reduce_n(0, 1, pa + 4, _ptrs(a), 1, 4, 1), nat.ERR_OVERLAP, ValueError),
        (lib.nt_sum_into(8, pa, pb, 8, 1), nat.ERR_DTYPE, TypeError),
        (lib.nt_sum_n(1, pa, _ptrs(b), 9, 8, 1), nat.ERR_NSOURCES, ValueError),
        (lib.nt_scale(3, pa, 2.0, 8, 1), nat.ERR_UNSUPPORTED, TypeError),
        (lib.nt_scale(6, pa, 2.0, 8, 1), nat.ERR_UNSUPPORTED, TypeError),
        (lib.nt_scale(7, pa, 2.0, 8, 1), nat.ERR_UNSUPPORTED, TypeError),
        (lib.nt_sgd_update(7, pa, pb, pa, 0.1, 0.9, 0.0, 8, 1), nat.ERR_UNSUPPORTED, TypeError),
        (lib.nt_scale(1, None, 2.0, 8, 1), nat.ERR_NULL, ValueError),
        (lib.nt_sgd_update(4, pa, pb, pa, 0.1, 0.9, 0.0, 8, 1), nat.ERR_UNSUPPORTED, TypeError),
        (lib.nt_sgd_update(1, pa, pb, pa, 0.1, 0.9, 0.0, 8, 1), nat.ERR_OVERLAP, ValueError),
        (lib.nt_sgd_update(1, pa, pb, None, 0.1, 0.9, 0.0, 8, 1), nat.ERR_NULL, ValueError),
        (lib.nt_copy(pa, pb, -1, 1), nat.ERR_SIZE, ValueError),
        (lib.nt_copy(pa, pb, 8, 0), nat.ERR_THREADS, ValueError),
        (lib.nt_copy(pa, pa + 4, 16, 1), nat.ERR_OVERLAP, ValueError),
        (lib.nt_copy(None, pb, 8, 1), nat.ERR_NULL, ValueError),
    ]
    for i, (status, want, exc) in enumerate(cases):
        assert status == want, f"case {i}: status {status}, expected {want}"
        with pytest.raises(exc, match=f"status {want}"):
            nat.check(status, f"case {i}")
    # nothing was written by a rejected call
    np.testing.assert_array_equal(a, 0)
    # a zero count needs no pointers
    assert lib.nt_reduce_n(0, 1, None, None, 1, 0, 1) == nat.OK
    assert lib.nt_copy(None, None, 0, 1) == nat.OK


def test_check_and_strerror() -> None:
    nat.check(nat.OK)
    names = {nat.strerror(s) for s in range(nat.ERR_INTERNAL + 1)}
    assert len(names) == nat.ERR_INTERNAL + 1
    assert nat.strerror(12345) == "unknown status"
    for status in (nat.ERR_INTERNAL, 12345, -1):
        with pytest.raises(NativeError, match=f"status {status}"):
            nat.check(status)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
@pytest.mark.subprocess
def test_forked_child_can_run_kernels() -> None:
    # the OpenMP pool does not survive fork(); without the library's guard the child hangs
    code = """if True:
        import os, numpy as np
        from nccltree import _native as nat
        a = np.ones(1 << 18, np.float32)
        d = np.empty_like(a)
        nat.reduce_n(d, [a, a], nthreads=2)
        pid = os.fork()
        if pid == 0:
            nat.reduce_n(d, [a, a, a], nthreads=2)
            os._exit(0 if (d == 3).all() else 1)
        _, status = os.waitpid(pid, 0)
        raise SystemExit(os.waitstatus_to_exitcode(status))
    """
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# ---- finding the library ----


def test_library_is_found_in_any_package_directory(tmp_path) -> None:
    first, second = tmp_path / "src", tmp_path / "site"
    (first / "_lib").mkdir(parents=True)
    (second / "_lib").mkdir(parents=True)
    lib = second / "_lib" / nat._LIB_NAMES[0]
    lib.write_bytes(b"")
    assert nat._find_library([first, second]) == lib
    assert nat._find_library([first]) is None
    assert nat.library_path().parent.name == "_lib"


def test_missing_library_raises_backend_unavailable(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(nat, "_package_dirs", lambda: [tmp_path])
    monkeypatch.setattr(nat, "_lib", None)
    with pytest.raises(BackendUnavailable, match="pip install"):
        nat.library()
    with pytest.raises(BackendUnavailable):
        nat.reduce_n(F32.copy(), [F32])


def test_broken_library_raises_backend_unavailable(monkeypatch, tmp_path) -> None:
    (tmp_path / "_lib").mkdir()
    (tmp_path / "_lib" / nat._LIB_NAMES[0]).write_bytes(b"not a shared library")
    monkeypatch.setattr(nat, "_package_dirs", lambda: [tmp_path])
    monkeypatch.setattr(nat, "_lib", None)
    with pytest.raises(BackendUnavailable, match="cannot load"):
        nat.library()


# ---- gather ----


def _gather_sources(sizes: list[int], seed: int = 5) -> list[memoryview]:
    rng = np.random.default_rng(seed)
    return [memoryview(rng.integers(0, 256, n, dtype=np.uint8).tobytes()) for n in sizes]


@pytest.mark.parametrize("nthreads", [1, 2, 3])
@pytest.mark.parametrize(
    "sizes",
    [
        [5],  # k = 1
        [1, 63, 64, 65, 0, 127, 3],  # odd sizes, an empty range among them
        [40000] * 7 + [1],  # above a thread block, below streaming
        [65536 - 64] * 40 + [17],  # streaming total, pieces not line-aligned in dst
        [STREAM_COPY_BYTES + 3 * LINE + 5],  # one range over many thread blocks
    ],
)
def test_gather_is_bitwise(sizes: list[int], nthreads: int) -> None:
    views = _gather_sources(sizes)
    want = np.frombuffer(b"".join(views), np.uint8)
    for offset in (0, 3):
        buf, dst = guarded(want.size, np.uint8, offset)
        assert nat.gather(dst, views, nthreads=nthreads) is dst
        np.testing.assert_array_equal(dst, want)
        assert_guards_intact(buf, dst)


def test_gather_takes_any_buffer_object() -> None:
    f = np.arange(6, dtype=np.float32)
    views = [b"ab", bytearray(b"cd"), memoryview(b"xyz")[1:], f, f[2:].view(np.uint8)]
    dst = np.empty(2 + 2 + 2 + 24 + 16, np.uint8)
    nat.gather(dst, views, nthreads=2)
    assert bytes(dst) == b"abcdyz" + f.tobytes() + f[2:].tobytes()
    typed = np.empty(6, np.float32)  # dst of any dtype: sizes count bytes
    nat.gather(typed, (f[:2], f[2:]))
    assert_bitwise(typed, f)


def test_gather_empty() -> None:
    dst = np.empty(0, np.uint8)
    assert nat.gather(dst, []) is dst
    assert nat.gather(dst, [b"", memoryview(b"")], nthreads=2) is dst
    lib = nat.library()
    assert lib.nt_gather(None, None, None, 0, 1) == nat.OK
    zero = (ctypes.c_int64 * 2)(0, 0)
    assert lib.nt_gather(None, (ctypes.c_void_p * 2)(None, None), zero, 2, 1) == nat.OK


@pytest.mark.parametrize(
    ("call", "exc", "match"),
    [
        (lambda: nat.gather(b"1234", [b"1234"]), TypeError, "numpy.ndarray"),
        (lambda: nat.gather(ro(F32), [bytes(32)]), ValueError, "writeable"),
        (lambda: nat.gather(np.zeros(16, np.uint8)[::2], [bytes(8)]), ValueError, "C-contiguous"),
        (lambda: nat.gather(np.zeros(4, np.uint8), b"1234"), TypeError, "list or tuple"),
        (
            lambda: nat.gather(np.zeros(4, np.uint8), np.zeros(4, np.uint8)),
            TypeError,
            "list or tuple",
        ),
        (lambda: nat.gather(np.zeros(4, np.uint8), [b"12", 34]), TypeError, r"views\[1\].*int"),
        (
            lambda: nat.gather(np.zeros(4, np.uint8), [memoryview(bytes(8))[::2]]),
            TypeError,
            r"views\[0\].*C-contiguous",
        ),
        (lambda: nat.gather(np.zeros(4, np.uint8), [b"123"]), ValueError, "3 bytes but dst has 4"),
        (
            lambda: nat.gather(np.zeros(4, np.uint8), [b"12345"]),
            ValueError,
            "5 bytes but dst has 4",
        ),
        (lambda: nat.gather(np.zeros(4, np.uint8), [b"1234"], nthreads=0), ValueError, "nthreads"),
        (lambda: nat.gather(np.zeros(4, np.uint8), [b"1234"], nthreads=2.0), TypeError, "nthreads"),
    ],
)
def test_gather_bad_arguments(call, exc: type[Exception], match: str) -> None:
    with pytest.raises(exc, match=match):
        call()


def test_gather_rejects_overlap_and_releases_buffers() -> None:
    buf = np.arange(16, dtype=np.uint8)
    with pytest.raises(ValueError, match="overlap"):
        nat.gather(buf[:8], [b"abcd", buf[6:10]])
    np.testing.assert_array_equal(buf, np.arange(16))  # nothing written
    # every buffer taken was released, also after a failure: a bytearray whose buffer is
    # still exported cannot be resized
    ba = bytearray(b"abcd")
    nat.gather(np.empty(4, np.uint8), [ba])
    with pytest.raises(TypeError):
        nat.gather(np.empty(8, np.uint8), [ba, 5])
    with pytest.raises(ValueError):
        nat.gather(np.empty(9, np.uint8), [ba, b"xyzw"])
    ba.extend(b"ef")
    assert ba == b"abcdef"


def test_gather_c_statuses() -> None:
    lib = nat.library()
    a, b = np.zeros(16, np.uint8), np.arange(8, dtype=np.uint8)
    pa, pb = a.ctypes.data, b.ctypes.data
    sizes = (ctypes.c_int64 * 2)(4, 4)  # dst: the first 8 bytes from its pointer on
    srcs = _ptrs(b, b)
    cases = [
        (lib.nt_gather(pa, srcs, sizes, -1, 1), nat.ERR_SIZE),
        (lib.nt_gather(pa, srcs, (ctypes.c_int64 * 2)(4, -1), 2, 1), nat.ERR_SIZE),
        (lib.nt_gather(pa, srcs, sizes, 2, 0), nat.ERR_THREADS),
        (lib.nt_gather(None, srcs, sizes, 2, 1), nat.ERR_NULL),
        (lib.nt_gather(pa, None, sizes, 2, 1), nat.ERR_NULL),
        (lib.nt_gather(pa, srcs, None, 2, 1), nat.ERR_NULL),
        (lib.nt_gather(pa, (ctypes.c_void_p * 2)(pb, None), sizes, 2, 1), nat.ERR_NULL),
        (lib.nt_gather(pa, (ctypes.c_void_p * 2)(pb, pa + 7), sizes, 2, 1), nat.ERR_OVERLAP),
        (lib.nt_gather(pa + 2, (ctypes.c_void_p * 2)(pb, pa), sizes, 2, 1), nat.ERR_OVERLAP),
        (lib.nt_gather(pa, (ctypes.c_void_p * 2)(pa + 8, pa + 4), sizes, 2, 1), nat.ERR_OVERLAP),
    ]
    for i, (status, want) in enumerate(cases):
        assert status == want, f"case {i}: status {status}, expected {want}"
    np.testing.assert_array_equal(a, 0)
    # a source just before or after dst is fine; so is a NULL source of zero bytes
    lib.nt_gather(pa, (ctypes.c_void_p * 2)(pa + 12, pa + 8), sizes, 2, 1)
    np.testing.assert_array_equal(a, 0)
    lib.nt_gather(pa, (ctypes.c_void_p * 2)(pb, pb + 4), sizes, 2, 1)
    np.testing.assert_array_equal(a[:8], b)
    ok = lib.nt_gather(pa, (ctypes.c_void_p * 2)(None, pb), (ctypes.c_int64 * 2)(0, 8), 2, 1)
    assert ok == nat.OK
