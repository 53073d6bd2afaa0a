"""The native wait primitive (``nccltree._native.Counter``) and the waits built on it."""

from __future__ import annotations

import mmap
import multiprocessing
import os
import sys
import threading
import time

import numpy as np
import pytest

from nccltree import _native
from nccltree._native import Counter, new_counter

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="futex: Linux")


def _waiter(c: Counter, target: int, timeout: float, out: list[object]) -> None:
    out.append(c.wait(target, timeout))


def _start_waiter(c: Counter, target: int, timeout: float = 30.0) -> tuple[threading.Thread, list]:
    out: list[object] = []
    t = threading.Thread(target=_waiter, args=(c, target, timeout, out), daemon=True)
    t.start()
    return t, out


def _wait_for_sleepers(c: Counter, n: int) -> None:
    """Until ``n`` threads sleep on ``c`` (they spin briefly first)."""
    deadline = time.monotonic() + 30
    while c.sleepers < n:
        assert time.monotonic() < deadline, "the waiters never went to sleep"
        time.sleep(0.001)


def test_starts_at_zero_and_adds() -> None:
    c = Counter()
    assert c.value == 0 and c.sleepers == 0
    c.add()
    c.add(4)
    assert c.value == 5


def test_wait_returns_at_once_when_reached() -> None:
    c = Counter()
    c.add(3)
    assert c.wait(3, 0.0) is True
    assert c.wait(2, 0.0) is True  # already past
    assert c.wait(4, 0.0) is False  # a zero timeout only looks


def test_wait_returns_when_the_counter_passes_the_target() -> None:
    c = Counter()
    t, out = _start_waiter(c, 2)
    _wait_for_sleepers(c, 1)
    c.add(1)  # not there yet: the waiter wakes, looks, sleeps again
    time.sleep(0.02)
    assert out == []
    c.add(5)  # past the target, not equal to it
    t.join(30)
    assert out == [True]
    assert c.sleepers == 0


def test_one_add_wakes_every_waiter() -> None:
    c = Counter()
    waiters = [_start_waiter(c, 1) for _ in range(4)]
    _wait_for_sleepers(c, 4)
    c.add(1)
    for t, out in waiters:
        t.join(30)
        assert out == [True]


def test_timeout_returns_false_within_bounds() -> None:
    c = Counter()
    t0 = time.monotonic()
    assert c.wait(1, 0.05) is False
    elapsed = time.monotonic() - t0
    # generous bounds: it did wait, and it did not hang
    assert 0.04 <= elapsed < 10
    assert c.sleepers == 0


def test_spin_only_then_timeout() -> None:
    c = Counter()
    assert c.wait(1, 0.01, spin=0.01) is False  # spin as long as the whole timeout
    assert c.wait(1, 0.01, spin=0.0) is False


@pytest.mark.parametrize("start", [0xFFFFFFF0, 0x7FFFFFF0])
def test_wrap_around_comparison(start: int) -> None:
    c = Counter()
    c.add(start)
    assert c.value == start
    target = start + 0x20  # past 2**32 for the first start: wraps to a small number
    assert c.wait(target, 0.0) is False
    c.add(0x20)
    assert c.value == target & 0xFFFFFFFF
    assert c.wait(target, 0.0) is True
    # a target up to 2**31 - 1 behind counts as reached, one 2**31 - 1 ahead does not
    assert c.wait(target - 0x7FFFFFFF, 0.0) is True
    assert c.wait(target + 0x7FFFFFFF, 0.0) is False


def test_wait_across_a_wrap() -> None:
    c = Counter()
    c.add(0xFFFFFFFF)
    t, out = _start_waiter(c, 0x100000001)  # 1 after the wrap
    _wait_for_sleepers(c, 1)
    c.add(2)
    t.join(30)
    assert out == [True] and c.value == 1


def test_wait_releases_the_gil() -> None:
    c = Counter()
    t, out = _start_waiter(c, 1, timeout=30.0)
    _wait_for_sleepers(c, 1)
    # this thread runs Python while the other one is blocked in the native wait
    n = sum(range(200_000))
    assert n > 0 and out == []
    c.add()
    t.join(30)
    assert out == [True]


