"""The collective benchmark driver (nccltree.comm.bench): figures, data, the #wrong check."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import bench_module

from nccltree.comm import World
from nccltree.comm import bench as drv
from nccltree.comm.collectives import COLLECTIVES

# The benchmark calls every collective through the World's one driver-side method,
# _driver(collective, xs, outs, op, root, streams, async_op, dtype).


class MaxInsteadOfSum(World):
    """A deliberately broken algorithm: all_reduce computes max whatever op is asked."""

    def _driver(self, collective, xs, outs, op, *args, **kw):
        if collective == "all_reduce":
            op = "max"
        return super()._driver(collective, xs, outs, op, *args, **kw)


class GatherNothing(World):
    """all_gather returns without writing the outputs."""

    def _driver(self, collective, xs, outs, *args, **kw):
        if collective == "all_gather":
            return outs
        return super()._driver(collective, xs, outs, *args, **kw)


class ReduceEverywhere(World):
    """reduce as an all_reduce: the root is right, but other ranks' inputs change."""

    def _driver(self, collective, *args, **kw):
        if collective == "reduce":
            collective = "all_reduce"
        return super()._driver(collective, *args, **kw)


# -- definitions --------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_bus_factors_are_nccl_tests(n):
    assert COLLECTIVES["all_reduce"].bus_factor(n) == pytest.approx(2 * (n - 1) / n)
    assert COLLECTIVES["all_gather"].bus_factor(n) == pytest.approx((n - 1) / n)
    assert COLLECTIVES["reduce_scatter"].bus_factor(n) == pytest.approx((n - 1) / n)
    assert COLLECTIVES["broadcast"].bus_factor(n) == 1.0
    assert COLLECTIVES["reduce"].bus_factor(n) == 1.0


def test_byte_counts_follow_nccl_tests():
    # 64 B of float32 on 3 ranks: all_reduce moves 16 elements; all_gather gathers 5 per
    # rank, so S is the whole gathered array of 15; reduce_scatter splits 15 into 3 x 5
    def shape(name: str) -> tuple[int, int, int, int]:
        c = COLLECTIVES[name]
        count = c.count_for(16, 3)
        return count, c.in_count(count, 3), c.out_count(count, 3), c.nbytes(count, 3, 4)

    assert shape("all_reduce") == (16, 16, 16, 64)
    assert shape("all_gather") == (5, 5, 15, 60)
    assert shape("reduce_scatter") == (5, 15, 5, 60)
    assert drv.bandwidths(2_000_000, 0.001, 1.5) == pytest.approx((2.0, 3.0))
    assert drv.bandwidths(0, 0.0, 1.5) == (0.0, 0.0)


def test_parse_size_and_range():
    assert [drv.parse_size(s) for s in ("8", "64K", "64M", "1G", "2k", "3MiB", "4MB")] == [
        8,
        64 << 10,
        64 << 20,
        1 << 30,
        2 << 10,
        3 << 20,
        4 << 20,
    ]
    for bad in ("", "1.5M", "12Q", "-8", "M"):
        with pytest.raises(ValueError, match="accepted"):
            drv.parse_size(bad)
    assert drv.size_range(8, 128, 2) == [8, 16, 32, 64, 128]
    assert drv.size_range(8, 100, 4) == [8, 32]
    assert drv.size_range(0, 4, 2) == [0, 1, 2, 4]
    with pytest.raises(ValueError, match="larger than max"):
        drv.size_range(64, 8, 2)
    with pytest.raises(ValueError, match="> 1"):
        drv.size_range(8, 64, 1)


def test_dtype_names():
    assert drv.check_dtype("half") == np.float16
    assert drv.check_dtype("float") == np.float32
    assert drv.check_dtype("double") == np.float64
    assert drv.check_dtype("int64") == np.int64
    with pytest.raises(ValueError, match="accepted: float16"):
        drv.check_dtype("uint16")


# -- data and check -----------------------------------------------------------------------


def test_init_data_is_seeded_and_varied():
    a = drv.init_data(0, 4, 1000, np.float32)
    assert np.array_equal(a, drv.init_data(0, 4, 1000, np.float32))
    assert not np.array_equal(a, drv.init_data(1, 4, 1000, np.float32))  # per rank
    assert not np.array_equal(a, drv.init_data(0, 4, 1000, np.float32, seed=1))
    assert len(np.unique(a)) > 5  # per element, not a constant
    assert np.all(a == np.round(a)) and np.abs(a).max() <= 4  # exact small integers
    # prod: +-1 with one rank's +-2 per element, so the product stays +-2 for any n
    n = 64
    ps = [drv.init_data(r, n, 500, np.float16, "prod") for r in range(n)]
    assert np.array_equal(np.abs(drv.reference("prod", ps)), np.full(500, 2.0))


