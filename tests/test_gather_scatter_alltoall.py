"""gather, scatter and all_to_all: rows of the collectives table, their (direct) plans under
every algorithm, the public methods of World and Comm, NCCL's send/receive groups on the
fake of CuPy's layer, argument errors, and the benchmark's tables. Process groups run them
in tests/mpi/pg_grid.py (test_process_group.py), against numpy and bitwise against the
in-process World.

The data are moved, never combined: every result is compared exactly."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import nccltree as nt
from nccltree.comm.algorithms import build_plan
from nccltree.comm.collectives import COLLECTIVES, collective
from nccltree.comm.faces import driver_method
from nccltree.comm.plan import check_races

NEW = ("gather", "scatter", "all_to_all", "sendrecv")
DTYPES = ("float32", "float64", "int32", "int64", "float16", "bfloat16", "int8", "uint8")


def _inputs(coll: str, n: int, count: int, dtype: str) -> list[np.ndarray]:
    c = COLLECTIVES[coll]
    rng = np.random.default_rng(count * 31 + n)
    return [
        (rng.integers(-1000, 1000, c.in_count(count, n)) + 0.5 * (dtype[0] == "f"))
        .astype(dtype)
        for _ in range(n)
    ]  # fmt: skip


def _call(world: nt.World, coll: str, xs: list[Any], outs: list[Any], root: int) -> None:
    # every new operation is a World method of its name (sendrecv: the ring shift, shift)
    kw = {"root": root} if COLLECTIVES[coll].rooted else {}
    getattr(world, driver_method(coll))(xs, outs, **kw)


def _check(coll: str, full: list[np.ndarray], xs: list[Any], outs: list[Any], root: int,
           what: str) -> None:  # fmt: skip
    for r, (which, want) in enumerate(COLLECTIVES[coll].expected(full, "sum", root)):
        got = np.asarray(xs[r] if which == "in" else outs[r]).astype(want.dtype)
        np.testing.assert_array_equal(got.reshape(-1), want, err_msg=f"{what} rank {r}")


@pytest.mark.parametrize("alg", ["tree", "ring", "direct", "auto"])
@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
@pytest.mark.slow
def test_every_new_collective_matches_numpy(alg: str, n: int) -> None:
    world = nt.World(nt.devices(f"cpu:{n}"), algorithm=alg)
    try:
        for coll in NEW:
            c = COLLECTIVES[coll]
            for dtype in DTYPES:
                for count in (0, 1, 7, 1000):
                    for root in sorted({0, n - 1}) if c.rooted else [0]:
                        full = _inputs(coll, n, count, dtype)
                        what = f"{alg} {coll} {dtype} count={count} root={root}"
                        xs = [f.copy() for f in full]
                        outs = [np.full(c.out_count(count, n), 7, dtype) for _ in range(n)]
                        _call(world, coll, xs, outs, root)
                        _check(coll, full, xs, outs, root, what)
                        if not c.in_place_ok:
                            continue
                        # in place: gather's input is block r of its output, scatter's
                        # output block r of its input (NCCL's layouts, as all_gather and
                        # reduce_scatter)
                        if coll == "gather":
                            outs = [np.zeros(c.out_count(count, n), dtype) for _ in range(n)]
                            for r in range(n):
                                outs[r][r * count : (r + 1) * count] = full[r]
                            xs = [outs[r][r * count : (r + 1) * count] for r in range(n)]
                        else:
                            xs = [f.copy() for f in full]
                            outs = [xs[r][r * count : (r + 1) * count] for r in range(n)]
                        _call(world, coll, xs, outs, root)
                        _check(coll, full, xs, outs, root, what + " in place")
    finally:
        world.close()


def test_per_rank_calls_and_async_work() -> None:
    n, count = 3, 5
    world = nt.World(nt.devices(f"cpu:{n}"), algorithm="tree")
    full = _inputs("all_to_all", n, count, "float32")
    outs = [np.zeros(n * count, np.float32) for _ in range(n)]

    def body(comm: nt.Comm) -> None:
        work = comm.all_to_all(full[comm.rank].copy(), outs[comm.rank], async_op=True)
        work.synchronize()
        g = np.zeros(n * count, np.float32)
        comm.gather(full[comm.rank][:count].copy(), g, root=1)
        if comm.rank == 1:
            np.testing.assert_array_equal(g, np.concatenate([f[:count] for f in full]))
        s = np.zeros(count, np.float32)
        comm.scatter(full[comm.rank].copy(), s, root=2)
        np.testing.assert_array_equal(s, full[2][comm.rank * count : (comm.rank + 1) * count])

    world.run(body)
    _check("all_to_all", full, full, outs, 0, "per-rank all_to_all")
    world.close()


def test_all_to_all_refuses_to_run_in_place_and_shapes_are_checked() -> None:
    world = nt.World(nt.devices("cpu:2"), algorithm="direct")
    xs = [np.zeros(4, np.float32) for _ in range(2)]
    with pytest.raises(ValueError, match="all_to_all cannot run in place"):
        world.all_to_all(xs, xs)
    with pytest.raises(ValueError, match="does not split into 2 blocks"):
        world.all_to_all([np.zeros(3, np.float32)] * 2, [np.zeros(3, np.float32)] * 2)
    with pytest.raises(ValueError, match="output needs 8 elements"):
        world.gather(xs, [np.zeros(4, np.float32)] * 2)
    with pytest.raises(ValueError, match="needs an output"):
        world._driver("scatter", xs, None, "sum", 0, None, False)
    assert collective("alltoall").name == "all_to_all"
    world.close()


@pytest.mark.parametrize("alg", ["tree", "ring", "direct"])
def test_new_plans_are_race_free(alg: str) -> None:
    for coll in NEW:
        for n in (1, 2, 3, 7):
            for count in (0, 1, 5, 64):
                for in_place in (False, True) if COLLECTIVES[coll].in_place_ok else (False,):
                    for root in sorted({0, n - 1}):
                        plan = build_plan(alg, coll, size=n, count=count, root=root,
                                          in_place=in_place, chunk=7)  # fmt: skip
                        assert check_races(plan) == [], (alg, coll, n, count, in_place, root)


def test_the_plans_move_each_block_once() -> None:
    """Each block crosses from where it is to where it goes once: n*(n-1) blocks for
    all_to_all between ranks, n-1 for gather and scatter."""
    n, count = 4, 10
    for coll, moved in (("gather", n - 1), ("scatter", n - 1), ("all_to_all", n * (n - 1)),
                        ("sendrecv", n)):  # fmt: skip
        plan = build_plan("direct", coll, size=n, count=count, root=1)
        across = [s for s in plan.data_steps() if s.dst is not None and
                  any(b.rank != s.dst.rank for b in s.srcs)]  # fmt: skip
        assert len(across) == moved, coll
        assert all(s.kind == "copy" and s.dst.count == count for s in across)


# -- NCCL: sends and receives in one group (the fake of CuPy's layer: wiring only) -----------


@pytest.mark.parametrize(
    ("coll", "in_place"),
    [(c, p) for c in NEW for p in (False, True) if COLLECTIVES[c].in_place_ok or not p],
)
def test_nccl_runs_them_as_one_group_of_sends_and_receives(
    fake_cupy: Any, coll: str, in_place: bool
) -> None:
    """Wiring check on tests/fakecupy, not GPU verification."""
    c = COLLECTIVES[coll]
    w = nt.World(nt.devices("gpu:0,1,2"), algorithm="nccl")
    n, count, root = 3, 6, 2
    full = _inputs(coll, n, count, "float32")
    if in_place and coll == "gather":
        big = [np.zeros(n * count, np.float32) for _ in range(n)]
        for r in range(n):
            big[r][r * count : (r + 1) * count] = full[r]
        outs = [d.from_host(b) for d, b in zip(w.devices, big, strict=True)]
        xs = [o[r * count : (r + 1) * count] for r, o in enumerate(outs)]
    elif in_place:
        xs = [d.from_host(f) for d, f in zip(w.devices, full, strict=True)]
        outs = [x[r * count : (r + 1) * count] for r, x in enumerate(xs)]
    else:
        xs = [d.from_host(f) for d, f in zip(w.devices, full, strict=True)]
        outs = [d.zeros(c.out_count(count, n), np.float32) for d in w.devices]
    fake_cupy.nccl.calls.clear()
    _call(w, coll, xs, outs, root)
    calls = fake_cupy.nccl.calls
    assert {k.method for k in calls} <= {"send", "recv"} and calls
    assert len({k.group for k in calls}) == 1 and all(k.in_group and k.executed for k in calls)
    sends = sorted((k.rank, k.peer) for k in calls if k.method == "send")
    recvs = sorted((k.peer, k.rank) for k in calls if k.method == "recv")
    assert sends == recvs  # every send has its receive
    _check(coll, full, [x.get() for x in xs], [o.get() for o in outs], root, coll)
    w.close()


# -- the benchmark ---------------------------------------------------------------------------


def test_the_benchmark_measures_and_checks_them(tmp_path: Any) -> None:
    import json

    from nccltree.cli import bench

    out = tmp_path / "b.json"
    argv = ["collectives", "--devices", "cpu:3", "--collective",
            "gather,scatter,alltoall,sendrecv",
            "-b", "64", "-e", "64K", "-f", "32", "-c", "1", "-n", "1", "-w", "0",
            "--algorithm", "tree,direct", "--json", str(out), "--quiet"]  # fmt: skip
    assert bench.main(argv) == 0
    recs = json.loads(out.read_text())["records"]
    assert {r["collective"] for r in recs} == set(NEW)
    assert all(r["wrong"] == 0 for r in recs)
    # all_to_all and sendrecv have no in-place form: out of place only
    for name in ("all_to_all", "sendrecv"):
        assert {r["placement"] for r in recs if r["collective"] == name} == {"out-of-place"}
    # nccl-tests' bus factors: (n-1)/n, and 1 for sendrecv
    for r in recs:
        if r["time_us"] > 0 and r["algbw"] > 0:
            factor = 1.0 if r["collective"] == "sendrecv" else 2 / 3
            assert r["busbw"] == pytest.approx(r["algbw"] * factor, rel=1e-6)


def test_the_readme_library_example_runs_and_its_comments_hold(capsys: Any) -> None:
    """The README's library example is run as written; its gather/scatter/all_to_all
    comments are then checked against what it computed."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    m = re.search(r"```python\n(import numpy as np.*?)```", text, re.S)
    assert m, "the README's library example"
    scope: dict[str, Any] = {}
    exec(compile(m.group(1), "README.md", "exec"), scope)
    xs, blocks, mine = scope["xs"], scope["blocks"], scope["mine"]
    # after the all_reduce, every x is the sum 0+1+2+3 = 6; gather put rank r's 8 at 8r
    gathered = np.concatenate([x[:8] for x in xs])
    np.testing.assert_array_equal(mine[1], gathered[8:16])
    # all_to_all turned block q of rank r into block r of rank q: blocks[0] (the gathered
    # array) sent block q to rank q, so every rank's block 0 is a piece of it
    for q in range(4):
        np.testing.assert_array_equal(blocks[q][:8], gathered[q * 8 : (q + 1) * 8])
    # the per-rank example prints what its comment says
    assert "[4.0, 2.0, 4.0, 2.0]" in capsys.readouterr().out


