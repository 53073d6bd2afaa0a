"""``algorithm="mpi"``: MPI's own collectives on a process group (one rank per process),
non-blocking and waited on with the group's bounded waits, so a peer that never calls
still ends in ``CommTimeout``; MPI errors become ``CommError``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np

from ..._errors import CommError
from .._args import Prepared
from ..collectives import COLLECTIVES

if TYPE_CHECKING:
    from mpi4py import MPI as _MPI

    from ..flight import Entry
    from .core import Core
    from .placement import Placement


@dataclass
class MpiContext:
    """What MPI's collectives need of their group: the shared core, and its
    one-rank-per-process check (``one(what)``)."""

    core: Core
    one: Callable[[str], None]


def run_mpi(ctx: MpiContext, prep: Prepared, entry: Entry) -> None:
    """MPI's own collectives (one rank per process)."""
    ctx.one(f"algorithm 'mpi' ({prep.collective})")
    pl = ctx.core.placement
    MPI = ctx.core.mpi
    comm = ctx.core.comm
    assert MPI is not None and comm is not None  # (refused at start without MPI)
    if COLLECTIVES[prep.collective].reduces and not mpi_reduces(prep.dtype):
        raise TypeError(
            f"algorithm 'mpi' cannot reduce {prep.dtype} (MPI has no such type); "
            "use tree, ring or direct"
        )
    x, o = prep.ins[0], prep.outs[0]
    t = mpi_type(MPI, prep.dtype)
    mop = {"sum": MPI.SUM, "mean": MPI.SUM, "prod": MPI.PROD, "max": MPI.MAX,
           "min": MPI.MIN}[prep.op]  # fmt: skip
    # MPI's ranks in this group's numbering: the communicator is the group's own dup, so
    # map roots through it
    root = pl.mpi_rank_of_proc[pl.proc_of_rank[prep.root]]
    coll = prep.collective
    entry.state = "running"
    me_root = comm.Get_rank() == root
    # non-blocking collectives, waited on with the group's timeout (a blocking MPI
    # call could not be bounded)
    try:
        if coll == "all_reduce":
            req = comm.Iallreduce(MPI.IN_PLACE if prep.in_place else [x, t], [o, t], op=mop)
        elif coll == "reduce":
            if me_root:
                send = MPI.IN_PLACE if prep.in_place else [x, t]
                req = comm.Ireduce(send, [o, t], op=mop, root=root)
            else:
                req = comm.Ireduce([x, t], None, op=mop, root=root)
        elif coll == "broadcast":
            if not prep.in_place and me_root:
                np.copyto(o, x)
            req = comm.Ibcast([o, t], root=root)
        elif coll == "all_gather":
            _mpi_order(pl, coll)
            req = comm.Iallgather(MPI.IN_PLACE if prep.in_place else [x, t], [o, t])
        elif coll == "gather":
            _mpi_order(pl, coll)
            if me_root:
                req = comm.Igather(MPI.IN_PLACE if prep.in_place else [x, t], [o, t], root=root)
            else:
                req = comm.Igather([x, t], None, root=root)
        elif coll == "scatter":
            _mpi_order(pl, coll)
            if me_root:
                req = comm.Iscatter([x, t], MPI.IN_PLACE if prep.in_place else [o, t], root=root)
            else:
                req = comm.Iscatter(None, [o, t], root=root)
        elif coll == "all_to_all":
            _mpi_order(pl, coll)
            req = comm.Ialltoall([x, t], [o, t])
        elif coll == "sendrecv":
            _mpi_order(pl, coll)
            me, n = comm.Get_rank(), comm.Get_size()
            req = comm.Isendrecv([x, t], (me + 1) % n, 0, [o, t], (me - 1) % n, 0)
        else:
            _mpi_order(pl, coll)
            # in place the output lies inside the input: reduce from a copy
            send = x.copy() if prep.in_place else x
            req = comm.Ireduce_scatter_block([send, t], [o, t], op=mop)
        ctx.core.waits.request(req, -1, f"MPI's {coll}")
    except MPI.Exception as exc:
        raise CommError(f"rank {pl.rank}: MPI {coll} failed: {exc}") from exc
    if prep.op == "mean" and (coll != "reduce" or me_root):
        o /= pl.size


def _mpi_order(pl: Placement, coll: str) -> None:
    if pl.mpi_rank_of_proc != list(range(pl.nprocs)):
        raise ValueError(
            f"algorithm 'mpi' ({coll}) needs MPI's rank order to be the group's "
            "(node-major); launch the processes of each node contiguously"
        )


def mpi_reduces(dtype: np.dtype) -> bool:
    """Whether MPI can reduce ``dtype``: not float16 or bfloat16, which it has no type for
    (``mpi_type`` moves them as 16-bit words, for the collectives that do not reduce)."""
    return np.dtype(dtype).name not in ("float16", "bfloat16")


def mpi_type(MPI: ModuleType, dtype: np.dtype) -> _MPI.Datatype:
    table = {
        "float32": MPI.FLOAT,
        "float64": MPI.DOUBLE,
        "int32": MPI.INT32_T,
        "int64": MPI.INT64_T,
        "int8": MPI.INT8_T,
        "uint8": MPI.UINT8_T,
        # moved as 16-bit words; MPI never reduces them here
        "float16": MPI.UINT16_T,
        "bfloat16": MPI.UINT16_T,
    }
    t = table.get(np.dtype(dtype).name)
    if t is None:
        raise TypeError(f"no MPI datatype for {dtype}")
    return t
