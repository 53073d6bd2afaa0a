"""bfloat16, int8 and uint8 through every collective, algorithm, op and placement on the
host backend, bitwise against numpy: each call's own plan performed step by step with
the numpy reference of the kernels (``reference(rounding="kernel")``: bfloat16 summed in
float32 and rounded once per step, 8-bit integers wrapping), so a result that combined
its contributions in another order, or rounded between them, fails. The data make the
order matter: bfloat16 values of magnitudes wider apart than float32's mantissa (the
small ones are lost unless they are added first) and integers that overflow 8 bits."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from test_collectives import worlds  # noqa: F401 - the fixture

import nccltree as nt
from nccltree.backends.base import BFLOAT16, DTYPES, FLOAT_DTYPES
from nccltree.comm import bench as drv
from nccltree.comm._ops import check_dtype, check_op, reference
from nccltree.comm.collectives import COLLECTIVES
from nccltree.comm.faces import driver_method
from nccltree.comm.plan import IN, OUT, STAGE, TMP, Plan

NEW = ("bfloat16", "int8", "uint8")
ALGS = ("tree", "ring", "direct")
COLLS = ("all_reduce", "reduce", "broadcast", "all_gather", "reduce_scatter")
OPS = ("sum", "mean", "prod", "max", "min")


def make_full(n: int, size: int, dtype: str, op: str, seed: int) -> list[np.ndarray]:
    """Each rank's whole input: bfloat16 spread over 2^-24 .. 2^24, wider than float32's
    24 bits, so even the float32 accumulation depends on the order (prod near 1);
    integers over the dtype's full range (sums and products wrap)."""
    rng = np.random.default_rng(seed)
    dt = np.dtype(dtype)
    if dt in FLOAT_DTYPES:
        if op == "prod":
            return [rng.uniform(0.5, 2.0, size).astype(dt) for _ in range(n)]
        mag = 2.0 ** rng.integers(-24, 25, (n, size))
        vals = rng.uniform(-1, 1, (n, size)) * mag
        # every 5th element: +2^24 on one rank, -2^24 two ranks on, 1 on the others: a
        # one added to 2^24 in float32 is lost, so the result counts the ones that were
        # not added between the two
        at = np.arange(0, size, 5)
        vals[:, at] = 1.0
        vals[at % n, at] = 2.0**24
        vals[(at + 2) % n, at] = -(2.0**24)
        return [vals[r].astype(dt) for r in range(n)]
    info = np.iinfo(dt)
    return [rng.integers(info.min, info.max, size, endpoint=True).astype(dt) for _ in range(n)]


def buffers(coll: str, full: list[np.ndarray], count: int, in_place: bool):
    """(inputs, outputs or None, flat ins, flat outs) laid out as a caller passes them,
    in place as NCCL's layouts put the input inside the output."""
    c, n = COLLECTIVES[coll], len(full)
    xs = [f.copy() for f in full]
    if not in_place:
        outs = [np.full(c.out_count(count, n), 7, full[0].dtype) for _ in range(n)]
        return xs, outs, xs, outs
    if coll == "all_gather":
        outs = [np.zeros(c.out_count(count, n), full[0].dtype) for _ in range(n)]
        for r in range(n):
            outs[r][r * count : (r + 1) * count] = full[r]
        xs = [outs[r][r * count : (r + 1) * count] for r in range(n)]
        return xs, outs, xs, outs
    if coll == "reduce_scatter":
        outs = [xs[r][r * count : (r + 1) * count] for r in range(n)]
        return xs, outs, xs, outs
    return xs, None, xs, xs