def test_counter_in_a_buffer_and_its_checks() -> None:
    buf = np.zeros(4, np.uint64)
    c = Counter(buf, 8)
    c.add(7)
    assert int(buf.view(np.uint32)[2]) == 7
    with pytest.raises(ValueError, match="8-byte aligned"):
        Counter(buf, 4)
    with pytest.raises(ValueError, match="8 writable bytes"):
        Counter(bytes(16))  # read-only
    with pytest.raises(ValueError, match="8 writable bytes"):
        Counter(bytearray(16), 12)  # too short
    with pytest.raises(ValueError, match="timeout"):
        c.wait(8, -1.0)


def test_bad_calls_to_the_library_return_statuses() -> None:
    lib = _native.library()
    assert lib.nt_counter_wait(None, 1, 0, 0, 0) == _native.ERR_NULL
    buf = np.zeros(4, np.uint32)
    odd = buf.ctypes.data + 4 if buf.ctypes.data % 8 == 0 else buf.ctypes.data
    assert lib.nt_counter_wait(odd, 1, 0, 0, 0) == _native.ERR_ALIGN
    assert lib.nt_counter_add_wake(odd, 1, 0, None) == _native.ERR_ALIGN
    assert lib.nt_counter_wait(buf.ctypes.data, 1, -1, 0, 0) == _native.ERR_SIZE
    assert "timed out" in _native.strerror(_native.TIMEOUT)


def _child_waits_then_answers(fd: int) -> None:  # runs in a forked child
    mm = mmap.mmap(fd, 4096)
    ping, pong = Counter(mm, 0, shared=True), Counter(mm, 64, shared=True)
    ok = ping.wait(1, 30.0)
    pong.add(2 if ok else 100)
    os._exit(0)


@linux_only
@pytest.mark.subprocess
def test_two_processes_share_a_counter() -> None:
    """A counter in a shared mapping: the parent wakes a forked child and the child
    wakes the parent back, each sleeping on the futex of the other."""
    fd = os.memfd_create("nccltree-test-counter")
    try:
        os.ftruncate(fd, 4096)
        mm = mmap.mmap(fd, 4096)
        ping, pong = Counter(mm, 0, shared=True), Counter(mm, 64, shared=True)
        ctx = multiprocessing.get_context("fork")
        child = ctx.Process(target=_child_waits_then_answers, args=(fd,))
        child.start()
        try:
            time.sleep(0.05)  # let the child go to sleep (not required for correctness)
            ping.add(1)
            assert pong.wait(2, 30.0) is True
            assert pong.value == 2
        finally:
            child.join(30)
        assert child.exitcode == 0
    finally:
        os.close(fd)


@pytest.mark.parametrize("spin", [0.0, None, 20e-6])
def test_futex_pingpong_reports_a_time(spin: float | None) -> None:
    t = _native.futex_pingpong(200, spin)
    assert 0 < t < 1.0


def test_futex_pingpong_checks_rounds() -> None:
    with pytest.raises(ValueError):
        _native.futex_pingpong(0)
    with pytest.raises(ValueError):
        _native.futex_pingpong(10, 0.0, (-1, 0))


@linux_only
def test_futex_pingpong_pinned() -> None:
    cpus = sorted(os.sched_getaffinity(0))
    assert 0 < _native.futex_pingpong(100, 0.0, (cpus[0], cpus[0])) < 1.0
    assert 0 < _native.futex_pingpong(100, 0.0, (cpus[0], cpus[-1])) < 1.0
    # a CPU this process may not use: pinning fails with a clear error, nothing hangs
    with pytest.raises(ValueError, match="pin"):
        _native.futex_pingpong(10, 0.0, (cpus[0], 100_000))


def test_condition_stand_in_behaves_alike(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_native, "_native_wait", False)
    c = new_counter()
    assert not isinstance(c, Counter)
    assert c.wait(0, 0.0) is True and c.wait(1, 0.0) is False
    c.add(0xFFFFFFFF)
    assert c.value == 0xFFFFFFFF and c.wait(0x100000000, 0.0) is False
    out: list[bool] = []
    t = threading.Thread(target=lambda: out.append(c.wait(0x100000001, 30.0)), daemon=True)
    t.start()
    c.add(2)
    t.join(30)
    assert out == [True]
    with pytest.raises(ValueError):
        c.wait(1, -1)