# -- uneven all_to_all --------------------------------------------------------------------------


def _v_expected(xs: list[np.ndarray], counts: np.ndarray) -> list[np.ndarray]:
    n = len(xs)
    return [
        np.concatenate(
            [xs[p][counts[p, :q].sum() : counts[p, :q].sum() + counts[p, q]] for p in range(n)]
        )  # fmt: skip
        for q in range(n)
    ]


@pytest.mark.parametrize("n", [1, 2, 3, 6])
@pytest.mark.parametrize("dtype", ["float32", "int64", "float16"])
def test_all_to_all_v_moves_uneven_blocks(n: int, dtype: str) -> None:
    rng = np.random.default_rng(n)
    w = nt.World(nt.devices(f"cpu:{n}"), algorithm="ring")
    for trial in range(4):
        counts = rng.integers(0, 50, (n, n))
        if trial == 1:
            counts[:, 0] = 0  # a rank that receives nothing
        if trial == 2:
            counts[0, :] = 0  # a rank that sends nothing
        xs = [(rng.integers(-99, 99, counts[r].sum())).astype(dtype) for r in range(n)]
        outs = [np.full(counts[:, q].sum(), 7, dtype) for q in range(n)]
        got = w.all_to_all_v(xs, outs, counts.tolist())
        for q, want in enumerate(_v_expected(xs, counts)):
            np.testing.assert_array_equal(outs[q], want)
            assert got[q] is outs[q]
    w.close()


