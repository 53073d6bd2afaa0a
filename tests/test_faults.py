"""Faults: argument errors on every rank, failing ranks, missing ranks, mismatched calls.

Nothing may hang: every test runs under a short World timeout and pytest-timeout.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import nccltree as nt

pytestmark = pytest.mark.timeout(60)


def world(n=3, alg="tree", timeout=2.0, **kw):
    return nt.World(nt.devices(f"cpu:{n}"), algorithm=alg, timeout=timeout, **kw)


@pytest.mark.parametrize("alg", ["tree", "ring", "direct"])
def test_driver_side_argument_errors_write_nothing_and_world_stays_usable(alg):
    with world(alg=alg) as w:
        xs = [np.arange(5.0) + r for r in range(3)]
        before = [x.copy() for x in xs]
        bad_cases = [
            ([xs[0], xs[1], np.arange(4.0)], ValueError),  # size mismatch
            ([xs[0], xs[1], np.arange(5, dtype=np.float32)], TypeError),  # dtype mismatch
            ([xs[0], xs[1], np.arange(10.0)[::2]], ValueError),  # not contiguous
            ([xs[0], xs[1], [1.0, 2.0]], TypeError),  # not an array
            ([xs[0], xs[1]], ValueError),  # wrong number of ranks
            ([x.astype(np.complex64) for x in xs], TypeError),  # unsupported dtype
        ]
        for args, exc in bad_cases:
            with pytest.raises(exc):
                w.all_reduce(args)
        with pytest.raises(ValueError, match="unknown reduction op"):
            w.all_reduce(xs, op="avg")
        with pytest.raises(TypeError, match="mean"):
            w.all_reduce([np.arange(5) for _ in range(3)], op="mean")
        with pytest.raises(ValueError, match="root"):
            w.broadcast(xs, root=3)
        with pytest.raises(ValueError, match="output"):
            w.all_gather(xs, [np.empty(14) for _ in range(3)])
        with pytest.raises(ValueError, match="split"):
            w.reduce_scatter([np.arange(4.0)] * 3, [np.empty(1)] * 3)
        for x, b in zip(xs, before):
            np.testing.assert_array_equal(x, b)
        w.all_reduce(xs)
        np.testing.assert_array_equal(xs[0], sum(before))


def test_per_rank_argument_error_raises_on_every_rank():
    with world() as w:
        seen = [None] * 3
        barrier = threading.Barrier(3)

        def body(comm):
            x = np.ones(4 if comm.rank != 1 else 5)
            try:
                comm.all_reduce(x)
            except ValueError as exc:
                seen[comm.rank] = str(exc)
                np.testing.assert_array_equal(x, 1.0)  # nothing written
            barrier.wait()
            y = np.ones(3)
            comm.all_reduce(y)  # the World is still usable
            return y

        results = w.run(body)
    assert all(s is not None and "size mismatch" in s for s in seen)
    assert all(np.all(r == 3.0) for r in results)


def test_rank_calling_a_different_collective():
    with world() as w:
        errors = [None] * 3

        def body(comm):
            x = np.ones(4)
            try:
                if comm.rank == 2:
                    comm.broadcast(x)
                else:
                    comm.all_reduce(x)
            except ValueError as exc:
                errors[comm.rank] = str(exc)

        w.run(body)
    assert all(e is not None and "disagree" in e for e in errors)


def _call(comm, collective: str) -> None:
    """One call of ``collective`` on small buffers."""
    n = comm.size
    x = np.ones(2 * n)
    if collective == "all_reduce":
        comm.all_reduce(x)
    elif collective == "reduce":
        comm.reduce(x, root=n - 1)
    elif collective == "broadcast":
        comm.broadcast(x, root=1)
    elif collective == "all_gather":
        comm.all_gather(x, np.empty(2 * n * n))
    elif collective == "reduce_scatter":
        comm.reduce_scatter(x, np.empty(2))
    else:
        comm.barrier()


@pytest.mark.parametrize(
    "collective", ["all_reduce", "reduce", "broadcast", "all_gather", "reduce_scatter", "barrier"]
)
@pytest.mark.parametrize("stage", ["before", "between", "after"])
@pytest.mark.slow
def test_rank_that_raises_makes_others_fail_quickly(stage, collective):
    with world(n=4, timeout=30) as w:
        outcome = {}

        def body(comm):
            if stage == "between":
                _call(comm, collective)
            if comm.rank == 1 and stage in ("before", "between"):
                raise RuntimeError("boom on rank 1")
            t0 = time.monotonic()
            try:
                _call(comm, collective)
                _call(comm, collective)
                if comm.rank == 1:
                    raise RuntimeError("boom on rank 1")
                _call(comm, collective)
            except nt.PeerFailure:
                outcome[comm.rank] = time.monotonic() - t0
                raise

        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="boom on rank 1") as info:
            w.run(body)
        elapsed = time.monotonic() - t0
    # every other rank raised PeerFailure, well before the 30 s timeout
    assert sorted(outcome) == [0, 2, 3]
    assert elapsed < 10
    notes = getattr(info.value, "__notes__", [])
    assert any("rank 1" in note for note in notes) or "rank 1" in str(info.value)
    with pytest.raises(nt.PeerFailure, match="aborted"):
        w.all_reduce([np.ones(2)] * 4)


def test_rank_that_never_calls_times_out_everyone():
    with world(n=3, timeout=0.5) as w:
        raised = {}

        def body(comm):
            if comm.rank == 0:
                return "skipped"
            try:
                comm.all_reduce(np.ones(4))
            except nt.CommTimeout as exc:
                raised[comm.rank] = exc
                assert isinstance(exc, TimeoutError)
                raise

        with pytest.raises(nt.CommTimeout, match="rank"):
            w.run(body)
    assert set(raised) == {1, 2}
    assert "waiting for rank(s) [0]" in str(raised[1])


def test_failure_inside_a_stream_aborts_the_world():
    with world(n=2, timeout=5, inline_bytes=0) as w:
        xs = [np.ones(1000), np.ones(1000)]
        # make rank 1's communication stream fail on its next op
        w._streams[1].call(_raise)
        with pytest.raises(nt.CommError):
            w.all_reduce(xs)
        assert w.aborted
        with pytest.raises(nt.PeerFailure):
            w.all_reduce(xs)


def _raise():
    raise RuntimeError("injected device failure")


def test_closed_world_refuses_work():
    w = world()
    w.close()
    with pytest.raises(nt.CommError, match="closed"):
        w.all_reduce([np.ones(2)] * 3)
    w.close()  # idempotent


def test_input_not_modified_when_a_peer_fails_argument_checks_in_reduce():
    with world(n=3) as w:
        xs = [np.arange(6.0) * (r + 1) for r in range(3)]
        before = [x.copy() for x in xs]
        with pytest.raises(TypeError):
            w.reduce([xs[0], xs[1], xs[2].astype(np.float32)], root=0)
        for x, b in zip(xs, before):
            np.testing.assert_array_equal(x, b)


def test_abort_from_another_thread_releases_waiting_ranks():
    with world(n=3, timeout=30) as w:
        seen = {}

        def body(comm):
            if comm.rank == 0:
                time.sleep(0.2)
                w.abort("stopped by the test")
                return None
            try:
                comm.all_reduce(np.ones(4))  # rank 0 never joins: waits until the abort
            except nt.PeerFailure as exc:
                seen[comm.rank] = str(exc)

        w.run(body)
    assert set(seen) == {1, 2} and all("stopped by the test" in m for m in seen.values())
