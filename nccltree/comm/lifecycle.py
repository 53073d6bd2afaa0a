"""The life cycle of a communicator: open, then closed, or failed for good.

A :class:`LifeCycle` holds what every communicator (a World, a process group) decides the
same way: whether it is closed, its first failure and when that came (later ones never
replace it), the check every call makes first, and the report of a failure found inside
(an error of a collective, a timeout, a dead peer): the failure and the flight recorder,
the communicator's last collectives, printed to stderr once (and noted on the error, when
it is a ``CommError``). An ``abort`` the caller asks for fails the communicator the same
way, without the report: the caller knows why.

The owner keeps what only it has to release or wake (streams, NCCL communicators, the
ranks asleep at its rendezvous): it calls :meth:`LifeCycle.fail` and then wakes them. A
subclass adds what a failure must do before it is reported (a process group tells its
node: :mod:`.group.lifecycle`) by overriding :meth:`LifeCycle.on_failure`.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from .._errors import CommError, PeerFailure
from .flight import FlightRecorder


class LifeCycle:
    """``LifeCycle(flight, where, closed_text, failed_text)``: ``where()`` names the
    communicator in a report (``"the World of 4 ranks (cpu0,...)"``); ``closed_text`` is
    the ``CommError`` a call to a closed communicator raises; ``failed_text`` starts the
    ``PeerFailure`` of a call to a failed one (the failure follows it, and is its cause).
    A failed communicator reports its failure even once it is closed."""

    def __init__(
        self,
        flight: FlightRecorder,
        where: Callable[[], str],
        closed_text: str,
        failed_text: str,
    ) -> None:
        self.flight = flight
        self._where = where
        self._closed_text = closed_text
        self._failed_text = failed_text
        self._lock = threading.Lock()
        self.closed = False
        self.failure: BaseException | None = None
        self.failed_at: float | None = None  # when failure was set

    @property
    def failed(self) -> bool:
        return self.failure is not None

    def check_usable(self) -> None:
        """Raise ``PeerFailure`` (failed, naming why) or ``CommError`` (closed)."""
        if self.failure is not None:
            raise PeerFailure(f"{self._failed_text}: {self.failure}") from self.failure
        if self.closed:
            raise CommError(self._closed_text)

    def close(self) -> bool:
        """Mark it closed; False when it was already (a second close does nothing)."""
        with self._lock:
            first = not self.closed
            self.closed = True
        return first

    def fail(self, exc: BaseException, report: bool = True) -> bool:
        """Fail for good with ``exc`` unless it failed already (the first failure stays):
        :meth:`on_failure`, then, if ``report`` (a failure found inside, not an abort the
        caller asked for), the report. Returns whether ``exc`` was the first."""
        with self._lock:
            first = self.failure is None
            if first:
                self.failure = exc
                self.failed_at = time.monotonic()
        if first:
            self.on_failure(exc)
            if report:
                self.report(exc)
        return first

    def on_failure(self, exc: BaseException) -> None:
        """What the first failure does before it is reported (a subclass's; nothing here)."""

    def report(self, exc: BaseException) -> str:
        """Print ``exc`` and the flight recorder to stderr, and note them on ``exc`` (a
        ``CommError``); returns the text."""
        text = f"nccltree: {type(exc).__name__}: {exc}\n{self.flight.dump(self._where())}"
        if isinstance(exc, CommError) and hasattr(exc, "add_note"):
            exc.add_note(text)  # Python >= 3.11
        print(text, file=sys.stderr, flush=True)
        return text


_Owner = TypeVar("_Owner", bound="HasLifeCycle")


class HasLifeCycle:
    """What a communicator with a :class:`LifeCycle` in ``_life`` shows of it, the same
    on every face: a context manager that closes it, ``closed``, ``aborted`` and the
    check every call makes first. The owner defines ``close``."""

    _life: LifeCycle

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self: _Owner) -> _Owner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_usable(self) -> None:
        self._life.check_usable()

    @property
    def closed(self) -> bool:
        """Whether it was closed."""
        return self._life.closed

    @property
    def aborted(self) -> bool:
        """Whether it failed or was aborted (closed for good)."""
        return self._life.failed
