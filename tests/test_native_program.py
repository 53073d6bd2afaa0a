"""Inline host calls run the whole plan in one native call (``nt_run_steps``): results
bitwise those of issuing the same steps one by one on the inline streams, for every
algorithm, collective, dtype, op and placement; the step-by-step path still serves calls
whose transfers are being recorded; a failing step names itself."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

import nccltree as nt
from nccltree import _native
from nccltree.backends.host import record_transfers
from nccltree.comm.executor import Program

ALGS = ("tree", "ring", "direct")
DTYPES = (np.float16, np.float32, np.float64, np.int32, np.int64)


def _data(n: int, count: int, dtype, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    if np.dtype(dtype).kind == "f":
        # magnitudes over several binades: the order of a sum changes its rounding
        return [
            (rng.standard_normal(count) * 10.0 ** rng.integers(-2, 3, count)).astype(dtype)
            for _ in range(n)
        ]
    return [rng.integers(-1000, 1000, count).astype(dtype) for _ in range(n)]


def _call(w: nt.World, coll: str, xs: list[np.ndarray], op: str, in_place: bool):
    n = w.size
    if coll == "all_reduce":
        outs = None if in_place else [np.empty_like(x) for x in xs]
        w.all_reduce(xs, op=op, outs=outs)
        return xs if in_place else outs
    if coll == "reduce":
        outs = None if in_place else [np.empty_like(x) for x in xs]
        w.reduce(xs, op=op, root=n - 1, outs=outs)
        return [(xs if in_place else outs)[n - 1]]
    if coll == "broadcast":
        outs = None if in_place else [np.empty_like(x) for x in xs]
        w.broadcast(xs, root=1 % n, outs=outs)
        return xs if in_place else outs
    if coll == "all_gather":
        outs = [np.empty(x.size * n, x.dtype) for x in xs]
        w.all_gather(xs, outs=outs)
        return outs
    outs = [np.empty(xs[0].size // n, xs[0].dtype) for _ in xs]
    w.reduce_scatter(xs, op=op, outs=outs)
    return outs


@pytest.mark.parametrize("n", [2, 3, 5])
@pytest.mark.parametrize("alg", ALGS)
@pytest.mark.slow
def test_one_native_call_is_bitwise_the_steps_one_by_one(monkeypatch, n, alg):
    lower = Program._lower
    calls = []

    def counting_lower(self):
        lowered = lower(self)
        calls.append(bool(lowered))
        return lowered

    cases = [
        (coll, dtype, op, in_place)
        for coll in ("all_reduce", "reduce", "broadcast", "all_gather", "reduce_scatter")
        for dtype in DTYPES
        for op in (
            ("sum", "mean", "max")
            if coll in ("all_reduce", "reduce", "reduce_scatter")
            else ("sum",)
        )
        for in_place in (
            (True, False) if coll in ("all_reduce", "reduce", "broadcast") else (False,)
        )
        if not (op == "mean" and np.dtype(dtype).kind != "f")
    ]
    results = {}
    for native in (True, False):
        monkeypatch.setattr(Program, "_lower", counting_lower if native else lambda self: False)
        # small chunks: several chunks and pieces per call
        with nt.World(nt.devices(f"cpu:{n}"), algorithm=alg, chunk_bytes=1024) as w:
            for i, (coll, dtype, op, in_place) in enumerate(cases):
                count = 3 * n * 257  # not a multiple of the 256-byte alignment
                xs = _data(n, count, dtype, seed=i)
                results.setdefault(i, []).append(
                    [o.tobytes() for o in _call(w, coll, xs, op, in_place)]
                )
    assert calls and all(calls), "the native program was not used: the test checks nothing"
    for i, (native, stepwise) in results.items():
        assert native == stepwise, cases[i]


def test_recorded_calls_take_the_step_by_step_path():
    with nt.World(nt.devices("cpu:3"), algorithm="tree") as w:
        xs = [np.full(1000, float(r)) for r in range(3)]
        w.all_reduce(xs)  # the native program, lowered and used
        with record_transfers() as log:
            w.all_reduce(xs)
    assert log, "a recorded call must log its transfers"
    assert all(np.all(x == 9.0) for x in xs)


def test_a_failing_step_names_itself():
    # a broken program (a step whose source partially overlaps its destination) is refused
    # by the library, which names the step
    steps = (_native.Step * 2)()
    steps[0].kind, steps[0].k, steps[0].count = _native.STEP_COPY, 1, 100
    steps[1].kind, steps[1].k, steps[1].count = _native.STEP_COPY, 1, 100
    steps[1].src_off[0] = 1
    buf = np.zeros(1000, np.float32)
    bases = (ctypes.c_void_p * 1)(buf.ctypes.data)
    threads = (ctypes.c_int * 1)(1)
    failed = ctypes.c_int(-1)
    code = _native.DTYPES[np.dtype(np.float32)]
    with pytest.raises((ValueError, nt.NcclTreeError), match="step 1"):
        _native.run_steps(code, steps, bases, threads, failed)
    assert failed.value == 1