def test_all_to_all_v_checks_its_counts_and_buffers_and_runs_async() -> None:
    w = nt.World(nt.devices("cpu:2"))
    counts = [[1, 2], [3, 4]]
    xs = [np.arange(3, dtype=np.float32), np.arange(7, dtype=np.float32)]
    outs = [np.zeros(4, np.float32), np.zeros(6, np.float32)]
    work = w.all_to_all_v(xs, outs, counts, async_op=True)
    work.synchronize()
    np.testing.assert_array_equal(outs[0], [0, 0, 1, 2])
    with pytest.raises(ValueError, match="a row per rank"):
        w.all_to_all_v(xs, outs, [[1, 2]])
    with pytest.raises(ValueError, match=r"counts\[1\]\[0\]"):
        w.all_to_all_v(xs, outs, [[1, 2], [-3, 4]])
    with pytest.raises(ValueError, match="rank 1: the input needs 7 elements"):
        w.all_to_all_v([xs[0], xs[1][:5]], outs, counts)
    with pytest.raises(ValueError, match="rank 0: the output needs 4 elements"):
        w.all_to_all_v(xs, [outs[0][:3], outs[1]], counts)
    with pytest.raises(ValueError, match="cannot run in place"):
        w.all_to_all_v([outs[0][:3], xs[1]], outs, counts)
    w.close()


def test_all_to_all_v_on_gpus(fake_cupy: Any) -> None:
    """Wiring check on tests/fakecupy (not GPU verification), an NCCL World included."""
    w = nt.World(nt.devices("gpu:0,1,2"), algorithm="nccl")
    counts = np.array([[2, 0, 5], [1, 1, 1], [0, 3, 2]])
    host = [np.arange(counts[r].sum(), dtype=np.float32) + 10 * r for r in range(3)]
    xs = [d.from_host(h) for d, h in zip(w.devices, host, strict=True)]
    outs = [d.zeros(counts[:, q].sum(), np.float32) for q, d in enumerate(w.devices)]
    w.all_to_all_v(xs, outs, counts.tolist())
    for q, want in enumerate(_v_expected(host, counts)):
        np.testing.assert_array_equal(outs[q].get(), want)
    w.close()
