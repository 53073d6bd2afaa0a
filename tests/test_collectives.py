"""Collectives: correctness against numpy in float64, every algorithm, both call styles.

Each World is built once per (N, algorithm, executor) and a whole grid of collective x op
x dtype x size x placement runs inside one test, so the product stays fast.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import nccltree as nt
from nccltree.comm._ops import reference
from nccltree.comm.collectives import COLLECTIVES

ALGS = ("tree", "ring", "direct")
DTYPES = ("float16", "float32", "float64", "int32", "int64")
OPS = ("sum", "mean", "max", "min", "prod")
TOL = {"float16": 2e-2, "float32": 2e-5, "float64": 1e-12}


def make_inputs(n: int, count: int, dtype: str, op: str, seed: int) -> list[np.ndarray]:
    """Seeded data, different per rank and element; ranges that keep prod exact."""
    rng = np.random.default_rng(seed)
    dt = np.dtype(dtype)
    if op == "prod":
        if dt.kind == "f":
            return [rng.uniform(0.8, 1.25, count).astype(dt) for _ in range(n)]
        return [rng.choice([-1, 1, 2], count).astype(dt) for _ in range(n)]
    if dt.kind == "f":
        return [rng.uniform(-1, 1, count).astype(dt) for _ in range(n)]
    return [rng.integers(-1000, 1000, count).astype(dt) for _ in range(n)]


def assert_close(got: np.ndarray, want: np.ndarray, dtype: str, what: str) -> None:
    got64 = got.astype(np.float64 if np.dtype(dtype).kind == "f" else np.int64)
    if np.dtype(dtype).kind == "f":
        np.testing.assert_allclose(got64, want, rtol=TOL[dtype], atol=TOL[dtype], err_msg=what)
    else:
        np.testing.assert_array_equal(got64, want, err_msg=what)


def expected(coll: str, xs: list[np.ndarray], op: str, root: int, r: int) -> np.ndarray | None:
    """Rank ``r``'s expected result in float64 (int64), from the collectives table; None
    where the rank's input must stay unchanged instead (reduce, off the root)."""
    which, want = COLLECTIVES[coll].expected(xs, op, root)[r]
    return None if which == "in" else want


