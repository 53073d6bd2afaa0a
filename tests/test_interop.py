"""Interop on the host backend: streams, object collectives, Work (timeouts, callbacks,
isend/irecv) and the v-collectives (all_gather_v, reduce_scatter_v, per-rank
all_to_all_v), on a World driver-side and through its per-rank Comm."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

import nccltree as nt
from nccltree import CommTimeout
from nccltree.comm.interop import as_stream


@pytest.fixture
def world3() -> Any:
    w = nt.World(nt.devices("cpu:3"), timeout=20)
    yield w
    w.close()


# -- streams ---------------------------------------------------------------------------------


def test_a_host_stream_is_taken_and_foreign_kinds_are_refused_with_the_reason(world3: Any):
    dev = world3.devices[0]
    st = dev.new_stream()
    assert as_stream(dev, st) is st and as_stream(dev, None) is None
    with pytest.raises(TypeError, match="takes an nccltree Stream"):
        as_stream(dev, 1234)  # a raw cudaStream_t means nothing on the host backend
    xs = [np.full(4, r + 1.0, np.float32) for r in range(3)]
    streams = [d.new_stream() for d in world3.devices]
    world3.all_reduce(xs, streams=streams)
    for s in streams:
        s.synchronize()
    assert all(float(x[0]) == 6.0 for x in xs)
    with pytest.raises(TypeError, match="takes an nccltree Stream"):
        world3.all_reduce(xs, streams=[1, 2, 3])
    world3.all_reduce(xs)  # the argument error left the World usable
    assert float(xs[0][0]) == 18.0


# -- object collectives ----------------------------------------------------------------------


def test_object_collectives_per_rank_follow_torch_semantics(world3: Any):
    def fn(comm: Any) -> Any:
        cfg = {"lr": 0.1, "layers": [1, 2, 3]} if comm.rank == 1 else None
        got = comm.broadcast_object(cfg, 1)
        mine = {"rank": comm.rank, "blob": "x" * (10 * comm.rank)}  # uneven sizes
        gathered = comm.all_gather_object(mine)
        return got, got is cfg, gathered

    results = world3.run(fn)
    for r, (got, same, gathered) in enumerate(results):
        assert got == {"lr": 0.1, "layers": [1, 2, 3]}
        assert same == (r == 1)  # the root keeps its object; the others get a copy
        assert gathered == [{"rank": q, "blob": "x" * (10 * q)} for q in range(3)]


def test_object_collectives_driver_side(world3: Any):
    obj = {"a": np.arange(3)}
    out = world3.broadcast_object([None, None, obj], root=2)
    assert out[2] is obj
    assert all(np.array_equal(o["a"], np.arange(3)) for o in out)
    assert out[0] is not obj
    assert world3.all_gather_object(["a", ("b", 2), None]) == [["a", ("b", 2), None]] * 3
    with pytest.raises(ValueError, match="an object per rank"):
        world3.all_gather_object([1, 2])
    with pytest.raises(ValueError, match="root"):
        world3.broadcast_object([1, 2, 3], root=3)


# -- Work --------------------------------------------------------------------------------------


def test_a_work_wait_timeout_raises_and_leaves_everything_usable(world3: Any):
    timed_out = threading.Event()

    def fn(comm: Any) -> Any:
        if comm.rank == 0:
            buf = np.zeros(5, np.float32)
            work = comm.irecv(buf, 1)
            assert not work.is_completed()
            with pytest.raises(CommTimeout):
                work.wait(timeout=0.05)  # nobody sent yet
            assert not work.is_completed()
            timed_out.set()
            work.wait()
            assert work.is_completed() and work.result() is buf
            return buf.tolist()
        if comm.rank == 1:
            assert timed_out.wait(15)
            work = comm.isend(np.arange(5, dtype=np.float32), 0)
            work.synchronize()
            return None
        return None

    results = world3.run(fn)
    assert results[0] == [0.0, 1.0, 2.0, 3.0, 4.0]
    xs = [np.ones(2, np.float32) for _ in range(3)]
    world3.all_reduce(xs)  # the World was not failed by the caller's own timeout
    assert float(xs[0][0]) == 3.0


def test_isend_irecv_exchange_without_a_batch_and_callbacks_run(world3: Any):
    def fn(comm: Any) -> Any:
        n, me = comm.size, comm.rank
        out = np.zeros(3, np.float64)
        send = comm.isend(np.full(3, float(me)), (me + 1) % n)  # everyone sends first
        recv = comm.irecv(out, (me - 1) % n)
        seen: list[Any] = []
        done = threading.Event()
        recv.add_done_callback(lambda w: (seen.append(w), done.set()))
        send.wait()
        recv.wait()
        assert done.wait(10) and seen == [recv]
        late: list[Any] = []
        recv.add_done_callback(late.append)  # already done: called at once
        assert late == [recv]
        return out.tolist()

    got = world3.run(fn)
    assert got == [[2.0] * 3, [0.0] * 3, [1.0] * 3]


def test_isend_refuses_a_batch_and_itself(world3: Any):
    def fn(comm: Any) -> None:
        if comm.rank != 0:
            return
        with pytest.raises(ValueError, match="posts on its own"):
            comm.isend(np.zeros(2), 0)
        with pytest.raises(ValueError, match="posts on its own"), comm.batch():
            comm.isend(np.zeros(2), 1)

    world3.run(fn)


def test_an_async_collective_calls_back_once_done(world3: Any):
    xs = [np.full(8, r, np.float32) for r in range(3)]
    work = world3.all_reduce(xs, async_op=True)
    done = threading.Event()
    got: list[Any] = []
    work.add_done_callback(lambda w: (got.append(w.result()), done.set()))
    assert done.wait(15)
    assert got[0] is not None and float(xs[2][0]) == 3.0
    with pytest.raises(TypeError, match="callable"):
        work.add_done_callback(3)


# -- the v-collectives -----------------------------------------------------------------------


@pytest.mark.parametrize("counts", [[1, 2, 3], [0, 4, 1], [5, 0, 0]])
def test_all_gather_v_driver_side_and_per_rank(world3: Any, counts: list[int]):
    xs = [np.arange(c, dtype=np.float32) + 10 * r for r, c in enumerate(counts)]
    want = np.concatenate(xs)
    outs = [np.full(sum(counts), -1, np.float32) for _ in range(3)]
    world3.all_gather_v(xs, outs, counts)
    assert all(np.array_equal(o, want) for o in outs)

    def fn(comm: Any) -> Any:
        out = np.full(sum(counts), -1, np.float32)
        return comm.all_gather_v(xs[comm.rank].copy(), out, counts)

    assert all(np.array_equal(o, want) for o in world3.run(fn))


@pytest.mark.parametrize("op", ["sum", "mean", "max", "prod"])
def test_reduce_scatter_v_driver_side_and_per_rank_agree_bitwise(world3: Any, op: str):
    counts = [2, 0, 5]
    rng = np.random.default_rng(3)
    xs = [rng.standard_normal(sum(counts)).astype(np.float32) for _ in range(3)]
    outs = [np.zeros(c, np.float32) for c in counts]
    world3.reduce_scatter_v([x.copy() for x in xs], outs, counts, op=op)
    ref = {"sum": np.add, "mean": np.add, "max": np.maximum, "prod": np.multiply}[op]
    full = ref(ref(xs[0], xs[1]), xs[2]) / (3 if op == "mean" else 1)
    at = 0
    for q, c in enumerate(counts):
        np.testing.assert_allclose(outs[q], full[at : at + c], rtol=1e-6)
        at += c

    def fn(comm: Any) -> Any:
        out = np.zeros(counts[comm.rank], np.float32)
        return comm.reduce_scatter_v(xs[comm.rank].copy(), out, counts, op=op)

    for q, got in enumerate(world3.run(fn)):
        assert np.array_equal(got, outs[q])  # the same kernels in the same order


def test_per_rank_all_to_all_v_matches_the_worlds(world3: Any):
    counts = [[1, 0, 2], [3, 1, 0], [0, 2, 2]]
    xs = [np.arange(sum(row), dtype=np.int64) + 100 * r for r, row in enumerate(counts)]
    outs = [np.zeros(sum(row[q] for row in counts), np.int64) for q in range(3)]
    world3.all_to_all_v(xs, outs, counts)

    def fn(comm: Any) -> Any:
        me = comm.rank
        out = np.zeros(sum(row[me] for row in counts), np.int64)
        return comm.all_to_all_v(xs[me], out, counts[me], [row[me] for row in counts])

    assert all(np.array_equal(a, b) for a, b in zip(world3.run(fn), outs, strict=True))


def test_v_collective_argument_errors_name_the_cause(world3: Any):
    xs = [np.zeros(c, np.float32) for c in (1, 2, 3)]
    outs = [np.zeros(6, np.float32) for _ in range(3)]
    with pytest.raises(ValueError, match="a count per rank"):
        world3.all_gather_v(xs, outs, [1, 2])
    with pytest.raises(ValueError, match="rank 1: the input needs 3 elements"):
        world3.all_gather_v(xs, outs, [1, 3, 2])
    with pytest.raises(ValueError, match=r"counts\[0\]"):
        world3.reduce_scatter_v(outs, xs, [-1, 2, 5])
    with pytest.raises(TypeError, match="mean"):
        world3.reduce_scatter_v(
            [np.zeros(6, np.int32)] * 3, [np.zeros(c, np.int32) for c in (1, 2, 3)],
            [1, 2, 3], op="mean",
        )  # fmt: skip
    with pytest.raises(ValueError, match="cannot run in place"):
        world3.reduce_scatter_v(outs, [o[:c] for o, c in zip(outs, (1, 2, 3), strict=True)],
                                [1, 2, 3])  # fmt: skip
    world3.all_gather_v(xs, outs, [1, 2, 3])  # still usable


def test_work_wait_orders_a_given_host_stream_and_takes_a_timedelta(world3: Any):
    import datetime

    xs = [np.full(4, 1.0, np.float32) for _ in range(3)]
    work = world3.all_reduce(xs, async_op=True)
    st = world3.devices[0].new_stream()
    work.wait(st)  # an nccltree stream, though the call's callers were host threads
    st.synchronize()
    work.wait(timeout=datetime.timedelta(seconds=10))
    assert work.is_completed() and float(xs[0][0]) == 3.0
    with pytest.raises(TypeError, match="only an nccltree Stream"):
        work.wait(7)


def test_a_read_only_buffer_is_refused_where_it_would_be_written(world3: Any):
    """An immutable framework array (a JAX array's view, an unversioned DLPack import)
    may be read, never written: refused before anything is written."""
    xs = [np.ones(3, np.float32) for _ in range(3)]
    xs[1].flags.writeable = False
    with pytest.raises(ValueError, match="rank 1: the input .written in place. is read-only"):
        world3.all_reduce(xs)
    outs = [np.zeros(3, np.float32) for _ in range(3)]
    world3.all_reduce(xs, outs=outs)  # read, not written: fine
    assert float(outs[0][0]) == 3.0 and float(xs[0][0]) == 1.0
    world3.reduce([xs[1], xs[0], xs[2]], 1, outs=[outs[1], outs[0], outs[2]])
    outs[2].flags.writeable = False
    with pytest.raises(ValueError, match="rank 2: the output is read-only"):
        world3.all_reduce(xs, outs=outs)
