"""World, Comm and Work arguments under the one checking rule (nccltree._validate):
numpy integers accepted, bool refused, NaN and infinities refused; and the collectives
table's in-place layouts and descriptions."""

from __future__ import annotations

import math

import numpy as np
import pytest

import nccltree as nt
from nccltree.comm.collectives import COLLECTIVES, collective, collective_name


@pytest.fixture(scope="module")
def world():
    with nt.World(nt.devices("cpu:3"), algorithm="tree", timeout=20) as w:
        yield w


@pytest.mark.parametrize(
    "kwargs,err,match",
    [
        ({"timeout": math.nan}, ValueError, "timeout must be a number, got NaN"),
        ({"timeout": math.inf}, ValueError, "timeout must be finite"),
        ({"timeout": 0}, ValueError, "timeout must be > 0"),
        ({"timeout": True}, TypeError, "timeout must be a real number"),
        ({"chunk_bytes": 32}, ValueError, "chunk_bytes must be >= 64, got 32"),
        ({"chunk_bytes": 4096.0}, TypeError, "chunk_bytes must be an integer"),
        ({"chunk_bytes": True}, TypeError, "chunk_bytes must be an integer"),
        ({"inline_bytes": -1}, ValueError, "inline_bytes must be >= 0"),
        ({"inline_bytes": 1.5}, TypeError, "inline_bytes must be an integer"),
    ],
)
def test_bad_world_arguments(kwargs, err, match):
    with pytest.raises(err, match=match):
        nt.World(nt.devices("cpu:2"), **kwargs)


def test_numpy_numbers_are_accepted_by_the_world():
    with nt.World(
        nt.devices("cpu:2"),
        timeout=np.float32(5),
        chunk_bytes=np.int64(4096),
        inline_bytes=np.uint32(0),
    ) as w:
        assert (w.timeout, w.chunk_bytes, w.inline_bytes) == (5.0, 4096, 0)
        assert type(w.chunk_bytes) is int and type(w.inline_bytes) is int
        assert w.comm(np.int64(1)).rank == 1
        xs = [np.full(5, float(r)) for r in range(2)]
        w.broadcast(xs, root=np.int64(1))
        np.testing.assert_array_equal(xs[0], np.ones(5))
        w.reduce(xs, root=np.int32(0))
        np.testing.assert_array_equal(xs[0], np.full(5, 2.0))
        plan = w.plan("reduce", np.int64(40), root=np.int64(1))
        assert plan == w.plan("reduce", 40, root=1)
        assert w.tree(np.int64(1)).root == 1


def test_ranks_and_roots_refuse_bool_and_floats(world):
    xs = [np.zeros(4) for _ in range(3)]
    with pytest.raises(TypeError, match="rank must be an integer"):
        world.comm(True)
    with pytest.raises(ValueError, match=r"rank must be in \[0, 3\), got 3"):
        world.comm(3)
    with pytest.raises(TypeError, match="root must be an integer"):
        world.broadcast(xs, root=True)
    with pytest.raises(TypeError, match="root must be an integer"):
        world.reduce(xs, root=1.0)
    with pytest.raises(ValueError, match=r"root must be in \[0, 3\), got -1"):
        world.reduce(xs, root=-1)
    with pytest.raises(ValueError, match="count must be >= 0"):
        world.plan("all_reduce", -1)
    with pytest.raises(TypeError, match="root must be an integer"):
        world.tree(True)


def test_per_rank_numpy_root(world):
    def body(comm):
        x = np.full(3, float(comm.rank))
        comm.broadcast(x, root=np.int64(2))
        return x

    for x in world.run(body):
        np.testing.assert_array_equal(x, np.full(3, 2.0))


def test_work_synchronize_refuses_nan(world):
    xs = [np.ones(4) for _ in range(3)]
    work = world.all_reduce(xs, async_op=True)
    with pytest.raises(ValueError, match="timeout must be a number, got NaN"):
        work.synchronize(math.nan)
    work.synchronize(np.float64(10))
    np.testing.assert_array_equal(xs[0], np.full(4, 3.0))


