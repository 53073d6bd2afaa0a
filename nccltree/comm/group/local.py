"""Several ranks in one process of a group: each rank's thread calls its own
:class:`GroupComm`; the calls of the process's ranks meet here and the last to arrive
runs the group collective for all of them (as per-rank calls meet in a World)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

import numpy as np

from ..._errors import CommError, CommTimeout, PeerFailure
from ..comm import _dtype_key
from ..faces import RankCollectives
from ..rendezvous import run_ranks
from ..work import Work

if TYPE_CHECKING:
    from numpy.typing import DTypeLike

    from ...backends.base import Stream
    from .group import ProcessGroup


class _Meeting:
    __slots__ = ("collective", "args", "root", "op", "dtype", "results", "error", "done")

    def __init__(self, n: int) -> None:
        self.collective: list[str | None] = [None] * n
        self.args: list[tuple[np.ndarray, np.ndarray | None] | None] = [None] * n
        self.root: list[int] = [0] * n
        self.op: list[str] = ["sum"] * n
        self.dtype: list[object] = [None] * n
        self.results: list[np.ndarray] | None = None
        self.error: BaseException | None = None
        self.done = False


class LocalRendezvous:
    """Call k of every local rank forms one group collective."""

    def __init__(self, pg: ProcessGroup) -> None:
        self.pg = pg
        self.n = len(pg.ranks)
        self.cv = threading.Condition()
        self.next = [0] * self.n
        self.meetings: dict[int, _Meeting] = {}
        self.aborted: BaseException | None = None

    def abort(self, exc: BaseException) -> None:
        with self.cv:
            if self.aborted is None:
                self.aborted = exc
            self.cv.notify_all()

    def arrive(
        self,
        i: int,
        collective: str,
        x: np.ndarray,
        out: np.ndarray | None,
        op: str,
        root: int,
        dtype: object = None,
    ) -> np.ndarray:
        pg = self.pg
        with self.cv:
            if self.aborted is not None:
                raise PeerFailure(f"rank {pg.ranks[i]}: {self.aborted}")
            k = self.next[i]
            self.next[i] += 1
            m = self.meetings.setdefault(k, _Meeting(self.n))
            m.collective[i], m.args[i], m.op[i], m.root[i] = collective, (x, out), op, root
            m.dtype[i] = _dtype_key(dtype)
            last = all(c is not None for c in m.collective)
        if last:
            try:
                if (
                    len(set(m.collective)) != 1
                    or len(set(m.op)) != 1
                    or len(set(m.root)) != 1
                    or any(d != m.dtype[0] for d in m.dtype)
                ):
                    raise ValueError(
                        f"the ranks of this process call different collectives: "
                        f"{list(zip(m.collective, m.op, m.root, m.dtype, strict=True))}"
                    )
                args = [a for a in m.args if a is not None]
                given = [o for _, o in args if o is not None]
                if given and len(given) != len(args):
                    raise ValueError("either every rank of this process passes out= or none")
                m.results = pg.call(
                    str(m.collective[0]),
                    [x for x, _ in args],
                    given or None,
                    op=m.op[0],
                    root=m.root[0],
                    dtype=cast("DTypeLike | None", m.dtype[0]),
                )
            except BaseException as exc:  # noqa: BLE001 - handed to every local rank
                m.error = exc
            with self.cv:
                m.done = True
                del self.meetings[k]
                self.cv.notify_all()
        else:
            deadline = time.monotonic() + pg.timeout
            with self.cv:
                while not m.done:
                    if self.aborted is not None:
                        raise PeerFailure(f"rank {pg.ranks[i]}: {self.aborted}")
                    left = deadline - time.monotonic()
                    if left <= 0:
                        missing = [pg.ranks[j] for j, c in enumerate(m.collective) if c is None]
                        raise CommTimeout(
                            f"rank {pg.ranks[i]}: waited {pg.timeout:g} s for ranks {missing} "
                            f"of this process to call {collective}"
                        )
                    self.cv.wait(min(left, 0.1))
        if m.error is not None:
            raise m.error
        assert m.results is not None
        return m.results[i]


class GroupComm(RankCollectives):
    """The per-rank face of a process group's rank (``pg.comm(i)``), used from that
    rank's own thread; the same collectives as :class:`~nccltree.comm.Comm`
    (:mod:`nccltree.comm.faces`), host arrays, synchronous."""

    def __init__(self, pg: ProcessGroup, index: int) -> None:
        self.pg = pg
        self.index = index
        self.rank = pg.ranks[index]
        self.size = pg.size

    def _call(
        self,
        collective: str,
        x: np.ndarray,
        out: np.ndarray | None,
        op: str,
        root: int,
        stream: Stream | None = None,
        async_op: bool = False,
        dtype: DTypeLike | None = None,
    ) -> np.ndarray | Work:
        if len(self.pg.ranks) == 1:
            return self.pg._call(collective, x, out, op, root, stream, async_op, dtype)
        if stream is not None or async_op:
            raise ValueError(
                "stream= and async_op= take one rank per process (this process holds "
                f"{len(self.pg.ranks)}): call synchronously from each rank's thread"
            )
        return self.pg._local.arrive(self.index, collective, x, out, op, root, dtype)

    def barrier(self) -> None:
        if self.pg.gpu:
            self.pg.barrier()  # one rank per process, on its GPU
            return
        self._call("all_reduce", np.zeros(1, np.float32), None, "sum", 0)


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
