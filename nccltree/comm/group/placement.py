"""Who is where in a process group: its processes, their nodes, ranks and MPI ranks.

Worked out once, at bootstrap, from one ``allgather`` (each process's node name, ranks,
process id and whether it may use shared memory) and one ``bcast`` (the job's name, made
by MPI rank 0); every process computes the same :class:`Placement` from them. Processes
are numbered node-major (nodes in order of their first MPI rank), ranks by process.

A *transport node* is a set of processes that share memory: a real node where every one
of its processes can use shared memory, else each process alone (MPI between all of
them); the topology keeps the real nodes.
"""

from __future__ import annotations

import os
import secrets
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .shm import remove_stale, shm_usable, shm_usable_reason

if TYPE_CHECKING:
    from mpi4py import MPI as _MPI


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


def place(comm: _MPI.Intracomm, nlocal: int, shm: bool | None) -> Placement:
    """Every process's placement (collective over ``comm``: one ``allgather``, then one
    ``bcast``). ``nlocal``: this process's ranks; ``shm``: as for the group. The first
    process of a node that cannot share memory says so on stderr."""
    from mpi4py import MPI

    nprocs = comm.Get_size()
    me = comm.Get_rank()
    node_name = os.environ.get("NCCLTREE_NODE") or MPI.Get_processor_name()
    job = secrets.token_hex(4) if me == 0 else None
    # this user's stale segments first: they would count as used space in shm_usable
    remove_stale()
    info = comm.allgather((node_name, nlocal, os.getpid(), shm_usable(shm)))
    job = comm.bcast(job, root=0)
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
    if not node_shm and phys[0] == proc and len(phys) > 1:
        print(f"nccltree: {shm_usable_reason(shm)}: the processes of node {node_name} "
              "exchange data over MPI instead of shared memory", file=sys.stderr,
              flush=True)  # fmt: skip
    mine = tnode_of_proc[proc]
    node_procs = [p for p in range(nprocs) if tnode_of_proc[p] == mine]
    node_ranks = [r for r in range(size) if proc_of_rank[r] in phys]
    assert job is not None
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