def run_plan_in_numpy(plan: Plan, ins: list[np.ndarray], outs: list[np.ndarray]) -> None:
    """Perform the plan's data steps in order with numpy and the kernels' rounding."""
    dtype = ins[0].dtype
    arrays = [
        {
            IN: ins[r],
            OUT: outs[r],
            TMP: np.zeros(plan.scratch.get(r, 0), dtype),
            STAGE: np.zeros(plan.stage.get(r, 0), dtype),
        }
        for r in range(plan.size)
    ]

    def view(b):
        return arrays[b.rank][b.role][b.offset : b.offset + b.count]

    for s in plan.data_steps():
        if s.kind == "copy":
            view(s.dst)[...] = view(s.srcs[0]).copy()
        elif s.kind == "reduce":
            assert len(s.srcs) <= 8
            srcs = [view(b).copy() for b in s.srcs]
            view(s.dst)[...] = reference(s.op, srcs, rounding="kernel", alpha=s.alpha)
        elif s.kind == "scale":
            view(s.dst)[...] = reference(
                "sum", [view(s.dst).copy()], rounding="kernel", alpha=s.alpha
            )
        else:
            raise AssertionError(f"unexpected step {s.kind}")


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).reshape(-1).view(f"u{a.dtype.itemsize}")


@pytest.mark.parametrize("inline", [False, True], ids=["streams", "inline"])
@pytest.mark.parametrize("n", [3, 4, 5])
@pytest.mark.parametrize("alg", ALGS)
@pytest.mark.slow
def test_every_collective_bitwise_against_its_plan_in_numpy(worlds, alg, n, inline):  # noqa: F811
    world = worlds(n, alg, inline)
    checked = 0
    for coll, dtype, op, count, in_place in itertools.product(
        COLLS, NEW, OPS, (1, 37, 1500), (False, True)
    ):
        c = COLLECTIVES[coll]
        if (op == "mean" and np.dtype(dtype) not in FLOAT_DTYPES) or (
            not c.reduces and op != "sum"
        ):
            continue
        root = (n - 1) if c.rooted else 0
        full = make_full(n, c.in_count(count, n), dtype, op, seed=count + n)
        xs, outs, ins, flat_outs = buffers(coll, full, count, in_place)
        kw = {"root": root} if c.rooted else {}
        if c.reduces:
            kw["op"] = op
        if outs is not None:
            kw["outs"] = outs
        res = getattr(world, driver_method(coll))(xs, **kw)
        # the same call's plan, performed by numpy on copies laid out the same way
        _, _, nins, nouts = buffers(coll, full, count, in_place)
        plan = world.plan(coll, count, op=op, root=root, in_place=in_place, dtype=dtype)
        run_plan_in_numpy(plan, [a.reshape(-1) for a in nins], [a.reshape(-1) for a in nouts])
        expected = c.expected([f.copy() for f in full], op, root)
        magnitude = c.expected([np.abs(f.astype(np.float64)) for f in full], "sum", root)
        what = f"{alg} n={n} {coll} {dtype} {op} count={count} in_place={in_place}"
        for r in range(n):
            which, want = expected[r]
            got = np.asarray(res[r])
            if which == "in":
                np.testing.assert_array_equal(bits(xs[r]), bits(full[r]), err_msg=what)
                continue
            np.testing.assert_array_equal(bits(got), bits(nouts[r]), err_msg=f"{what} rank {r}")
            # and near the exact result: bfloat16 sums within a few units of the sum of
            # magnitudes (one rounding per step), max/min exact; integers modulo 2^8
            if np.dtype(dtype) in FLOAT_DTYPES:
                err = np.abs(got.astype(np.float64).reshape(-1) - want)
                if op in ("sum", "mean"):
                    bound = n * 2.0**-8 * magnitude[r][1] / (n if op == "mean" else 1)
                    assert (err <= bound).all(), what
                elif op == "prod":
                    assert (err <= 0.05 * np.abs(want)).all(), what
                else:
                    assert (err == 0).all(), what
            else:
                np.testing.assert_array_equal(got.reshape(-1), want.astype(dtype), err_msg=what)
            checked += 1
    assert checked > 200


def test_the_order_of_summation_matters_for_this_data():
    # the check above could not pass by accident: summing the same bfloat16 data in
    # another order, or rounding after each step, changes many results
    full = make_full(5, 4000, "bfloat16", "sum", seed=1)
    once = reference("sum", full, rounding="kernel")
    other = reference("sum", full[::-1], rounding="kernel")
    stepwise = full[0]
    for x in full[1:]:
        stepwise = reference("sum", [stepwise, x], rounding="kernel")
    assert (bits(once) != bits(other)).sum() > 100
    assert (bits(once) != bits(stepwise)).sum() > 100


