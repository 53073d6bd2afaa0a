"""The waits of a process group: on a shared-memory counter, on an MPI request, on the
node's processes (a node sync). Every wait is bounded by the group's timeout and checks,
while it waits, the node's abort word, whether the node's other processes are alive and
whether the launcher reported a death: a dead process raises ``PeerFailure`` naming its
ranks, a process that never comes ``CommTimeout`` naming them."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ... import _native
from ..._errors import CommTimeout, PeerFailure
from .shm import alive

if TYPE_CHECKING:
    from types import ModuleType

    from mpi4py import MPI as _MPI

    from .lifecycle import Lifecycle
    from .node_memory import LauncherWatch, NodeMemory
    from .placement import Placement

_POLL = 0.01  # seconds between liveness checks while waiting
_MPI_SLICE = 0.0002  # seconds between MPI progress calls while sends are in flight


@dataclass(eq=False)
class Waits:
    """The bounded waits of one group. ``inflight``: the sends of the current call not
    known finished (MPI moves their data only inside MPI calls, so the waits let it
    progress between slices)."""

    placement: Placement
    mem: NodeMemory
    life: Lifecycle
    launcher: LauncherWatch
    mpi: ModuleType | None  # (None: no MPI; nothing is then in flight)
    timeout: float
    inflight: list[_MPI.Request] = field(default_factory=list)

    def counter(self, counter: _native.Counter, target: int, proc: int, what: str) -> None:
        """Until ``counter`` reaches ``target`` (process ``proc`` moves it: named if it
        never does)."""
        if counter.wait(target, 0.0005):
            return
        deadline = time.monotonic() + self.timeout
        # while sends are in flight, MPI moves their data only inside MPI calls (large
        # messages go in pieces, each handed over when both sides call MPI): wait in
        # short slices and let MPI progress between them
        slice_s = _MPI_SLICE if self.inflight else _POLL
        last_check = time.monotonic()
        while not counter.wait(target, slice_s):
            if self.inflight:
                self.progress_mpi()
            now = time.monotonic()
            if now - last_check >= _POLL:
                last_check = now
                self.check_peers()
                if now > deadline:
                    raise CommTimeout(self.timed_out(proc, what))

    def progress_mpi(self) -> None:
        """Let MPI move the data of the call's sends (finished ones are null requests,
        which cost nothing to test)."""
        assert self.mpi is not None
        self.mpi.Request.Testall(self.inflight)

    def request(
        self, req: _MPI.Request, proc: int, what: str, status: _MPI.Status | None = None
    ) -> None:
        """Until ``req`` completes (bounded, watching the node); ``status`` gets its
        status (a completed request is null after: ask here, not afterwards)."""
        if req.Test(status):
            return
        deadline = time.monotonic() + self.timeout
        spin_until = time.perf_counter() + 0.0002
        last_check = time.monotonic()
        while not req.Test(status):
            if self.inflight:
                self.progress_mpi()
            if time.perf_counter() < spin_until:
                continue
            time.sleep(0.00005)
            now = time.monotonic()
            if now - last_check > _POLL:
                last_check = now
                self.check_peers()
                if now > deadline:
                    raise CommTimeout(self.timed_out(proc, what))

    def node_sync(self) -> None:
        """Every process of the node got this far (a symmetric allocation)."""
        mem = self.mem
        mem.sync_n += 1
        mem.sync[self.placement.proc].add(1)
        for p in self.placement.node_procs:
            self.counter(mem.sync[p], mem.sync_n, p, "a shared-memory allocation")

    def timed_out(self, proc: int, what: str) -> str:
        pl = self.placement
        who = f"ranks {pl.ranks_of(proc)} (process {proc})" if proc >= 0 else "a peer"
        return (
            f"rank {pl.rank}: waited {self.timeout:g} s for {who}: {what} of collective "
            f"#{self.life.seq} never came"
        )

    def check_peers(self) -> None:
        """Raise ``PeerFailure`` if a process of the node failed or died, or the launcher
        reported a death. The first process to see a death tells the node (its abort
        word) which process died, before it raises: the node's others, which may then see
        this one gone too, read that and blame the same process."""
        pl = self.placement
        reason = self.mem.abort_reason()
        if reason is not None:
            raise PeerFailure(f"rank {pl.rank}: {reason}")
        for p in pl.node_procs:
            if p == pl.proc:
                continue
            pid = self.mem.pid(p)
            if not alive(pid):
                told = self.mem.set_abort(
                    f"the process of ranks {pl.ranks_of(p)} (pid {pid}) died during "
                    f"collective #{self.life.seq}",
                    p,
                )
                raise PeerFailure(f"rank {pl.rank}: {told}")
        self.check_launcher()

    def check_launcher(self) -> None:
        if self.launcher.reported:
            told = self.mem.set_abort(
                f"the launcher reported that a process of the job died (SIGUSR1) during "
                f"collective #{self.life.seq}",
                None,
            )
            raise PeerFailure(f"rank {self.placement.rank}: {told}")
