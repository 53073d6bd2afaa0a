"""The World under misuse: a rank stuck outside the collectives, argument errors inside
``World.run``, and device sets too large for this machine's memory.

``World.run`` is bounded by the timeout once a rank fails and names the rank that is
stuck; an argument error leaves the World usable whether it is raised inside ``run`` or
in the caller's own threads; ``devices("cpu:N")`` and ``World`` refuse, before allocating
anything, a number of ranks whose memory cannot fit.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import nccltree as nt
import nccltree.backends as backends
from nccltree import MissingRanks
from nccltree.data import MemorySource
from nccltree.models import build_model
from nccltree.parallel import DataParallel, RankFailure

pytestmark = pytest.mark.timeout(60)


# -- a rank stuck outside any collective ---------------------------------------------------


def test_run_is_bounded_by_the_timeout_and_names_the_stuck_rank():
    release = threading.Event()
    with nt.World(nt.devices("cpu:3"), timeout=0.5) as w:

        def body(comm):
            if comm.rank == 2:
                release.wait(20)  # stuck in the function's own code, not in a collective
            comm.all_reduce(np.ones(4))

        t0 = time.monotonic()
        with pytest.raises(MissingRanks) as info:
            w.run(body)
        elapsed = time.monotonic() - t0
        # the others time out after 0.5 s, then rank 2 gets 0.5 s more to return
        assert elapsed < 3, elapsed
        assert info.value.ranks == (2,)
        assert str(info.value).startswith("rank(s) [2] of 3 did not return")
        assert "daemon thread" in str(info.value)
        assert isinstance(info.value, nt.CommTimeout)
        assert w.aborted
        # the stuck rank's later collectives fail at once instead of waiting
        release.set()


def test_run_names_the_rank_that_did_not_arrive_when_it_returns_late():
    with nt.World(nt.devices("cpu:3"), timeout=0.3) as w:

        def body(comm):
            if comm.rank == 0:
                time.sleep(0.5)  # late, but returns within the grace period
                return None
            comm.all_reduce(np.ones(4))
            return None

        with pytest.raises(MissingRanks) as info:
            w.run(body)
    assert info.value.ranks == (0,)
    assert "waiting for rank(s) [0]" in str(info.value)
    notes = getattr(info.value, "__notes__", [])
    if sys.version_info >= (3, 11):
        assert any("rank(s) [0] of 3 at fault" in n for n in notes), notes


def test_run_with_a_failing_rank_and_a_stuck_one_raises_the_error_and_notes_the_stuck():
    release = threading.Event()
    with nt.World(nt.devices("cpu:3"), timeout=0.5) as w:

        def body(comm):
            if comm.rank == 1:
                raise RuntimeError("boom on rank 1")
            if comm.rank == 2:
                release.wait(20)
                return
            comm.all_reduce(np.ones(4))

        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="boom on rank 1") as info:
            w.run(body)
        assert time.monotonic() - t0 < 3
        release.set()
    notes = getattr(info.value, "__notes__", [])
    if sys.version_info >= (3, 11):
        assert any("rank(s) [2] of 3 did not return" in n for n in notes), notes


def test_run_without_a_failure_waits_as_long_as_the_ranks_work():
    with nt.World(nt.devices("cpu:2"), timeout=0.2) as w:
        # longer than the timeout, but nothing failed: no bound
        assert w.run(lambda comm: time.sleep(0.5) or comm.rank) == [0, 1]


def test_data_parallel_blames_the_stuck_rank_not_the_one_that_timed_out():
    """A rank stuck reading its data: the run ends within the timeout and names it."""
    x = np.zeros((4, 8), np.float32)
    y = np.zeros(4, np.int64)
    release = threading.Event()

    class StuckOnRank2(MemorySource):
        def next_batch(self, rank=0, timeout=None):
            if rank == 2 and self._next[2] >= 1:
                release.wait(20)
            return super().next_batch(rank, timeout)

    source = StuckOnRank2([[(x, y)]] * 3)
    dp = DataParallel(build_model("softmax", (8,), 2), nt.devices("cpu:3"), lr=0.1, timeout=0.5)
    t0 = time.monotonic()
    try:
        with pytest.raises(RankFailure) as info:  # the driver's error, blaming rank 2
            dp.fit(source, 10)
        assert time.monotonic() - t0 < 5
    finally:
        release.set()
        dp.close()
    exc = info.value
    assert exc.rank == 2, exc
    assert isinstance(exc.error, MissingRanks) and exc.error.ranks == (2,)


# -- argument errors: one rule -------------------------------------------------------------


def _size_mismatch(comm):
    comm.all_reduce(np.ones(5 if comm.rank == 0 else 4))


def test_argument_error_inside_run_leaves_the_world_usable():
    with nt.World(nt.devices("cpu:3"), timeout=2) as w:
        with pytest.raises(ValueError, match="size mismatch"):
            w.run(_size_mismatch)
        assert not w.aborted
        xs = [np.full(4, r + 1.0) for r in range(3)]
        w.all_reduce(xs)  # driver side
        np.testing.assert_array_equal(xs[0], 6.0)
        out = w.run(lambda comm: comm.all_reduce(np.ones(4)))  # per rank, inside run
        assert all(np.all(o == 3.0) for o in out)


def test_argument_error_from_the_callers_threads_leaves_the_world_usable():
    with nt.World(nt.devices("cpu:3"), timeout=2) as w:
        seen: dict[int, BaseException] = {}

        def body(comm):
            try:
                _size_mismatch(comm)
            except ValueError as exc:
                seen[comm.rank] = exc

        threads = [threading.Thread(target=body, args=(w.comm(r),)) for r in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert sorted(seen) == [0, 1, 2]
        assert not w.aborted
        out = w.run(lambda comm: comm.all_reduce(np.ones(4)))
        assert all(np.all(o == 3.0) for o in out)


def test_a_rank_raising_valueerror_of_its_own_still_aborts_the_world():
    """Only the collectives' argument errors are exempt: a ValueError from the function's
    own code leaves the other ranks waiting for it, so it is a rank failure."""
    with nt.World(nt.devices("cpu:3"), timeout=10) as w:

        def body(comm):
            if comm.rank == 1:
                raise ValueError("the function's own mistake")
            comm.all_reduce(np.ones(4))

        t0 = time.monotonic()
        with pytest.raises(ValueError, match="own mistake"):
            w.run(body)
        assert time.monotonic() - t0 < 5
        assert w.aborted


def test_argument_error_caught_and_replaced_by_the_function_is_a_rank_failure():
    with nt.World(nt.devices("cpu:2"), timeout=10) as w:

        def body(comm):
            try:
                _size_mismatch(comm)
            except ValueError as exc:
                raise RuntimeError("wrapped") from exc

        with pytest.raises(RuntimeError, match="wrapped"):
            w.run(body)
        assert w.aborted


# -- device sets too large for memory ------------------------------------------------------


def test_ranks_memory_grows_with_the_pairs():
    assert backends.ranks_memory(1) == backends.RANK_BYTES + backends.PAIR_BYTES
    assert backends.ranks_memory(100_000) > 10**12  # 10^10 pairs: no machine has this


def test_devices_refuses_what_cannot_fit(monkeypatch):
    monkeypatch.setattr(backends, "available_memory", lambda: 1 << 30)
    with pytest.raises(ValueError, match=r"'cpu:100000' needs about 1\.6 TB") as info:
        nt.devices("cpu:100000")
    msg = str(info.value)
    assert "1.1 GB is available" in msg
    most = int(msg.rsplit("at most ", 1)[1].split()[0])
    assert backends.ranks_memory(most) <= 1 << 30 < backends.ranks_memory(most + 1)
    # bounded by memory, not by cores: many more devices than cores are fine
    assert len(nt.devices("cpu:64")) == 64


def test_world_refuses_a_device_list_that_cannot_fit(monkeypatch):
    devs = nt.devices("cpu:64")
    monkeypatch.setattr(backends, "available_memory", lambda: backends.ranks_memory(63))
    with pytest.raises(ValueError, match="a World of 64 ranks needs about"):
        nt.World(devs)
    monkeypatch.setattr(backends, "available_memory", lambda: None)  # nothing says: no bound
    nt.World(devs).close()


def test_available_memory_reads_this_machine():
    avail = backends.available_memory()
    if sys.platform.startswith("linux"):
        assert avail is not None and avail > 0


@pytest.mark.subprocess
def test_a_huge_device_set_is_refused_at_once_in_a_fresh_process():
    """The real estimate against the real memory: cpu:100000 is refused in well under a
    second instead of growing until the kernel kills it (the address space is capped at
    2 GB so that a regression fails here instead of taking the machine's memory)."""
    code = textwrap.dedent(
        """
        import resource, sys, time
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
        import nccltree as nt
        t0 = time.monotonic()
        for make in (lambda: nt.devices("cpu:100000"), lambda: nt.World("cpu:100000")):
            try:
                make()
            except ValueError as exc:
                assert "needs about" in str(exc), exc
            else:
                sys.exit("not refused")
        assert time.monotonic() - t0 < 2, time.monotonic() - t0
        """
    )
    if not sys.platform.startswith("linux"):
        pytest.skip("RLIMIT_AS is what bounds the subprocess")
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=50, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _cap_address_space() -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS bounds the run")
@pytest.mark.subprocess
@pytest.mark.slow
def test_train_cli_refuses_a_huge_device_set_as_usage(tmp_path):
    # the address space is capped: a regression fails here instead of taking the machine
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "nccltree.cli.train",
            "--devices",
            "cpu:100000",
            "--iters",
            "1",
            "--out",
            str(tmp_path / "run"),
        ],
        capture_output=True,
        text=True,
        timeout=50,
        check=False,
        preexec_fn=_cap_address_space,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "needs about" in proc.stderr and "Traceback" not in proc.stderr


