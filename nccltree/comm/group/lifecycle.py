"""A process group's life cycle: the communicator's (:class:`..lifecycle.LifeCycle`: open,
closed, or failed for good; the check every call makes; the report of a failure found
inside) plus what only a group has: the numbering of its calls (the flight recorder's),
a closing that waits for the node, and what any failure does first (free the names of
this process's segments, tell the node, leave at exit without ``MPI_Finalize``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from ..._errors import CommTimeout, PeerFailure
from ..lifecycle import LifeCycle
from .shm import exit_without_finalize, remove_stale

if TYPE_CHECKING:
    from ..flight import FlightRecorder
    from .node_memory import NodeMemory
    from .placement import Placement


class Lifecycle(LifeCycle):
    """``seq``: collectives (and point-to-point operations) called so far. ``mem`` is set
    once the node's memory exists (bootstrap)."""

    def __init__(self, placement: Placement, flight: FlightRecorder) -> None:
        pl = placement
        super().__init__(
            flight,
            lambda: f"rank {pl.rank} (process {pl.proc}, node {pl.node})",
            "the process group is closed",
            "the process group failed earlier",
        )
        self.placement = placement
        self.mem: NodeMemory | None = None
        self.seq = 0

    def close(
        self, sync: Callable[[], None] | None = None, release: Sequence[Callable[[], None]] = ()
    ) -> bool:
        """Close once (False if closed already): unless the group failed, ``sync`` first
        (every process of the node got here: bounded, and a failure there does not stop
        the closing, but the process then leaves at exit without finalizing, as after
        any failure: ``MPI_Finalize`` would wait for the process that did not come),
        then each of ``release`` in order."""
        if self.closed:
            return False
        if self.failure is None and sync is not None:
            try:
                sync()
            except (PeerFailure, CommTimeout):
                import atexit

                atexit.register(exit_without_finalize)
        if not super().close():
            return False
        for step in release:
            step()
        return True

    def on_failure(self, exc: BaseException) -> None:
        """Tell the node (unless the group was closed, or the node knows already: a
        peer's failure learnt from it, or a death this process told it of), free the
        names of the node's segments, and leave at exit without finalizing."""
        pl = self.placement
        mem = self.mem
        assert mem is not None
        # the node first: a process that then finds a name below gone reads why here
        if not self.closed:
            if not isinstance(exc, PeerFailure):
                mem.set_abort(
                    f"ranks {list(pl.ranks)} failed: {type(exc).__name__}: {exc}", pl.proc
                )
            elif mem.abort_reason() is None:
                mem.set_abort(f"{exc}", None)  # (learnt otherwise: said as it was learnt)
        # nobody may map this process's new segments any more: free their names now
        mem.unlink_pending()
        if pl.shm and len(pl.node_procs) > 1:
            if mem.abort_reason() is not None:
                # ... nor any other of the node's: its processes may be killed by their
                # launcher before they free their own
                mem.unlink_node_names()
            # ... nor a dead process's, of this group or another (see remove_stale)
            remove_stale()
        # MPI_Finalize would wait for processes that may never come (a dead one, one
        # stuck, or peers of an aborted group): leave without it, whatever failed
        import atexit

        atexit.register(exit_without_finalize)
