"""Where the ranks of one process meet, and the threads they run in.

:class:`Rendezvous`: call k of every rank (on one channel) forms one meeting; the last
rank to arrive runs it for all (the World's per-rank collectives, a process group's local
ranks, the data-parallel driver's gradient buckets, one channel per bucket). Waiting
ranks sleep on ``changed``, a native wait counter (futex, GIL released, no spin: see
"Waiting" in docs/architecture.md) that moves at every completed meeting, abort and
close: a waiter reads it, checks its meeting, and sleeps until it moves. What a waiter
checks while it sleeps (a failure, a timeout, the owner closed) is the caller's: each
owner keeps its own messages.

:func:`run_ranks`: ``call(i)`` in a thread per rank, each result; the first error
re-raised, naming its rank (``World.run``, ``ProcessGroup.run``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from .. import _native
from .._errors import CommError, MissingRanks, PeerFailure

C = TypeVar("C")  # what a rank deposits
R = TypeVar("R")  # what the runner hands to every rank

# Longest single sleep of a waiter: it looks at its meeting (and its owner) at least
# this often even when nothing wakes it.
WAIT_SLICE_S = 0.5


@dataclass
class Meeting(Generic[C, R]):
    """One meeting: every rank's call (None until it arrives); the runner's outcome."""

    calls: list[C | None]
    index: int = 0  # call k of every rank on its channel
    channel: int = 0
    arrived: int = 0
    all_arrived_at: float | None = None
    runner: int = -1  # the rank that arrived last and runs it
    done: bool = False
    result: R | None = None
    error: BaseException | None = None

    def missing(self) -> list[int]:
        """The ranks whose call has not arrived."""
        return [r for r, c in enumerate(self.calls) if c is None]


@dataclass
class Rendezvous(Generic[C, R]):
    """Call k of every one of ``n`` ranks on a channel forms meeting k of that channel."""

    n: int
    channels: int = 1
    lock: threading.Lock = field(default_factory=threading.Lock)
    changed: _native.CounterLike = field(default_factory=_native.new_counter)

    def __post_init__(self) -> None:
        self._next = [[0] * self.n for _ in range(self.channels)]
        self._open: dict[tuple[int, int], Meeting[C, R]] = {}

    def wake_all(self) -> None:
        """Wake every waiting rank to look again (an abort, a close)."""
        self.changed.add(1)

    def arrive(
        self, rank: int, call: C, channel: int = 0, check: Callable[[], None] | None = None
    ) -> tuple[Meeting[C, R], bool]:
        """Deposit ``rank``'s next call on ``channel``; ``check`` (under the lock, before
        anything is deposited) may refuse it by raising. Returns the meeting and whether
        this rank arrived last: then it runs the meeting and calls :meth:`finish`; the
        others :meth:`wait` for it."""
        with self.lock:
            if check is not None:
                check()
            nxt = self._next[channel]
            idx = nxt[rank]
            nxt[rank] += 1
            m = self._open.get((channel, idx))
            if m is None:
                m = self._open[(channel, idx)] = Meeting([None] * self.n, idx, channel)
            m.calls[rank] = call
            m.arrived += 1
            last = m.arrived == self.n
            if last:
                m.all_arrived_at = time.monotonic()
                m.runner = rank
                del self._open[(channel, idx)]  # complete: later arrivals make a new one
        return m, last

    def finish(
        self, m: Meeting[C, R], result: R | None = None, error: BaseException | None = None
    ) -> None:
        """The runner's outcome; wakes the meeting's waiters."""
        m.result, m.error = result, error
        m.done = True  # before the counter moves: a waiter checks it after reading it
        self.changed.add(1)

    def missing(self, m: Meeting[C, R]) -> list[int]:
        """The ranks that have not arrived at ``m`` (read under the lock)."""
        with self.lock:
            return m.missing()

    def wait(
        self, m: Meeting[C, R], check: Callable[[], float], slice_s: float = WAIT_SLICE_S
    ) -> None:
        """Sleep until ``m`` is done. ``check()`` runs whenever the counter moved (or
        ``slice_s`` passed) while ``m`` is not done: it raises to end the wait (a failure,
        a timeout) or returns the seconds until it must run again."""
        changed = self.changed
        while True:
            seen = changed.value
            if m.done:
                return
            remaining = check()
            # no spin: the rank that wakes this one holds the GIL, which this rank needs
            # next; a spinning rank only meets it on another CPU (see Waiting in
            # docs/architecture.md)
            changed.wait(seen + 1, max(0.0, min(remaining, slice_s)), 0.0)


def add_note(exc: BaseException, note: str) -> None:
    if hasattr(exc, "add_note"):  # Python 3.11+
        exc.add_note(note)


# How often run_ranks, while no rank has failed, looks for an abort or a timeout (seconds).
RUN_POLL_S = 0.1


def run_ranks(
    n: int,
    call: Callable[[int], object],
    *,
    on_error: Callable[[int, BaseException], None],
    abort: Callable[[BaseException], None],
    label: Callable[[int], int] = int,
    size: int | None = None,
    cleanup: Callable[[int], None] | None = None,
    stuck_after: float | None = None,
    failed_at: Callable[[], float | None] = lambda: None,
    failure: Callable[[], BaseException | None] = lambda: None,
    inline_one: bool = False,
) -> list[object]:
    """``call(i)`` for every rank ``i`` of ``n`` in a thread of its own (named
    ``nccltree-rank{label(i)}``; ``inline_one``: one rank runs in the calling thread);
    every result, in rank order.

    ``on_error(i, exc)`` runs in rank i's thread when its call raises (to abort the
    others, unless the error is one they share), then ``cleanup(i)`` whatever happened.
    The first error is re-raised here, a ``PeerFailure`` only when there is no other,
    with a note naming its rank (``label(i)`` of ``size``, default ``n``).

    ``stuck_after`` (seconds): after the first failure (a rank's error, or ``failed_at()``:
    when the owner failed, ``failure()`` saying why) the others get that long to return; a rank still running then
    is left running as a daemon thread, the owner is aborted (``abort``) with a
    ``MissingRanks`` naming it, which is raised (or noted on the first error of its own).
    None: wait for every rank."""
    total = n if size is None else size
    results: list[object] = [None] * n
    errors: list[tuple[int, int, BaseException]] = []
    finished = [False] * n
    first_error_at: list[float] = []
    cv = threading.Condition()

    def target(i: int) -> None:
        try:
            results[i] = call(i)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            with cv:
                errors.append((len(errors), i, exc))
                first_error_at.append(time.monotonic())
            on_error(i, exc)
        finally:
            if cleanup is not None:
                cleanup(i)
            with cv:
                finished[i] = True
                cv.notify_all()

    if inline_one and n == 1:
        target(0)
    else:
        for i in range(n):
            name = f"nccltree-rank{label(i)}"
            t = threading.Thread(target=target, args=(i,), name=name, daemon=True)
            try:
                t.start()
            except RuntimeError as exc:  # "can't start new thread": the started ranks
                # would wait for this one in their first collective
                err = CommError(f"could not start the thread of rank {label(i)} of {total}: {exc}")
                abort(err)
                raise err from exc
    with cv:
        while not all(finished):
            starts = [t for t in (failed_at(), *first_error_at[:1]) if t is not None]
            if stuck_after is None or not starts:
                # nothing failed yet: wake now and then to see an abort or a timeout
                cv.wait(RUN_POLL_S)
                continue
            remaining = min(starts) + stuck_after - time.monotonic()
            if remaining <= 0:
                break
            cv.wait(min(remaining, RUN_POLL_S))
        stuck = [i for i in range(n) if not finished[i]]
        errors = sorted(errors, key=lambda e: (isinstance(e[2], PeerFailure), e[0]))
    if stuck:
        assert stuck_after is not None
        cause = errors[0][2] if errors else failure()
        ranks = [label(i) for i in stuck]
        text = (
            f"rank(s) {ranks} of {total} did not return within {stuck_after:g} s of the "
            "first failure"
            + ("" if cause is None else f" ({type(cause).__name__}: {cause})")
            + ": stuck outside the collectives, in the function's own code; a thread "
            "cannot be stopped from outside, so it is left running as a daemon thread"
        )
        stuck_exc = MissingRanks(text, ranks)
        abort(stuck_exc)
        if not errors or isinstance(errors[0][2], PeerFailure):
            raise stuck_exc from cause
        add_note(errors[0][2], f"({text})")
    if errors:
        _, i, first = errors[0]
        if isinstance(first, MissingRanks):
            add_note(
                first,
                f"(rank(s) {list(first.ranks)} of {total} at fault; seen on rank {label(i)})",
            )
        else:
            add_note(first, f"(raised on rank {label(i)} of {total})")
        raise first
    return results
