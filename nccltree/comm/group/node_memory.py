"""The node's shared memory of a process group: the control block, the arenas and the
symmetric buffers.

The **control block** (one segment per transport node, made by its first process,
attached by the others at bootstrap, then unlinked at once) holds the abort word, its
reason and the process it blames (claimed by the first process that fails or sees a
death: every other one reports the same), then one slot per process: its counters
(arrivals, progress, node syncs), its process id, its secret (the unguessable part of
its segments' names derives from it: :func:`.shm.name_part`), the generation and size
of its arena, the descriptor of its current call (by call parity: the signature and
where its ranks' buffers are), and on GPU groups the IPC handles of its arena (one per
generation) and of its newest symmetric buffer; after the slots, the point-to-point
mailboxes (:class:`~.p2p.Mailboxes`); after those, page-aligned, the payload slots of the
small calls (:mod:`.small`).

Each process's **arena** (a segment it creates, or GPU memory exported through CUDA IPC)
holds its mirrors and scratch; it grows by a new generation, which the node's other
processes map when they next need it; its creator unlinks a generation's name once every
process of the node mapped it (or a newer one). **Symmetric buffers** (``pg.empty``) are
made by every process of the node at once and mapped by all.

A process that is alone on its transport node keeps its control block in private memory.

When the group fails, the process that fails (or sees a death) first unlinks every name
of the node's segments it can derive (each process's arenas and symmetric buffers, from
the secrets in the control block): the node's other processes may be killed by their
launcher before they unlink their own.
"""

from __future__ import annotations

import atexit
import mmap
import os
import secrets
import signal
import threading
import time
import weakref
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING, cast

import numpy as np

from ... import _native
from ..._errors import CommError, PeerFailure
from ...backends.base import data_ptr
from .gpu import ARENA_TABLE_BYTES, DeviceBlock, PeerBlock, get_arena_handle, put_arena_handle
from .p2p import Mailboxes, mailbox_bytes
from .shm import (
    SHM_DIR,
    Segment,
    address,
    exit_without_finalize,
    name_for,
    name_part,
    remove_stale,
    segment_name,
)

if TYPE_CHECKING:
    from .gpu import GpuSide
    from .links import Links
    from .placement import Placement

Mem = Segment | DeviceBlock | PeerBlock  # shared host memory, or GPU memory over IPC
_Handler = Callable[[int, FrameType | None], object] | int | signal.Handlers

# control segment layout (one per node): the abort word and its reason, then a slot per
# process of the node
_ABORT = 0
ABORT_OFFSET = _ABORT  # (the small calls' native waits read it)
_REASON = 8
REASON_BYTES = 1024
_CLAIM = 2048  # a counter: who tells the node first (see set_abort)
_CULPRIT = 2056  # the process blamed, plus one (0: not known)
_SLOTS = 4096
_SLOT = 8192
_ARRIVE, _PROGRESS, _ACK, _SYNC = 0, 8, 16, 24  # counters (8 bytes each)
_PID, _ARENA_GEN, _ARENA_SIZE = 32, 40, 48  # int64
_DESC = (128, 2112)  # descriptor, by call parity
_IPC_HEAP = 4160  # ... of its newest symmetric buffer (pg.empty), and that one's size
_IPC_HEAP_SIZE = 4224
_IPC_BYTES = 64
_SECRET, SECRET_BYTES = 4352, 32  # names of the process's segments derive from it
_ARENA_MADE = 4384  # the newest generation of its arena created (maybe not yet published)
_IPC_ARENAS = 4416  # GPU groups: the arena's handle per generation (gpu.put_arena_handle)
assert _IPC_ARENAS + ARENA_TABLE_BYTES <= _SLOT
SIG_BYTES = 512
MAX_LOCAL_RANKS = 16
_DESC_LOC = SIG_BYTES + 16  # offset of the buffer locations in a descriptor

#: a process's call descriptor: (its bytes, its head: sequence number and signature
#: length, its buffer locations: per local rank (heap, offset) of its input and output)
Desc = tuple[memoryview, np.ndarray, np.ndarray]


