"""Who is where in a process group: its processes, their nodes, ranks and MPI ranks.

Worked out once, from one exchange of the bootstrap (:mod:`.bootstrap`): each process's
node name, ranks, process id, whether it may use shared memory, a job name (process 0's
is the job's) and the group's settings, which must be the same everywhere (else every
process raises ``ValueError`` naming what differs); every process computes the same
:class:`Placement` from them. Processes
are numbered node-major (nodes in order of their first MPI rank), ranks by process.

A *transport node* is a set of processes that share memory: a real node where every one
of its processes can use shared memory, else each process alone (MPI between all of
them); the topology keeps the real nodes.
"""

from __future__ import annotations

import os
import secrets
import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .shm import remove_stale, shm_usable, shm_usable_reason

if TYPE_CHECKING:
    from .bootstrap import Bootstrap


@dataclass(frozen=True)
class Placement:
    """This process's view of the group's layout (the same data in every process, but
    ``proc`` and what derives from it)."""

    nprocs: int
    proc: int  # this process
    size: int  # ranks in the group
    ranks: tuple[int, ...]  # this process's ranks
    node: str  # this process's node name
    node_index: int
    nodes: int
    local_rank: int  # of this process's first rank, among its node's ranks
    local_size: int  # ranks on this process's node
    shm: bool  # whether this process's node shares memory
    job: str  # the job's name, in the names of its shared-memory segments
    mpi_rank_of_proc: list[int]
    node_of_proc: list[int]
    nlocal_of_proc: list[int]
    first_rank_of_proc: list[int]
    proc_of_rank: list[int]
    tnode_of_proc: list[int]  # the transport node of each process
    phys: list[int]  # the processes of this process's (real) node
    node_procs: list[int]  # the processes of this process's transport node
    remote_procs: list[int]  # every other process

    @property
    def rank(self) -> int:
        """This process's first rank."""
        return self.ranks[0]

    def ranks_of(self, proc: int) -> list[int]:
        return [r for r in range(self.size) if self.proc_of_rank[r] == proc]


def place(
    boot: Bootstrap,
    nlocal: int,
    shm: bool | None,
    settings: Mapping[str, object] | None = None,
    instead: str | None = "MPI",
    who: str = "MPI ranks",
) -> Placement:
    """Every process's placement (collective over the bootstrap's processes: one
    exchange). ``nlocal``: this process's ranks; ``shm``: as for the group; ``settings``:
    what every process must have alike (the group's algorithm, ...). The first process of
    a node that cannot share memory says so on stderr, naming ``instead``, what carries
    their data then (None: nothing is said, the group refuses to start). ``who``: how a
    settings mismatch names the bootstrap's processes (``"MPI ranks"``; ``"processes"``
    for a start without MPI, numbered by the launcher's ranks)."""
    nprocs = boot.size
    me = boot.rank
    node_name = os.environ.get("NCCLTREE_NODE") or socket.gethostname()
    # this user's stale segments first: they would count as used space in shm_usable
    remove_stale()
    entry = [node_name, nlocal, os.getpid(), shm_usable(shm), secrets.token_hex(4), settings or {}]
    info: list[tuple[str, int, int, bool]] = []
    every: list[dict[str, object]] = []
    for p, got in enumerate(boot.exchange(entry)):
        if not (isinstance(got, list) and len(got) == 6 and isinstance(got[5], dict)):
            raise ValueError(f"bootstrap: process {p} sent a malformed placement: {got!r:.200}")
        info.append((str(got[0]), int(got[1]), int(got[2]), bool(got[3])))
        every.append(got[5])
        if p == 0:
            job = str(got[4])
    _check_settings(every, who)
    # processes numbered node-major: nodes in order of their first MPI rank
    order: list[str] = []
    for name, *_ in info:
        if name not in order:
            order.append(name)
    procs = sorted(range(nprocs), key=lambda i: (order.index(info[i][0]), i))
    proc = procs.index(me)
    node_of_proc = [order.index(info[i][0]) for i in procs]
    nlocal_of_proc = [info[i][1] for i in procs]
    first = np.cumsum([0, *nlocal_of_proc]).tolist()
    size = int(first[-1])
    ranks = tuple(range(first[proc], first[proc + 1]))
    proc_of_rank = [p for p in range(nprocs) for _ in range(nlocal_of_proc[p])]
    node_index = node_of_proc[proc]
    phys = [p for p in range(nprocs) if node_of_proc[p] == node_index]
    # shared memory within a node only where every process of the node can use it;
    # elsewhere each process is a "node" of its own for the transports (MPI between
    # all of them), while the topology keeps the real nodes
    node_shm = all(info[procs[p]][3] for p in phys)
    shm_nodes = {n for n in range(len(order))
                 if all(info[procs[p]][3] for p in range(nprocs) if node_of_proc[p] == n)}  # fmt: skip
    tnode_of_proc = [
        node_of_proc[p] if node_of_proc[p] in shm_nodes else len(order) + p for p in range(nprocs)
    ]
    if not node_shm and phys[0] == proc and len(phys) > 1 and instead is not None:
        print(f"nccltree: {shm_usable_reason(shm)}: the processes of node {node_name} "
              f"exchange data over {instead} instead of shared memory", file=sys.stderr,
              flush=True)  # fmt: skip
    mine = tnode_of_proc[proc]
    node_procs = [p for p in range(nprocs) if tnode_of_proc[p] == mine]
    node_ranks = [r for r in range(size) if proc_of_rank[r] in phys]
    return Placement(
        nprocs=nprocs,
        proc=proc,
        size=size,
        ranks=ranks,
        node=node_name,
        node_index=node_index,
        nodes=len(order),
        local_rank=ranks[0] - node_ranks[0],
        local_size=len(node_ranks),
        shm=node_shm,
        job=job,
        mpi_rank_of_proc=procs,
        node_of_proc=node_of_proc,
        nlocal_of_proc=nlocal_of_proc,
        first_rank_of_proc=first[:-1],
        proc_of_rank=proc_of_rank,
        tnode_of_proc=tnode_of_proc,
        phys=phys,
        node_procs=node_procs,
        remote_procs=[p for p in range(nprocs) if p not in node_procs],
    )


def _check_settings(every: list[dict[str, object]], who: str = "MPI ranks") -> None:
    """Every process's group settings alike, or ``ValueError`` (on every process, which
    all see the same table) naming each that differs, by its bootstrap rank (MPI's, or
    the launcher's ``RANK``), as ``who`` says."""
    lines = []
    for key in sorted({k for d in every for k in d}):
        values: dict[str, list[int]] = {}
        for p, d in enumerate(every):
            values.setdefault(repr(d.get(key)), []).append(p)
        if len(values) > 1:
            lines.append(f"  {key}: " + ", ".join(f"{v} on {who} {ps}" for v, ps in values.items()))
    if lines:
        raise ValueError(
            "the processes start the process group with different settings:\n" + "\n".join(lines)
        )