def test_reference_accumulates_in_float64():
    xs = [np.full(3, v, np.float16) for v in (1.0, 2.0, 4.0)]
    assert drv.reference("sum", xs).dtype == np.float64
    assert drv.reference("sum", xs).tolist() == [7.0] * 3
    assert drv.reference("mean", xs).tolist() == pytest.approx([7 / 3] * 3)
    assert drv.reference("min", xs).tolist() == [1.0] * 3
    ints = [np.array([2, 3], np.int32), np.array([5, -1], np.int32)]
    assert drv.reference("prod", ints).tolist() == [10, -3]


def test_reference_with_the_kernels_rounding():
    # float16 accumulated in float32 and rounded once: 2048 + 1 + 1 is 2050 in float16,
    # while rounding after each add would stay at 2048 (float16's spacing there is 2)
    xs = [np.full(2, v, np.float16) for v in (2048.0, 1.0, 1.0)]
    got = drv.reference("sum", xs, rounding="kernel")
    assert got.dtype == np.float16 and got.tolist() == [2050.0] * 2
    # integers wrap in their own width
    big = np.array([2**31 - 1], np.int32)
    assert drv.reference("sum", [big, big], rounding="kernel").tolist() == [-2]
    # a mean is the sum times 1/len rounded to the compute type, rounded to the dtype once
    xs = [np.array([1.0, 2.0], np.float32), np.array([2.0, 2.0], np.float32)]
    want = (np.float32(3.0) * np.float32(1 / 3)).astype(np.float32)
    assert drv.reference("mean", [*xs, np.zeros(2, np.float32)], rounding="kernel")[0] == want
    with pytest.raises(ValueError, match="unknown reduction op"):
        drv.reference("avg", xs)


def test_count_wrong():
    want = np.array([1.0, 2.0, 3.0, 7 / 3])
    got = np.array([1, 2, 3, 7 / 3], np.float16)  # 7/3 rounded to half: within tolerance
    assert drv.count_wrong(got, want, np.float16) == 0
    got[0] = 1.5
    got[1] = np.nan
    assert drv.count_wrong(got, want, np.float16) == 2
    assert drv.count_wrong(np.array([1, 2], np.int32), np.array([1, 3]), np.int32) == 1
    assert drv.count_wrong(np.zeros(3, np.float32), np.zeros(4), np.float32) == 4


# -- the driver ---------------------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.slow
def test_every_collective_is_right_and_figures_are_consistent(make_devices, n):
    devs = make_devices(n)
    with drv.Benchmark(
        devs,
        ["tree", "ring", "direct"],
        list(COLLECTIVES),
        [0, 4, 60, 4100],
        iters=2,
        warmup=1,
        root=n - 1,
    ) as bench:
        recs = list(bench)
    # 4 sizes x 3 algorithms, both placements, but all_to_all out of place only
    in_place = sum(c.in_place_ok for c in COLLECTIVES.values())
    assert len(recs) == bench.total == 4 * 3 * (2 * in_place + (len(COLLECTIVES) - in_place))
    for r in recs:
        assert r.wrong == 0, r
        assert r.busbw == pytest.approx(r.algbw * COLLECTIVES[r.collective].bus_factor(n))
        assert r.algbw == pytest.approx(r.size / (r.time_us * 1e-6) / 1e9)
        assert r.time_us > 0 and r.ranks == n and r.machine["backend"] == devs[0].backend
        assert r.root == (n - 1 if COLLECTIVES[r.collective].rooted else -1)
        assert r.op == ("sum" if COLLECTIVES[r.collective].reduces else "none")
    assert {(r.placement, r.algorithm) for r in recs} == {
        (p, a) for p in drv.PLACEMENTS for a in ("tree", "ring", "direct")
    }


@pytest.mark.parametrize(
    "op,dtype", [("max", "float16"), ("prod", "int32"), ("mean", "float64"), ("min", "int64")]
)
def test_ops_and_dtypes_check_clean(host_devs, op, dtype):
    recs = drv.run_benchmark(
        host_devs(3),
        algorithms=["tree", "ring"],
        collectives=["all_reduce", "reduce_scatter"],
        sizes=[96, 3000],
        dtype=dtype,
        op=op,
        iters=1,
        warmup=0,
    )
    assert [r.wrong for r in recs] == [0] * len(recs)


@pytest.mark.parametrize(
    "broken,collective", [(MaxInsteadOfSum, "all_reduce"), (GatherNothing, "all_gather")]
)
def test_a_broken_algorithm_is_caught(host_devs, broken, collective):
    devs = host_devs(3)
    recs = drv.run_benchmark(
        devs,
        algorithms=["tree"],
        collectives=[collective],
        sizes=[64, 4096],
        iters=1,
        warmup=0,
        world_factory=lambda d, a: broken(d, algorithm=a),
    )
    assert all(r.wrong > 0 for r in recs)


