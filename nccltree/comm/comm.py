"""``Comm``: a rank's face of a World, and the rendezvous where per-rank calls meet."""

from __future__ import annotations

import time
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import numpy as np
from numpy.typing import DTypeLike

from .._errors import CommError, CommTimeout, MissingRanks, NcclTreeError, PeerFailure
from ._args import Array, Launched
from .collectives import COLLECTIVES
from .faces import PointToPoint, RankCall, RankCollectives
from .p2p import P2pWork
from .rendezvous import Meeting, Rendezvous
from .work import Work

if TYPE_CHECKING:
    from ..backends.base import Device, Stream
    from .interop import StreamArg
    from .world import World


@dataclass
class _Call:
    collective: str
    x: Array
    out: Array
    op: str
    root: int
    stream: Stream | None
    async_op: bool
    dtype: object = None


class Comm(RankCollectives, PointToPoint):
    """Rank ``rank``'s face of a World, for a thread per rank (NCCL/MPI style); its
    collectives, sends and receives are declared in :mod:`nccltree.comm.faces`.

    Made by ``world.comm(rank)`` (``world``: the World it belongs to). Every rank calls
    the same collectives in the same order; the last to arrive runs the
    collective for all. Arguments are checked for all ranks together, so a bad argument
    raises on every rank before any buffer is written.

    ``dtype`` (every collective, send and recv): as for the World's collectives (None:
    the arrays' own; ``"bfloat16"`` for ``uint16`` arrays of its bits, how CuPy arrays
    carry it); the ranks of one call name the same.
    """

    def __init__(self, world: World, rank: int) -> None:
        self.world = world
        self.rank = rank

    @property
    def size(self) -> int:
        """The number of ranks of the World."""
        return self.world.size

    @property
    def device(self) -> Device:
        """The device this rank's buffers live on."""
        return self.world.devices[self.rank]

    def _call(self, call: RankCall) -> Array | Work:
        c = call
        stream = self.world._caller_stream(self.rank, c.stream)
        met = _Call(c.collective, c.x, c.out, c.op, c.root, stream, c.async_op, _dtype_key(c.dtype))
        return self.world._rendezvous.arrive(self.rank, met)

    def batch(self) -> AbstractContextManager[None]:
        return self.world._mailbox.batch(self.rank)

    def _post_p2p(
        self, kind: str, buf: Array, peer: int, stream: StreamArg, dtype: DTypeLike | None
    ) -> None:
        box = self.world._mailbox
        pending = box.in_batch(self.rank)
        if pending is None and peer == self.rank:
            exc = ValueError(
                f"rank {self.rank}: a {kind} with itself needs both halves in one batch "
                "(with comm.batch(): ...)"
            )
            self.world._argument_error_raised(exc)
            raise exc
        op = box.post(kind, self.rank, peer, buf, stream, dtype)
        if pending is not None:
            pending.append(op)
        else:
            box.wait([op])

    def _post_p2p_async(
        self, kind: str, buf: Array, peer: int, stream: StreamArg, dtype: DTypeLike | None
    ) -> Work:
        box = self.world._mailbox
        if box.in_batch(self.rank) is not None or peer == self.rank:
            exc = ValueError(
                f"rank {self.rank}: i{kind} posts on its own; inside a batch, or with itself, "
                f"use {kind} in a batch (with comm.batch(): ...)"
            )
            self.world._argument_error_raised(exc)
            raise exc
        op = box.post(kind, self.rank, peer, buf, stream, dtype)
        return P2pWork(box, op, buf, self.world.timeout)

    def _own(self) -> tuple[int, int, Device]:
        return self.rank, self.world.size, self.device

    def split(self, color: int | None, key: int = 0) -> Comm | None:
        """MPI's ``Comm_split``: every rank calls it; the ranks of one ``color`` form a
        group (a World of their own, ordered by ``(key, rank)``) and each gets its face
        there; color None: in no group (None). The groups close with this World."""
        return self.world._split_by_ranks(self.rank, color, key)

    def barrier(self) -> None:
        stream = self.world._caller_stream(self.rank, None)
        if stream is not None:
            stream.synchronize(self.world.timeout)
        self.world._rendezvous.arrive(
            self.rank, _Call("barrier", None, None, "sum", 0, None, False)
        )


