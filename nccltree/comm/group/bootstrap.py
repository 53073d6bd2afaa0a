"""The bootstrap of a process group: what the group needs from the way its processes were
started, behind one small interface (:class:`Bootstrap`: ``exchange``, ``barrier``,
``abort``), so that other ways of starting a job can provide it later.

:class:`MpiBootstrap` provides it over an MPI communicator, with every wait bounded by
the group's timeout (non-blocking MPI, polled): MPI's blocking calls would wait for a
process that never comes for ever. It starts with a roll call on the parent
communicator (each process tells MPI rank 0 it is here; rank 0 answers every process
with who is missing), so that a process that never calls ``init_process_group`` is
named, by its MPI rank, by every other one within the timeout. Only then does it
duplicate the communicator (a collective that cannot be bounded). The roll call uses two
tags of the parent communicator (:data:`HELLO_TAG` and the next), which a program
should not use for messages of its own in flight at that moment.

:class:`StoreBootstrap` provides it over a key-value store (:mod:`.store`: a TCP store
hosted by rank 0 or by the launcher, or a directory on a shared filesystem), for jobs
started without MPI; :class:`LocalBootstrap` is the one process of a job that has no
other.

What travels is JSON (names, numbers, flags), never pickled objects.
"""

from __future__ import annotations

import atexit
import json
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol

import numpy as np

from ..._errors import CommError, CommTimeout, MissingRanks, PeerFailure
from .shm import exit_without_finalize
from .store import KeysTimeout

if TYPE_CHECKING:
    from types import ModuleType

    from mpi4py import MPI as _MPI

    from .store import Store

#: the roll call's tags on the parent communicator (the answer uses the next one)
HELLO_TAG = 32_700
_ABORT_TAG = 3  # on the bootstrap's own communicator
_EXCHANGE = "the bootstrap's exchange"
_SLEEP = 0.0005


class Bootstrap(Protocol):
    """How a group's processes meet before the group exists. ``rank``/``size``: this
    process among them. Every call is collective and bounded: a process that does not
    come is named, or the wait ends in ``CommTimeout``; ``abort`` makes the others'
    waits raise ``PeerFailure`` with its reason."""

    rank: int
    size: int

    def exchange(self, obj: object) -> list[object]:
        """Every process's ``obj`` (JSON-able), in process order."""
        ...

    def barrier(self) -> None:
        """Every process got this far."""
        ...

    def abort(self, reason: str) -> None:
        """Tell the other processes this one gives up (they raise ``PeerFailure``)."""
        ...


class MpiBootstrap:
    """The bootstrap over an MPI communicator (see the module docstring). After the roll
    call it works on a duplicate of ``comm`` (``self.comm``; ``close`` frees it)."""

    def __init__(self, comm: _MPI.Intracomm, timeout: float, mpi: ModuleType) -> None:
        self.mpi = mpi
        self.timeout = timeout
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        if self.size > 1:
            try:
                _roll_call(comm, timeout, mpi)
            except CommTimeout:
                # MPI_Finalize at exit would wait for the missing process
                atexit.register(exit_without_finalize)
                raise
        self.comm: _MPI.Intracomm = comm.Dup()

    def close(self) -> None:
        try:
            self.comm.Free()
        except Exception:  # noqa: BLE001 - best effort
            pass

    def exchange(self, obj: object) -> list[object]:
        MPI = self.mpi
        data = np.frombuffer(json.dumps(obj).encode(), np.uint8)
        n = np.array([data.size], np.int64)
        sizes = np.zeros(self.size, np.int64)
        self._wait(self.comm.Iallgather([n, MPI.INT64_T], [sizes, MPI.INT64_T]), _EXCHANGE)
        displs = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        got = np.zeros(max(1, int(sizes.sum())), np.uint8)
        req = self.comm.Iallgatherv(
            [data.copy(), MPI.BYTE], [got, (sizes.tolist(), displs.tolist()), MPI.BYTE]
        )
        self._wait(req, _EXCHANGE)
        return _decoded(
            got[int(displs[p]) : int(displs[p] + sizes[p])].tobytes() for p in range(self.size)
        )

    def barrier(self) -> None:
        self._wait(self.comm.Ibarrier(), "the bootstrap's barrier")

    def abort(self, reason: str) -> None:
        msg = np.frombuffer(reason.encode()[:4000], np.uint8).copy()
        for p in range(self.size):
            if p != self.rank:
                self.comm.Isend([msg, self.mpi.BYTE], p, _ABORT_TAG)

    def _wait(self, req: _MPI.Request, what: str) -> None:
        """Until ``req`` completes; ``PeerFailure`` if another process aborted,
        ``CommTimeout`` after the timeout."""
        MPI = self.mpi
        deadline = time.monotonic() + self.timeout
        status = MPI.Status()
        while not req.Test():
            if self.comm.Iprobe(MPI.ANY_SOURCE, _ABORT_TAG, status):
                n = status.Get_count(MPI.BYTE)
                buf = np.zeros(n, np.uint8)
                self.comm.Recv([buf, MPI.BYTE], status.Get_source(), _ABORT_TAG)
                req.Cancel()
                raise PeerFailure(
                    f"bootstrap: process {status.Get_source()} gave up: "
                    f"{buf.tobytes().decode(errors='replace')}"
                )
            if time.monotonic() > deadline:
                req.Cancel()
                atexit.register(exit_without_finalize)
                raise CommTimeout(
                    f"MPI rank {self.rank}: waited {self.timeout:g} s for {what}; a process "
                    "stopped during the process group's start"
                )
            time.sleep(_SLEEP)


