"""``BlockingQueue``: a bounded FIFO between threads that can be closed.

Caffe's blocking_queue, on ``threading.Condition``: a consumer that has to wait can say so
in the log (a data pipeline that is too slow shows up there), and ``close()`` wakes every
waiter with ``QueueClosed`` instead of leaving a thread blocked forever when its peer died.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Generic, TypeVar

from ._errors import NcclTreeError
from ._validate import check_int, check_timeout

__all__ = ["BlockingQueue", "QueueClosed"]

T = TypeVar("T")
log = logging.getLogger("nccltree.queue")

#: A waiting ``pop`` logs its message on the first wait and then once every this many.
DEFAULT_LOG_EVERY = 1000


class QueueClosed(NcclTreeError):
    """The queue was closed: nothing more can be pushed, and it is empty for readers."""


class BlockingQueue(Generic[T]):
    """A thread-safe FIFO; ``maxsize > 0`` bounds it (``push`` then blocks while full).

    ``None`` cannot be pushed, so ``try_pop``'s ``None`` always means "empty". After
    ``close()`` readers still get the items already queued, then ``QueueClosed``; pushes
    fail at once. Blocking calls take ``timeout`` seconds (None: wait until an item arrives
    or the queue is closed) and raise the builtin ``TimeoutError`` when it runs out.
    """

    def __init__(self, maxsize: int = 0) -> None:
        self.maxsize = check_int(maxsize, "maxsize", min=0)  # 0: unbounded
        self._items: deque[T] = deque()
        self._lock = threading.Lock()
        self._not_empty = threading.Condition(self._lock)
        self._not_full = threading.Condition(self._lock)
        self._closed = False
        self._reason: object = None
        self._pop_waits = 0

    # -- state --

    def size(self) -> int:
        """Number of queued items."""
        return len(self._items)

    def __len__(self) -> int:
        return len(self._items)

    @property
    def closed(self) -> bool:
        """True once ``close()`` was called."""
        return self._closed

    def close(self, reason: object = None) -> None:
        """Close the queue and wake every waiter. ``reason`` (text or an exception) goes
        into every later ``QueueClosed``; an exception is chained as its cause. Closing
        again keeps the first reason."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._reason = reason
            self._not_empty.notify_all()
            self._not_full.notify_all()

    def _closed_error(self) -> QueueClosed:
        reason = self._reason
        msg = "the queue is closed"
        if reason is not None:
            text = (
                f"{type(reason).__name__}: {reason}"
                if isinstance(reason, BaseException)
                else reason
            )
            msg = f"{msg}: {text}"
        err = QueueClosed(msg)
        if isinstance(reason, BaseException):
            err.__cause__ = reason
        return err

    # -- producers --

    def push(self, item: T, timeout: float | None = None) -> None:
        """Append ``item``; while the queue is full, wait up to ``timeout`` seconds."""
        if item is None:
            raise TypeError("None cannot be pushed (try_pop returns None for 'empty')")
        timeout = check_timeout(timeout)
        with self._lock:
            if self.maxsize > 0 and len(self._items) >= self.maxsize and not self._closed:
                deadline = _deadline(timeout)
                while len(self._items) >= self.maxsize and not self._closed:
                    if not self._not_full.wait(_remaining(deadline)) and _expired(deadline):
                        raise TimeoutError(
                            f"BlockingQueue.push: still full ({self.maxsize} items) "
                            f"after {timeout:g} s"
                        )
            if self._closed:
                raise self._closed_error()
            self._items.append(item)
            self._not_empty.notify()

    # -- consumers --

    def _wait_item(
        self, timeout: float | None, what: str, log_on_wait: str | None, log_every: int
    ) -> None:
        """With the lock held: wait until an item is queued (or raise)."""
        if self._items:
            return
        if self._closed:
            raise self._closed_error()
        if log_on_wait is not None:
            if self._pop_waits % log_every == 0:
                log.info(log_on_wait)
            self._pop_waits += 1
        deadline = _deadline(timeout)
        while not self._items:
            if self._closed:
                raise self._closed_error()
            if not self._not_empty.wait(_remaining(deadline)) and _expired(deadline):
                if self._items:
                    break
                if self._closed:
                    raise self._closed_error()
                raise TimeoutError(f"BlockingQueue.{what}: no item within {timeout:g} s")

    def pop(
        self,
        timeout: float | None = None,
        log_on_wait: str | None = None,
        log_every: int = DEFAULT_LOG_EVERY,
    ) -> T:
        """Remove and return the oldest item, waiting up to ``timeout`` seconds for one.

        If it has to wait and ``log_on_wait`` is given, that message is logged (INFO, logger
        ``nccltree.queue``) on the first such wait and then once every ``log_every`` waits.
        """
        timeout = check_timeout(timeout)
        log_every = check_int(log_every, "log_every", min=1)
        with self._lock:
            self._wait_item(timeout, "pop", log_on_wait, log_every)
            item = self._items.popleft()
            self._not_full.notify()
            return item

    def try_pop(self) -> T | None:
        """The oldest item, removed, or None if the queue is empty (``QueueClosed`` if it is
        empty and closed)."""
        with self._lock:
            if not self._items:
                if self._closed:
                    raise self._closed_error()
                return None
            item = self._items.popleft()
            self._not_full.notify()
            return item

    def peek(self, timeout: float | None = None) -> T:
        """The oldest item, left in the queue, waiting up to ``timeout`` seconds for one."""
        timeout = check_timeout(timeout)
        with self._lock:
            self._wait_item(timeout, "peek", None, DEFAULT_LOG_EVERY)
            return self._items[0]

    def try_peek(self) -> T | None:
        """The oldest item, left in the queue, or None if it is empty (``QueueClosed`` if it
        is empty and closed)."""
        with self._lock:
            if not self._items:
                if self._closed:
                    raise self._closed_error()
                return None
            return self._items[0]

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<BlockingQueue {len(self._items)}/{self.maxsize or 'inf'} {state}>"


def _deadline(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + timeout


def _remaining(deadline: float | None) -> float | None:
    if deadline is None:
        return None
    return max(0.0, deadline - time.monotonic())


def _expired(deadline: float | None) -> bool:
    return deadline is not None and time.monotonic() >= deadline
