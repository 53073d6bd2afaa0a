"""Streams and events: asynchronous in-order work, waits, sticky failures, timeouts, jitter."""

from __future__ import annotations

import gc
import threading

import numpy as np
import pytest

import nccltree as nt
from nccltree.backends import host

GATE_S = 10  # a gate op gives up after this long, so a broken test fails instead of hanging


# -- every backend --------------------------------------------------------------------------


def test_work_runs_in_stream_order(dev):
    # x -> 2x + 1 repeated: any reordering changes the result
    s = dev.new_stream()
    x = dev.from_host(np.zeros(16, np.float64))
    one = dev.from_host(np.ones(16, np.float64))
    for _ in range(20):
        s.scale(x, 2.0)
        s.reduce(x, [x, one])
    s.synchronize()
    assert s.query()
    np.testing.assert_array_equal(dev.to_host(x), np.full(16, 2.0**20 - 1))


def test_event_orders_work_across_streams_and_devices(devs):
    d0, d1 = devs
    s0, s1 = d0.new_stream(), d1.new_stream()
    x0 = d0.from_host(np.ones(1 << 12, np.float32))
    y1 = d1.zeros(1 << 12, np.float32)
    for _ in range(10):
        s0.scale(x0, 2.0)
    ev = s0.record()
    s1.wait_event(ev)
    s1.copy(y1, x0, src_device=d0)
    s1.synchronize()
    assert ev.query()
    np.testing.assert_array_equal(d1.to_host(y1), np.full(1 << 12, 1024, np.float32))


def test_unrecorded_event_counts_as_complete(dev):
    ev = dev.new_event()
    assert ev.query()
    ev.synchronize(timeout=0)
    s = dev.new_stream()
    s.wait_event(ev)
    s.synchronize()


def test_current_stream_context(dev):
    s = dev.new_stream()
    outer = dev.current_stream()
    assert dev.explicit_current_stream() is None
    with s:
        assert dev.current_stream() is s and dev.explicit_current_stream() is s
        s2 = dev.new_stream()
        with s2:
            assert dev.current_stream() is s2
        assert dev.current_stream() is s
        seen = []
        t = threading.Thread(target=lambda: seen.append(dev.current_stream()))
        t.start()
        t.join()
        assert seen[0] is not s  # the current stream is per thread
    assert dev.current_stream() is not s and dev.explicit_current_stream() is None
    s.__enter__()
    s2.__enter__()
    with pytest.raises(RuntimeError, match="reverse order"):
        s.__exit__(None, None, None)
    s2.__exit__(None, None, None)  # the refused exit left both entered: unwind properly
    s.__exit__(None, None, None)
    assert dev.explicit_current_stream() is None
    if dev.backend == "host":
        assert outer is dev.default_stream


def test_device_synchronize_waits_for_every_stream(dev):
    xs = [dev.from_host(np.ones(256, np.float32)) for _ in range(4)]
    streams = [dev.new_stream() for _ in xs]
    for s, x in zip(streams, xs, strict=True):
        for _ in range(5):
            s.scale(x, 3.0)
    dev.synchronize()
    for x in xs:
        np.testing.assert_array_equal(dev.to_host(x), np.full(256, 243, np.float32))


# -- host: the missing-wait proof -----------------------------------------------------------


def _gated_producer(stream, x, value):
    """Enqueue a producer op that writes ``value`` into ``x`` once the returned gate opens."""
    gate = threading.Event()
    stream.call(gate.wait, GATE_S)
    stream.call(x.fill, value)
    return gate


def test_missing_wait_sees_stale_value_every_time(host_devs):
    d0, d1 = host_devs(2)
    prod, cons = d0.new_stream(), d1.new_stream()
    stale = 0
    for trial in range(100):
        x = np.zeros(4, np.float32)
        gate = _gated_producer(prod, x, trial + 1)
        prod.record()  # the event a correct consumer would wait for, ignored here
        out = np.full(4, -1, np.float32)
        cons.copy(out, x, src_device=d0)
        cons.synchronize()  # completes: nothing orders it after the held producer
        stale += int((out == 0).all())
        gate.set()
        prod.synchronize()
    assert stale == 100