def _roll_call(comm: _MPI.Intracomm, timeout: float, mpi: ModuleType) -> None:
    """Every process of ``comm`` is here, or every one that is raises ``CommTimeout``
    naming the MPI ranks that are not (MPI rank 0 collects and answers)."""
    MPI = mpi
    me, n = comm.Get_rank(), comm.Get_size()
    if me != 0:
        hello = np.array([me], np.int64)
        sent = comm.Isend([hello, MPI.INT64_T], 0, HELLO_TAG)
        verdict = np.zeros(n, np.int64)
        got = comm.Irecv([verdict, MPI.INT64_T], 0, HELLO_TAG + 1)
        # rank 0 answers within its own timeout: wait a little longer for it
        if not _poll(got, time.monotonic() + timeout + 2.0):
            got.Cancel()
            sent.Cancel()
            raise CommTimeout(
                f"MPI rank {me}: MPI rank 0 did not start the process group within "
                f"{timeout:g} s (init_process_group is called by every process)"
            )
        sent.Wait()
        missing = [p for p in range(n) if verdict[p]]
    else:
        boxes = [np.zeros(1, np.int64) for _ in range(n)]
        reqs = {p: comm.Irecv([boxes[p], MPI.INT64_T], p, HELLO_TAG) for p in range(1, n)}
        deadline = time.monotonic() + timeout
        while reqs:
            for p in [p for p, r in reqs.items() if r.Test()]:
                del reqs[p]
            if not reqs or time.monotonic() > deadline:
                break
            time.sleep(_SLEEP)
        missing = sorted(reqs)
        for r in reqs.values():
            r.Cancel()
        verdict = np.zeros(n, np.int64)
        verdict[missing] = 1
        answers = [
            comm.Isend([verdict, MPI.INT64_T], p, HELLO_TAG + 1)
            for p in range(1, n)
            if p not in missing
        ]
        _poll_all(answers, time.monotonic() + min(timeout, 5.0))
    if missing:
        raise CommTimeout(
            f"MPI rank {me}: MPI ranks {missing} of {n} did not call init_process_group "
            f"within {timeout:g} s"
        )


def _poll(req: _MPI.Request, deadline: float) -> bool:
    while not req.Test():
        if time.monotonic() > deadline:
            return False
        time.sleep(_SLEEP)
    return True


def _poll_all(reqs: list[_MPI.Request], deadline: float) -> None:
    for r in reqs:
        if not _poll(r, deadline):
            r.Cancel()


#: seconds between a store bootstrap's looks for an abort while it waits
_SLICE = 0.25
#: the longest a store's host waits at ``close`` for the others to be done with it
_CLOSE_WAIT = 10.0