class LauncherWatch:
    """MPICH's launcher run with ``-disable-auto-cleanup`` tells the survivors of a
    dead process with SIGUSR1, whose default action ends the process: where nobody
    handles SIGUSR1, note it instead, so the waits raise ``PeerFailure`` (restored
    at close)."""

    def __init__(self) -> None:
        self.reported = False
        self._old_usr1: _Handler | None = None

    def watch(self) -> None:
        """Handle SIGUSR1 from now on (where nobody else does, in the main thread)."""
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGUSR1) != signal.SIG_DFL:
            return

        def noted(signum: int, frame: FrameType | None) -> None:
            self.reported = True

        self._old_usr1 = signal.signal(signal.SIGUSR1, noted)

    def restore(self) -> None:
        if self._old_usr1 is not None:
            try:
                signal.signal(signal.SIGUSR1, self._old_usr1)
            except ValueError:  # not the main thread
                pass


class NodeMemory:
    """This process's view of its node's shared memory (see the module docstring).
    Bootstrap is collective over ``node_comm`` (the transport node's processes)."""

    def __init__(
        self, placement: Placement, links: Links, gpu: GpuSide | None, small_bytes: int = 0
    ) -> None:
        self.placement = placement
        self.small_bytes = small_bytes  # the small calls' payload slots (small.py)
        self.gpu = gpu
        self.arenas: dict[int, Mem] = {}  # the node's arenas (own and attached)
        self.arena_gen = dict.fromkeys(placement.node_procs, 0)
        self.pending_unlink: list[tuple[Segment, int]] = []
        self.heaps: list[dict[int, Mem]] = []  # pg.empty segments, by allocation
        self.heap_bases: list[int] = []  # their addresses in this process
        self.closed = False
        self._bootstrap(links)
        atexit.register(_leave_if_failed, weakref.ref(self))

    def _bootstrap(self, links: Links) -> None:
        """The node's control segment: made by its first process, attached by the others
        (barriers are allowed here, at bootstrap: the node's communicator's, or the
        group's bootstrap's, where every process of the group takes part), then unlinked
        at once."""
        pl = self.placement
        procs = pl.node_procs
        lead = links.node_lead
        size = _SLOTS + _SLOT * len(procs) + mailbox_bytes(len(procs))
        # the payload slots of the small calls (small.py), page-aligned, after the rest
        self.small_at = (size + 4095) // 4096 * 4096
        size = self.small_at + (self.small_bytes if pl.shm else 0)
        if not pl.shm:
            # a process of its own: its control block is private memory
            seg = Segment("", size, mmap.mmap(-1, size))
            seg.linked = False
        if pl.shm or links.group_wide:
            name: object = None
            if pl.shm and lead:
                remove_stale()
                seg = Segment.create(lambda: segment_name(pl.job, f"ctl{pl.node_index}"), size)
                name = seg.name
            name = links.node_share(name)
            if pl.shm and not lead:
                seg = Segment.attach(str(name))
            links.node_barrier()
            if pl.shm and lead:
                seg.unlink()
        self.ctl = seg
        self.slot_of = {p: i for i, p in enumerate(procs)}
        buf = seg.buf

        def counter(p: int, field: int) -> _native.Counter:
            return _native.Counter(buf, _SLOTS + _SLOT * self.slot_of[p] + field, shared=True)

        self.arrive = {p: counter(p, _ARRIVE) for p in procs}
        self.progress = {p: counter(p, _PROGRESS) for p in procs}
        self.sync = {p: counter(p, _SYNC) for p in procs}
        self.sync_n = 0
        # point-to-point within the node; also who mapped which arena (see settle_arenas)
        self.mail = Mailboxes(buf, _SLOTS + _SLOT * len(procs), procs)
        self._i64 = np.frombuffer(buf, np.int64, (_SLOTS + _SLOT * len(procs)) // 8)
        self._claim = _native.Counter(buf, _CLAIM, shared=True)
        self.slot_i64(pl.proc, _PID)[0] = os.getpid()
        self.secret = secrets.token_bytes(SECRET_BYTES)
        at = self._ipc_at(pl.proc, _SECRET)
        buf[at : at + SECRET_BYTES] = self.secret
        self.own_gen = self.slot_i64(pl.proc, _ARENA_GEN)

        def desc(p: int, parity: int) -> Desc:
            d = self._desc(p, parity)
            return (
                d,
                np.frombuffer(d, np.int64, 2),
                np.frombuffer(d, np.int64, MAX_LOCAL_RANKS * 4, _DESC_LOC),
            )

        self.peer_desc = {p: (desc(p, 0), desc(p, 1)) for p in procs}
        self.own_desc = self.peer_desc[pl.proc]
        self.desc_written: list[bytes | None] = [None, None]
        self.desc_loc_set = [True, True]  # (zeroed memory: write -1 the first time)
        self.peer_gen = {p: self.slot_i64(p, _ARENA_GEN) for p in procs}

    # -- the control block ----------------------------------------------------------------
    def slot_i64(self, p: int, field: int) -> np.ndarray:
        at = (_SLOTS + _SLOT * self.slot_of[p] + field) // 8
        return self._i64[at : at + 1]

    def _desc(self, p: int, parity: int) -> memoryview:
        at = _SLOTS + _SLOT * self.slot_of[p] + _DESC[parity]
        return memoryview(self.ctl.buf)[at : at + _DESC[1] - _DESC[0]]

    def pid(self, p: int) -> int:
        """The process id of the node's process ``p``."""
        return int(self.slot_i64(p, _PID)[0])

    def _ipc_at(self, p: int, field: int) -> int:
        return _SLOTS + _SLOT * self.slot_of[p] + field

    def abort_reason(self) -> str | None:
        """Why the group failed (None while the node was not told)."""
        if not int(self._i64[_ABORT // 8]):
            return None
        raw = bytes(self.ctl.buf[_REASON : _REASON + REASON_BYTES]).rstrip(b"\0")
        return raw.decode(errors="replace")

    def culprit(self) -> int | None:
        """The process the node's abort word blames (None: none, or not known)."""
        p = int(self._i64[_CULPRIT // 8]) - 1
        return p if p >= 0 and int(self._i64[_ABORT // 8]) else None

    def set_abort(self, reason: str, culprit: int | None) -> str:
        """Tell the node the group failed, why and because of which process (``culprit``,
        None when not known), unless another process told it first: the reason the node
        holds then. The first to claim the word (one atomic add) writes it; the others
        wait (at most a second) for its reason, so every process reports the same."""
        if self._claim.add_fetch(1) == 1:
            raw = reason.encode()[: REASON_BYTES - 1]
            self.ctl.buf[_REASON : _REASON + len(raw)] = raw
            self._i64[_CULPRIT // 8] = 0 if culprit is None else culprit + 1
            self._i64[_ABORT // 8] = 1
            return reason
        deadline = time.monotonic() + 1.0
        while (told := self.abort_reason()) is None and time.monotonic() < deadline:
            time.sleep(0.001)
        return reason if told is None else told

    # -- arenas ---------------------------------------------------------------------------
    def ensure_arena(self, need: int) -> None:
        """This process's arena, grown (a new generation) to hold ``need`` bytes."""
        me = self.placement.proc
        cur = self.arenas.get(me)
        if need == 0 or (cur is not None and cur.size >= need):
            return
        size = 1 << max(16, (need - 1).bit_length())
        gen = self.arena_gen[me] + 1
        if self.gpu is not None:
            # device memory; the old arena stays allocated until close (another process's
            # stream may still read it)
            blk = DeviceBlock(self.gpu.device, size)
            if cur is not None:
                self.gpu.retired.append(cast("DeviceBlock", cur))
            self.arenas[me] = blk
            self.arena_gen[me] = gen
            self.slot_i64(me, _ARENA_SIZE)[0] = size
            put_arena_handle(self.ctl.buf, self._ipc_at(me, _IPC_ARENAS), gen, size, blk.handle)
            return
        self.slot_i64(me, _ARENA_MADE)[0] = gen  # first: a failing peer unlinks its name
        seg = Segment.create(segment_name(self.placement.job, f"arena{gen}", self.secret), size)
        if cur is not None:
            cur.close()
        self.arenas[me] = seg
        self.arena_gen[me] = gen
        self.slot_i64(me, _ARENA_SIZE)[0] = size
        # a peer that failed meanwhile may have swept the node's names before this one
        # existed: nobody will map it now. (Its claim, an atomic add, comes before its
        # sweep; here the creating system calls come between the generation written
        # above and the claim read: one of the two sees the other.)
        if len(self.placement.node_procs) > 1 and not self._claim.value:
            self.pending_unlink.append((seg, gen))
        else:
            seg.unlink()

    def publish_gen(self) -> None:
        """Say which generation of its arena this process's current call uses."""
        self.own_gen[0] = self.arena_gen[self.placement.proc]

    def refresh_arenas(self) -> None:
        """Map the node's arenas that grew since the last call."""
        for q in self.placement.node_procs:
            if q != self.placement.proc:
                self.refresh_arena(q)

    def refresh_arena(self, q: int) -> None:
        """Map process ``q``'s arena if it grew, and say so in the mailboxes: its creator
        unlinks an arena's name once every process of the node mapped it or a newer one
        (send/recv map only their peers' arenas, when they need them)."""
        gen = int(self.peer_gen[q][0])
        if gen and self.arena_gen[q] != gen:
            old = self.arenas.pop(q, None)
            if old is not None:
                if self.gpu is not None:
                    self.gpu.wait_stream()  # this process's GPU may still read it
                old.close()
            if self.gpu is not None:
                # the block of the generation q named, not q's newest
                handle, size = get_arena_handle(self.ctl.buf, self._ipc_at(q, _IPC_ARENAS), gen)
                self.arenas[q] = PeerBlock(self.gpu.device, self.gpu.owner_ordinal(q), handle, size)
            else:
                try:
                    self.arenas[q] = Segment.attach(self.name_of(q, f"arena{gen}"))
                except CommError:
                    # a process that failed frees the node's names, having told the node
                    # first: its failure is the error, not the name found missing
                    reason = self.abort_reason()
                    if reason is None:
                        raise
                    raise PeerFailure(f"rank {self.placement.rank}: {reason}") from None
            self.arena_gen[q] = gen
            self.mail.set_mapped(q, self.placement.proc, gen)

    def settle_arenas(self) -> None:
        """Unlink this process's new arenas once every process of the node mapped them
        (or a newer one: a process maps only an arena's newest generation)."""
        keep = []
        me = self.placement.proc
        others = [p for p in self.placement.node_procs if p != me]
        for seg, gen in self.pending_unlink:
            if all(self.mail.mapped(me, p) >= gen for p in others):
                seg.unlink()
            else:
                keep.append((seg, gen))
        self.pending_unlink = keep

    def unlink_pending(self) -> None:
        """Free the names of this process's arenas not yet mapped everywhere."""
        for seg, _ in self.pending_unlink:
            seg.unlink()
        self.pending_unlink = []

    def secret_of(self, p: int) -> bytes:
        at = self._ipc_at(p, _SECRET)
        return bytes(self.ctl.buf[at : at + SECRET_BYTES])

    def name_of(self, p: int, what: str) -> str:
        """The name of the node's process ``p``'s segment ``what`` (``arena3``,
        ``heap0``), from its pid and secret in the control block."""
        part = name_part(self.secret_of(p), what)
        return name_for(self.placement.job, self.pid(p), part, what)

    def unlink_node_names(self) -> list[str]:
        """Unlink every name of the node's segments this process can derive (each
        process's arenas up to the newest generation made, and symmetric buffers up to one
        past this process's): only once the group failed, when nobody may map a new
        segment of it any more. Returns the names unlinked."""
        done: list[str] = []
        if not self.placement.shm or self.gpu is not None:
            return done
        heaps = len(self.heaps) + 2
        for p in self.placement.node_procs:
            if not self.pid(p) or not any(self.secret_of(p)):
                continue  # (not yet past bootstrap)
            made = int(self.slot_i64(p, _ARENA_MADE)[0])
            whats = [f"arena{g}" for g in range(1, made + 1)]
            whats += [f"heap{i}" for i in range(heaps)]
            for what in whats:
                name = self.name_of(p, what)
                try:
                    os.unlink(os.path.join(SHM_DIR, name))
                    done.append(name)
                except OSError:
                    pass
        return done

    # -- symmetric buffers ------------------------------------------------------------------
    def heap_of(self, arr: np.ndarray) -> tuple[int, int] | None:
        """(symmetric buffer, byte offset) of ``arr``'s data; None if it is in none."""
        if not self.heaps:
            return None
        p = data_ptr(arr)
        me = self.placement.proc
        for i, heap in enumerate(self.heaps):
            seg = heap[me]
            base = self.heap_bases[i]
            if base <= p < base + seg.size:
                return i, p - base
        return None

    def host_heap(self, nbytes: int, node_sync: Callable[[], None]) -> Segment:
        """A new symmetric buffer of ``nbytes`` in shared memory: this process's segment,
        every other process's mapped (``node_sync``: every process of the node got this
        far, called twice)."""
        pl = self.placement
        idx = len(self.heaps)
        own = Segment.create(segment_name(pl.job, f"heap{idx}", self.secret), nbytes)
        heap: dict[int, Mem] = {pl.proc: own}
        try:
            node_sync()
            for p in pl.node_procs:
                if p != pl.proc:
                    heap[p] = Segment.attach(self.name_of(p, f"heap{idx}"))
            node_sync()
        except BaseException:
            for mem in heap.values():
                mem.close()  # its name first: nobody maps it now
            raise
        own.unlink()
        self.heaps.append(heap)
        self.heap_bases.append(address(own))
        return own

    def gpu_heap(self, nbytes: int, node_sync: Callable[[], None]) -> DeviceBlock:
        """A new symmetric buffer in GPU memory: its IPC handle goes through the control
        block, once per buffer, and every process of the node opens the others'."""
        g = self.gpu
        assert g is not None
        pl = self.placement
        own = DeviceBlock(g.device, nbytes)
        heap: dict[int, Mem] = {pl.proc: own}
        at = self._ipc_at(pl.proc, _IPC_HEAP)
        self.ctl.buf[at : at + _IPC_BYTES] = own.handle
        self.slot_i64(pl.proc, _IPC_HEAP_SIZE)[0] = own.size
        node_sync()  # (bounded, and watching the node's processes, as every wait)
        for p in pl.node_procs:
            if p != pl.proc:
                at = self._ipc_at(p, _IPC_HEAP)
                handle = bytes(self.ctl.buf[at : at + _IPC_BYTES])
                size = int(self.slot_i64(p, _IPC_HEAP_SIZE)[0])
                heap[p] = PeerBlock(g.device, g.owner_ordinal(p), handle, size)
        node_sync()  # everybody read the handles: the fields may change again
        self.heaps.append(heap)
        self.heap_bases.append(own.ptr)
        return own

    def close(self) -> None:
        """Unmap everything (the names not yet unlinked go first). A node told of a
        failure makes this process leave at exit without finalizing (see
        :func:`_leave_if_failed`)."""
        if self.abort_reason() is not None:
            atexit.register(exit_without_finalize)
        self.closed = True
        for seg, _ in self.pending_unlink:
            seg.unlink()
        for mem in self.arenas.values():
            mem.close()
        for heap in self.heaps:
            for mem in heap.values():
                mem.close()
        self.ctl.close()


def _leave_if_failed(ref: weakref.ref[NodeMemory]) -> None:
    """At exit, a process whose group is still open on a node told of a failure (this
    process itself never saw it: it was elsewhere, or never came) leaves without
    ``MPI_Finalize``, which would wait for the failed processes."""
    mem = ref()
    if mem is not None and not mem.closed and mem.abort_reason() is not None:
        exit_without_finalize()
