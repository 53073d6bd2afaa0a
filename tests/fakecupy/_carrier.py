"""How the fake's NCCL reaches the other processes of a communicator that spans
processes: over MPI (``fake.mpi_comm``), or without it over files (``fake.nccl_files``).

**Wiring only.** Real NCCL moves data over NVLink, PCIe or the network; these carriers
only let the fake's communicators of several processes run their operations (each at
once, when posted: a send is buffered, a receive waits for its message, a collective
gathers every rank's input). They never say anything about NCCL's speed or its own
ordering rules.

The file carrier keeps a folder in /dev/shm named after the test run and the unique id
(``fakecupy-nccl-<session>-<uid>``). A message from rank a to rank b is one file,
``<channel>-a-b-<n>`` (the n-th on that channel between the pair), written under a
temporary name and renamed, read once by its receiver, which then removes it. Every wait
is bounded (:data:`TIMEOUT`: ``NcclError(ncclRemoteError)`` after it). A process removes
the messages addressed to it that it never read when its communicator goes (and at
exit), and the last one out removes what is left and the folder.
"""

from __future__ import annotations

import atexit
import os
import pickle
import time
from collections import defaultdict
from typing import Any

from . import _core

#: seconds a receive waits for its message before it fails (a peer that never sends)
TIMEOUT = 120.0
_OPEN: list[FileCarrier] = []  # carriers not yet closed, closed at exit


class MpiCarrier:
    """Over an MPI communicator of the communicator's processes (``where``: the MPI rank
    of each NCCL rank)."""

    def __init__(self, mpi: Any, where: dict[int, int]) -> None:
        self.mpi = mpi
        self.where = where
        self.sends: list[Any] = []

    def send(self, channel: str, peer: int, obj: Any) -> None:
        self.sends.append(self.mpi.isend(obj, dest=self.where[peer], tag=7))
        self.sends = [r for r in self.sends if not r.Test()]

    def recv(self, channel: str, peer: int) -> Any:
        return self.mpi.recv(source=self.where[peer], tag=7)

    def allgather(self, obj: Any) -> list[Any]:
        return list(self.mpi.allgather(obj))

    def close(self) -> None:
        pass


class FileCarrier:
    """Over files (see the module docstring), for rank ``rank`` of ``n`` of the
    communicator of unique id ``uid``."""

    def __init__(self, uid: bytes, rank: int, n: int) -> None:
        self.dir = f"/dev/shm/fakecupy-nccl-{_core.session_tag()}-{uid.hex()[:24]}"
        os.makedirs(self.dir, exist_ok=True)
        self.rank = rank
        self.n = n
        self._sent: dict[tuple[str, int], int] = defaultdict(int)
        self._got: dict[tuple[str, int], int] = defaultdict(int)
        self.closed = False
        _OPEN.append(self)

    def _path(self, channel: str, src: int, dst: int, k: int) -> str:
        return os.path.join(self.dir, f"{channel}-{src}-{dst}-{k}")

    def send(self, channel: str, peer: int, obj: Any) -> None:
        k = self._sent[(channel, peer)]
        self._sent[(channel, peer)] = k + 1
        path = self._path(channel, self.rank, peer, k)
        tmp = f"{path}.tmp{os.getpid()}"
        try:
            with open(tmp, "wb") as f:
                pickle.dump(obj, f, protocol=pickle.HIGHEST_PROTOCOL)
            os.replace(tmp, path)
        except FileNotFoundError:
            pass  # every peer is gone (the folder with them): nobody will read it

    def recv(self, channel: str, peer: int) -> Any:
        from .cupy.cuda.nccl import NcclError, ncclRemoteError

        k = self._got[(channel, peer)]
        path = self._path(channel, peer, self.rank, k)
        deadline = time.monotonic() + TIMEOUT
        pause = 0.0002
        while True:
            try:
                with open(path, "rb") as f:
                    obj = pickle.load(f)
                break
            except FileNotFoundError:
                if time.monotonic() > deadline:
                    raise NcclError(ncclRemoteError) from None
                time.sleep(pause)
                pause = min(pause * 2, 0.005)
        os.unlink(path)
        self._got[(channel, peer)] = k + 1
        return obj

    def allgather(self, obj: Any) -> list[Any]:
        for q in range(self.n):
            if q != self.rank:
                self.send("all", q, obj)
        return [obj if q == self.rank else self.recv("all", q) for q in range(self.n)]

    def close(self) -> None:
        """The messages addressed to this rank that it never read removed, and this rank
        marked gone (``closed-<rank>``); the last rank to go removes what is left (a
        message no rank will read) and the folder."""
        if self.closed:
            return
        self.closed = True
        if self in _OPEN:
            _OPEN.remove(self)
        try:
            names = os.listdir(self.dir)
        except OSError:
            return
        for name in names:
            parts = name.split("-")
            if len(parts) == 4 and parts[2] == str(self.rank):
                _unlink(os.path.join(self.dir, name))
        try:
            with open(os.path.join(self.dir, f"closed-{self.rank}"), "w"):
                pass
            names = os.listdir(self.dir)
        except OSError:
            return
        if sum(n.startswith("closed-") for n in names) >= self.n:
            for name in names:
                _unlink(os.path.join(self.dir, name))
            try:
                os.rmdir(self.dir)
            except OSError:
                pass


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def close_all() -> None:
    """Every carrier of this process closed (at exit; before ``os._exit``)."""
    for c in list(_OPEN):
        c.close()


atexit.register(close_all)
