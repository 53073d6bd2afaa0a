"""Point-to-point between the ranks of a World: ``send``/``recv``/``sendrecv`` and batches
(nccltree.comm.p2p): matching order, exchanges without deadlock, the deadlock a batch
avoids (negative control), errors, timeouts, groups, and the GPU path on the fake of
CuPy's layer (wiring only)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import nccltree as nt


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("dtype", ["float32", "float64", "int32", "float16"])
def test_ring_exchange_with_sendrecv(n: int, dtype: str) -> None:
    w = nt.World(nt.devices(f"cpu:{n}"))

    def body(comm: nt.Comm) -> np.ndarray:
        r = comm.rank
        out = np.zeros(1001, dtype)
        mine = (np.arange(1001) * (r + 1) % 97).astype(dtype)
        return comm.sendrecv(mine, (r + 1) % n, out, (r - 1) % n)

    got = w.run(body)
    for r in range(n):
        src = (r - 1) % n
        np.testing.assert_array_equal(got[r], (np.arange(1001) * (src + 1) % 97).astype(dtype))
    w.close()


def test_a_pipeline_of_lone_sends_and_receives_keeps_the_call_order() -> None:
    n = 4
    w = nt.World(nt.devices(f"cpu:{n}"))

    def body(comm: nt.Comm) -> list[float]:
        r = comm.rank
        seen = []
        for micro in range(5):  # micro-batches flow down the pipeline in order
            x = np.full(8, float(micro))
            if r > 0:
                comm.recv(x, r - 1)
            seen.append(float(x[0]))
            x += 100
            if r < n - 1:
                comm.send(x, r + 1)
        return seen

    got = w.run(body)
    assert got[0] == [0, 1, 2, 3, 4]
    assert got[3] == [300, 301, 302, 303, 304]  # three stages added 100 each, in order
    w.close()


def test_a_batch_exchanges_with_every_rank_at_once() -> None:
    n = 5
    w = nt.World(nt.devices(f"cpu:{n}"))

    def body(comm: nt.Comm) -> list[int]:
        r = comm.rank
        outs = [np.zeros(3, np.int64) for _ in range(n)]
        with comm.batch():  # every send first: fine inside a batch
            for q in range(n):
                comm.send(np.full(3, 10 * r + q), q)
            for q in range(n):
                comm.recv(outs[q], q)
        return [int(o[0]) for o in outs]

    got = w.run(body)
    assert got == [[10 * q + r for q in range(n)] for r in range(n)]
    w.close()


def test_without_a_batch_two_ranks_sending_first_wait_for_each_other() -> None:
    """Negative control: a lone send waits for its receive, so two ranks that both send
    first never get to their receives: the timeout ends it, naming the peer."""
    w = nt.World(nt.devices("cpu:2"), timeout=0.5)

    def body(comm: nt.Comm) -> None:
        other = 1 - comm.rank
        comm.send(np.ones(4), other)
        comm.recv(np.zeros(4), other)

    with pytest.raises(nt.CommTimeout, match=r"its send to rank \d .* not matched"):
        w.run(body)
    assert w.aborted
    w.close()


def test_mismatched_sizes_raise_on_both_ranks_and_bad_arguments_are_refused() -> None:
    w = nt.World(nt.devices("cpu:2"))
    raised: dict[int, str] = {}

    def body(comm: nt.Comm) -> None:
        try:
            if comm.rank == 0:
                comm.send(np.ones(4, np.float32), 1)
            else:
                comm.recv(np.zeros(5, np.float32), 0)
        except ValueError as exc:
            raised[comm.rank] = str(exc)
            raise

    with pytest.raises(ValueError, match="sends 4 float32 to rank 1, which receives 5"):
        w.run(body)
    assert set(raised) == {0, 1}
    c = w.comm(0)
    with pytest.raises(ValueError, match="with itself needs both halves in one batch"):
        c.send(np.ones(2), 0)
    with pytest.raises(ValueError, match="peer 2 is not a rank of 2"):
        c.send(np.ones(2), 2)
    with pytest.raises(ValueError, match="batches do not nest"):
        with c.batch(), c.batch():
            pass
    w.close()


def test_a_rank_that_never_receives_fails_the_world_in_time() -> None:
    w = nt.World(nt.devices("cpu:3"), timeout=0.5)
    raised: dict[int, BaseException] = {}

    def body(comm: nt.Comm) -> None:
        try:
            if comm.rank == 0:
                comm.send(np.ones(4), 2)  # rank 2 never receives
        except nt.NcclTreeError as exc:
            raised[comm.rank] = exc
            raise

    with pytest.raises(nt.CommTimeout, match="rank 0: its send to rank 2"):
        w.run(body)
    assert set(raised) == {0} and w.aborted
    with pytest.raises(nt.PeerFailure, match="aborted"):  # failed for good, as after a collective
        w.comm(1).send(np.ones(1), 0)
    w.close()


def test_groups_exchange_side_by_side() -> None:
    """Two halves of a World, each a group, exchange in rings at once and with the
    parent's collectives in between: groups never wait for each other."""
    w = nt.World(nt.devices("cpu:6"))

    def body(comm: nt.Comm) -> tuple[float, float]:
        sub = comm.split(comm.rank % 2)
        assert sub is not None
        r, n = sub.rank, sub.size
        out = np.zeros(100)
        for _ in range(3):
            sub.sendrecv(np.full(100, float(comm.rank)), (r + 1) % n, out, (r - 1) % n)
            y = np.ones(1)
            comm.all_reduce(y)
        return float(out[0]), float(y[0])

    got = w.run(body)
    # group of the evens: 0, 2, 4 (ranks 0, 1, 2 there); each gets its predecessor's
    assert [g[0] for g in got] == [4.0, 5.0, 0.0, 1.0, 2.0, 3.0]
    assert all(g[1] == 6.0 for g in got)
    w.close()


def test_on_gpus_the_copy_runs_on_the_receivers_stream(fake_cupy: Any) -> None:
    """Wiring check on tests/fakecupy (not GPU verification)."""
    w = nt.World(nt.devices("gpu:0,1,2"))

    def body(comm: nt.Comm) -> Any:
        r = comm.rank
        x = comm.device.from_host(np.full(64, r + 1, np.float32))
        out = comm.device.zeros(64, np.float32)
        comm.sendrecv(x, (r + 1) % 3, out, (r - 1) % 3)
        return out.get()

    fake_cupy.ops.clear()
    got = w.run(body)
    for r in range(3):
        np.testing.assert_array_equal(got[r], np.full(64, (r - 1) % 3 + 1, np.float32))
    on_device = 1 << 48  # the fake's device addresses start there
    copies = [op for op in fake_cupy.ops if op.kind in ("memcpy", "memcpy_peer")
              and op.src >= on_device and op.dst >= on_device]  # fmt: skip
    streams = {w._streams[r].cupy_stream.ptr for r in range(3)}  # type: ignore[attr-defined]
    assert len(copies) == 3 and {op.stream for op in copies} <= streams
    w.close()
