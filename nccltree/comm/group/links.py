"""How a process group reaches its processes outside its data paths: the rare exchanges
of its start (the node's control segment, the GPUs' bus ids and links, the inter-process
events, NCCL's unique id), ``split``/``new_group`` and, over MPI, its messages between
nodes.

Two kinds, chosen by how the job was started:

- **over MPI** (launched by ``mpiexec``/``srun`` with MPI, or given a communicator): three
  duplicates of the parent communicator, as before there was any other kind: ``comm``
  (host data and notifications between nodes; the start's exchanges), ``ctl`` (argument
  agreement, signatures between nodes) and ``node_comm`` (the transport node's processes).
- **over the bootstrap** (``env://``, ``tcp://``, ``file://``, Slurm without MPI): the
  group keeps its :class:`~.bootstrap.Bootstrap` for its life and every one of those
  exchanges goes through it. The bootstrap knows no sub-communicators, so an exchange
  "within the node" is one of the whole group, in which every process takes part in the
  same order whatever its node (each keeps what its node's processes said). There is no
  data path between nodes here: host groups spanning nodes are refused at start (see
  :func:`refuse_without_mpi`); GPU groups move their data between nodes over NCCL.

What travels over the bootstrap is JSON: bytes go as hex.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from ..._errors import BackendUnavailable

if TYPE_CHECKING:
    from types import ModuleType

    from mpi4py import MPI as _MPI

    from .bootstrap import Bootstrap
    from .placement import Placement


class SubBootstrap(Protocol):
    """A bootstrap that can make one among some of its processes (``split``)."""

    rank: int
    size: int

    def exchange(self, obj: object) -> list[object]: ...

    def barrier(self) -> None: ...

    def abort(self, reason: str) -> None: ...

    def sub(self, name: str, members: list[int]) -> SubBootstrap: ...

    def close(self) -> None: ...


class BootOwner:
    """Who closes a bootstrap: whoever started it (``init_process_group`` keeps a
    store's for the process's life), the groups started over it and every group split
    from one hold it; the last to let go closes it (its store with it)."""

    def __init__(self, boot: Bootstrap) -> None:
        self.boot = boot
        self.holders = 1
        self.groups = 0  # groups started on it (each on a bootstrap of its own)

    def hold(self) -> BootOwner:
        self.holders += 1
        return self

    def release(self) -> None:
        self.holders -= 1
        if self.holders == 0:  # (once: later calls find it negative)
            close = getattr(self.boot, "close", None)
            if close is not None:
                close()


class Links:
    """The group's links to its processes (see the module docstring). ``mpi``: the MPI
    module (None without MPI); ``comm``/``ctl``/``node_comm``: the communicators (None
    without MPI); ``boot``: the bootstrap kept (None over MPI)."""

    def __init__(self, pl: Placement, mpi: ModuleType | None) -> None:
        self.pl = pl
        self.mpi = mpi
        self.comm: _MPI.Intracomm | None = None
        self.ctl: _MPI.Intracomm | None = None
        self.node_comm: _MPI.Comm | None = None
        self.boot: Bootstrap | None = None
        self.owner: BootOwner | None = None
        self._splits = 0
        me = pl.mpi_rank_of_proc[pl.proc]
        self.first = me == 0  # MPI rank 0 of the parent, or the bootstrap's rank 0
        self.node_lead = pl.node_procs[0] == pl.proc

    @classmethod
    def over_mpi(cls, parent: _MPI.Intracomm, pl: Placement, mpi: ModuleType) -> Links:
        self = cls(pl, mpi)
        self.comm = parent.Dup()  # our own message space: data and notifications
        self.ctl = parent.Dup()  # signatures, agreement
        self.node_comm = self.comm.Split(pl.tnode_of_proc[pl.proc], pl.proc)
        return self

    @classmethod
    def over_boot(cls, boot: Bootstrap, pl: Placement, owner: BootOwner) -> Links:
        self = cls(pl, None)
        self.boot = boot
        self.owner = owner
        return self

    @property
    def group_wide(self) -> bool:
        """Whether a node's exchanges are the whole group's (over the bootstrap)."""
        return self.boot is not None

    # -- the whole group --------------------------------------------------------------------
    def gather(self, obj: object) -> list[object]:
        """Every process's ``obj``, by process (the group's numbering). Collective."""
        got = self.comm.allgather(obj) if self.comm is not None else self._exchange(obj)
        return [got[self.pl.mpi_rank_of_proc[p]] for p in range(self.pl.nprocs)]

    def share(self, obj: object) -> object:
        """The first process's ``obj`` (MPI rank 0, or the bootstrap's rank 0), on every
        process. Collective."""
        if self.comm is not None:
            return self.comm.bcast(obj, root=0)
        return self._exchange(obj if self.first else None)[0]

    def _exchange(self, obj: object) -> list[object]:
        assert self.boot is not None
        if self.boot.size == 1:
            return [obj]
        return self.boot.exchange(obj)

    # -- the transport node -----------------------------------------------------------------
    def node_share(self, obj: object) -> object:
        """The node's first process's ``obj``, on each process of the node. Over the
        bootstrap every process of the group calls it (see the module docstring)."""
        if self.node_comm is not None:
            return self.node_comm.bcast(obj, root=0)
        got = self._exchange(obj if self.node_lead else None)
        return got[self.pl.mpi_rank_of_proc[self.pl.node_procs[0]]]

    def node_gather(self, obj: object) -> list[object]:
        """Every process of the node's ``obj``, in the node's order. As ``node_share``."""
        if self.node_comm is not None:
            return list(self.node_comm.allgather(obj))
        got = self._exchange(obj)
        return [got[self.pl.mpi_rank_of_proc[p]] for p in self.pl.node_procs]

    def node_barrier(self) -> None:
        """Every process of the node got here. As ``node_share``."""
        if self.node_comm is not None:
            self.node_comm.Barrier()
        elif self.boot is not None and self.boot.size > 1:
            self.boot.barrier()

    # -- split ------------------------------------------------------------------------------
    def split_boot(self, color: int | None, key: int) -> tuple[SubBootstrap, BootOwner] | None:
        """Over the bootstrap: the processes of ``color`` (None: none) ordered by ``(key,
        rank)`` (as MPI's ``Comm_split`` orders them), and a bootstrap among them
        (``boot.sub``); None for color None. Collective over the group: one exchange."""
        assert self.boot is not None and self.owner is not None
        pl = self.pl
        self._splits += 1
        got = self._exchange([color, key, pl.rank])
        members = []
        for b, entry in enumerate(got):
            if not (isinstance(entry, list) and len(entry) == 3):
                raise ValueError(f"split: process {b} sent a malformed entry: {entry!r:.200}")
            if entry[0] is not None and entry[0] == color:
                members.append((int(entry[1]) * pl.size + int(entry[2]), b))
        if color is None:
            return None
        sub = getattr(self.boot, "sub", None)
        if sub is None:
            raise BackendUnavailable(
                f"split: this group's bootstrap ({type(self.boot).__name__}) cannot make one "
                "among some of its processes"
            )
        name = f"split{self._splits}c{color}"
        return sub(name, [b for _, b in sorted(members)]), self.owner.hold()

    # -- the end ----------------------------------------------------------------------------
    def close(self) -> None:
        for c in (self.node_comm, self.ctl, self.comm):
            if c is None:
                continue
            try:
                c.Free()
            except Exception:  # noqa: BLE001 - best effort at teardown
                pass
        boot, owner = self.boot, self.owner
        self.boot = self.owner = None
        if boot is not None and owner is not None:
            if boot is not owner.boot:  # a split's own bootstrap
                close = getattr(boot, "close", None)
                if close is not None:
                    close()
            owner.release()  # the last group over the job's bootstrap closes it


def refuse_without_mpi(pl: Placement, gpu: bool, algorithm: str, method: str) -> None:
    """What a group started without MPI cannot do, refused with one line on every process
    (each sees the same placement): ``algorithm="mpi"``, and host data between transport
    nodes (nodes, or processes of a node that cannot share memory), which needs MPI."""
    if algorithm == "mpi":
        raise BackendUnavailable(
            f"algorithm='mpi' needs MPI, and this group was started without it ({method}); "
            "use 'auto', 'tree', 'ring' or 'direct', or launch with mpiexec"
        )
    if gpu or len(set(pl.tnode_of_proc)) == 1:
        return
    if pl.nodes > 1:
        why = f"spans {pl.nodes} nodes"
    else:
        why = "has processes that cannot share memory (see NCCLTREE_SHM)"
    raise BackendUnavailable(
        f"a host process group that {why} needs MPI to move its data between them, and "
        f"this job was started without it ({method}): launch it with mpiexec (pip install "
        "'nccltree[mpich]', or 'nccltree[mpi]' over this machine's MPI), or use "
        "devices='gpu' (NCCL between nodes)"
    )
