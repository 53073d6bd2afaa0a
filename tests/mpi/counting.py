"""A wrapper of an mpi4py communicator that counts what goes through the MPI layer:
collective calls, and point-to-point payload bytes to processes of this node and of
other nodes (by host name or NCCLTREE_NODE, exchanged once when wrapped): the
collectives' payload, and apart from it the send/recv communicator's (a duplicate of the
payload communicator). Independent of the process group's own counters."""

from __future__ import annotations

import os
from typing import Any

from mpi4py import MPI

_COLLECTIVES = {
    "Allreduce", "Reduce", "Bcast", "Allgather", "Reduce_scatter_block", "Barrier",
    "allgather", "bcast", "allreduce", "barrier", "gather", "scatter", "Split", "Dup",
    "Alltoall", "Gather", "Scatter", "Iallreduce", "Ireduce", "Ibcast", "Iallgather",
    "Ireduce_scatter_block", "Ibarrier", "Ialltoall", "Ialltoallv", "Igather", "Iscatter",
}  # fmt: skip


class _Shared:
    def __init__(self) -> None:
        self.collectives = 0
        self.local_bytes = 0
        self.remote_bytes = 0
        self.control_bytes = 0  # point-to-point bytes on communicators duplicated later
        self.p2p_local_bytes = 0  # send/recv bytes to processes of this node
        self.p2p_remote_bytes = 0  # ... and of other nodes
        self.dups = 0


class CountingComm:
    def __init__(
        self, comm: Any, shared: _Shared | None = None, nodes: list[str] | None = None,
        payload: bool = True, p2p: bool = False,
    ):  # fmt: skip
        self._c = comm
        self._payload = payload
        self._p2p = p2p
        self._s = shared or _Shared()
        if nodes is None:
            name = os.environ.get("NCCLTREE_NODE") or MPI.Get_processor_name()
            nodes = comm.allgather(name)
        self._nodes = nodes
        self._me = comm.Get_rank()
        self._root = True  # the communicator the test wrapped (not one of its duplicates)

    # counters, shared by every communicator made from this one
    @property
    def collectives(self) -> int:
        return self._s.collectives

    @property
    def local_bytes(self) -> int:
        return self._s.local_bytes

    @property
    def remote_bytes(self) -> int:
        return self._s.remote_bytes

    @property
    def control_bytes(self) -> int:
        return self._s.control_bytes

    @property
    def p2p_local_bytes(self) -> int:
        return self._s.p2p_local_bytes

    @property
    def p2p_remote_bytes(self) -> int:
        return self._s.p2p_remote_bytes

    def reset(self) -> None:
        s = self._s
        s.collectives = s.local_bytes = s.remote_bytes = s.control_bytes = 0
        s.p2p_local_bytes = s.p2p_remote_bytes = 0

    def Dup(self) -> CountingComm:
        # the group duplicates the communicator for its bootstrap first, then for its
        # payload, then for control messages (signatures): bytes on all but the payload's
        # are counted apart; a duplicate of a duplicate (the group's send/recv space) is
        # counted apart too
        self._s.collectives += 1
        if self._root:
            self._s.dups += 1
            payload = self._s.dups % 3 == 2
        else:
            payload = False
        # the payload communicator's duplicate: the group's send/recv space
        p2p = not self._root and self._payload
        dup = CountingComm(self._c.Dup(), self._s, self._nodes, payload=payload, p2p=p2p)
        dup._root = False
        return dup

    def Split(self, color: int, key: int) -> Any:
        self._s.collectives += 1
        return self._c.Split(color, key)

    def Isend(self, buf: Any, dest: int, tag: int = 0) -> Any:
        arr = buf[0] if isinstance(buf, (list, tuple)) else buf
        nbytes = int(getattr(arr, "nbytes", 0))
        if self._p2p:
            if self._nodes[dest] == self._nodes[self._me]:
                self._s.p2p_local_bytes += nbytes
            else:
                self._s.p2p_remote_bytes += nbytes
        elif not self._payload:
            self._s.control_bytes += nbytes
        elif self._nodes[dest] == self._nodes[self._me]:
            self._s.local_bytes += nbytes
        else:
            self._s.remote_bytes += nbytes
        return self._c.Isend(buf, dest, tag)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._c, name)
        if name in _COLLECTIVES:

            def counted(*a: Any, **k: Any) -> Any:
                self._s.collectives += 1
                return attr(*a, **k)

            return counted
        return attr


def report(d: dict[str, Any], key: object) -> None:
    """One JSON line on stdout, and the file $NCCLTREE_TEST_OUT/<key>.json when set: the
    launcher interleaves the processes' output, and may stop forwarding it once a process
    died."""
    import json

    text = json.dumps(d)
    print(text, flush=True)
    where = os.environ.get("NCCLTREE_TEST_OUT")
    if where:
        with open(os.path.join(where, f"{key}.json"), "w") as f:
            f.write(text)
