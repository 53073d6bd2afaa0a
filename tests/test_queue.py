"""BlockingQueue: FIFO, blocking with timeouts, logging on wait, close semantics, races."""

from __future__ import annotations

import logging
import math
import threading

import numpy as np
import pytest

import nccltree as nt
from nccltree.queue import BlockingQueue, QueueClosed

WAIT_S = 10  # generous bound on joins, so a broken test fails instead of hanging


def _start(fn, *args):
    t = threading.Thread(target=fn, args=args, daemon=True)
    t.start()
    return t


def _wait_until_blocked(q, n=1):
    """Wait until ``n`` threads sleep in the queue's condition (white-box, no sleeps)."""
    cond = q._not_empty
    for _ in range(100_000):
        with q._lock:
            if len(cond._waiters) + len(q._not_full._waiters) >= n:
                return
        threading.Event().wait(0.0005)
    raise AssertionError("no thread blocked on the queue")


def test_public_names():
    assert nt.BlockingQueue is BlockingQueue and nt.QueueClosed is QueueClosed
    assert issubclass(QueueClosed, nt.NcclTreeError)


def test_fifo_size_peek_try():
    q = BlockingQueue()
    assert q.try_pop() is None and q.try_peek() is None and len(q) == 0
    for i in range(5):
        q.push(i)
    assert q.size() == len(q) == 5
    assert q.peek() == 0 and q.try_peek() == 0 and len(q) == 5
    assert [q.pop() for _ in range(3)] == [0, 1, 2]
    assert q.try_pop() == 3 and q.pop(timeout=0) == 4
    assert q.try_pop() is None


def test_none_cannot_be_pushed_and_bad_arguments():
    q = BlockingQueue()
    with pytest.raises(TypeError, match="None"):
        q.push(None)
    with pytest.raises(ValueError, match="maxsize"):
        BlockingQueue(-1)
    with pytest.raises(ValueError, match="timeout"):
        q.pop(timeout=-1)


@pytest.mark.parametrize("timeout", [math.nan, math.inf, -math.inf, np.float64("nan")])
def test_nan_and_infinite_timeouts_refused(timeout):
    # NaN used to pass `timeout < 0`; checked at the entry, even when no wait is needed
    q = BlockingQueue()
    q.push(1)
    for call in (q.pop, q.peek, lambda timeout: q.push(2, timeout=timeout)):
        with pytest.raises(ValueError, match="timeout must be"):
            call(timeout=timeout)
    assert q.pop(timeout=None) == 1 and len(q) == 0


def test_numpy_numbers_accepted_bool_refused():
    q = BlockingQueue(maxsize=np.int64(2))
    assert q.maxsize == 2 and type(q.maxsize) is int
    q.push("a", timeout=np.float32(0.5))
    assert q.peek(timeout=np.int64(1)) == "a"
    assert q.pop(timeout=np.float64(0.0), log_every=np.int32(2)) == "a"
    with pytest.raises(TypeError, match="maxsize must be an integer"):
        BlockingQueue(True)
    with pytest.raises(TypeError, match="maxsize must be an integer"):
        BlockingQueue(2.0)
    with pytest.raises(TypeError, match="timeout must be a real number"):
        q.pop(timeout=True)
    with pytest.raises(ValueError, match="log_every must be >= 1"):
        q.pop(timeout=0, log_every=0)


def test_timeouts_raise_timeout_error():
    q = BlockingQueue(maxsize=1)
    with pytest.raises(TimeoutError, match="pop"):
        q.pop(timeout=0.01)
    with pytest.raises(TimeoutError, match="peek"):
        q.peek(timeout=0)
    q.push("a")
    with pytest.raises(TimeoutError, match="full"):
        q.push("b", timeout=0.01)
    assert q.pop() == "a"


def test_pop_blocks_until_a_push():
    q = BlockingQueue()
    got = []
    t = _start(lambda: got.append(q.pop(timeout=WAIT_S)))
    _wait_until_blocked(q)
    assert got == []
    q.push("x")
    t.join(WAIT_S)
    assert got == ["x"]


def test_push_blocks_while_full():
    q = BlockingQueue(maxsize=2)
    q.push(1)
    q.push(2)
    t = _start(q.push, 3, WAIT_S)
    _wait_until_blocked(q)
    assert len(q) == 2
    assert q.pop() == 1
    t.join(WAIT_S)
    assert [q.pop(), q.pop()] == [2, 3]


def test_log_on_wait_at_most_once_every_n(caplog):
    q = BlockingQueue()
    caplog.set_level(logging.INFO, logger="nccltree.queue")
    for _ in range(7):
        with pytest.raises(TimeoutError):
            q.pop(timeout=0, log_on_wait="data is late", log_every=3)
    q.push(1)
    q.pop(log_on_wait="not logged: no wait", log_every=1)
    messages = [r.getMessage() for r in caplog.records if r.name == "nccltree.queue"]
    assert messages == ["data is late"] * 3  # waits 1, 4 and 7


def test_close_wakes_every_waiter_with_the_reason():
    q = BlockingQueue(maxsize=1)
    errors = []

    def pop():
        try:
            q.pop(timeout=WAIT_S)
        except QueueClosed as exc:
            errors.append(exc)

    poppers = [_start(pop) for _ in range(4)]
    _wait_until_blocked(q, 4)
    q.close("reader stopped")
    for t in poppers:
        t.join(WAIT_S)
    assert len(errors) == 4 and all("reader stopped" in str(e) for e in errors)

    full = BlockingQueue(maxsize=1)
    full.push(1)
    pushed = []

    def push():
        try:
            full.push(2, timeout=WAIT_S)
        except QueueClosed as exc:
            pushed.append(exc)

    t = _start(push)
    _wait_until_blocked(full)
    full.close()
    t.join(WAIT_S)
    assert len(pushed) == 1


def test_close_with_an_exception_chains_it():
    q = BlockingQueue()
    cause = RuntimeError("solver died")
    q.close(cause)
    q.close("second reason is ignored")
    with pytest.raises(QueueClosed, match="solver died") as info:
        q.pop()
    assert info.value.__cause__ is cause
    assert q.closed


def test_readers_drain_after_close_then_closed():
    q = BlockingQueue()
    q.push("a")
    q.push("b")
    q.close()
    with pytest.raises(QueueClosed):
        q.push("c")
    assert q.peek() == "a" and q.pop() == "a" and q.try_pop() == "b"
    for op in (q.pop, q.try_pop, q.peek, q.try_peek):
        with pytest.raises(QueueClosed):
            op()


@pytest.mark.parametrize("maxsize", [0, 1, 7])
def test_many_producers_and_consumers(maxsize):
    q = BlockingQueue(maxsize=maxsize)
    n_prod, n_cons, per = 6, 5, 300
    got: list[list[tuple[int, int]]] = [[] for _ in range(n_cons)]

    def produce(p):
        for i in range(per):
            q.push((p, i), timeout=WAIT_S)

    def consume(c):
        while True:
            try:
                got[c].append(q.pop(timeout=WAIT_S))
            except QueueClosed:
                return

    producers = [_start(produce, p) for p in range(n_prod)]
    consumers = [_start(consume, c) for c in range(n_cons)]
    for t in producers:
        t.join(WAIT_S)
    q.close()
    for t in consumers:
        t.join(WAIT_S)
    everything = [x for g in got for x in g]
    assert sorted(everything) == [(p, i) for p in range(n_prod) for i in range(per)]
    for g in got:  # each consumer sees each producer's items in push order
        for p in range(n_prod):
            seq = [i for (u, i) in g if u == p]
            assert seq == sorted(seq)
