"""Wiring tests of the NCCL engine and the World's watchdog on a fake of CuPy's layer.

nccltree's own ``World``, ``NcclEngine``, ``CudaDevice``/``CudaStream``/``CudaEvent`` run
unmodified on ``tests/fakecupy``, whose ``cupy.cuda.nccl`` has CuPy 14.2's exact
signatures and NCCL's group rules. These tests check which communicator method is called
with which pointers, counts, types, root and stream, inside one group; how errors and
hangs are handled. They check wiring only: they are not GPU verification and never
count as such.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest

import nccltree as nt
from nccltree.comm import nccl as nccl_engine

COLLECTIVES = ("all_reduce", "reduce", "broadcast", "all_gather", "reduce_scatter")
DTYPES = (np.float16, np.float32, np.float64, np.int32, np.int64, np.int8, np.uint8)
METHOD = {
    "all_reduce": "allReduce",
    "reduce": "reduce",
    "broadcast": "broadcast",
    "all_gather": "allGather",
    "reduce_scatter": "reduceScatter",
}


@pytest.fixture
def world(fake_cupy: Any) -> Any:
    """``world(spec, **kw)`` -> an NCCL World on the fake, closed after the test."""
    made: list[nt.World] = []

    def make(spec: str = "gpu:0,1,2", **kw: Any) -> nt.World:
        kw.setdefault("algorithm", "nccl")
        w = nt.World(nt.devices(spec), **kw)
        made.append(w)
        return w

    yield make
    for w in made:
        w.close()


def _data(n: int, dtype: Any, seed: int) -> np.ndarray:
    # small positive integers: sums, products and means are exact in every dtype here
    return np.random.default_rng(seed).integers(1, 3, n).astype(dtype)


def _ops_for(collective: str, dtype: Any) -> list[str]:
    if collective in ("broadcast", "all_gather"):
        return ["sum"]
    return ["sum", "prod", "max", "min"] + (["mean"] if np.dtype(dtype).kind == "f" else [])


def _expected(collective: str, op: str, host: list[np.ndarray], root: int, rank: int) -> Any:
    stack = np.stack(host)
    red = {
        "sum": lambda: stack.sum(0, dtype=stack.dtype),
        "prod": lambda: stack.prod(0, dtype=stack.dtype),
        "max": lambda: stack.max(0),
        "min": lambda: stack.min(0),
        "mean": lambda: (stack.astype(np.float64).mean(0)).astype(stack.dtype),
    }
    n = len(host)
    if collective == "all_reduce":
        return red[op]()
    if collective == "reduce":
        return red[op]() if rank == root else host[rank]
    if collective == "broadcast":
        return host[root]
    if collective == "all_gather":
        return np.concatenate(host)
    block = host[0].size // n
    return red[op]()[rank * block : (rank + 1) * block]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("collective", COLLECTIVES)
@pytest.mark.slow
def test_every_collective_dtype_and_op_calls_nccl_right(
    world: Any, fake_cupy: Any, collective: str, dtype: Any
) -> None:
    """The right method, pointers, count, datatype, op, root and stream, one group per
    collective, results as numpy's (wiring check, not GPU verification)."""
    import cupy
    from cupy.cuda import nccl

    w = world("gpu:0,1,2")
    devs, n = w.devices, w.size
    count = 12
    root = 2
    for op in _ops_for(collective, dtype):
        fake_cupy.nccl.calls.clear()
        host = [_data(count * (n if collective == "reduce_scatter" else 1), dtype, r + 7)
                for r in range(n)]  # fmt: skip
        xs = [d.from_host(h) for d, h in zip(devs, host, strict=True)]
        out_size = {"all_gather": count * n, "reduce_scatter": count}.get(collective, count)
        outs = [d.empty(out_size, dtype) for d in devs]
        args: dict[str, Any] = {"outs": outs}
        if collective in ("reduce", "broadcast"):
            args["root"] = root
        if collective not in ("broadcast", "all_gather"):
            args["op"] = op
        getattr(w, collective)(xs, **args)
        calls = fake_cupy.nccl.calls
        assert [c.method for c in calls] == [METHOD[collective]] * n
        assert len({c.group for c in calls}) == 1 and all(c.in_group for c in calls)
        assert [c.rank for c in calls] == list(range(n))
        for r, c in enumerate(calls):
            assert c.device == devs[r].physical_id
            assert c.sendbuf == xs[r].data.ptr and c.recvbuf == outs[r].data.ptr
            if collective in ("broadcast", "all_gather"):
                # only moved: bytes
                assert (c.count, c.datatype) == (count * np.dtype(dtype).itemsize, nccl.NCCL_UINT8)
            else:
                assert c.count == count
                assert c.datatype == getattr(nccl, f"NCCL_{np.dtype(dtype).name.upper()}")
            if collective in ("all_reduce", "reduce", "reduce_scatter"):
                assert c.op == getattr(nccl, {"mean": "NCCL_AVG"}.get(op, f"NCCL_{op.upper()}"))
            if collective in ("reduce", "broadcast"):
                assert c.root == root
            with cupy.cuda.Device(devs[r].physical_id):
                assert c.stream == cupy.cuda.get_current_stream().ptr
            assert c.executed
        for r in range(n):
            if collective == "reduce" and r != root:
                continue  # NCCL leaves a non-root's recvbuf alone
            want = _expected(collective, op, host, root, r)
            if op == "mean":  # NCCL_AVG is a pre-multiplied sum: not bitwise numpy's mean
                tol = 1e-3 if dtype == np.float16 else 1e-6
                np.testing.assert_allclose(outs[r].get(), want, rtol=tol)
            else:
                np.testing.assert_array_equal(outs[r].get(), want, err_msg=f"{op} rank {r}")
        for r in range(n):  # inputs are never written out of place
            np.testing.assert_array_equal(xs[r].get(), host[r])