def test_with_the_wait_never_stale(host_devs):
    d0, d1 = host_devs(2)
    prod, cons = d0.new_stream(), d1.new_stream()
    fresh = 0
    for trial in range(100):
        x = np.zeros(4, np.float32)
        gate = _gated_producer(prod, x, trial + 1)
        ev = prod.record()
        out = np.full(4, -1, np.float32)
        cons.wait_event(ev)  # returns at once: only the consumer's worker waits
        cons.copy(out, x, src_device=d0)
        assert not cons.query() and not ev.query()
        gate.set()
        cons.synchronize()
        fresh += int((out == trial + 1).all())
    assert fresh == 100


def test_enqueue_returns_before_the_work_runs(host_devs):
    (d,) = host_devs(1)
    s = d.new_stream()
    ran = []
    gate = threading.Event()
    s.call(gate.wait, GATE_S)
    s.call(ran.append, 1)
    assert ran == [] and not s.query()
    gate.set()
    s.synchronize()
    assert ran == [1] and s.query()


def test_event_marks_a_point_and_can_be_rerecorded(host_devs):
    (d,) = host_devs(1)
    s = d.new_stream()
    ev = d.new_event()
    s.record(ev)
    gate = threading.Event()
    s.call(gate.wait, GATE_S)
    assert ev.query()  # recorded before the held op
    assert s.record(ev) is ev
    assert not ev.query()
    gate.set()
    ev.synchronize(timeout=GATE_S)
    assert ev.query()


# -- host: failures and timeouts ------------------------------------------------------------


def _boom():
    raise ValueError("op failed")


def test_failed_op_makes_the_stream_sticky_failed(host_devs):
    d0, d1 = host_devs(2)
    s = d0.new_stream()
    ran = []
    s.call(ran.append, "before")
    before = s.record()
    s.call(_boom)
    s.call(ran.append, "after")  # dropped
    after = s.record()
    with pytest.raises(ValueError, match="op failed") as first:
        s.synchronize()
    with pytest.raises(ValueError) as second:
        s.synchronize()
    assert first.value is second.value  # the original error, every time
    with pytest.raises(ValueError):
        s.query()
    before.synchronize()  # work before the failure completed normally
    assert before.query()
    with pytest.raises(ValueError):
        after.synchronize()
    with pytest.raises(ValueError):
        after.query()
    s.call(ran.append, "later")  # later work is dropped as well
    with pytest.raises(ValueError):
        s.synchronize()
    assert ran == ["before"]

    # a stream waiting on an event behind the failure fails with the same error
    other = d1.new_stream()
    other.wait_event(after)
    other.call(ran.append, "waiter")
    with pytest.raises(ValueError) as waited:
        other.synchronize()
    assert waited.value is first.value
    assert ran == ["before"]


def test_synchronize_times_out(host_devs):
    d0, d1 = host_devs(2)
    s = d0.new_stream()
    gate = threading.Event()
    s.call(gate.wait, GATE_S)
    ev = s.record()
    with pytest.raises(nt.CommTimeout, match="not done"):
        s.synchronize(timeout=0.05)
    with pytest.raises(TimeoutError):
        ev.synchronize(timeout=0.01)
    with pytest.raises(nt.CommTimeout):
        d0.synchronize(timeout=0.01)
    gate.set()
    s.synchronize()  # a timeout does not break the stream


def test_a_waiting_worker_times_out_instead_of_hanging(host_devs, monkeypatch):
    monkeypatch.setattr(host, "_wait_timeout", 0.05)
    d0, d1 = host_devs(2)
    a, b = d0.new_stream(), d1.new_stream()
    gate = threading.Event()
    a.call(gate.wait, GATE_S)
    b.wait_event(a.record())
    with pytest.raises(nt.CommTimeout):
        b.synchronize(timeout=GATE_S)
    gate.set()
    a.synchronize()


