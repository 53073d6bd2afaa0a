"""``Work``: the handle of an asynchronous collective."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from .._validate import check_timeout

if TYPE_CHECKING:
    from ..backends.base import Event, Stream


class Work:
    """A collective in flight.

    ``wait()`` makes the caller's stream(s) wait for it without blocking the host;
    ``synchronize()`` blocks until it is done; ``result()`` synchronises and returns the
    output. The Work holds every buffer the collective uses (inputs, outputs, scratch),
    so none is freed while the devices still work on it.

    Made by the collectives (``async_op=True``), not by callers: ``events`` mark the
    end of each rank's part, ``caller_streams`` are the streams ``wait()`` orders by
    default, ``result`` is what ``result()`` returns, ``keepalive`` holds the buffers,
    ``timeout`` bounds ``synchronize()`` (``CommTimeout`` past it) and ``on_error`` turns
    a failure seen while waiting into the error raised (the World's ``PeerFailure``).
    """

    def __init__(
        self,
        events: Sequence[Event],
        caller_streams: Sequence[Stream | None],
        result: object,
        keepalive: object,
        timeout: float,
        on_error: Callable[[BaseException], BaseException] | None = None,
    ) -> None:
        self._events = list(events)
        self._caller_streams = list(caller_streams)
        self._result = result
        self._keepalive = keepalive
        self._timeout = timeout
        self._on_error = on_error
        self._done = False

    def wait(self, stream: Stream | None = None) -> None:
        """Order the caller's stream (or ``stream``) after this collective."""
        for i, ev in enumerate(self._events):
            st = stream if stream is not None else self._caller_streams[i]
            if st is not None:
                st.wait_event(ev)
            else:
                self.synchronize()
                return

    def synchronize(self, timeout: float | None = None) -> None:
        """Block until the collective finished (``CommTimeout`` after ``timeout``)."""
        if self._done:
            return
        limit = check_timeout(timeout)
        if limit is None:
            limit = self._timeout
        try:
            for ev in self._events:
                ev.synchronize(limit)
        except BaseException as exc:
            if self._on_error is not None:
                raise self._on_error(exc) from exc
            raise
        self._done = True
        self._keepalive = None

    def is_completed(self) -> bool:
        """True if the collective finished (never blocks)."""
        if self._done:
            return True
        return all(ev.query() for ev in self._events)

    def result(self) -> Any:
        """Synchronise, then return the output (an array, or one per rank driver-side)."""
        self.synchronize()
        return self._result

    def __repr__(self) -> str:
        state = "done" if self._done else "in flight"
        return f"<Work {state}, {len(self._events)} rank(s)>"