def test_new_counter_is_native_here() -> None:
    if sys.platform.startswith("linux"):
        assert isinstance(new_counter(), Counter)


# ---- the waits built on it: streams and the per-rank rendezvous ----


def test_many_small_per_rank_calls_lose_no_wake_up() -> None:
    """Back-to-back per-rank calls at 4 ranks (each wake-up sleeps and is woken through the
    counter): every call completes with the right sum."""
    import nccltree as nt

    with nt.World("cpu:4", timeout=30.0) as w:

        def fn(comm: object) -> list[float]:
            x = np.zeros(2, np.float32)
            sums = []
            for i in range(300):
                x[:] = comm.rank + i  # type: ignore[attr-defined]
                comm.all_reduce(x)  # type: ignore[attr-defined]
                sums.append(float(x[0]))
            return sums

        results = w.run(fn)
    want = [float(sum(r + i for r in range(4))) for i in range(300)]
    assert all(r == want for r in results)


def test_abort_wakes_ranks_waiting_in_a_collective() -> None:
    """Ranks asleep in the rendezvous wake at an abort from another thread, long before
    the World's timeout."""
    import nccltree as nt
    from nccltree._errors import PeerFailure

    w = nt.World("cpu:3", timeout=600.0)
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            w.comm(r).all_reduce(np.ones(4, np.float32))
        except BaseException as exc:  # noqa: BLE001 - the test looks at it
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in (0, 1)]
    for t in threads:
        t.start()
    counter = w._rendezvous.changed
    deadline = time.monotonic() + 30
    while getattr(counter, "sleepers", 2) < 2:  # rank 2 never arrives
        assert time.monotonic() < deadline
        time.sleep(0.001)
    w.abort("stop")
    for t in threads:
        t.join(30)
        assert not t.is_alive()
    assert len(errors) == 2 and all(isinstance(e, PeerFailure) for e in errors)
    w.close()


def test_stream_shutdown_wakes_a_waiter_asleep_on_the_counter() -> None:
    import nccltree as nt
    from nccltree.backends import host

    dev = nt.devices("cpu:1")[0]
    s = dev.new_stream()
    gate = threading.Event()
    s._call(lambda: gate.wait(30), ())  # type: ignore[attr-defined]
    core = s._core  # type: ignore[attr-defined]
    errors: list[BaseException] = []

    def waiter() -> None:
        try:
            s.synchronize(600.0)
        except BaseException as exc:  # noqa: BLE001 - the test looks at it
            errors.append(exc)

    t = threading.Thread(target=waiter, daemon=True)
    t.start()
    deadline = time.monotonic() + 30
    while core.changed.sleepers < 1:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    dev.runtime.shutdown()
    t.join(30)
    gate.set()
    assert not t.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], host._StreamShutdown)


def test_infinite_timeout_is_clamped_and_nan_refused() -> None:
    c = Counter()
    c.add(1)
    assert c.wait(1, float("inf")) is True
    with pytest.raises(ValueError, match="timeout"):
        c.wait(2, float("nan"))


def test_world_and_streams_work_on_the_condition_stand_in(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the native primitive is missing, streams and the rendezvous use the
    condition-variable stand-in: per-rank and stream-ordered calls still complete."""
    import nccltree as nt

    monkeypatch.setattr(_native, "_native_wait", False)
    with nt.World("cpu:2", timeout=30.0, inline_bytes=0) as w:
        assert not isinstance(w._rendezvous.changed, Counter)

        def fn(comm: object) -> float:
            x = np.full(1000, float(comm.rank + 1), np.float32)  # type: ignore[attr-defined]
            for _ in range(20):
                comm.all_reduce(x)  # type: ignore[attr-defined]
            return float(x[0])

        # every call goes through the streams (inline_bytes=0): 20 doublings of 3
        assert w.run(fn) == [3.0 * 2**19] * 2