def test_in_place_and_per_rank_calls_on_a_user_stream(world: Any, fake_cupy: Any) -> None:
    """Per-rank calls (a thread per rank) on explicit streams: each rank's call is issued
    on its own stream (wiring check, not GPU verification)."""
    w = world("gpu:0,1")
    host = [_data(32, np.float32, r) for r in range(2)]
    xs = [d.from_host(h) for d, h in zip(w.devices, host, strict=True)]
    streams = [d.new_stream() for d in w.devices]

    def step(comm: Any) -> None:
        comm.all_reduce(xs[comm.rank], stream=streams[comm.rank])
        streams[comm.rank].synchronize()

    w.run(step)
    calls = fake_cupy.nccl.calls
    assert [c.stream for c in calls] == [s.cupy_stream.ptr for s in streams]
    assert all(c.sendbuf == c.recvbuf for c in calls)  # in place
    for x in xs:
        np.testing.assert_array_equal(x.get(), host[0] + host[1])


def test_one_rank_and_async_work(world: Any, fake_cupy: Any) -> None:
    """NCCL with one rank (``initAll([0])``) and ``async_op`` (wiring check)."""
    w = world("gpu:0")
    x = w.devices[0].from_host(np.arange(8, dtype=np.float32))
    work = w.all_reduce([x], op="mean", async_op=True)
    work.wait()
    assert work.result()[0] is x
    assert work.is_completed()
    np.testing.assert_array_equal(x.get(), np.arange(8, dtype=np.float32))
    assert [c.method for c in fake_cupy.nccl.calls] == ["allReduce"]
    # one rank's mean is passed as a sum: NCCL's one-rank average kernel (before 2.29.7)
    # leaves tail elements unwritten; the GPU test with a count of 2**18 + 3 catches that
    from cupy.cuda import nccl

    assert fake_cupy.nccl.calls[0].op == nccl.NCCL_SUM


def test_auto_takes_nccl_for_large_messages_and_tree_for_small(world: Any, fake_cupy: Any) -> None:
    w = world("gpu:0,1", algorithm="auto")
    big = [d.zeros(1 << 18, np.float32) for d in w.devices]  # 1 MiB
    w.all_reduce(big)
    assert [c.method for c in fake_cupy.nccl.calls] == ["allReduce", "allReduce"]
    fake_cupy.nccl.calls.clear()
    small = [d.zeros(16, np.float32) for d in w.devices]
    w.all_reduce(small)
    assert fake_cupy.nccl.calls == []