class _Rendezvous:
    """Where a World's per-rank calls meet (:class:`~nccltree.comm.rendezvous.Rendezvous`):
    call k of every rank forms one collective, run by the last to arrive."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.meet: Rendezvous[_Call, Launched] = Rendezvous(world.size)
        self.changed = self.meet.changed

    def wake_all(self) -> None:
        """Wake every waiting rank to look at the World again (abort, close)."""
        self.meet.wake_all()

    def arrive(self, rank: int, call: _Call) -> Any:
        w = self.world
        arrived_at = time.monotonic()
        p, last = self.meet.arrive(rank, call, check=w._life.check_usable)
        if not last:
            self.meet.wait(p, lambda: self._check(p, rank, call, arrived_at))
            return self._result(p, rank)
        try:
            launched, error = self._run(p), None
        except BaseException as exc:  # noqa: BLE001 - handed to every rank
            launched, error = None, exc
            if not isinstance(exc, (ValueError, TypeError)):
                w._abort(exc if isinstance(exc, NcclTreeError) else CommError(repr(exc)))
        self.meet.finish(p, launched, error)
        return self._result(p, rank)

    def _check(
        self, p: Meeting[_Call, Launched], rank: int, call: _Call, arrived_at: float
    ) -> float:
        """While ``rank`` waits: raise when the World failed or closed or the wait timed
        out; else the seconds left."""
        w = self.world
        idx = p.index
        failure = w._life.failure
        if failure is not None:
            # a timeout seen by another rank of this collective is this rank's timeout
            # too, and ranks that did not arrive are at fault here as well
            text = f"rank {rank}: {call.collective} #{idx} cannot complete: {failure}"
            if isinstance(failure, MissingRanks):
                raise MissingRanks(text, failure.ranks) from failure
            kind = CommTimeout if isinstance(failure, CommTimeout) else PeerFailure
            raise kind(text) from failure
        if w._life.closed:
            raise CommError(f"rank {rank}: the World was closed during {call.collective}")
        start = p.all_arrived_at if p.all_arrived_at is not None else arrived_at
        # waiting for late ranks is bounded by the timeout; once all arrived, the runner
        # has its own timeout on the devices' work, and we allow for it
        limit = w.timeout if p.all_arrived_at is None else 2 * w.timeout
        remaining = start + limit - time.monotonic()
        if remaining <= 0:
            missing = self.meet.missing(p)
            what = f"rank {rank}: {call.collective} #{idx} timed out after {w.timeout:g} s"
            if missing:
                # the blame goes to the ranks that did not arrive, not to this one
                exc: CommTimeout = MissingRanks(
                    f"{what} waiting for rank(s) {missing}, which did not arrive", missing
                )
            else:
                exc = CommTimeout(f"{what} waiting for it to run")
            w._abort(exc)
            raise exc
        return remaining

    def _result(self, p: Meeting[_Call, Launched], rank: int) -> Any:
        if p.error is not None:
            err = p.error
            if isinstance(err, (ValueError, TypeError)):
                # an argument error, raised on every rank before anything was written: the
                # World stays usable, also when the rank runs inside World.run
                copy = type(err)(*err.args)
                self.world._argument_error_raised(copy)
                raise copy
            if rank == p.runner:
                raise err
            raise PeerFailure(f"rank {rank}: the collective failed: {err}") from err
        launched = p.result
        if launched is None:  # barrier
            return None
        call = p.calls[rank]
        if call is not None and call.async_op:
            events = [launched.events[rank]] if launched.events else []
            return Work(
                events,
                [launched.caller_streams[rank]],
                launched.results[rank],
                launched.keepalive,
                self.world.timeout,
                self.world._on_stream_error,
            )
        return launched.results[rank]

    def _run(self, p: Meeting[_Call, Launched]) -> Launched | None:
        calls = [c for c in p.calls if c is not None]
        assert len(calls) == len(p.calls)  # the last rank to arrive runs it
        first = calls[0]
        key = (first.collective, first.op, first.root, first.async_op, first.dtype)
        for r, c in enumerate(calls):
            if (c.collective, c.op, c.root, c.async_op, c.dtype) != key:
                raise ValueError(
                    f"ranks disagree on the collective: rank 0 called "
                    f"{_describe(first)}, rank {r} called {_describe(c)}"
                )
        if first.collective == "barrier":
            return None
        return self.world._launch(
            first.collective,
            [c.x for c in calls],
            [c.out for c in calls],
            first.op,
            first.root,
            [c.stream for c in calls],
            first.async_op,
            by_ranks=True,
            dtype=first.dtype,
        )


def _describe(c: _Call) -> str:
    if c.collective == "barrier":
        text = "barrier()"
    else:
        text = COLLECTIVES[c.collective].describe(c.op, c.root)
    if c.dtype is not None:
        text = text[:-1] + ("" if text.endswith("()") else ", ") + f"dtype={c.dtype!r})"
    if c.async_op:
        text = text[:-1] + ("async)" if text.endswith("()") else ", async)")
    return text


def _dtype_key(dtype: object) -> object:
    """A per-rank call's ``dtype=``, comparable between ranks (``"float32"`` and
    ``np.float32`` name one dtype); left as given when it is no dtype, for the checks
    to refuse with the argument named."""
    if dtype is None or (isinstance(dtype, str) and dtype == "bfloat16"):
        return dtype
    try:
        return np.dtype(cast("DTypeLike", dtype)).name
    except TypeError:
        return dtype
