"""The shared pieces under World, a process group's local ranks and the data-parallel
driver: the rendezvous, the per-rank runner and the life cycle (nccltree/comm/)."""

from __future__ import annotations

import sys
import threading
import time
from typing import TYPE_CHECKING, cast

import numpy as np
import pytest

import nccltree as nt
from nccltree._errors import CommError, CommTimeout, MissingRanks, PeerFailure
from nccltree.comm.flight import FlightRecorder
from nccltree.comm.group.lifecycle import Lifecycle as GroupLifecycle
from nccltree.comm.group.placement import Placement
from nccltree.comm.group.shm import exit_without_finalize
from nccltree.comm.lifecycle import LifeCycle
from nccltree.comm.rendezvous import Rendezvous, run_ranks

if TYPE_CHECKING:
    from nccltree.comm.group.node_memory import NodeMemory

# -- the rendezvous ------------------------------------------------------------------------


def test_the_last_to_arrive_runs_the_meeting_and_wakes_the_others():
    meet: Rendezvous[int] = Rendezvous(3)
    seen: list[tuple[int, object]] = []

    def rank(r: int) -> None:
        m, last = meet.arrive(r, 10 * r)
        if last:
            meet.finish(m, sum(c for c in m.calls if c is not None))
        else:
            meet.wait(m, lambda: 30.0)
        seen.append((r, m.result))

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(seen) == [(0, 30), (1, 30), (2, 30)]


def test_calls_meet_by_their_number_on_each_channel():
    meet: Rendezvous[str] = Rendezvous(2, channels=2)
    a0, last = meet.arrive(0, "a", channel=0)
    assert not last and (a0.index, a0.channel) == (0, 0)
    b0, last = meet.arrive(0, "b", channel=1)  # another channel: another meeting
    assert not last and b0 is not a0 and meet.missing(b0) == [1]
    a1, last = meet.arrive(0, "a again", channel=0)  # call 1 of channel 0
    assert not last and a1.index == 1
    m, last = meet.arrive(1, "a", channel=0)
    assert last and m is a0 and m.runner == 1 and m.calls == ["a", "a"]
    assert meet.missing(a1) == [1]


def test_a_wait_ends_when_its_check_raises_and_a_refused_arrival_deposits_nothing():
    meet: Rendezvous[int] = Rendezvous(2)

    def refuse() -> None:
        raise CommError("closed")

    with pytest.raises(CommError):
        meet.arrive(0, 1, check=refuse)
    m, _ = meet.arrive(0, 1)
    assert m.index == 0  # the refused call took no number
    calls = []

    def check() -> float:
        calls.append(time.monotonic())
        if len(calls) == 3:
            raise CommTimeout("enough")
        return 0.01

    with pytest.raises(CommTimeout, match="enough"):
        meet.wait(m, check)
    assert len(calls) == 3


def test_wake_all_makes_a_sleeping_waiter_look_again():
    meet: Rendezvous[int] = Rendezvous(2)
    m, _ = meet.arrive(0, 1)
    stop = threading.Event()
    errors: list[BaseException] = []

    def check() -> float:
        if stop.is_set():
            raise PeerFailure("aborted")
        return 600.0

    def waiter() -> None:
        try:
            meet.wait(m, check, slice_s=600.0)
        except PeerFailure as exc:
            errors.append(exc)

    t = threading.Thread(target=waiter, daemon=True)
    t.start()
    time.sleep(0.2)
    stop.set()
    t0 = time.monotonic()
    meet.wake_all()
    t.join(30)
    assert not t.is_alive() and len(errors) == 1
    assert time.monotonic() - t0 < 10  # woken, not timed out


# -- the per-rank runner -------------------------------------------------------------------


def _no_abort(exc: BaseException) -> None:
    raise AssertionError(f"aborted: {exc}")


def test_run_ranks_returns_every_result_in_rank_order_from_named_threads():
    names: dict[int, str] = {}

    def call(i: int) -> int:
        names[i] = threading.current_thread().name
        return i * i

    got = run_ranks(4, call, on_error=lambda i, e: None, abort=_no_abort, label=lambda i: i + 10)
    assert got == [0, 1, 4, 9]
    assert names == {i: f"nccltree-rank{i + 10}" for i in range(4)}