def test_auto_falls_back_when_nccl_cannot_initialise(world: Any, fake_cupy: Any) -> None:
    """An ``NcclError`` from ``initAll`` makes ``auto`` use the hand-built algorithms and
    an explicit ``nccl`` World fail with ``BackendUnavailable`` (wiring check)."""
    fake_cupy.nccl.fail_next_init()
    w = world("gpu:0,1", algorithm="auto")
    host = [_data(1 << 18, np.float32, r) for r in range(2)]
    xs = [d.from_host(h) for d, h in zip(w.devices, host, strict=True)]
    w.all_reduce(xs)
    assert fake_cupy.nccl.calls == []
    np.testing.assert_array_equal(xs[1].get(), host[0] + host[1])
    fake_cupy.nccl.fail_next_init()
    with pytest.raises(nt.BackendUnavailable, match="NCCL could not create communicators"):
        world("gpu:0,1")


def test_error_inside_the_group_launches_nothing_and_aborts(world: Any, fake_cupy: Any) -> None:
    """An NCCL error on one rank inside the group: nothing of the collective runs, the
    caller gets ``CommError``, the communicators are aborted and the World is failed for
    good (wiring check, not GPU verification)."""
    w = world("gpu:0,1,2")
    host = [_data(16, np.float32, r) for r in range(3)]
    xs = [d.from_host(h) for d, h in zip(w.devices, host, strict=True)]
    fake_cupy.nccl.fail_next_call(1)
    with pytest.raises(nt.CommError, match="NCCL all_reduce failed") as info:
        w.all_reduce(xs)
    assert not isinstance(info.value, nt.PeerFailure)
    assert not any(c.executed for c in fake_cupy.nccl.calls)
    for x, h in zip(xs, host, strict=True):
        np.testing.assert_array_equal(x.get(), h)  # nothing written
    assert w.aborted
    assert sorted(r for _, r in fake_cupy.nccl.aborted) == [0, 1, 2]
    with pytest.raises(nt.PeerFailure, match="aborted"):
        w.all_reduce(xs)


def test_argument_errors_touch_nothing_and_keep_the_world(world: Any, fake_cupy: Any) -> None:
    w = world("gpu:0,1")
    xs = [d.zeros(16, np.float32) for d in w.devices]
    with pytest.raises(TypeError, match="mean"):
        w.all_reduce([d.zeros(16, np.int32) for d in w.devices], op="mean")
    with pytest.raises(ValueError, match="size mismatch"):
        w.all_reduce([xs[0], w.devices[1].zeros(8, np.float32)])
    assert fake_cupy.nccl.calls == [] and not w.aborted
    w.all_reduce(xs)
    assert len(fake_cupy.nccl.calls) == 2


def test_failed_stream_raises_at_once_not_at_the_timeout(world: Any, fake_cupy: Any) -> None:
    """A kernel fault after the collective: waiting on its Work raises the CUDA error at
    once (CuPy's ``done`` would spin until the timeout) (wiring check)."""
    w = world("gpu:0,1", timeout=60)
    xs = [d.zeros(16, np.float32) for d in w.devices]
    streams = [d.new_stream() for d in w.devices]
    token = fake_cupy.hang_stream(streams[1])
    work = w.all_reduce(xs, streams=streams, async_op=True)
    token.release(700)
    start = time.monotonic()
    with pytest.raises(nt.CommError) as info:
        work.synchronize()
    assert time.monotonic() - start < 10
    assert "700" in str(info.value) or "illegal" in str(info.value).lower()
    assert w.aborted


def _wait_until(predicate: Any, limit: float = 10.0) -> bool:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.005)
    return False