def test_argument_checks_name_the_new_dtypes():
    with nt.World(nt.devices("cpu:3"), timeout=30) as world:
        i8 = [np.ones(4, np.int8) for _ in range(3)]
        with pytest.raises(TypeError, match="op 'mean' needs a floating-point dtype, got int8"):
            world.all_reduce(i8, op="mean")
        with pytest.raises(TypeError, match="op 'mean' needs a floating-point dtype, got uint8"):
            world.all_reduce([np.ones(4, np.uint8) for _ in range(3)], op="mean")
        with pytest.raises(TypeError, match="dtype mismatch: rank 0 has int8, rank 2 has uint8"):
            world.all_reduce([*i8[:2], np.ones(4, np.uint8)])
        with pytest.raises(
            TypeError, match="rank 1: output dtype bfloat16 differs from input int8"
        ):
            world.all_gather(
                i8, [np.ones(12, np.int8), np.ones(12, BFLOAT16), np.ones(12, np.int8)]
            )
        with pytest.raises(TypeError, match="accepted: .*bfloat16, int8, uint8"):
            world.all_reduce([np.ones(4, np.uint16) for _ in range(3)])
    assert check_dtype(np.dtype("bfloat16")) == BFLOAT16
    assert check_op("mean", BFLOAT16) == "sum"


def test_host_stream_kernels_take_the_new_dtypes_and_refuse_scaling_integers():
    (d,) = nt.devices("cpu:1")
    s = d.new_stream()
    x = np.array([1.5, -2.0, 3.0], BFLOAT16)
    s.scale(x, 0.5)
    s.synchronize()
    np.testing.assert_array_equal(x.astype(np.float32), [0.75, -1.0, 1.5])
    w, g, v = x.copy(), np.ones(3, BFLOAT16), np.zeros(3, BFLOAT16)
    s.sgd_update(w, g, v, lr=0.5, momentum=0.9, weight_decay=0.0)
    s.synchronize()
    np.testing.assert_array_equal(w.astype(np.float32), [0.25, -1.5, 1.0])
    for dt in (np.int8, np.uint8):
        with pytest.raises(TypeError, match="accepted: float16, float32, float64, bfloat16$"):
            s.scale(np.ones(3, dt), 2.0)
        with pytest.raises(TypeError, match="accepted: float16, float32, float64, bfloat16$"):
            s.sgd_update(np.ones(3, dt), np.ones(3, dt), np.ones(3, dt), 0.1, 0.9, 0.0)
        with pytest.raises(TypeError, match="accepted: float16, float32, float64, bfloat16$"):
            s.reduce(np.ones(3, dt), [np.ones(3, dt)], alpha=0.5)
    # a small 3-source bfloat16 reduce rounds once too (numpy's ufuncs would round twice)
    a, b, c = (np.array([v], BFLOAT16) for v in (256.0, 1.0, 1.0))
    out = np.empty(1, BFLOAT16)
    s.reduce(out, [a, b, c])
    s.synchronize()
    assert float(out[0]) == 258.0 and float(((a + b) + c)[0]) == 256.0


def test_bench_check_takes_the_new_dtypes():
    for name in NEW:
        dt = drv.check_dtype(name)
        assert dt == np.dtype(name)
        assert (drv.tolerance(dt) > 0) == (dt in FLOAT_DTYPES)
    # integers are compared modulo the dtype: 100 + 100 in int8 is -56
    got = np.array([-56], np.int8)
    assert drv.count_wrong(got, np.array([200], np.int64), np.int8) == 0
    assert drv.count_wrong(got, np.array([201], np.int64), np.int8) == 1


def test_mpi_reduces_every_dtype_but_the_16_bit_floats():
    from nccltree.comm.group.mpi_collectives import mpi_reduces

    assert [d.name for d in DTYPES if not mpi_reduces(d)] == [
        "float16",
        "bfloat16",
    ]
