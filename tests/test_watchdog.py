"""The watchdog of outstanding device work, on host streams (real stream semantics).

Work that never completes is a stream blocked in a ``call``; a failed op is a ``call`` that
raises (the host backend's streams then fail for good, as CUDA streams do).
"""

from __future__ import annotations

import threading
import time

import pytest

import nccltree as nt
from nccltree.comm.watchdog import Watchdog


class Failures:
    def __init__(self) -> None:
        self.errors: list[BaseException] = []
        self.seen = threading.Event()

    def __call__(self, exc: BaseException) -> None:
        self.errors.append(exc)
        self.seen.set()


@pytest.fixture
def stream(host_devs):
    return host_devs(1)[0].new_stream()


def test_completed_work_is_dropped_and_its_buffers_released(stream):
    failures = Failures()
    wd = Watchdog(failures, poll_interval=0.001)
    release = threading.Event()
    stream.call(release.wait)
    wd.watch("work", [stream.record()], timeout=30, keepalive=["buffers"])
    assert wd.outstanding() == 1
    assert not wd.drain(0.05)  # still blocked
    release.set()
    assert wd.drain(10)
    assert wd.outstanding() == 0
    wd.close()
    assert failures.errors == []


def test_deadline_reports_a_timeout_once(stream):
    failures = Failures()
    wd = Watchdog(failures, poll_interval=0.001)
    release = threading.Event()
    stream.call(release.wait)
    ev = stream.record()
    start = time.monotonic()
    wd.watch("NCCL all_reduce", [ev], timeout=0.05)
    wd.watch("NCCL broadcast", [ev], timeout=0.05)
    assert failures.seen.wait(10)
    assert time.monotonic() - start < 5
    time.sleep(0.05)
    assert len(failures.errors) == 1  # the owner is dead: later entries say nothing new
    err = failures.errors[0]
    assert isinstance(err, nt.CommTimeout)
    assert "NCCL all_reduce did not complete within 0.05 s" in str(err)
    assert wd.outstanding() == 0 and wd.drain(0)
    wd.watch("after the failure", [ev], timeout=0.01)  # ignored
    assert wd.outstanding() == 0
    release.set()
    wd.close()


def test_failed_stream_is_reported_at_once_not_at_the_deadline(stream):
    failures = Failures()
    wd = Watchdog(failures, poll_interval=0.001)

    def fault() -> None:
        raise RuntimeError("illegal address")

    stream.call(fault)
    start = time.monotonic()
    wd.watch("work", [stream.record()], timeout=60)
    assert failures.seen.wait(10)
    assert time.monotonic() - start < 5
    assert "illegal address" in repr(failures.errors[0])
    wd.close()


def test_close_stops_the_thread_and_forgets_entries(stream):
    failures = Failures()
    wd = Watchdog(failures, poll_interval=0.001)
    release = threading.Event()
    stream.call(release.wait)
    wd.watch("work", [stream.record()], timeout=0.2)
    wd.close()
    wd.close()
    assert wd.outstanding() == 0
    time.sleep(0.3)
    assert failures.errors == []  # closed before the deadline: nothing reported
    release.set()


def test_bad_arguments():
    with pytest.raises(ValueError, match="poll_interval"):
        Watchdog(lambda e: None, poll_interval=0)
    wd = Watchdog(lambda e: None)
    with pytest.raises(ValueError, match="timeout"):
        wd.watch("x", [], timeout=-1)
    wd.close()