def test_run_ranks_one_rank_inline_runs_in_the_calling_thread():
    me = threading.current_thread()
    got = run_ranks(
        1, lambda i: threading.current_thread() is me, on_error=lambda i, e: None,
        abort=_no_abort, inline_one=True,
    )  # fmt: skip
    assert got == [True]


def test_run_ranks_raises_the_first_own_error_not_a_peer_failure_naming_its_rank():
    release = threading.Event()
    handled: list[int] = []
    cleaned: list[int] = []

    def call(i: int) -> None:
        if i == 2:
            raise RuntimeError("injected")
        release.wait(30)
        raise PeerFailure(f"rank {i}: released")

    def on_error(i: int, exc: BaseException) -> None:
        handled.append(i)
        if i == 2:
            release.set()  # the owner's abort releases the others

    with pytest.raises(RuntimeError, match="injected") as ei:
        run_ranks(3, call, on_error=on_error, abort=_no_abort, cleanup=cleaned.append,
                  label=lambda i: 5 + i, size=8)  # fmt: skip
    if sys.version_info >= (3, 11):
        assert ei.value.__notes__ == ["(raised on rank 7 of 8)"]
    assert sorted(handled) == [0, 1, 2] and sorted(cleaned) == [0, 1, 2]


def test_run_ranks_bounds_a_rank_stuck_after_a_failure():
    aborted: list[BaseException] = []
    hold = threading.Event()

    def call(i: int) -> None:
        if i == 0:
            raise PeerFailure("rank 0: released by a failure")
        hold.wait(60)  # stuck in its own code

    t0 = time.monotonic()
    try:
        with pytest.raises(MissingRanks, match=r"rank\(s\) \[1\] of 2 did not return") as ei:
            run_ranks(2, call, on_error=lambda i, e: None, abort=aborted.append,
                      stuck_after=0.3)  # fmt: skip
    finally:
        hold.set()
    assert tuple(ei.value.ranks) == (1,) and aborted == [ei.value]
    assert time.monotonic() - t0 < 10


# -- the life cycle ------------------------------------------------------------------------


def _life() -> LifeCycle:
    flight = FlightRecorder()
    flight.start(1, "all_reduce", 8, np.dtype(np.float32), "tree")
    return LifeCycle(flight, lambda: "the test's World", "it is closed", "it failed")


def test_the_first_failure_stays_and_is_reported_once_with_the_flight_recorder(capsys):
    life = _life()
    life.check_usable()
    assert life.fail(CommTimeout("first"))
    assert not life.fail(PeerFailure("second"))
    assert isinstance(life.failure, CommTimeout) and life.failed and life.failed_at
    err = capsys.readouterr().err
    assert err.count("nccltree: CommTimeout: first") == 1 and "second" not in err
    assert "the test's World" in err and "all_reduce" in err
    with pytest.raises(PeerFailure, match="it failed: first"):
        life.check_usable()


def test_an_abort_the_caller_asks_for_is_not_reported(capsys):
    life = _life()
    assert life.fail(PeerFailure("stop"), report=False)
    assert capsys.readouterr().err == ""
    with pytest.raises(PeerFailure, match="it failed: stop"):
        life.check_usable()


def test_close_once_then_calls_are_refused():
    life = _life()
    assert life.close() and not life.close()
    with pytest.raises(CommError, match="it is closed"):
        life.check_usable()


def test_a_world_reports_a_failure_found_inside_but_not_its_callers_abort(capsys):
    with nt.World("cpu:2", timeout=0.5) as w:
        with pytest.raises(MissingRanks):
            w.comm(0).all_reduce(np.ones(2, np.float32))  # rank 1 never comes
        err = capsys.readouterr().err
        assert "nccltree: MissingRanks" in err and "the World of 2 ranks" in err
        with pytest.raises(PeerFailure, match="aborted and is closed for good"):
            w.all_reduce([np.ones(2, np.float32)] * 2)
    with nt.World("cpu:2") as w:
        w.abort("the caller's reason")
        assert w.aborted and capsys.readouterr().err == ""