def test_the_plan_cache_is_bounded_by_steps(monkeypatch):
    import nccltree.comm.programs as programs_mod

    monkeypatch.setattr(programs_mod, "PLAN_CACHE_STEPS", 200)
    with nt.World(nt.devices("cpu:8"), algorithm="ring") as w:
        cache = w._programs
        for count in range(64, 64 * 20, 64):
            w.plan("all_reduce", count)
            assert cache.plan_steps == sum(len(p.steps) for p in cache.plans.values())
            assert cache.plan_steps <= 200 or len(cache.plans) == 1
            assert cache.programs.keys() == cache.plans.keys()


def test_a_rank_thread_that_cannot_start_aborts_the_world(monkeypatch):
    """With thousands of ranks the threads may run out: the ranks already started must
    not wait for the missing one until the timeout."""
    real_start = threading.Thread.start
    released: dict[int, float] = {}

    def start(self):
        if self.name == "nccltree-rank2":
            raise RuntimeError("can't start new thread")
        real_start(self)

    with nt.World(nt.devices("cpu:3"), timeout=30) as w:

        def body(comm):
            t0 = time.monotonic()
            try:
                comm.all_reduce(np.ones(4))
            except nt.PeerFailure:
                released[comm.rank] = time.monotonic() - t0

        monkeypatch.setattr(threading.Thread, "start", start)
        with pytest.raises(nt.CommError, match="could not start the thread of rank 2"):
            w.run(body)
        monkeypatch.setattr(threading.Thread, "start", real_start)
        assert w.aborted
        deadline = time.monotonic() + 5
        while len(released) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    assert sorted(released) == [0, 1] and max(released.values()) < 5