def run_driver(world, coll, xs, op, root, in_place):
    n = world.size
    c = xs[0].size
    if coll == "all_reduce":
        outs = None if in_place else [np.full_like(x, 7) for x in xs]
        res = world.all_reduce(xs, op=op, outs=outs)
    elif coll == "reduce":
        outs = None if in_place else [np.full_like(x, 7) for x in xs]
        res = world.reduce(xs, root=root, op=op, outs=outs)
    elif coll == "broadcast":
        outs = None if in_place else [np.full_like(x, 7) for x in xs]
        res = world.broadcast(xs, root=root, outs=outs)
    elif coll == "all_gather":
        if in_place:
            bufs = [np.full(n * c, 7, xs[0].dtype) for _ in range(n)]
            for r in range(n):
                bufs[r][r * c : (r + 1) * c] = xs[r]
            res = world.all_gather([bufs[r][r * c : (r + 1) * c] for r in range(n)], bufs)
        else:
            res = world.all_gather(xs, [np.full(n * c, 7, xs[0].dtype) for _ in range(n)])
    else:
        if in_place:
            res_in = [x.copy() for x in xs]
            res = world.reduce_scatter(
                res_in, [res_in[r][r * (c // n) : (r + 1) * (c // n)] for r in range(n)], op=op
            )
        else:
            res = world.reduce_scatter(
                xs, [np.full(c // n, 7, xs[0].dtype) for _ in range(n)], op=op
            )
    return res


def check_grid(world, sizes, dtypes=DTYPES, ops=OPS, colls=None, seed=0):
    n = world.size
    colls = colls or ("all_reduce", "reduce", "broadcast", "all_gather", "reduce_scatter")
    for coll, dtype, op, size, in_place in itertools.product(
        colls, dtypes, ops, sizes, (False, True)
    ):
        if op == "mean" and np.dtype(dtype).kind != "f":
            continue
        if coll in ("broadcast", "all_gather") and op != "sum":
            continue
        count = size * n if coll == "reduce_scatter" else size
        roots = sorted({0, n - 1}) if coll in ("reduce", "broadcast") else [0]
        for root in roots:
            xs = make_inputs(n, count, dtype, op, seed)
            originals = [x.copy() for x in xs]
            work = [x.copy() for x in xs]
            res = run_driver(world, coll, work, op, root, in_place)
            what = (
                f"{world.algorithm} {coll} {op} {dtype} n={n} size={size} root={root} "
                f"in_place={in_place}"
            )
            for r, (which, want) in enumerate(COLLECTIVES[coll].expected(originals, op, root)):
                if which == "in":
                    # reduce leaves non-root inputs unchanged
                    np.testing.assert_array_equal(work[r], originals[r], err_msg=what)
                    continue
                assert_close(np.asarray(res[r]).reshape(-1), want, dtype, what + f" rank {r}")
            if coll == "reduce" and not in_place:
                for r in range(n):
                    np.testing.assert_array_equal(work[r], originals[r], err_msg=what)


@pytest.fixture(scope="module")
def worlds():
    made = {}

    def get(n: int, alg: str, inline: bool):
        key = (n, alg, inline)
        if key not in made:
            made[key] = nt.World(
                nt.devices(f"cpu:{n}"),
                algorithm=alg,
                timeout=30,
                chunk_bytes=64,
                inline_bytes=(1 << 20) if inline else 0,
            )
        return made[key]

    yield get
    for w in made.values():
        w.close()


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("alg", ALGS)
@pytest.mark.slow
def test_tiny_sizes_every_combination(worlds, n, alg):
    # streams executor (inline off): sizes 0, 1 and odd, with 16-element chunks
    check_grid(worlds(n, alg, False), sizes=(0, 1, 37))


@pytest.mark.parametrize("n", [2, 3, 5])
@pytest.mark.parametrize("alg", ALGS)
@pytest.mark.slow
def test_inline_executor_matches(worlds, n, alg):
    check_grid(worlds(n, alg, True), sizes=(1, 37), dtypes=("float32", "int32"))


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("alg", ALGS)
@pytest.mark.slow
def test_mib_sizes(n, alg):
    with nt.World(nt.devices(f"cpu:{n}"), algorithm=alg, chunk_bytes=256 << 10) as w:
        check_grid(
            w,
            sizes=((1 << 20) // 4 + 3,),
            dtypes=("float32",),
            ops=("sum", "mean"),
            colls=("all_reduce", "reduce", "broadcast", "reduce_scatter", "all_gather"),
        )


@pytest.mark.parametrize("n", [2, 3, 5])
@pytest.mark.parametrize("alg", ALGS)
@pytest.mark.slow
def test_mean_is_bitwise_the_sum_times_the_reciprocal(n, alg):
    # the 1/n is folded into the sum that finishes each piece: the same operations as a
    # sum followed by a scale, on the numpy path (small pieces) and in the kernels
    for inline in (0, 1 << 20):
        with nt.World(nt.devices(f"cpu:{n}"), algorithm=alg, inline_bytes=inline) as w:
            for dtype, count in itertools.product(("float32", "float64"), (37, 100_003)):
                xs = make_inputs(n, count, dtype, "sum", count)
                sums, means = [x.copy() for x in xs], [x.copy() for x in xs]
                w.all_reduce(sums, op="sum")
                w.all_reduce(means, op="mean")
                scale = np.dtype(dtype).type(1 / n)
                for s, m in zip(sums, means, strict=True):
                    assert m.tobytes() == (s * scale).tobytes(), (dtype, count, inline)


@pytest.mark.parametrize("alg", ALGS)
def test_repeated_runs_are_bitwise_equal(alg):
    n = 5
    xs = make_inputs(n, 100_003, "float32", "sum", 3)
    outs = []
    with nt.World(nt.devices(f"cpu:{n}"), algorithm=alg, chunk_bytes=4096) as w:
        for _ in range(3):
            work = [x.copy() for x in xs]
            w.all_reduce(work)
            outs.append(work)
    for rep in outs[1:]:
        for a, b in zip(outs[0], rep):
            assert a.tobytes() == b.tobytes()
    # and every rank holds the same bits
    for a in outs[0][1:]:
        assert a.tobytes() == outs[0][0].tobytes()


@pytest.mark.parametrize("preset", ["dgx1", "pcie2s8", "k80x4"])
@pytest.mark.slow
def test_presets_tree(preset):
    topo = nt.Topology.preset(preset)
    with nt.World(
        nt.devices(f"cpu:{topo.n}"),
        algorithm="tree",
        topology=topo,
        chunk_bytes=256,
        inline_bytes=0,
    ) as w:
        check_grid(w, sizes=(1, 301), dtypes=("float32", "int64"), ops=("sum", "max"))


@pytest.mark.parametrize("alg", ALGS)
def test_per_rank_calls(alg):
    n = 4
    xs = make_inputs(n, 1001, "float64", "sum", 5)
    want = reference("sum", xs)

    def body(comm, x):
        r = comm.rank
        y = x[r].copy()
        out = comm.all_reduce(y)
        assert out is y
        mean = comm.all_reduce(x[r].copy(), op="mean", out=np.empty_like(y))
        b = np.arange(10.0) * (r + 1)
        comm.broadcast(b, root=2)
        red = x[r].copy()
        comm.reduce(red, root=1)
        g = np.empty(n * 3)
        comm.all_gather(np.full(3, float(r)), g)
        rs = np.empty(2)
        comm.reduce_scatter(np.arange(2.0 * n) + r, rs)
        w = comm.all_reduce(x[r].copy(), async_op=True)
        comm.barrier()
        return y, mean, b, red, g, rs, w.result()

    with nt.World(nt.devices(f"cpu:{n}"), algorithm=alg, timeout=20) as w:
        results = w.run(body, xs)
    for r, (y, mean, b, red, g, rs, asy) in enumerate(results):
        np.testing.assert_allclose(y, want, rtol=1e-12)
        np.testing.assert_allclose(asy, want, rtol=1e-12)
        np.testing.assert_allclose(mean, want / n, rtol=1e-12)
        np.testing.assert_array_equal(b, np.arange(10.0) * 3)
        if r == 1:
            np.testing.assert_allclose(red, want, rtol=1e-12)
        else:
            np.testing.assert_array_equal(red, xs[r])
        np.testing.assert_array_equal(g, np.repeat(np.arange(float(n)), 3))
        full = sum(np.arange(2.0 * n) + q for q in range(n))
        np.testing.assert_array_equal(rs, full[2 * r : 2 * r + 2])


def test_async_work_and_explicit_streams():
    n = 3
    devs = nt.devices(f"cpu:{n}")
    xs = make_inputs(n, 50_000, "float32", "sum", 9)
    want = reference("sum", xs)
    with nt.World(devs, algorithm="tree") as w:
        work = [x.copy() for x in xs]
        h = w.all_reduce(work, async_op=True)
        res = h.result()
        assert res is not None and h.is_completed()
        for a in work:
            np.testing.assert_allclose(a, want, rtol=1e-5, atol=1e-5)
        # explicit caller streams: the collective is ordered after work queued on them
        streams = [d.new_stream() for d in devs]
        work = [np.zeros_like(x) for x in xs]
        for st, dst, src in zip(streams, work, xs):
            st.copy(dst, src)  # queued, not yet necessarily run
        w.all_reduce(work, streams=streams)
        for st in streams:
            st.synchronize()
        for a in work:
            np.testing.assert_allclose(a, want, rtol=1e-5, atol=1e-5)


def test_auto_choice_and_plan_inspection():
    with nt.World(nt.devices("cpu:4"), algorithm="auto") as w:
        # on uniform host links direct takes every size
        for count in (16, 65, 1 << 18, (1 << 18) + 1, 1 << 20):
            assert "direct" in w.plan("all_reduce", count).description
        # the topology-aware tree where links differ
    with nt.World(nt.devices("cpu:8"), algorithm="auto", topology=nt.Topology.preset("dgx1")) as w:
        assert "tree" in w.plan("all_reduce", 1 << 20).description
    with nt.World(nt.devices("cpu:4"), algorithm="auto") as w:
        xs = make_inputs(4, 1 << 18, "float32", "sum", 1)
        want = reference("sum", xs)
        w.all_reduce(xs)
        np.testing.assert_allclose(xs[2], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n", [3, 4])
@pytest.mark.parametrize("alg", ALGS)
@pytest.mark.slow
def test_under_jitter(monkeypatch, n, alg):
    # Seeded random delays before every stream op: a missing wait anywhere in a plan
    # turns into a wrong answer here.
    monkeypatch.setenv("NCCLTREE_HOST_JITTER", f"{n * 7 + len(alg)}:300")
    with nt.World(
        nt.devices(f"cpu:{n}"), algorithm=alg, timeout=30, chunk_bytes=64, inline_bytes=0
    ) as w:
        check_grid(w, sizes=(1, 37), dtypes=("float32", "int64"), ops=("sum", "max"))
    test_per_rank_calls(alg)


@pytest.mark.parametrize("alg", ALGS)
@pytest.mark.slow
def test_staged_topology_under_jitter(monkeypatch, alg):
    monkeypatch.setenv("NCCLTREE_HOST_JITTER", "11:200")
    topo = nt.Topology.preset("pcie2s8")
    with nt.World(
        nt.devices("cpu:8"),
        algorithm=alg,
        topology=topo,
        timeout=30,
        chunk_bytes=256,
        inline_bytes=0,
    ) as w:
        check_grid(w, sizes=(301,), dtypes=("float64",), ops=("sum",))


@pytest.mark.parametrize("n", [3, 5])
@pytest.mark.parametrize("alg", ALGS)
@pytest.mark.slow
def test_awkward_sizes_every_dtype(n, alg):
    # counts whose per-rank slices and blocks fall off 16-byte boundaries, chunks of a size
    # that is no multiple of 256 bytes: however the plan rounds its slices and chunks to
    # aligned offsets, every element must be covered exactly once
    with nt.World(nt.devices(f"cpu:{n}"), algorithm=alg, chunk_bytes=1000, inline_bytes=0) as w:
        check_grid(w, sizes=(1001, 4099), ops=("sum", "max"))