def test_reduce_must_leave_other_inputs_alone(host_devs):
    recs = drv.run_benchmark(
        host_devs(3),
        algorithms=["tree"],
        collectives=["reduce"],
        sizes=[4096],
        iters=1,
        warmup=0,
        world_factory=lambda d, a: ReduceEverywhere(d, algorithm=a),
    )
    wrong = {r.placement: r.wrong for r in recs}
    # out of place the root's result is right and inputs stay; in place the two non-root
    # buffers change (except where the other ranks' values happen to sum to zero)
    assert wrong["out-of-place"] == 0
    assert 1024 < wrong["in-place"] <= 2 * 1024


def test_check_zero_reports_no_wrong_column(host_devs):
    recs = drv.run_benchmark(
        host_devs(2),
        sizes=[64],
        iters=1,
        warmup=0,
        check=0,
        world_factory=lambda d, a: MaxInsteadOfSum(d, algorithm=a),
    )
    assert [r.wrong for r in recs] == [None, None]


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"collectives": ["allscatter"]}, "accepted: all_reduce"),
        ({"root": 2}, r"root must be in \[0, 2\), got 2"),
        ({"root": True}, "root must be an integer"),
        ({"iters": 2.0}, "iters must be an integer"),
        ({"timeout": float("nan")}, "timeout must be a number, got NaN"),
        ({"timeout": float("inf")}, "timeout must be finite"),
        ({"op": "mean", "dtype": "int32"}, "floating-point"),
        ({"op": "avg"}, "accepted: sum"),
        ({"iters": 0}, "iters must be >= 1, got 0"),
        ({"check": -1}, "check must be"),
        ({"sizes": ["12Q"]}, "accepted"),
        ({"dtype": "complex64"}, "accepted"),
    ],
)
def test_bad_arguments_fail_before_any_world_exists(host_devs, kwargs, match):
    made = []
    with pytest.raises((ValueError, TypeError), match=match):
        drv.Benchmark(host_devs(2), world_factory=lambda d, a: made.append(a), **kwargs)
    assert made == []


def test_numpy_integers_are_accepted(host_devs):
    recs = drv.run_benchmark(
        host_devs(2),
        collectives=["broadcast"],
        sizes=[np.int64(64)],
        root=np.int64(1),
        iters=np.int32(1),
        warmup=np.int64(0),
        check=np.uint8(1),
    )
    assert [(r.root, r.wrong, r.iters) for r in recs] == [(1, 0, 1)] * 2
    assert type(recs[0].root) is int and type(recs[0].iters) is int


def test_step_factor_must_be_a_finite_number_above_one():
    for bad, err in ((float("nan"), ValueError), (float("inf"), ValueError), (True, TypeError)):
        with pytest.raises(err, match="step factor"):
            drv.size_range(8, 64, bad)


def test_devices_from_a_spec_are_shut_down_by_close():
    with drv.Benchmark("cpu:2", sizes=[64], iters=1, warmup=0) as bench:
        assert [r.wrong for r in bench] == [0, 0]
        assert bench.label == "cpu:2"
    assert bench.devices[0].runtime.closed and bench.worlds == {}


def test_machine_description(host_devs):
    m = drv.machine_description(host_devs(2))
    assert m["backend"] == "host" and m["device_names"] == ["cpu:0", "cpu:1"]
    assert m["cpu_count"] >= 1 and m["numpy"] == np.__version__


def test_make_tables_renders_driver_json(host_devs):
    mt = bench_module("make_tables")
    recs = drv.run_benchmark(
        host_devs(2), algorithms=["tree", "ring"], sizes=[8, 4096], iters=1, warmup=0
    )
    data = {
        "tool": "nccltree-bench collectives",
        "machine": recs[0].machine,
        "records": [r.as_dict() for r in recs],
    }
    rows = [x for x in mt.tables(data) if x.startswith("| ") and "B |" in x]
    # compact: a row per size, busbw out of place / in place per algorithm
    assert len(rows) == 2 and rows[1].startswith("| 4 KiB |") and rows[1].count(" / ") == 2
    rows = [x for x in mt.tables(data, full=True) if x.startswith("| ") and "B |" in x]
    assert len(rows) == 4 and rows[0].startswith("| 8 B | tree |")
    assert rows[0].endswith(" · 0 |")  # the #wrong of the in-place run
    with pytest.raises(ValueError, match="unknown benchmark JSON"):
        mt.tables({"tool": "something else"})
