"""A process group's life cycle: open, closed, or failed for good; the numbering of its
calls (the flight recorder's); what a failure does (free the names of this process's
segments, tell the node, leave at exit without ``MPI_Finalize``, print the flight
recorder)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from ..._errors import CommError, CommTimeout, PeerFailure
from .shm import exit_without_finalize, remove_stale

if TYPE_CHECKING:
    from ..flight import FlightRecorder
    from .node_memory import NodeMemory
    from .placement import Placement


class Lifecycle:
    """``seq``: collectives (and point-to-point operations) called so far; ``closed``;
    ``failure``: what failed the group (None while it did not). ``mem`` is set once the
    node's memory exists (bootstrap)."""

    def __init__(self, placement: Placement, flight: FlightRecorder) -> None:
        self.placement = placement
        self.flight = flight
        self.mem: NodeMemory | None = None
        self.seq = 0
        self.closed = False
        self.failure: BaseException | None = None

    def check_usable(self) -> None:
        if self.closed:
            raise CommError("the process group is closed")
        if self.failure is not None:
            raise PeerFailure(f"the process group failed earlier: {self.failure}")

    def close(self, sync: Callable[[], None] | None, release: Sequence[Callable[[], None]]) -> bool:
        """Close once (False if closed already): unless the group failed, ``sync`` first
        (every process of the node got here: bounded, and a failure there does not stop
        the closing), then each of ``release`` in order."""
        if self.closed:
            return False
        if self.failure is None and sync is not None:
            try:
                sync()
            except (PeerFailure, CommTimeout):
                pass
        self.closed = True
        for step in release:
            step()
        return True

    def fail(self, exc: BaseException) -> None:
        """Close the group for good; tell the node; print the flight recorder."""
        if self.failure is not None:
            return
        self.failure = exc
        pl = self.placement
        mem = self.mem
        assert mem is not None
        # nobody may map this process's new segments any more: free their names now
        mem.unlink_pending()
        if pl.shm and len(pl.node_procs) > 1:
            # ... nor a dead process's: an arena that only its send/recv peers mapped
            # keeps its name until every process of the node has mapped it
            remove_stale()
        if not isinstance(exc, PeerFailure) and not self.closed:
            mem.set_abort(f"ranks {list(pl.ranks)} failed: {type(exc).__name__}: {exc}")
        # MPI_Finalize would wait for processes that may never come (a dead one, one
        # stuck, or peers of an aborted group): leave without it, whatever failed
        import atexit

        atexit.register(exit_without_finalize)
        text = self.flight.dump(f"rank {pl.rank} (process {pl.proc}, node {pl.node})")
        text = f"nccltree: {type(exc).__name__}: {exc}\n{text}"
        if isinstance(exc, CommError) and hasattr(exc, "add_note"):
            exc.add_note(text)  # Python >= 3.11
        print(text, file=sys.stderr, flush=True)