class StoreBootstrap:
    """The bootstrap over a key-value store (:mod:`.store`), for ``size`` processes of
    which this one is ``rank``; every wait is bounded by ``timeout``.

    Keys live under ``prefix`` and a generation (each process counts the bootstraps it
    made on the prefix, so a second group on the same store reuses no key), and each
    exchange or barrier takes a sequence number: ``<prefix>g<gen>/x<seq>/<rank>``. When
    every process has written exchange ``seq``, all have read ``seq - 1``, whose keys
    rank 0 then deletes. ``abort`` writes ``<prefix>g<gen>/abort``, which the others'
    waits look for between slices of :data:`_SLICE` seconds. ``own_store``: ``close``
    also closes the store (a store's host first waits, up to :data:`_CLOSE_WAIT`
    seconds, until every process has closed, so nobody loses it while still reading)."""

    def __init__(
        self,
        store: Store,
        rank: int,
        size: int,
        timeout: float,
        prefix: str = "",
        *,
        own_store: bool = True,
    ) -> None:
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"bootstrap: rank {rank} is not in 0..{size - 1}")
        if timeout <= 0:
            raise ValueError(f"bootstrap: timeout must be positive, not {timeout}")
        self.store = store
        self.rank = rank
        self.size = size
        self.timeout = float(timeout)
        self.own_store = own_store
        gen = store.add(f"{prefix}gen/{rank}", 1)
        self.prefix = f"{prefix}g{gen}/"
        self._seq = 0
        self._abort_key = self.prefix + "abort"
        self._aborted = False
        self._closed = False

    def _key(self, kind: str, seq: int, p: int) -> str:
        return f"{self.prefix}{kind}{seq}/{p}"

    def exchange(self, obj: object) -> list[object]:
        return _decoded(self._round("x", json.dumps(obj).encode(), "the bootstrap's exchange"))

    def barrier(self) -> None:
        self._round("x", b"null", "the bootstrap's barrier")

    def _round(self, kind: str, mine: bytes, what: str) -> list[bytes]:
        seq = self._seq
        self._seq += 1
        self.store.set(self._key(kind, seq, self.rank), mine)
        keys = [self._key(kind, seq, p) for p in range(self.size)]
        got = self._gather(keys, what)
        if self.rank == 0 and seq > 0:
            for p in range(self.size):  # everyone wrote seq, so read seq - 1
                self.store.delete(self._key(kind, seq - 1, p))
        return got

    def _gather(self, keys: list[str], what: str) -> list[bytes]:
        """The values of ``keys`` (one per process); ``PeerFailure`` when a process
        aborts, ``MissingRanks`` naming the processes not there after the timeout."""
        deadline = time.monotonic() + self.timeout
        while True:
            left = deadline - time.monotonic()
            try:
                return self.store.multi_get(keys, max(0.0, min(_SLICE, left)))
            except KeysTimeout:
                pass
            self._check_abort()
            if time.monotonic() >= deadline:
                missing = [p for p, k in enumerate(keys) if not self.store.check([k])]
                if not missing:
                    continue  # all came in the last instant
                raise MissingRanks(
                    f"bootstrap (process {self.rank} of {self.size}): processes {missing} "
                    f"did not reach {what} within {self.timeout:g} s",
                    missing,
                )

    def _check_abort(self) -> None:
        if self.store.check([self._abort_key]):
            who, _, reason = (
                self.store.get(self._abort_key).decode(errors="replace").partition("\n")
            )
            raise PeerFailure(f"bootstrap: process {who} gave up: {reason}")

    def abort(self, reason: str) -> None:
        self._aborted = True
        try:
            self.store.set(self._abort_key, f"{self.rank}\n{reason[:4000]}".encode())
        except CommError:
            pass  # the store is gone: the others' waits end on their own

    def sub(self, name: str, members: list[int]) -> StoreBootstrap:
        """A bootstrap among ``members`` (this process's ranks here, in the sub's order)
        only, on the same store under a new prefix; called by the members alone, each
        with the same ``name`` (unique among this bootstrap's subs)."""
        if self.rank not in members:
            raise ValueError(f"bootstrap: process {self.rank} is not among {members}")
        if len(set(members)) != len(members) or not all(0 <= m < self.size for m in members):
            raise ValueError(f"bootstrap: members {members} are not distinct processes here")
        if not name or "/" in name:
            raise ValueError(f"bootstrap: a sub's name has no '/' and is not empty: {name!r}")
        return StoreBootstrap(
            self.store,
            members.index(self.rank),
            len(members),
            self.timeout,
            f"{self.prefix}s/{name}/",
            own_store=False,
        )

    def close(self) -> None:
        """Done with the bootstrap; with ``own_store``, close the store too."""
        if self._closed:
            return
        self._closed = True
        if not self.own_store:
            return
        try:
            done = self.prefix + "closed"
            if self.store.add(done, 1) >= self.size:
                self.store.set(done + "/all", b"")
            elif self.store.hosts and not self._aborted:
                self.store.wait([done + "/all"], min(self.timeout, _CLOSE_WAIT))
        except CommError:
            pass  # best effort: a process that is gone does not close
        self.store.close()


class LocalBootstrap:
    """The bootstrap of a job of one process: nobody to wait for."""

    rank = 0
    size = 1

    def exchange(self, obj: object) -> list[object]:
        return [json.loads(json.dumps(obj))]

    def barrier(self) -> None:
        pass

    def abort(self, reason: str) -> None:
        pass

    def sub(self, name: str, members: list[int]) -> LocalBootstrap:
        if members != [0]:
            raise ValueError(f"bootstrap: members {members} are not this one process")
        return LocalBootstrap()

    def close(self) -> None:
        pass


def _decoded(raw: Iterable[bytes]) -> list[object]:
    """The exchange's messages, process by process, read back from JSON; a malformed one
    is the sender's failure."""
    out: list[object] = []
    for p, got in enumerate(raw):
        try:
            out.append(json.loads(got))
        except ValueError as exc:
            raise PeerFailure(f"bootstrap: process {p} sent a malformed message ({exc})") from exc
    return out
