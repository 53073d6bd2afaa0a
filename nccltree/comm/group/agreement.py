"""Argument agreement for the calls that do not arrive through the schedule engine.

The engine (:mod:`.engine`) compares every process's signature as part of the arrival
the plan needs anyway. MPI's and NCCL's own collectives have no such step, and ``auto``
may pick a different path on two processes whose arguments differ (it decides by size),
so before any of those calls, and before ``split``/``new_group``, the processes agree
here: one non-blocking ``MPI_Iallreduce`` (``MAX``) of ``[h, -h]``, ``h`` a 62-bit
digest of the call's signature, on the group's control communicator. Every process gets
the same two numbers and they agree exactly when ``max(h) == min(h)``: all decide alike,
raise ``ValueError`` together before any buffer is written, and the group goes on. Only
on a mismatch a second exchange (``MPI_Iallgather`` of each signature's text) names who
called what. Both waits are the group's bounded, liveness-checking waits.

A process whose own checks refuse a call takes part all the same, with a signature that
says so: the others raise ``ValueError`` naming it, and no later call is matched with
the wrong partner.

Without MPI (a group started over another bootstrap, :mod:`.links`) there is no control
communicator, and the agreement takes one of two other bounded forms:

- every process on one transport node (shared memory): through the node's control block,
  as the engine's own arrival (:meth:`.engine.Engine.refuse`: each publishes the
  signature, arrives, and compares every other's with its own). Only calls on NCCL's own
  collectives need it: an ``auto`` call that chooses an engine algorithm agrees in the
  engine's arrival, which two processes that chose differently also meet in (their
  signatures then differ, and both raise);
- across transport nodes (GPU groups only, host ones are refused): one tiny NCCL
  ``all_reduce`` (``MAX``) of the same ``[h, -h]``, on a second NCCL communicator of the
  group and a stream of its own, waited for on the host with the group's bounded waits;
  before every call, whatever its algorithm (the engine compares signatures only within
  a node then). On a mismatch the texts go through the bootstrap.

``NCCLTREE_CHECK=off`` skips the exchange (a user who accepts MPI's and NCCL's rules:
arguments that differ between processes then give whatever those libraries give); the
engine's own comparison stays, as it costs nothing extra.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from ..collectives import COLLECTIVES

if TYPE_CHECKING:
    from types import ModuleType

    from mpi4py import MPI as _MPI

    from .._args import Prepared
    from .engine import Engine
    from .gpu import GpuSide
    from .links import Links
    from .placement import Placement
    from .waits import Waits

#: the paths whose calls agree here first (the engine's agree as they arrive)
AGREE_FIRST = ("mpi", "nccl", "auto")
#: bytes of a signature's text in the exchange that names a mismatch
TEXT_BYTES = 200
_MASK = (1 << 62) - 1


def check_enabled(value: str | None = None) -> bool:
    """Whether calls agree first: ``NCCLTREE_CHECK`` (``on``/``1``, the default, or
    ``off``/``0``)."""
    raw = os.environ.get("NCCLTREE_CHECK", "") if value is None else value
    v = raw.strip().lower()
    if v in ("", "on", "1"):
        return True
    if v in ("off", "0"):
        return False
    raise ValueError(f"NCCLTREE_CHECK must be 'on' or 'off' (or 1/0), got {raw!r}")


def call_signature(prep: Prepared) -> str:
    """What every process must pass alike: the collective, its op and root where it has
    them, count and dtype (whether a call is in place is each process's own business)."""
    coll = COLLECTIVES[prep.collective]
    return f"{coll.describe(prep.op, prep.root)} count={prep.count} dtype={prep.dtype.name}"


def refusal_signature(collective: str, exc: BaseException) -> str:
    """The signature of a call this process's own checks refused."""
    first = str(exc).splitlines()[0] if str(exc) else ""
    return f"{collective} refused by its own checks ({type(exc).__name__}: {first})"


def digest(sig: str) -> int:
    """A 62-bit digest of ``sig``, the same in every process (Python's ``hash`` is
    salted per process)."""
    h = int.from_bytes(hashlib.blake2b(sig.encode(), digest_size=8).digest(), "little")
    return h & _MASK


def mismatch_text(pl: Placement, sig: str, theirs: dict[int, str]) -> str:
    """The error every process raises: its own call first, then every other one that
    differs, by the ranks that made it."""
    lines = [f"collective arguments differ between processes: ranks {list(pl.ranks)} call {sig}"]
    for p, s in sorted(theirs.items()):
        if s != sig:
            lines.append(f"  ranks {pl.ranks_of(p)} call {s}")
    return "\n".join(lines)


class Agreement:
    """The agreement of one group's processes (see the module docstring). ``comm``: the
    group's control communicator (None without MPI: then ``arrive``, the node's arrival
    with a signature, or ``reduce``, the NCCL ``MAX`` of ``[h, -h]``, with ``gather``,
    every process's text by process, for a mismatch)."""

    def __init__(
        self,
        pl: Placement,
        comm: _MPI.Intracomm | None,
        mpi: ModuleType | None,
        waits: Waits,
        *,
        arrive: Callable[[str], None] | None = None,
        reduce: Callable[[int], tuple[int, int]] | None = None,
        gather: Callable[[object], list[object]] | None = None,
    ) -> None:
        self.pl = pl
        self.comm = comm
        self.mpi = mpi
        self.waits = waits
        self.enabled = check_enabled()
        self._send = np.zeros(2, np.int64)
        self._got = np.zeros(2, np.int64)
        self._digests: dict[str, int] = {}
        self._arrive = arrive
        self._reduce = reduce
        self._gather = gather
        #: agreement through the node's arrival (no MPI, one transport node)
        self.in_node = comm is None and arrive is not None

    def first(self, algorithm: str) -> bool:
        """Whether a call on ``algorithm`` (the one chosen, or the group's setting)
        agrees here before it runs."""
        if not (self.enabled and self.pl.nprocs > 1):
            return False
        if self.comm is not None:
            return algorithm in AGREE_FIRST
        if self.in_node:
            return algorithm == "nccl"  # the engine's calls agree as they arrive
        return True  # across nodes without MPI: the engine compares only within a node

    def check(self, sig: str, what: str = "the call's arguments") -> None:
        """Every process passes ``sig`` alike, or every one raises ``ValueError`` naming
        who passed what. Collective over the group's processes; bounded."""
        if self.pl.nprocs == 1:
            return
        if self.comm is None:
            self._check_without_mpi(sig, what)
            return
        h = self._digests.get(sig)
        if h is None:
            if len(self._digests) > 4096:
                self._digests.clear()
            h = self._digests[sig] = digest(sig)
        MPI = self.mpi
        assert MPI is not None
        self._send[0], self._send[1] = h, -h
        req = self.comm.Iallreduce([self._send, MPI.INT64_T], [self._got, MPI.INT64_T], MPI.MAX)
        self.waits.request(req, -1, f"the agreement on {what}")
        if self._got[0] == -self._got[1]:
            return
        raise ValueError(mismatch_text(self.pl, sig, self._texts(sig, what)))

    def _check_without_mpi(self, sig: str, what: str) -> None:
        if self._arrive is not None:
            self._arrive(sig)  # raises ValueError naming who differs
            return
        assert self._reduce is not None and self._gather is not None
        top, neg_bottom = self._reduce(digest(sig))
        if top == -neg_bottom:
            return
        # every process saw the mismatch: every one takes part in this exchange
        got = self._gather(sig[: TEXT_BYTES * 4])
        theirs = {p: str(t) for p, t in enumerate(got) if p != self.pl.proc}
        raise ValueError(mismatch_text(self.pl, sig, theirs))

    def _texts(self, sig: str, what: str) -> dict[int, str]:
        """Every process's signature (the rare second exchange, after a mismatch)."""
        assert self.comm is not None and self.mpi is not None
        mine = np.frombuffer(sig.encode()[:TEXT_BYTES].ljust(TEXT_BYTES, b"\0"), np.uint8)
        table = np.zeros((self.pl.nprocs, TEXT_BYTES), np.uint8)
        MPI = self.mpi
        req = self.comm.Iallgather([mine.copy(), MPI.BYTE], [table, MPI.BYTE])
        self.waits.request(req, -1, f"the texts of {what}")
        return {
            p: bytes(table[self.pl.mpi_rank_of_proc[p]]).rstrip(b"\0").decode(errors="replace")
            for p in range(self.pl.nprocs)
            if p != self.pl.proc
        }


def make_agreement(
    pl: Placement, links: Links, waits: Waits, engine: Engine, gpu: GpuSide | None
) -> Agreement:
    """The group's agreement: over its control communicator (MPI), else through the
    node's arrival (one transport node), else over NCCL (a GPU group across nodes)."""
    if links.ctl is not None:
        return Agreement(pl, links.ctl, links.mpi, waits)
    if len(set(pl.tnode_of_proc)) == 1:
        return Agreement(pl, None, None, waits, arrive=engine.refuse)
    assert gpu is not None  # host groups across nodes are refused without MPI
    return Agreement(pl, None, None, waits, reduce=gpu.agree, gather=links.gather)