class _NodeMemory:
    """What a process group's life cycle asks of the node's memory, recorded."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.reason: str | None = None  # the abort word's

    def unlink_pending(self) -> None:
        self.calls.append("unlink")

    def abort_reason(self) -> str | None:
        return self.reason

    def set_abort(self, reason: str, culprit: int | None) -> str:
        self.calls.append(f"abort word: {reason} (blames {culprit})")
        if self.reason is None:
            self.reason = reason
        return self.reason


def _group_life(monkeypatch: pytest.MonkeyPatch) -> tuple[GroupLifecycle, _NodeMemory, list]:
    import atexit

    at_exit: list[object] = []
    monkeypatch.setattr(atexit, "register", at_exit.append)  # never leave pytest that way
    pl = Placement(
        nprocs=1, proc=0, size=1, ranks=(0,), node="a", node_index=0, nodes=1, local_rank=0,
        local_size=1, shm=False, job="j", mpi_rank_of_proc=[0], node_of_proc=[0],
        nlocal_of_proc=[1], first_rank_of_proc=[0], proc_of_rank=[0], tnode_of_proc=[0],
        phys=[0], node_procs=[0], remote_procs=[],
    )  # fmt: skip
    flight = FlightRecorder()
    flight.start(1, "broadcast", 4, np.dtype(np.float32), "tree")
    life = GroupLifecycle(pl, flight)
    mem = _NodeMemory()
    life.mem = cast("NodeMemory", mem)
    return life, mem, at_exit


def test_a_process_group_fails_as_a_world_does_and_tells_its_node(monkeypatch, capsys):
    life, mem, at_exit = _group_life(monkeypatch)
    exc = CommTimeout("rank 0: waited")
    assert life.fail(exc) and not life.fail(PeerFailure("later"))
    # the node is told before the names are freed: a peer that finds one gone reads why
    assert mem.calls == [
        "abort word: ranks [0] failed: CommTimeout: rank 0: waited (blames 0)",
        "unlink",
    ]
    assert at_exit == [exit_without_finalize]
    err = capsys.readouterr().err
    assert err.startswith("nccltree: CommTimeout: rank 0: waited\nflight recorder of rank 0 ")
    assert "broadcast" in err
    if sys.version_info >= (3, 11):
        assert exc.__notes__ == [err.rstrip("\n")]
    # closing a failed group skips the node's sync but releases; the failure stays named
    released: list[str] = []
    assert life.close(lambda: released.append("sync"), [lambda: released.append("free")])
    assert released == ["free"] and not life.close()
    with pytest.raises(PeerFailure, match="the process group failed earlier: rank 0") as ei:
        life.check_usable()
    assert ei.value.__cause__ is exc


def test_a_process_groups_abort_tells_its_node_but_prints_nothing(monkeypatch, capsys):
    life, mem, at_exit = _group_life(monkeypatch)
    assert life.fail(CommError("stop"), report=False)
    assert mem.calls == ["abort word: ranks [0] failed: CommError: stop (blames 0)", "unlink"]
    assert at_exit == [exit_without_finalize] and capsys.readouterr().err == ""
    # a peer's failure, learnt from the node, is not told back to it
    life, mem, _ = _group_life(monkeypatch)
    mem.reason = "ranks [1] failed"
    life.fail(PeerFailure("rank 0: ranks [1] failed"))
    assert mem.calls == ["unlink"]
    # ... but one learnt otherwise is, as it was learnt (blaming nobody it does not know)
    life, mem, _ = _group_life(monkeypatch)
    life.fail(PeerFailure("rank 0: a local rank failed"))
    assert mem.calls == ["abort word: rank 0: a local rank failed (blames None)", "unlink"]


def test_a_process_group_closes_after_its_node_syncs_even_when_the_sync_fails(monkeypatch):
    life, _, _ = _group_life(monkeypatch)
    steps: list[str] = []

    def sync() -> None:
        steps.append("sync")
        raise CommTimeout("a peer never came")

    assert life.close(sync, [lambda: steps.append("a"), lambda: steps.append("b")])
    assert steps == ["sync", "a", "b"] and life.closed and not life.failed
    with pytest.raises(CommError, match="the process group is closed"):
        life.check_usable()