@pytest.mark.slow
def test_watchdog_aborts_work_that_never_completes(world: Any, fake_cupy: Any) -> None:
    """NCCL work that never completes: the call returns at once (stream-ordered), and the
    watchdog aborts the communicators and fails the World once the timeout passes; every
    later call raises (wiring check, not GPU verification)."""
    w = world("gpu:0,1", timeout=1.5)
    xs = [d.zeros(16, np.float32) for d in w.devices]
    fake_cupy.nccl.hang_next_call(0)
    start = time.monotonic()
    w.all_reduce(xs)  # returns: the caller's streams are ordered after the work
    assert time.monotonic() - start < 1.5
    assert not w.aborted
    assert _wait_until(lambda: w.aborted)
    assert time.monotonic() - start >= 1.5
    assert sorted(r for _, r in fake_cupy.nccl.aborted) == [0, 1]
    with pytest.raises(nt.PeerFailure, match="did not complete within 1.5 s"):
        w.all_reduce(xs)


def test_watchdog_reports_a_stream_failure_without_any_wait(world: Any, fake_cupy: Any) -> None:
    w = world("gpu:0,1", timeout=60)
    xs = [d.zeros(16, np.float32) for d in w.devices]
    streams = [d.new_stream() for d in w.devices]
    token = fake_cupy.hang_stream(streams[0])
    w.all_reduce(xs, streams=streams)
    assert not w.aborted
    token.release(700)
    assert _wait_until(lambda: w.aborted)
    with pytest.raises(nt.PeerFailure):
        w.all_reduce(xs)


def test_close_destroys_finished_communicators_and_aborts_hung_ones(
    world: Any, fake_cupy: Any
) -> None:
    w = world("gpu:0,1", timeout=5)
    xs = [d.zeros(16, np.float32) for d in w.devices]
    w.all_reduce(xs)
    w.close()
    assert sorted(r for _, r in fake_cupy.nccl.destroyed) == [0, 1]
    assert fake_cupy.nccl.aborted == []

    w = world("gpu:0,1", timeout=0.2)
    fake_cupy.nccl.hang_next_call(1)
    w.all_reduce([d.zeros(16, np.float32) for d in w.devices])
    start = time.monotonic()
    w.close()  # bounded by the timeout, then the communicators are aborted
    assert time.monotonic() - start < 5
    assert sorted(r for _, r in fake_cupy.nccl.aborted) == [0, 1]


def test_negative_control_stream_wrapper_has_no_ptr(
    world: Any, fake_cupy: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The old defect (``streams[r].ptr`` on nccltree's stream wrapper) is caught by these
    tests: reintroduced, the first collective fails."""
    w = world("gpu:0,1")
    xs = [d.zeros(16, np.float32) for d in w.devices]
    monkeypatch.setattr(nccl_engine, "stream_handle", lambda s: s.ptr)
    with pytest.raises(AttributeError, match="ptr"):
        w.all_reduce(xs)


def test_nccl_refuses_shared_gpus_and_host_devices(fake_cupy: Any) -> None:
    with pytest.raises(ValueError, match="one rank per distinct GPU"):
        nt.World(nt.devices("gpu:0,0"), algorithm="nccl")
    with pytest.raises(ValueError, match="CUDA devices"):
        nt.World(nt.devices("cpu:2"), algorithm="nccl")


def test_device_error_while_enqueueing_a_plan_aborts_the_world(
    fake_cupy: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A raw CUDA error raised while a tree plan is enqueued (a broken context) becomes
    ``CommError`` and fails the World, as a failed op does (wiring check)."""
    from cupy.cuda import runtime

    w = nt.World(nt.devices("gpu:0,1"), algorithm="tree")
    xs = [d.zeros(1 << 12, np.float32) for d in w.devices]

    def broken(*args: Any) -> None:
        raise runtime.CUDARuntimeError(700)

    monkeypatch.setattr(runtime, "memcpyPeerAsync", broken)
    monkeypatch.setattr(runtime, "memcpyAsync", broken)
    with pytest.raises(nt.CommError, match="failed on a device"):
        w.all_reduce(xs, outs=[d.zeros(1 << 12, np.float32) for d in w.devices])
    assert w.aborted
    w.close()