def test_shutdown_wakes_waiters_and_refuses_work(host_devs):
    (d,) = host_devs(1)
    s = d.new_stream()
    gate = threading.Event()
    s.call(gate.wait, GATE_S)
    s.call(int)
    errors = []

    def waiter():
        try:
            s.synchronize(timeout=GATE_S)
        except nt.NcclTreeError as exc:
            errors.append(exc)

    t = threading.Thread(target=waiter)
    t.start()
    d.runtime.shutdown()
    t.join(GATE_S)
    gate.set()
    assert len(errors) == 1 and "shut down" in str(errors[0])
    with pytest.raises(nt.NcclTreeError, match="shut down"):
        s.call(int)
    with pytest.raises(nt.NcclTreeError, match="shut down"):
        d.new_stream()


def test_dropped_stream_finishes_its_work_and_its_worker_exits(host_devs):
    (d,) = host_devs(1)
    s = d.new_stream()
    gate = threading.Event()
    s.call(gate.wait, GATE_S)
    out = []
    s.call(out.append, "done")
    ev = s.record()
    worker = s._core.thread
    del s
    gc.collect()
    gate.set()
    ev.synchronize(timeout=GATE_S)
    worker.join(GATE_S)
    assert out == ["done"] and not worker.is_alive()


# -- host: many threads, many streams, jitter -----------------------------------------------


def test_many_producer_threads_on_one_stream(host_devs):
    (d,) = host_devs(1)
    s = d.new_stream()
    seen: list[tuple[int, int]] = []
    n_threads, n_ops = 8, 200

    def produce(t):
        for i in range(n_ops):
            s.call(seen.append, (t, i))

    threads = [threading.Thread(target=produce, args=(t,)) for t in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    s.synchronize()
    assert len(seen) == n_threads * n_ops
    for t in range(n_threads):  # each producer's ops ran in its order
        assert [i for (u, i) in seen if u == t] == list(range(n_ops))


def _ring_token_pass(devs, rounds):
    """Pass a counter round a ring of streams, ordered only by events."""
    n = len(devs)
    streams = [d.new_stream() for d in devs]
    bufs = [np.zeros(1, np.int64) for _ in devs]
    one = np.ones(1, np.int64)
    ev = None
    for r in range(rounds):
        i, j = r % n, (r + 1) % n
        s = streams[j]
        if ev is not None:
            s.wait_event(ev)
        s.copy(bufs[j], bufs[i], src_device=devs[i])
        s.reduce(bufs[j], [bufs[j], one])
        ev = s.record()
    ev.synchronize(timeout=GATE_S)
    return int(bufs[rounds % n][0])


def test_ring_of_streams_ordered_by_events(host_devs):
    assert _ring_token_pass(host_devs(4), 400) == 400


def test_jitter_keeps_correct_programs_correct(host_devs, monkeypatch):
    monkeypatch.setenv(host.JITTER_ENV, "11:30")
    devs = host_devs(3)
    assert devs[0].new_stream()._core.jitter_max == pytest.approx(30e-6)
    assert _ring_token_pass(devs, 150) == 150


def test_jitter_is_seeded_per_stream(host_devs, monkeypatch):
    monkeypatch.setenv(host.JITTER_ENV, "5")
    a, b = host_devs(2), host_devs(2)
    draws = [[d.new_stream()._core.rng.random() for d in devs] for devs in (a, b)]
    assert draws[0] == draws[1]  # same seed, same streams: same delays
    assert draws[0][0] != draws[0][1]  # but each stream has its own sequence
    assert a[0].new_stream()._core.jitter_max == pytest.approx(200e-6)


@pytest.mark.parametrize("value", ["x", "1:y", "1:-5"])
def test_bad_jitter_setting_is_rejected(host_devs, monkeypatch, value):
    monkeypatch.setenv(host.JITTER_ENV, value)
    (d,) = host_devs(1)
    with pytest.raises(ValueError, match=host.JITTER_ENV):
        d.new_stream()
