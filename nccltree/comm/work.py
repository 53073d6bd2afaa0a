"""``Work``: the handle of an asynchronous collective, send or receive."""

from __future__ import annotations

import datetime
import logging
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from .._errors import CommTimeout
from .._validate import check_timeout

if TYPE_CHECKING:
    from ..backends.base import Event, Stream
    from .interop import StreamArg

log = logging.getLogger("nccltree")


class Work:
    """A collective (or, from ``isend``/``irecv``, a send or receive) in flight.

    ``wait()`` makes the caller's stream(s) wait for it without blocking the host (on the
    host backend without a stream it blocks); ``wait(timeout=s)`` and ``synchronize()``
    block until it is done; ``is_completed()`` asks without blocking; ``result()``
    synchronises and returns the output; ``add_done_callback(fn)`` calls ``fn(work)``
    once it is done. The Work holds every buffer it uses (inputs, outputs, scratch), so
    none is freed while the devices still work on it.

    Timeouts: a wait given its own ``timeout`` raises ``CommTimeout`` when it runs out
    and changes nothing else: the work stays in flight, the World or group stays usable,
    and the Work can be waited for again. A wait without one is bounded by the World's
    (or group's) timeout, and running out of that fails the World, as in every other
    wait of it.

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
        self._cb_lock = threading.Lock()
        self._callbacks: list[Callable[[Work], object]] = []
        self._settled = False  # the callbacks ran (or are running)
        self._watcher: threading.Thread | None = None

    # -- what a subclass with another kind of completion overrides -------------------------
    def _wait_all(self, limit: float, callers_bound: bool) -> None:
        """Block until done; ``CommTimeout`` after ``limit`` seconds (``callers_bound``:
        the caller's own bound, whose running out must fail nothing)."""
        for ev in self._events:
            ev.synchronize(limit)

    def _query(self) -> bool:
        return all(ev.query() for ev in self._events)

    def _order(self, stream: Stream | None) -> bool:
        """Order ``stream`` (else each caller stream) after the work; False where there
        is no stream to order (the host thread is the caller: it must block)."""
        for i, ev in enumerate(self._events):
            st = stream if stream is not None else self._caller_streams[i]
            if st is None:
                return False
            st.wait_event(ev)
        return True

    # -- the public face -------------------------------------------------------------------
    def wait(
        self,
        stream: StreamArg = None,
        *,
        timeout: float | datetime.timedelta | None = None,
    ) -> None:
        """Order the caller's stream (or ``stream``: any kind ``stream=`` takes) after
        this work, without blocking the host; where the caller is a host thread (host
        backend, no stream), block instead. ``timeout`` (seconds or a ``timedelta``):
        block until done, at most that long (``CommTimeout`` then, the work still in
        flight and everything usable)."""
        if timeout is not None:
            if isinstance(timeout, datetime.timedelta):
                timeout = timeout.total_seconds()
            self.synchronize(timeout)
            return
        from ..backends.base import Stream as _Stream

        if stream is not None and not isinstance(stream, _Stream):
            from .interop import as_stream

            devices = [s.device for s in self._caller_streams if s is not None]
            if not devices:
                raise TypeError(
                    "wait(stream=...): this work was ordered against the calling host "
                    "thread, so only an nccltree Stream can be ordered after it"
                )
            stream = as_stream(devices[0], stream)
        assert stream is None or isinstance(stream, _Stream)
        if not self._order(stream):
            self.synchronize()

    def synchronize(self, timeout: float | None = None) -> None:
        """Block until the work finished (``CommTimeout`` after ``timeout``; see the
        class docstring for what a timeout does)."""
        if self._done:
            return
        given = check_timeout(timeout)
        limit = self._timeout if given is None else given
        try:
            self._wait_all(limit, given is not None)
        except CommTimeout:
            if given is not None:
                raise  # the caller's own bound: nothing failed, the work goes on
            self._failed_wait()
            raise
        except BaseException:
            self._failed_wait()
            raise
        self._done = True
        self._keepalive = None

    def _failed_wait(self) -> None:
        import sys

        exc = sys.exc_info()[1]
        if self._on_error is not None and exc is not None:
            raise self._on_error(exc) from exc

    def is_completed(self) -> bool:
        """True if the work finished (never blocks)."""
        if self._done:
            return True
        return self._query()

    def result(self) -> Any:
        """Synchronise, then return the output (an array, or one per rank driver-side)."""
        self.synchronize()
        return self._result

    def add_done_callback(self, fn: Callable[[Work], object]) -> None:
        """Call ``fn(work)`` once the work is done (or failed: ``work.result()`` in ``fn``
        then raises the error). Already done: called at once, in this thread; otherwise
        from a thread of the Work's own, in the order added. An exception ``fn`` raises is
        logged (logger ``nccltree``), not raised."""
        if not callable(fn):
            raise TypeError(f"add_done_callback takes a callable, got {type(fn).__name__}")
        with self._cb_lock:
            if not self._settled and not self._done:
                self._callbacks.append(fn)
                if self._watcher is None:
                    self._watcher = threading.Thread(
                        target=self._watch, name="nccltree-work-callbacks", daemon=True
                    )
                    self._watcher.start()
                return
        _run_callback(fn, self)

    def _watch(self) -> None:
        try:
            self.synchronize()
        except BaseException:  # noqa: BLE001 - result() raises it again for the callback
            pass
        with self._cb_lock:
            self._settled = True
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            _run_callback(fn, self)

    def __repr__(self) -> str:
        state = "done" if self._done else "in flight"
        return f"<Work {state}, {len(self._events)} rank(s)>"


def _run_callback(fn: Callable[[Work], object], work: Work) -> None:
    try:
        fn(work)
    except Exception:  # a callback's error is its own: logged
        log.exception("a Work's done-callback raised")
