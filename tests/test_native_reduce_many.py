"""``nt_reduce_many``: one pass that reduces k sources into m destinations (a
reduction and the copies of its result, fused): bitwise the reduction followed by the
copies, for every op, dtype, source and destination count, with destinations that are
sources or repeat, scaled sums, and the overlaps it refuses; and its use by the inline
programs (``FUSE_REDUCE_COPIES``)."""

from __future__ import annotations

import numpy as np
import pytest

import nccltree as nt
from nccltree import NativeError
from nccltree import _native as nat
from nccltree.comm import executor
from tests.test_native import DTYPES, KERNEL_OPS, assert_bitwise, pool

SIZES = (1, 4099, 300_001)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("op", KERNEL_OPS)
def test_bitwise_the_reduction_then_the_copies(op: str, dtype: type) -> None:
    src = pool(dtype, op)
    for n in SIZES:
        for k, m in ((1, 2), (2, 2), (3, 4), (8, 8)):
            srcs = [s[:n] for s in src[:k]]
            want = nat.reduce_n(np.empty(n, dtype), srcs, op)
            dsts = [np.full(n, 7, dtype) for _ in range(m)]
            nat.reduce_many(dsts, srcs, op, nthreads=2)
            for d in dsts:
                assert_bitwise(d, want)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32], ids=str)
def test_destinations_that_are_sources_in_place(dtype: type) -> None:
    # direct's all_reduce in place: every rank's buffer is a source and a destination
    src = pool(dtype)
    for n in SIZES:
        bufs = [s[:n].copy() for s in src[:4]]
        want = nat.reduce_n(np.empty(n, dtype), bufs, "sum")
        nat.reduce_many([bufs[2], bufs[0], bufs[1], bufs[3]], bufs, "sum", nthreads=2)
        for b in bufs:
            assert_bitwise(b, want)


def test_a_repeated_destination_is_written_once_and_scaled_sums() -> None:
    a, b = pool(np.float32)[0][:4099], pool(np.float32)[1][:4099]
    x = np.zeros(4099, np.float32)
    nat.reduce_many([x, x], [a, b], "sum")
    assert_bitwise(x, nat.reduce_n(np.empty_like(x), [a, b], "sum"))
    outs = [np.empty(4099, np.float32) for _ in range(3)]
    nat.reduce_many(outs, [a, b], "sum", alpha=0.5)
    want = nat.reduce_n(np.empty_like(x), [a, b], "sum", alpha=0.5)
    for o in outs:
        assert_bitwise(o, want)


def test_overlaps_and_bad_arguments_are_refused() -> None:
    buf = np.zeros(2000, np.float32)
    a = np.ones(1000, np.float32)
    with pytest.raises((ValueError, NativeError)):
        nat.reduce_many([buf[:1000], buf[1:1001]], [a], "sum")  # destinations overlap
    with pytest.raises((ValueError, NativeError)):
        nat.reduce_many([buf[:1000], buf[500:1500]], [buf[1000:]], "sum")
    with pytest.raises((ValueError, NativeError)):
        nat.reduce_many([buf[:1000], buf[1000:]], [buf[1:1001]], "sum")  # source shifted
    with pytest.raises(ValueError, match="alpha"):
        nat.reduce_many([buf[:1000], buf[1000:]], [a], "max", alpha=0.5)
    with pytest.raises(ValueError, match="1 to 8"):
        nat.reduce_many([], [a], "sum")
    with pytest.raises(ValueError, match="op must be"):
        nat.reduce_many([buf[:1000]], [a], "bogus")


@pytest.mark.parametrize("alg", ["direct", "tree"])
def test_inline_programs_fuse_a_reduction_and_its_copies(monkeypatch, alg: str) -> None:
    kinds: list[int] = []
    lower = executor.Program._lower

    def spy(self):  # type: ignore[no-untyped-def]
        got = lower(self)
        if got:
            kinds.extend(st.kind for st in got.steps)
        return got

    monkeypatch.setattr(executor.Program, "_lower", spy)
    results = {}
    for fuse in (True, False):
        monkeypatch.setattr(executor, "FUSE_REDUCE_COPIES", fuse)
        with nt.World(nt.devices("cpu:4"), algorithm=alg) as w:
            xs = [np.random.default_rng(r).standard_normal(70_001).astype(np.float32)
                  for r in range(4)]  # fmt: skip
            w.all_reduce(xs)
            results[fuse] = [x.tobytes() for x in xs]
    assert nat.STEP_REDUCE_MANY in kinds  # the fused step was used: the check means something
    assert results[True] == results[False]
