"""What the pieces of one process group share (:class:`Core`), named once: the engine,
point-to-point and MPI's own collectives each take it with what only they need."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from types import ModuleType

    from mpi4py import MPI as _MPI

    from .gpu import GpuSide
    from .node_memory import NodeMemory
    from .placement import Placement
    from .waits import Waits


@dataclass(frozen=True)
class Core:
    """Who is where, the node's memory, the bounded waits, the GPU side (None on the
    host), the group's communicator (data and notifications) and the MPI module (both
    None for a group started without MPI: it has no host data path between nodes)."""

    placement: Placement
    mem: NodeMemory
    waits: Waits
    gpu: GpuSide | None
    comm: _MPI.Intracomm | None
    mpi: ModuleType | None