def test_the_table_names_and_aliases():
    assert list(COLLECTIVES) == [
        "all_reduce",
        "reduce",
        "broadcast",
        "all_gather",
        "reduce_scatter",
        "gather",
        "scatter",
        "all_to_all",
        "sendrecv",
    ]
    for alias, name in [
        ("allreduce", "all_reduce"),
        ("All-Reduce", "all_reduce"),
        ("bcast", "broadcast"),
        ("allgather", "all_gather"),
        ("reducescatter", "reduce_scatter"),
    ]:
        assert collective_name(alias) == name
    with pytest.raises(ValueError, match="accepted: all_reduce, reduce, broadcast"):
        collective("gather_all")
    assert collective("reduce").describe("max", 2) == "reduce(op=max, root=2)"
    assert collective("all_gather").describe("sum", 0) == "all_gather()"
    assert collective("broadcast").keywords("max", 1) == {"root": 1}
    assert collective("reduce_scatter").keywords("max", 1) == {"op": "max"}


def test_in_place_layouts_come_from_the_table(world):
    # all_gather in place: rank r's input is block r of its output; any other overlap
    # is refused; reduce_scatter in place: rank r's output is block r of its input
    n, c = 3, 4
    bufs = [np.zeros(n * c) for _ in range(n)]
    for r in range(n):
        bufs[r][r * c : (r + 1) * c] = r + 1
    world.all_gather([bufs[r][r * c : (r + 1) * c] for r in range(n)], bufs)
    for b in bufs:
        np.testing.assert_array_equal(b, np.repeat([1.0, 2.0, 3.0], c))
    with pytest.raises(ValueError, match="not the in-place layout of all_gather"):
        world.all_gather([bufs[r][1 : 1 + c] for r in range(n)], bufs)
    xs = [np.arange(n * c, dtype=np.float64) for _ in range(n)]
    world.reduce_scatter(xs, [xs[r][r * c : (r + 1) * c] for r in range(n)])
    for r in range(n):
        np.testing.assert_array_equal(xs[r][r * c : (r + 1) * c], 3 * np.arange(r * c, r * c + c))


def test_settings_written_after_construction_take_effect_and_are_checked():
    """``algorithm``, ``timeout``, ``inline_bytes``, ``inline_threads`` and
    ``max_scratch_bytes`` are read by the World's chooser, issuer and program cache on
    every call: a write reaches them, and a bad value is refused as the constructor
    refuses it."""
    with nt.World("cpu:4", algorithm="tree") as w:
        w.algorithm = "ring"
        assert w.algorithm == "ring"
        assert w.plan("all_reduce", 4096) is w.plan("all_reduce", 4096, algorithm="ring")
        w.inline_bytes, w.inline_threads, w.timeout = 0, 2, 30
        assert (w.inline_bytes, w.inline_threads, w.timeout) == (0, 2, 30)
        w.max_scratch_bytes = 0
        xs = [np.full(1000, r + 1, np.float32) for r in range(4)]
        outs = [np.zeros(1000, np.float32) for _ in range(4)]
        w.algorithm = "tree"
        w.reduce(xs, root=0, outs=outs)  # the tree's reduce needs scratch: its own
        np.testing.assert_array_equal(outs[0], np.full(1000, 10, np.float32))
        assert w.scratch_bytes == 0
        w.max_scratch_bytes = None
        w.reduce(xs, root=0, outs=outs)
        assert w.scratch_bytes == 4000  # kept again
        for name, value in [("algorithm", "fastest"), ("timeout", -1), ("inline_bytes", -1),
                            ("inline_threads", 0), ("max_scratch_bytes", -1)]:  # fmt: skip
            with pytest.raises(ValueError, match=name):
                setattr(w, name, value)
