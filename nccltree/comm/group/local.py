"""Several ranks in one process of a group: each rank's thread calls its own
:class:`GroupComm`; the calls of the process's ranks meet here and the last to arrive
runs the group collective for all of them (as per-rank calls meet in a World)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import numpy as np

from ..._errors import CommError, CommTimeout, PeerFailure
from ..comm import _dtype_key
from ..faces import RankCall, RankCollectives
from ..rendezvous import Meeting, Rendezvous, run_ranks
from ..work import Work

if TYPE_CHECKING:
    from numpy.typing import DTypeLike

    from ...backends.base import Device
    from .group import ProcessGroup


@dataclass
class _LocalCall:
    collective: str
    x: np.ndarray
    out: np.ndarray | None
    op: str
    root: int
    dtype: object


class LocalRendezvous:
    """Call k of every local rank forms one group collective
    (:class:`~nccltree.comm.rendezvous.Rendezvous`), run by the last to arrive."""

    def __init__(self, pg: ProcessGroup) -> None:
        self.pg = pg
        self.n = len(pg.ranks)
        self.meet: Rendezvous[_LocalCall, list[np.ndarray]] = Rendezvous(self.n)
        self.aborted: BaseException | None = None

    def abort(self, exc: BaseException) -> None:
        with self.meet.lock:
            if self.aborted is None:
                self.aborted = exc
        self.meet.wake_all()

    def _check(self, i: int) -> None:
        if self.aborted is not None:
            raise PeerFailure(f"rank {self.pg.ranks[i]}: {self.aborted}")

    def arrive(self, i: int, rank_call: RankCall) -> np.ndarray:
        pg = self.pg
        c = rank_call
        collective = c.collective
        call = _LocalCall(collective, c.x, c.out, c.op, c.root, _dtype_key(c.dtype))
        m, last = self.meet.arrive(i, call, check=lambda: self._check(i))
        if last:
            try:
                results, error = self._run(m), None
            except BaseException as exc:  # noqa: BLE001 - handed to every local rank
                results, error = None, exc
            self.meet.finish(m, results, error)
        else:
            deadline = time.monotonic() + pg.timeout

            def waiting() -> float:
                self._check(i)
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = [pg.ranks[j] for j in self.meet.missing(m)]
                    raise CommTimeout(
                        f"rank {pg.ranks[i]}: waited {pg.timeout:g} s for ranks {missing} "
                        f"of this process to call {collective}"
                    )
                return left

            self.meet.wait(m, waiting)
        if m.error is not None:
            raise m.error
        assert m.result is not None
        return m.result[i]

    def _run(self, m: Meeting[_LocalCall, list[np.ndarray]]) -> list[np.ndarray]:
        calls = [c for c in m.calls if c is not None]
        first = calls[0]
        if any(
            (c.collective, c.op, c.root) != (first.collective, first.op, first.root)
            or c.dtype != first.dtype
            for c in calls
        ):
            raise ValueError(
                f"the ranks of this process call different collectives: "
                f"{[(c.collective, c.op, c.root, c.dtype) for c in calls]}"
            )
        given = [c.out for c in calls if c.out is not None]
        if given and len(given) != len(calls):
            raise ValueError("either every rank of this process passes out= or none")
        return self.pg.call(
            first.collective,
            [c.x for c in calls],
            given or None,
            op=first.op,
            root=first.root,
            dtype=cast("DTypeLike | None", first.dtype),
        )


class GroupComm(RankCollectives):
    """The per-rank face of a process group's rank (``pg.comm(i)``), used from that
    rank's own thread; the same collectives as :class:`~nccltree.comm.Comm`
    (:mod:`nccltree.comm.faces`), host arrays, synchronous."""

    def __init__(self, pg: ProcessGroup, index: int) -> None:
        self.pg = pg
        self.index = index
        self.rank = pg.ranks[index]
        self.size = pg.size

    def _call(self, call: RankCall) -> np.ndarray | Work:
        if len(self.pg.ranks) == 1:
            return self.pg._call(call)
        if call.stream is not None or call.async_op:
            raise ValueError(
                "stream= and async_op= take one rank per process (this process holds "
                f"{len(self.pg.ranks)}): call synchronously from each rank's thread"
            )
        return self.pg._local.arrive(self.index, call)

    def _own(self) -> tuple[int, int, Device]:
        return self.rank, self.size, self.pg.devices[self.index]

    def barrier(self) -> None:
        if self.pg.gpu:
            self.pg.barrier()  # one rank per process, on its GPU
            return
        self._call(RankCall("all_reduce", np.zeros(1, np.float32)))


def run_local(pg: ProcessGroup, fn: Callable[..., object], *args: object) -> list[object]:
    """``fn(pg.comm(i), *args)`` in a thread per rank of this process; each result. An
    exception in one rank's thread releases the others (``PeerFailure``) and is re-raised
    here, naming the rank."""

    def on_error(i: int, exc: BaseException) -> None:
        if not isinstance(exc, (ValueError, TypeError, PeerFailure)):
            pg._local.abort(CommError(f"rank {pg.ranks[i]} failed: {exc!r}"))

    return run_ranks(
        len(pg.ranks),
        lambda i: fn(pg.comm(i), *args),
        on_error=on_error,
        abort=pg._local.abort,
        label=lambda i: pg.ranks[i],
        size=pg.size,
        inline_one=True,
    )
