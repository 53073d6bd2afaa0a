"""A watchdog for device work that the host cannot wait on with a timeout.

An NCCL call returns once its kernels are enqueued; if a peer never joins, or a kernel
faults, nothing tells the host. Blocking on the work would hang the caller, and engines
return as soon as the caller's stream is ordered (the tree, ring and direct plans do the
same), so the waiting moves here: one thread per owner (a World, later a process group)
polls the completion events of every outstanding piece of work against its deadline.

- all events complete: the entry is dropped (and with it the buffers it keeps alive);
- an event reports a failed stream: ``on_failure(error)`` at once;
- the deadline passes first: ``on_failure(CommTimeout)``.

``on_failure`` runs on the watchdog thread; the owner uses it to abort its communicators
and fail for good, which wakes every waiting rank. After a failure the watchdog forgets the
owner's other entries: the owner is dead, and their failure would say nothing new.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .._errors import CommTimeout
from .._validate import check_real
from ..backends.base import Event

#: How often outstanding work is polled (seconds). Completion is seen this late at most;
#: the callers never wait for the watchdog, so only failures are reported with this delay.
POLL_INTERVAL = 0.005


@dataclass(eq=False)
class _Entry:
    what: str
    events: list[Event]
    deadline: float
    timeout: float
    keepalive: Any = field(default=None, repr=False)


class Watchdog:
    """Polls events of outstanding work against deadlines on one daemon thread.

    ``on_failure(exc)`` is called (on the watchdog thread, at most once) for the first
    entry whose events fail or whose deadline passes; the watchdog then stops watching.
    The thread starts with the first ``watch`` and ends with ``close``.
    """

    def __init__(
        self,
        on_failure: Callable[[BaseException], None],
        *,
        name: str = "nccltree-watchdog",
        poll_interval: float = POLL_INTERVAL,
    ) -> None:
        if poll_interval <= 0:
            raise ValueError(f"poll_interval must be > 0 seconds, got {poll_interval!r}")
        self._on_failure = on_failure
        self._name = name
        self._poll = float(poll_interval)
        self._cond = threading.Condition()
        self._entries: list[_Entry] = []
        self._thread: threading.Thread | None = None
        self._closed = False
        self._failed: BaseException | None = None

    # -- owner side -----------------------------------------------------------------------
    def watch(
        self, what: str, events: Sequence[Event], timeout: float, keepalive: Any = None
    ) -> None:
        """Watch ``events`` (work described by ``what``) until they complete; fail the owner
        if they are not complete ``timeout`` seconds from now. ``keepalive`` (buffers the
        work uses) is held until then."""
        timeout = check_real(timeout, "timeout", min=0.0)
        entry = _Entry(what, list(events), time.monotonic() + timeout, timeout, keepalive)
        with self._cond:
            if self._closed or self._failed is not None:
                return  # the owner is closing or dead: nothing to report any more
            self._entries.append(entry)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def outstanding(self) -> int:
        """Entries not yet seen complete."""
        with self._cond:
            return len(self._entries)

    def drain(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds until nothing is outstanding; True if so (or if
        the watchdog already reported a failure, after which nothing is watched)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._entries and self._failed is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, self._poll))
            return True

    def close(self) -> None:
        """Stop the thread and forget every entry (idempotent)."""
        with self._cond:
            self._closed = True
            self._entries.clear()
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    # -- the thread -----------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._entries and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                entries = list(self._entries)
            failure = None
            done: list[_Entry] = []
            now = time.monotonic()
            for e in entries:
                try:
                    complete = all(ev.query() for ev in e.events)
                except BaseException as exc:  # noqa: BLE001 - a failed stream, reported
                    failure = exc
                    break
                if complete:
                    done.append(e)
                elif now >= e.deadline:
                    failure = CommTimeout(
                        f"{e.what} did not complete within {e.timeout:g} s; aborted"
                    )
                    break
            with self._cond:
                for e in done:
                    if e in self._entries:
                        self._entries.remove(e)
                if failure is not None:
                    self._failed = failure
                    self._entries.clear()
                self._cond.notify_all()
                if failure is None and self._entries:
                    self._cond.wait(self._poll)
            if failure is not None:
                self._on_failure(failure)
                return
