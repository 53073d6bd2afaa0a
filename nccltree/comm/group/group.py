"""ProcessGroup: the collectives of a World whose ranks live in several processes.

Every process builds the same plan and cuts it into one schedule per process
(:mod:`.schedule`); each performs its own. Within a node, processes read and write each
other's buffers in shared memory and order their steps with progress counters there
(the C wait primitive: a short spin, then a futex; every wait bounded). Between nodes,
data and "I have got this far" notifications travel as non-blocking MPI point-to-point
messages. After bootstrap no MPI collective runs (except with ``algorithm="mpi"``), and
no payload between processes of one node goes through MPI.

One call, in one process:

1. the local arguments are checked and the plan's schedules looked up (cached);
2. the user's buffers that another process of the node reads or writes are copied into
   this process's shared arena ("mirrors"; buffers from :meth:`ProcessGroup.empty` are
   shared already and used in place);
3. the call's signature and buffer locations are published (shared memory within the
   node, a small message to every process of another node), and this process arrives;
4. every signature is compared with this process's own: a mismatch raises ``ValueError``
   on every process before any buffer is written (each process sees every signature, so
   all decide alike). This is the only round trip a call adds, and within a node it is
   the start fence the plan needs anyway: nobody may read a buffer before its owner
   arrived;
5. the schedule runs; the mirrors are copied back into the user's outputs.

Faults: every wait is bounded by the group's timeout and checks, while it waits, the
node's abort word (set by a process that failed) and whether the node's other processes
are still alive; a dead process raises ``PeerFailure`` naming its ranks, a process that
never arrives ``CommTimeout`` naming them. Either way the group is closed for good and
the flight recorder (the last collectives of this process) is printed.
"""

from __future__ import annotations

import mmap
import os
import re
import secrets
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from types import FrameType
from typing import TYPE_CHECKING, cast

import numpy as np

from ... import _native
from ..._errors import CommError, CommTimeout, PeerFailure
from ..._validate import check_index, check_int, check_real
from ...backends import devices as make_devices
from ...backends.base import Array, Device, carried_dtype, carry, data_ptr
from ...topology import Topology
from .. import debug
from .._args import Prepared, _device_array, check_call_dtype, prepare
from ..algorithms import ALGORITHMS, build_plan
from ..collectives import COLLECTIVES, collective_name
from ..executor import Buffers, Program
from ..faces import PointToPoint, RankCollectives
from ..flight import Entry, FlightRecorder
from ..plan import IN, OUT, STAGE, TMP, Plan, Step
from ..work import Work
from .gpu import DeviceBlock, GpuSide, PeerBlock, message_order
from .local import GroupComm, LocalRendezvous, run_local
from .mpi_collectives import mpi_reduces, mpi_type, run_mpi
from .p2p import TAG_ALL_TO_ALL, GroupP2p, Mailboxes, mailbox_bytes
from .schedule import RECV, Item, Schedule, split
from .staging import MIRROR, Staging
from .staging import plan as staged_plan

if TYPE_CHECKING:
    from mpi4py import MPI as _MPI
    from numpy.typing import DTypeLike

    from ...backends.base import Stream
    from ...backends.host import HostDevice
    from ...tree import Tree
from .shm import (
    Segment,
    address,
    alive,
    exit_without_finalize,
    name_for,
    remove_stale,
    segment_name,
    shm_usable,
    shm_usable_reason,
)

_Mem = Segment | DeviceBlock | PeerBlock  # shared host memory, or GPU memory over IPC
GROUP_ALGORITHMS = ("tree", "ring", "direct", "mpi", "nccl", "auto")
_GPU_SPEC = re.compile(r"gpu(:\d+)?")
#: ``auto`` hands messages of at most this many bytes per rank to MPI (see _choose)
AUTO_MPI_BYTES = 256 << 10
_Handler = Callable[[int, FrameType | None], object] | int | signal.Handlers
BASE = "base"  # an in-place rank's one buffer (its mirror holds the input and the output)


def _in_place_shape(collective: str, rank: int, count: int, size: int) -> tuple[int, int]:
    """In place: (where the input starts minus where the output starts, in elements; the
    elements of the one buffer holding both)."""
    coll = COLLECTIVES[collective]
    off_in, off_out = coll.in_place(rank, count, size)
    shift = off_in - off_out
    nin, nout = coll.in_count(count, size), coll.out_count(count, size)
    return shift, max(nin + max(shift, 0), nout + max(-shift, 0))


# control segment layout (one per node): the abort word and its reason, then a slot per
# process of the node
_ABORT = 0
_REASON = 8
_REASON_BYTES = 1024
_SLOTS = 4096
_SLOT = 8192
_ARRIVE, _PROGRESS, _ACK, _SYNC = 0, 8, 16, 24  # counters (8 bytes each)
_PID, _ARENA_GEN, _ARENA_SIZE = 32, 40, 48  # int64
_DESC = (128, 2112)  # descriptor, by call parity
_IPC_ARENA = 4096  # GPU groups: the IPC handle of the process's arena (64 bytes)
_IPC_HEAP = 4160  # ... of its newest symmetric buffer (pg.empty), and that one's size
_IPC_HEAP_SIZE = 4224
_IPC_BYTES = 64
_SIG_BYTES = 512
MAX_LOCAL_RANKS = 16
_DESC_LOC = _SIG_BYTES + 16  # offset of the buffer locations in a descriptor
_CTL_TAG_MOD = 1 << 14
_POLL = 0.01  # seconds between liveness checks while waiting
_MPI_SLICE = 0.0002  # seconds between MPI progress calls while sends are in flight


@dataclass
class _Run:
    """A stretch of a schedule: ``steps`` (a program of consecutive steps without waits,
    ``count`` of them), ``wait`` (the waits of ``item``) or ``send`` (``item``: a send or
    notify)."""

    kind: str
    program: Program | None = None
    item: Item | None = None
    count: int = 0
    recvs: tuple[int, ...] = ()  # kind "recv" (GPU groups): indices into the receives


_Requests = dict[tuple[int, int], "_MPI.Request"]


@dataclass
class _Compiled:
    plan: Plan
    scheds: list[Schedule]
    mine: Schedule
    # per same-node process q: (rank, role) -> offset (bytes) in q's arena, and its size
    layouts: dict[int, tuple[dict[tuple[int, str], int], int]]
    # runs of this process's items: ("steps", Program, first item) or ("item", Item)
    runs: list[_Run]
    writes: set[tuple[int, str]]  # (rank, role) that some step writes
    # the schedule with this process's user buffers staged range by range (staging.py);
    # None where that is not possible (then whole buffers are mirrored)
    staged_runs: list[_Run] | None = None
    staging: Staging | None = None
    sig: str = ""  # the call's signature, compared between processes
    sig_raw: bytes = b""
    # the buffers of every rank, as the last call left them (see _buffers), and what they
    # were made for: the node's arena generations and heap use
    arrays: list[dict[str, np.ndarray]] | None = None
    arrays_for: tuple[object, ...] = ()
    # this process's mirrors in its arena: (arena segment, {(rank, role): view})
    mirrors: tuple[_Mem | None, dict[tuple[int, str], np.ndarray]] = (None, {})
    # where the messages from other nodes land: every call's receives have completed when
    # it returns, so the next call of this signature reuses it (no fresh pages per call)
    recv_arena: Array | None = None


class ProcessGroup(RankCollectives, PointToPoint):
    """Ranks across processes and nodes (see the module docstring). Made by
    :func:`init_process_group`."""

    def __init__(
        self,
        comm: _MPI.Intracomm | None = None,
        devices: str = "cpu",
        algorithm: str = "auto",
        timeout: float = 60.0,
        shm: bool | None = None,
    ) -> None:
        if algorithm not in GROUP_ALGORITHMS:
            raise ValueError(
                f"unknown algorithm {algorithm!r} for a process group; accepted: "
                f"{', '.join(GROUP_ALGORITHMS)}"
            )
        self.algorithm = algorithm
        self.timeout = check_real(timeout, "timeout", min=0.0, min_open=True)
        gpu = isinstance(devices, str) and _GPU_SPEC.fullmatch(devices) is not None
        if not isinstance(devices, str) or not (
            devices == "cpu" or devices.startswith("cpu:") or gpu
        ):
            raise ValueError(
                f"devices must be 'cpu' (one rank in this process), 'cpu:N' (N ranks), "
                f"'gpu' (this process's GPU, picked by its index among its node's processes) "
                f"or 'gpu:K' (CUDA device K), got {devices!r}"
            )
        if gpu and algorithm == "mpi":
            raise ValueError(
                "algorithm='mpi' carries host arrays only; a GPU group accepts "
                "'nccl', 'tree', 'ring', 'direct' or 'auto'"
            )
        if not gpu and algorithm == "nccl":
            raise ValueError("algorithm='nccl' needs devices='gpu' (one GPU per process)")
        self.gpu = gpu
        nlocal = (
            1
            if devices == "cpu" or gpu
            else check_int(
                int(devices[4:]) if devices[4:].isdigit() else -1, "ranks in devices", min=1
            )
        )
        if nlocal > MAX_LOCAL_RANKS:
            raise ValueError(f"at most {MAX_LOCAL_RANKS} ranks per process, got {nlocal}")
        if comm is None:
            from mpi4py import MPI

            comm = MPI.COMM_WORLD
        self._comm = comm.Dup()  # our own message space: data and notifications
        self._ctl_comm = comm.Dup()  # signatures
        from mpi4py import MPI

        self._MPI = MPI
        nprocs = self._comm.Get_size()
        me = self._comm.Get_rank()
        node_name = os.environ.get("NCCLTREE_NODE") or MPI.Get_processor_name()
        job = secrets.token_hex(4) if me == 0 else None
        info = self._comm.allgather((node_name, nlocal, os.getpid(), shm_usable(shm)))
        job = self._comm.bcast(job, root=0)
        # processes numbered node-major: nodes in order of their first MPI rank
        order: list[str] = []
        for name, *_ in info:
            if name not in order:
                order.append(name)
        procs = sorted(range(nprocs), key=lambda i: (order.index(info[i][0]), i))
        self._mpi_rank_of_proc = procs
        self.proc = procs.index(me)
        self.nprocs = nprocs
        self._node_of_proc = [order.index(info[i][0]) for i in procs]
        self._nlocal_of_proc = [info[i][1] for i in procs]
        first = np.cumsum([0, *self._nlocal_of_proc]).tolist()
        self.size = int(first[-1])
        self.ranks = tuple(range(first[self.proc], first[self.proc + 1]))
        self._first_rank_of_proc = first[:-1]
        self._proc_of_rank = [p for p in range(nprocs) for _ in range(self._nlocal_of_proc[p])]
        self.node = node_name
        self.node_index = self._node_of_proc[self.proc]
        phys = [p for p in range(nprocs) if self._node_of_proc[p] == self.node_index]
        # shared memory within a node only where every process of the node can use it;
        # elsewhere each process is a "node" of its own for the transports (MPI between
        # all of them), while the topology keeps the real nodes
        self.shm = all(info[procs[p]][3] for p in phys)
        shm_nodes = {n for n in range(len(order))
                     if all(info[procs[p]][3] for p in range(nprocs) if self._node_of_proc[p] == n)}  # fmt: skip
        self._tnode_of_proc = [
            self._node_of_proc[p] if self._node_of_proc[p] in shm_nodes else len(order) + p
            for p in range(nprocs)
        ]
        if not self.shm and phys[0] == self.proc and len(phys) > 1:
            print(f"nccltree: {shm_usable_reason(shm)}: the processes of node {node_name} "
                  "exchange data over MPI instead of shared memory", file=sys.stderr,
                  flush=True)  # fmt: skip
        mine = self._tnode_of_proc[self.proc]
        self._node_procs = [p for p in range(nprocs) if self._tnode_of_proc[p] == mine]
        self._remote_procs = [p for p in range(nprocs) if p not in self._node_procs]
        node_ranks = [r for r in range(self.size) if self._proc_of_rank[r] in phys]
        self.rank = self.ranks[0]
        self.local_rank = self.rank - node_ranks[0]
        self.local_size = len(node_ranks)
        self.nodes = len(order)
        self._job = job
        # devices: this process's ranks; other ranks' steps never run here, but the
        # executor names a device per rank: they share this process's first
        threads = max(1, (os.cpu_count() or 1) // max(1, len(self._node_procs)))
        self._threads = threads
        self._gpu: GpuSide | None = None
        if gpu:
            self._gpu = GpuSide(self, devices, phys)
            self.devices: list[Device] = [self._gpu.device]
            self._all_devices = self._gpu.rank_devices
            self.topology = self._gpu.topology
        else:
            local_devs = cast("list[HostDevice]", make_devices(f"cpu:{nlocal}"))
            for d in local_devs:
                d.threads = max(1, threads // nlocal)
            self.devices = list(local_devs)
            self._all_devices = [
                local_devs[r - self.rank] if r in self.ranks else local_devs[0]
                for r in range(self.size)
            ]
            # topology: one memory within a node, the network between nodes
            self.topology = Topology.cluster(
                [self._node_of_proc[self._proc_of_rank[r]] for r in range(self.size)]
            )
        self._trees: dict[int, Tree] = {}
        self._compiled: dict[tuple[object, ...], _Compiled] = {}
        self._seq = 0  # collectives called (the flight recorder's numbering)
        self._arrivals = 0  # collectives that arrive through shared memory (not "mpi")
        self._base = dict.fromkeys(self._node_procs, 0)  # steps completed before this call
        self._closed = False
        self._failure: BaseException | None = None
        self._lock = threading.RLock()
        self.flight = FlightRecorder()
        self.sent_bytes = 0  # payload this process sent to other nodes (its own count)
        self._heaps: list[dict[int, _Mem]] = []  # pg.empty segments, by allocation
        self._heap_bases: list[int] = []  # their addresses in this process
        self._arenas: dict[int, _Mem] = {}  # the node's arenas (own and attached)
        self._arena_gen = dict.fromkeys(self._node_procs, 0)
        self._pending_unlink: list[tuple[Segment, int]] = []
        self._inflight: list[_MPI.Request] = []  # this call's sends not known finished
        self._stream: Stream | None = None  # the group's stream (async and stream calls)
        self._bootstrap_shm()
        if self._gpu is not None:
            self._gpu.connect()
        self._p2p = GroupP2p(self)
        # what split() gives the groups it makes: the same GPU, not one picked again
        self._spec = devices if self._gpu is None else f"gpu:{self._gpu.device.physical_id}"
        self._shm_arg = shm
        self._watch_launcher()
        self._local = LocalRendezvous(self)
        self._comms = [GroupComm(self, i) for i in range(len(self.ranks))]

    # -- bootstrap ------------------------------------------------------------------------
    def _bootstrap_shm(self) -> None:
        """The node's control segment: made by its first process, attached by the others
        (MPI barriers are allowed here, at bootstrap), then unlinked at once."""
        MPI = self._MPI
        self._node_comm = self._comm.Split(self._tnode_of_proc[self.proc], self.proc)
        lead = self._node_comm.Get_rank() == 0
        size = _SLOTS + _SLOT * len(self._node_procs) + mailbox_bytes(len(self._node_procs))
        if not self.shm:
            # a process of its own: its control block is private memory
            seg = Segment("", size, mmap.mmap(-1, size))
            seg.linked = False
        else:
            name = None
            if lead:
                remove_stale()
                seg = Segment.create(segment_name(self._job, f"ctl{self.node_index}"), size)
                name = seg.name
            name = self._node_comm.bcast(name, root=0)
            if not lead:
                seg = Segment.attach(name)
            self._node_comm.Barrier()
            if lead:
                seg.unlink()
        self._ctl = seg
        self._slot_of = {p: i for i, p in enumerate(self._node_procs)}
        buf = seg.buf

        def counter(p: int, field: int) -> _native.Counter:
            return _native.Counter(buf, _SLOTS + _SLOT * self._slot_of[p] + field, shared=True)

        self._arrive = {p: counter(p, _ARRIVE) for p in self._node_procs}
        self._progress = {p: counter(p, _PROGRESS) for p in self._node_procs}
        self._sync = {p: counter(p, _SYNC) for p in self._node_procs}
        self._sync_n = 0
        # point-to-point within the node; also who mapped which arena (see _settle_arenas)
        self._mail = Mailboxes(buf, _SLOTS + _SLOT * len(self._node_procs), self._node_procs)
        self._i64 = np.frombuffer(buf, np.int64, (_SLOTS + _SLOT * len(self._node_procs)) // 8)
        self._slot_i64(self.proc, _PID)[0] = os.getpid()
        self._own_gen = self._slot_i64(self.proc, _ARENA_GEN)

        def desc(p: int, parity: int) -> tuple[memoryview, np.ndarray, np.ndarray]:
            d = self._desc(p, parity)
            return (
                d,
                np.frombuffer(d, np.int64, 2),
                np.frombuffer(d, np.int64, MAX_LOCAL_RANKS * 4, _DESC_LOC),
            )

        self._peer_desc = {p: (desc(p, 0), desc(p, 1)) for p in self._node_procs}
        self._own_desc = self._peer_desc[self.proc]
        self._desc_written: list[bytes | None] = [None, None]
        self._desc_loc_set = [True, True]  # (zeroed memory: write -1 the first time)
        self._peer_gen = {p: self._slot_i64(p, _ARENA_GEN) for p in self._node_procs}
        del MPI

    def _watch_launcher(self) -> None:
        """MPICH's launcher run with ``-disable-auto-cleanup`` tells the survivors of a
        dead process with SIGUSR1, whose default action ends the process: where nobody
        handles SIGUSR1, note it instead, so the waits raise ``PeerFailure`` (restored
        at close)."""
        self._launcher_reported = False
        self._old_usr1: _Handler | None = None
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGUSR1) != signal.SIG_DFL:
            return

        def noted(signum: int, frame: FrameType | None) -> None:
            self._launcher_reported = True

        self._old_usr1 = signal.signal(signal.SIGUSR1, noted)

    def _slot_i64(self, p: int, field: int) -> np.ndarray:
        at = (_SLOTS + _SLOT * self._slot_of[p] + field) // 8
        return self._i64[at : at + 1]

    def _desc(self, p: int, parity: int) -> memoryview:
        at = _SLOTS + _SLOT * self._slot_of[p] + _DESC[parity]
        return memoryview(self._ctl.buf)[at : at + _DESC[1] - _DESC[0]]

    # -- life cycle -----------------------------------------------------------------------
    def close(self) -> None:
        """Release shared memory and the group's communicator. Collective within a node:
        it first waits (at most the timeout) for the node's other processes to close too,
        so that none still needs a segment about to go. Idempotent; after it,
        :func:`init_process_group` may be called again."""
        if self._closed:
            return
        if self._failure is None and len(self._node_procs) > 1:
            # closing is collective: wait (bounded) until every process of the node is
            # here, so each has mapped the arenas a last call made before their creator
            # unlinks them below
            try:
                self._node_sync()
            except (PeerFailure, CommTimeout):
                pass
        self._closed = True
        if self._gpu is not None:
            self._gpu.close()  # its stream finished first: nothing uses the blocks below
        self._p2p.close()
        for seg, _ in self._pending_unlink:
            seg.unlink()
        for mem in self._arenas.values():
            mem.close()
        for heap in self._heaps:
            for mem in heap.values():
                mem.close()
        self._ctl.close()
        if self._old_usr1 is not None:
            try:
                signal.signal(signal.SIGUSR1, self._old_usr1)
            except ValueError:  # not the main thread
                pass
        for c in (self._node_comm, self._ctl_comm, self._comm):
            try:
                c.Free()
            except Exception:  # noqa: BLE001 - best effort at teardown
                pass
        global _current
        if _current is self:
            _current = None

    def __enter__(self) -> ProcessGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_usable(self) -> None:
        if self._closed:
            raise CommError("the process group is closed")
        if self._failure is not None:
            raise PeerFailure(f"the process group failed earlier: {self._failure}")

    @property
    def aborted(self) -> bool:
        """Whether the group failed or was aborted (closed for good)."""
        return self._failure is not None

    def abort(self, reason: str = "aborted by the caller") -> None:
        """Fail the group now: this process's ranks waiting in a collective, and the
        node's other processes, raise ``PeerFailure``."""
        self._fail(CommError(reason))
        self._local.abort(CommError(reason))

    def comm(self, index: int) -> GroupComm:
        """The per-rank face of this process's ``index``-th rank (``ranks[index]``), used
        from that rank's own thread."""
        return self._comms[check_index(index, "local rank index", len(self.ranks))]

    def run(self, fn: Callable[..., object], *args: object) -> list[object]:
        """``fn(pg.comm(i), *args)`` in a thread per rank of this process; each result."""
        self._check_usable()
        return run_local(self, fn, *args)

    # -- public collectives (one rank per process) ---------------------------------------
    def _one(self, name: str) -> None:
        if len(self.ranks) != 1:
            raise ValueError(
                f"{name}: this process holds {len(self.ranks)} ranks; call the collectives "
                f"of each from its own thread through pg.comm(i), or pass a list per rank "
                f"to pg.call"
            )

    def _call(
        self,
        collective: str,
        x: np.ndarray,
        out: np.ndarray | None,
        op: str,
        root: int,
        stream: Stream | None = None,
        async_op: bool = False,
        dtype: DTypeLike | None = None,
    ) -> np.ndarray | Work:
        """One rank per process: a synchronous call, or (``stream``/``async_op``, as for
        ``Comm``) one run on the group's own stream, a worker thread, ordered after the
        work ``stream`` holds (else after what this thread did, as host calls are), with
        ``stream`` (else the returned ``Work``) ordered after it. Calls keep their order:
        a synchronous one first waits for those in flight. Arguments are checked before
        the call returns; a fault surfaces from ``Work.synchronize``/``result``, and the
        group's later calls fail. ``dtype``: as for a World's collectives."""
        self._one(collective)
        if self._gpu is not None:
            return self._gpu_call(collective, x, out, op, root, stream, async_op, dtype)
        if not async_op and stream is None:
            outs = None if out is None else [out]
            return self.call(collective, [x], outs, op=op, root=root, dtype=dtype)[0]
        with self._lock:
            prep = self._prepare(collective, [x], None if out is None else [out], op, root, dtype)
            return self._enqueue(prep, stream, async_op)

    def _gpu_call(
        self,
        collective: str,
        x: Array,
        out: Array | None,
        op: str,
        root: int,
        stream: Stream | None,
        async_op: bool,
        dtype: DTypeLike | None = None,
    ) -> Array | Work:
        """A GPU group's call: issued on the group's stream after the work of ``stream``
        (default: the caller's current stream); ``stream`` is ordered after it unless
        ``async_op``, which returns a ``Work`` instead. The host returns once the work is
        issued. ``dtype="bfloat16"``: the ``uint16`` CuPy arrays hold bfloat16."""
        g = self._gpu
        assert g is not None
        with self._lock:
            prep = self._prepare(collective, [x], None if out is None else [out], op, root, dtype)
            caller = stream if stream is not None else self.devices[0].current_stream()
            g.caller, g.caller_waits = caller, not async_op
            try:
                self._perform(prep)
            finally:
                g.caller, g.caller_waits = None, True
            result = prep.results[0]
            if async_op:
                assert g.last_end is not None
                return Work([g.last_end], [caller], result, prep, self.timeout)
            return result

    # -- point-to-point (p2p.py) ---------------------------------------------------------
    def _post_p2p(
        self, kind: str, buf: Array, peer: int, stream: Stream | None, dtype: DTypeLike | None
    ) -> None:
        buf = _p2p_buffer(self, buf, kind, dtype)
        self._p2p.drain()
        with self._lock:
            self._p2p.post(kind, buf, peer, stream)

    def batch(self) -> AbstractContextManager[None]:
        return self._p2p.batch()

    def all_to_all_v(
        self,
        x: Array,
        out: Array,
        send_counts: Sequence[int],
        recv_counts: Sequence[int],
        *,
        stream: Stream | None = None,
        dtype: DTypeLike | None = None,
    ) -> Array:
        """all_to_all with uneven blocks, one rank per process: ``x`` holds this rank's
        blocks for ranks 0, 1, ... (``send_counts[q]`` elements for rank q), ``out``
        receives rank p's block at the place its ``recv_counts`` give (rank p's
        ``send_counts[me]`` must equal ``recv_counts[p]``: each side says its own). One
        batch of sends and receives (p2p.py): within the node through the arenas (shared
        memory; CUDA IPC on GPUs), to other nodes as MPI messages (host arrays) or NCCL
        sends and receives (CuPy arrays). Blocks meet in one order with the pair's
        send/recv: every rank calls it at the same point of its exchanges with each peer.
        A block of another size than its receiver expects raises ``ValueError`` (within
        the node on both sides, the group going on). Returns ``out``."""
        sc = [check_int(c, "send_counts[i]", min=0) for c in send_counts]
        rc = [check_int(c, "recv_counts[i]", min=0) for c in recv_counts]
        if len(sc) != self.size or len(rc) != self.size:
            raise ValueError(
                f"send_counts and recv_counts need a count per rank ({self.size}), got "
                f"{len(sc)} and {len(rc)}"
            )
        self._one("all_to_all_v")
        dev = self.devices[0]
        xa = _device_array(dev, x, f"rank {self.rank}: input").reshape(-1)
        oa = _device_array(dev, out, f"rank {self.rank}: output").reshape(-1)
        if xa.size != sum(sc) or oa.size != sum(rc):
            raise ValueError(
                f"rank {self.rank}: the input needs {sum(sc)} elements (send_counts) and "
                f"the output {sum(rc)} (recv_counts), got {xa.size} and {oa.size}"
            )
        if xa.dtype != oa.dtype:
            raise TypeError(f"rank {self.rank}: output dtype {oa.dtype} differs from {xa.dtype}")
        xa = _p2p_buffer(self, xa, "input", dtype)
        oa = _p2p_buffer(self, oa, "output", dtype)
        sd = np.cumsum([0, *sc[:-1]]).tolist()
        rd = np.cumsum([0, *rc[:-1]]).tolist()
        p2p = self._p2p
        # empty blocks travel too (a size mismatch is then seen), except over NCCL, which
        # orders nothing for them
        nccl = self._gpu is not None
        with p2p.batch(), self._lock:
            self._check_usable()
            self._seq += 1
            where = "p2p" if all(p2p.local(q) for q in range(self.size)) else "p2p-net"
            entry = self.flight.start(self._seq, "all_to_all_v", xa.size, xa.dtype, where)
            for q in range(self.size):
                if sc[q] or not (nccl and not p2p.local(q)):
                    blk = xa[sd[q] : sd[q] + sc[q]]
                    p2p.post("send", blk, q, stream, entry, TAG_ALL_TO_ALL)
            for q in range(self.size):
                if rc[q] or not (nccl and not p2p.local(q)):
                    blk = oa[rd[q] : rd[q] + rc[q]]
                    p2p.post("recv", blk, q, stream, entry, TAG_ALL_TO_ALL)
        return out

    def split(self, color: int | None, key: int = 0) -> ProcessGroup | None:
        """MPI's ``Comm_split`` over the group's processes: every process calls it (in the
        same order as the group's collectives); the processes of one ``color`` form a new
        group (its own communicator, shared memory, plans and, on GPUs, the same GPU),
        None for color None. Within a node the new group orders processes by ``(key,
        rank)``; ranks stay node-major. The new group is independent: close it when done
        (closing this one does not). One rank per process; the split itself is an MPI
        collective, as the bootstrap is."""
        self._check_usable()
        self._one("split")
        MPI = self._MPI
        c = MPI.UNDEFINED if color is None else check_int(color, "color", min=0)
        k = check_int(key, "key", min=0)
        # MPI orders by key, then by rank in the parent: the group's rank breaks ties
        sub = self._comm.Split(c, k * self.size + self.rank)
        if sub == MPI.COMM_NULL:
            return None
        try:
            return ProcessGroup(
                cast("_MPI.Intracomm", sub), self._spec, self.algorithm, self.timeout,
                self._shm_arg,
            )  # fmt: skip
        finally:
            sub.Free()  # the group keeps its own duplicates

    def new_group(self, ranks: Sequence[int]) -> ProcessGroup | None:
        """The group of ``ranks`` (ordered as given within a node), from :meth:`split`:
        every process calls it with the same ``ranks``; those outside get None."""
        picked = [check_index(r, "a rank of the group", self.size) for r in ranks]
        if len(set(picked)) != len(picked) or not picked:
            raise ValueError(f"ranks of a group must be distinct and not empty, got {ranks!r}")
        if self.rank not in picked:
            return self.split(None)
        return self.split(0, picked.index(self.rank))

    def barrier(self) -> None:
        """Every rank of the group has arrived (a one-element all_reduce)."""
        if self._gpu is not None:
            x = self.devices[0].zeros(1, np.float32)
            self.call("all_reduce", [x])
            self._gpu.wait_end()
            return
        xs = [np.zeros(1, np.float32) for _ in self.ranks]
        self.call("all_reduce", xs)

    def empty(self, shape: int | Sequence[int], dtype: DTypeLike = np.float32) -> np.ndarray:
        """A symmetric buffer: an array in shared memory that the node's other processes
        read and write in place (no staging). Collective: every process of the group
        calls it, in the same order, with the same shape and dtype."""
        self._check_usable()
        shape_t = (shape,) if isinstance(shape, int) else tuple(shape)
        dt = np.dtype(dtype)
        if self._gpu is not None:
            return self._gpu_empty(shape_t, dt)
        if len(self._node_procs) == 1:
            # no process shares this one's memory (alone on its node, or shared memory off)
            return np.zeros(shape_t, dt)
        nbytes = max(1, int(np.prod(shape_t)) * dt.itemsize)
        idx = len(self._heaps)
        own = Segment.create(segment_name(self._job, f"heap{idx}"), nbytes)
        heap: dict[int, _Mem] = {self.proc: own}
        self._node_sync()
        for p in self._node_procs:
            if p != self.proc:
                pid = int(self._slot_i64(p, _PID)[0])
                heap[p] = Segment.attach(name_for(self._job, pid, f"heap{idx}"))
        self._node_sync()
        own.unlink()
        self._heaps.append(heap)
        self._heap_bases.append(address(own))
        return np.frombuffer(own.buf, dt, int(np.prod(shape_t))).reshape(shape_t)

    def _gpu_empty(self, shape: tuple[int, ...], dt: np.dtype) -> Array:
        """``empty`` of a GPU group: device memory whose IPC handle every process of the
        node opens (the handles travel through the control segment, once per buffer)."""
        g = self._gpu
        assert g is not None
        count = int(np.prod(shape))
        if len(self._node_procs) == 1:
            return self.devices[0].empty(shape, dt)
        own = DeviceBlock(g.device, max(1, count * dt.itemsize))
        heap: dict[int, _Mem] = {self.proc: own}
        at = _SLOTS + _SLOT * self._slot_of[self.proc] + _IPC_HEAP
        self._ctl.buf[at : at + _IPC_BYTES] = own.handle
        self._slot_i64(self.proc, _IPC_HEAP_SIZE)[0] = own.size
        self._node_sync()  # (bounded, and watching the node's processes, as every wait)
        for p in self._node_procs:
            if p != self.proc:
                at = _SLOTS + _SLOT * self._slot_of[p] + _IPC_HEAP
                handle = bytes(self._ctl.buf[at : at + _IPC_BYTES])
                size = int(self._slot_i64(p, _IPC_HEAP_SIZE)[0])
                heap[p] = PeerBlock(g.device, g.owner_ordinal(p), handle, size)
        self._node_sync()  # everybody read the handles: the fields may change again
        self._heaps.append(heap)
        self._heap_bases.append(own.ptr)
        return own.view(dt, count, 0).reshape(shape)

    def _node_sync(self) -> None:
        """Every process of the node got this far (a symmetric allocation); a dead or
        absent process fails the group, as in a collective."""
        self._sync_n += 1
        self._sync[self.proc].add(1)
        try:
            for p in self._node_procs:
                self._wait_counter(self._sync[p], self._sync_n, p, "a shared-memory allocation")
        except (PeerFailure, CommTimeout) as exc:
            self._fail(exc)
            raise

    # -- the engine -----------------------------------------------------------------------
    def call(
        self,
        collective: str,
        xs: Sequence[np.ndarray],
        outs: Sequence[np.ndarray] | None = None,
        *,
        op: str = "sum",
        root: int = 0,
        dtype: DTypeLike | None = None,
    ) -> list[np.ndarray]:
        """A collective with one array per rank of this process (``xs[i]`` for rank
        ``ranks[i]``), synchronous; returns each rank's result. ``dtype``: as for a
        World's collectives (``"bfloat16"`` for ``uint16`` arrays of its bits)."""
        if self._stream is not None:
            # the calls in flight first (outside the lock, which their runs take)
            self._stream.synchronize(self.timeout)
        with self._lock:
            prep = self._prepare(collective, xs, outs, op, root, dtype)
            self._perform(prep)
            return cast("list[np.ndarray]", prep.results)

    def _prepare(
        self,
        collective: str,
        xs: Sequence[np.ndarray],
        outs: Sequence[np.ndarray] | None,
        op: str,
        root: int,
        dtype: object = None,
    ) -> Prepared:
        self._check_usable()
        return prepare(
            self.devices, collective_name(collective), list(xs),
            None if outs is None else list(outs), op, root, ranks=self.ranks, size=self.size,
            dtype=dtype,
        )  # fmt: skip

    def _perform(self, prep: Prepared) -> None:
        with self._lock:
            self._check_usable()
            algorithm = self._choose(prep)
            self._seq += 1
            entry = self.flight.start(self._seq, prep.collective, prep.count, prep.dtype, algorithm)
            debug.trace_call(f"process group rank {self.rank} #{self._seq}", prep, algorithm)
            try:
                if algorithm == "mpi":
                    run_mpi(self, prep, entry)
                elif algorithm == "nccl":
                    assert self._gpu is not None
                    self._gpu.run_nccl(prep)
                else:
                    self._run(algorithm, prep, entry)
            except (ValueError, TypeError):
                entry.state = "argument error"
                raise
            except BaseException as exc:
                entry.state = f"failed: {type(exc).__name__}"
                if self._gpu is not None and self._gpu.engine is not None:
                    self._gpu.engine.close(abort=True)
                self._fail(exc)
                self._local.abort(exc)
                raise
            entry.state = "done"
            entry.ended = time.monotonic()

    def _enqueue(self, prep: Prepared, stream: Stream | None, async_op: bool) -> np.ndarray | Work:
        """The call of this process's one rank on the group's stream (see _call)."""
        if self._stream is None:
            self._stream = self.devices[0].new_stream()
        caller = stream if stream is not None else self.devices[0].explicit_current_stream()
        if caller is not None:
            self._stream.wait_event(caller.record())
        self._stream.call(self._perform, prep)
        done = self._stream.record()
        result = cast("np.ndarray", prep.results[0])
        if async_op:
            return Work([done], [caller], result, prep, self.timeout, self._stream_error)
        assert caller is not None  # a stream was given
        caller.wait_event(done)
        return result

    def _stream_error(self, exc: BaseException) -> BaseException:
        """A call that failed on the group's stream: its own error."""
        return exc

    def _choose(self, prep: Prepared) -> str:
        """``auto``: MPI's own collectives for small messages where MPI can run the call
        (one rank per process, MPI's rank order the group's, no float16 reduction): a
        call through the shared-memory engine pays a signature handshake and a few
        Python steps, tens of microseconds, where MPICH's shared-memory collectives take
        a few (measured: docs/performance.md#process-groups). Above that, the tree
        across nodes (it crosses each node boundary once) and direct within one node
        (the fewest bytes)."""
        if self.algorithm != "auto":
            return self.algorithm
        if self._gpu is not None:
            if self._gpu.nccl_ok:
                return "nccl"
            return "tree" if self.nodes > 1 else "direct"
        if (
            prep.nbytes <= AUTO_MPI_BYTES
            and len(self.ranks) == 1
            and self._mpi_rank_of_proc == list(range(self.nprocs))
            and not (COLLECTIVES[prep.collective].reduces and not mpi_reduces(prep.dtype))
        ):
            return "mpi"
        return "tree" if self.nodes > 1 else "direct"

    def tree(self, root: int = 0) -> Tree:
        root = check_index(root, "root", self.size)
        if root not in self._trees:
            from ...tree import build_tree

            self._trees[root] = build_tree(self.topology, root=root)
        return self._trees[root]

    def plan(self, collective: str, count: int, *, algorithm: str = "tree", op: str = "sum",
             root: int = 0, in_place: bool = False, dtype: DTypeLike = np.float32) -> Plan:  # fmt: skip
        """The plan a call runs (every process builds the same)."""
        return build_plan(
            algorithm, collective_name(collective), size=self.size, count=count, op=op,
            root=root, in_place=in_place, chunk=max(1, (16 << 20) // np.dtype(dtype).itemsize),
            tree_for=self.tree, itemsize=np.dtype(dtype).itemsize,
        )  # fmt: skip

    def _compile(self, algorithm: str, prep: Prepared, in_place: bool) -> _Compiled:
        # the dtype itself, not its size: the compiled call keeps typed views and the
        # signature
        key = (algorithm, prep.collective, prep.count, prep.op, prep.root, in_place,
               prep.dtype.str, prep.array_dtype.str)  # fmt: skip
        got = self._compiled.get(key)
        if got is not None:
            return got
        if algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm {algorithm!r} has no plan")
        plan = self.plan(prep.collective, prep.count, algorithm=algorithm, op=prep.op,
                         root=prep.root, in_place=in_place, dtype=prep.dtype)  # fmt: skip
        scheds = split(plan, self._proc_of_rank, self._tnode_of_proc)
        mine = scheds[self.proc]
        coll = COLLECTIVES[prep.collective]
        n = self.size
        item = prep.dtype.itemsize
        extents = {
            IN: [coll.in_count(prep.count, n)] * n,
            OUT: [coll.out_count(prep.count, n)] * n,
            TMP: [plan.scratch.get(r, 0) for r in range(n)],
            STAGE: [plan.stage.get(r, 0) for r in range(n)],
            RECV: [mine.arena] * n,
        }
        layouts = {}
        for q in self._node_procs:
            lay: dict[tuple[int, str], int] = {}
            off = 0
            for r in range(n):
                if self._proc_of_rank[r] != q:
                    continue
                exposed = scheds[q].exposed
                roles = [TMP, STAGE]
                if not in_place:
                    roles += [role for role in (IN, OUT) if (r, role) in exposed]
                for role in roles:
                    cnt = extents[role][r]
                    if cnt:
                        lay[(r, role)] = off
                        off += -(-cnt * item // 256) * 256
                if in_place and ((r, IN) in exposed or (r, OUT) in exposed):
                    # one mirror for the one buffer: input and output at their in-place
                    # offsets inside it (all_gather: the input inside the output;
                    # reduce_scatter: the output inside the input)
                    shift, base = _in_place_shape(prep.collective, r, prep.count, n)
                    lay[(r, BASE)] = off
                    lay[(r, IN)] = off + max(shift, 0) * item
                    lay[(r, OUT)] = off + max(-shift, 0) * item
                    off += -(-base * item // 256) * 256
            layouts[q] = (lay, off)
        # GPU groups across nodes: NCCL receives at their place in the global order
        recv_before: dict[int, tuple[int, ...]] = {}
        if self._gpu is not None and self._gpu.sync_mode and mine.recvs:
            pending: list[int] = []
            for kind, i in message_order(scheds, self.proc):
                if kind == "recv":
                    pending.append(i)
                elif pending:
                    recv_before[i] = tuple(pending)
                    pending = []
            if pending:
                recv_before[len(mine.items)] = tuple(pending)
        # this process's items, consecutive steps without waits fused into one program
        runs = self._runs(plan, mine.items, extents, None, recv_before, prep.carried)
        exec_proc = [0] * len(plan.data_steps())
        for p, sched in enumerate(scheds):
            for it in sched.items:
                if it.kind == "step":
                    exec_proc[it.index] = p
        mirrored: dict[tuple[int, str], int] = {}
        one_buffer = set()
        lay = layouts[self.proc][0]
        for r in self.ranks:
            if in_place and (r, BASE) in lay:
                shift, _ = _in_place_shape(prep.collective, r, prep.count, n)
                mirrored[(r, IN)], mirrored[(r, OUT)] = max(shift, 0), max(-shift, 0)
                one_buffer.add(r)
            elif not in_place:
                mirrored.update({(r, role): 0 for role in (IN, OUT) if (r, role) in lay})
        staging = staged_plan(
            plan.data_steps(), exec_proc, mine.items, self.proc, set(self._node_procs),
            mirrored, one_buffer,
        )  # fmt: skip
        staged_runs = None
        if staging is not None:
            extents = {**extents, MIRROR[IN]: extents[IN], MIRROR[OUT]: extents[OUT]}
            staged_runs = self._runs(plan, mine.items, extents, staging, recv_before, prep.carried)
        writes = {(s.dst.rank, s.dst.role) for s in plan.steps if s.dst is not None}
        got = _Compiled(plan, scheds, mine, layouts, runs, writes, staged_runs, staging)
        got.sig = (
            f"{prep.collective} count={prep.count} dtype={prep.dtype.name} op={prep.op} "
            f"root={prep.root} in_place={in_place} algorithm={algorithm}"
        )
        got.sig_raw = got.sig.encode()[:_SIG_BYTES]
        self._compiled[key] = got
        if debug.info_enabled():
            debug.log.info(
                debug.plan_line(plan, item, f"process group rank {self.rank}")
                + f"; this process: {len(mine.items)} items, {len(mine.recvs)} messages in, "
                f"{sum(it.kind in ('send', 'notify') for it in mine.items)} out"
            )
        return got

    def _runs(
        self,
        plan: Plan,
        items: Sequence[Item],
        extents: dict[str, list[int]],
        staging: Staging | None,
        recv_before: dict[int, tuple[int, ...]],
        carried: np.dtype | None = None,
    ) -> list[_Run]:
        """This process's items as runs: consecutive steps without waits fused into one
        program; with ``staging``, its steps and sends rewritten (staging.py); receives
        (GPU groups across nodes) placed before the items ``recv_before`` names;
        ``carried``: the dtype the arrays carry, for the programs to name (see
        :class:`~nccltree.comm.executor.Program`)."""
        n = plan.size
        runs: list[_Run] = []
        group: list[Item] = []

        def steps_of(it: Item) -> list[Step]:
            assert it.step is not None
            if staging is None:
                return [it.step]
            return staging.steps.get(it.index, [it.step])

        def flush() -> None:
            if group:
                steps = [st for it in group for st in steps_of(it)]
                sub = Plan(n, steps, 0, dict(plan.scratch), dict(plan.stage), plan.same_buffer)
                runs.append(
                    _Run(
                        "steps", Program(sub, self._all_devices, extents, carried), None, len(group)
                    )
                )
                group.clear()

        for k, it in enumerate(items):
            if k in recv_before:
                flush()
                runs.append(_Run("recv", recvs=recv_before[k]))
            if it.kind == "step" and not it.waits and not it.recvs:
                group.append(it)
                continue
            flush()
            if it.kind in ("step", "end"):
                runs.append(_Run("wait", item=it))
                if it.kind == "step":
                    group.append(it)
            else:
                src = staging.sends.get(k) if staging is not None else None
                runs.append(_Run("send", item=it if src is None else replace(it, src=src)))
        flush()
        if len(items) in recv_before:
            runs.append(_Run("recv", recvs=recv_before[len(items)]))
        return runs

    def _run(self, algorithm: str, prep: Prepared, entry: Entry) -> None:
        coll = COLLECTIVES[prep.collective]
        # a rooted call whose output is the root's only: in place there is planned as out of
        # place (the root's output is made distinct memory, then copied back)
        in_place = prep.in_place and not coll.root_output
        c = self._compile(algorithm, prep, in_place)
        g = self._gpu
        if g is not None:
            if g.ipc_problem:
                raise CommError(g.ipc_problem)
            g.begin()
        self._arrivals += 1
        seq = self._arrivals
        dt = prep.array_dtype  # the arrays' (uint16 CuPy arrays that carry bfloat16)
        sig = c.sig
        # 1. this process's arena, grown (a new segment) when the call needs more
        self._ensure_arena(c.layouts[self.proc][1])
        arena = self._arenas.get(self.proc)
        if c.mirrors[0] is not arena:
            c.mirrors = (arena, {})
        mirrors = c.mirrors[1]
        heaps = bool(self._heaps)
        # 2. where this process's ranks' buffers are, and the mirrors filled
        ins = {r: prep.ins[i] for i, r in enumerate(self.ranks)}
        outs = {r: prep.outs[i] for i, r in enumerate(self.ranks)}
        if coll.root_output and prep.in_place and prep.root in ins:
            i = self.ranks.index(prep.root)
            outs[prep.root] = self.devices[i].empty(prep.outs[i].shape, dt)
        lay = c.layouts[self.proc][0]
        loc = np.full((MAX_LOCAL_RANKS, 4), -1, np.int64) if heaps else None
        copy_back: list[tuple[np.ndarray, np.ndarray]] = []
        mine_in: dict[int, np.ndarray] = {}
        mine_out: dict[int, np.ndarray] = {}
        own_heap = heaps and any(
            self._heap_of(a) is not None for r in self.ranks for a in (ins[r], outs[r])
        )
        # user buffers staged range by range where the schedule allows (staging.py);
        # symmetric buffers are used in place; else whole buffers are mirrored
        staged = c.staging is not None and not own_heap
        extra: dict[int, dict[str, np.ndarray]] = {}
        if staged:
            self._stage(c, prep, ins, outs, mirrors, arena, copy_back, mine_in, mine_out, extra)
        for i, r in enumerate(self.ranks):
            if staged:
                break
            user_in, user_out = ins[r], outs[r]
            if user_out is not prep.outs[i]:  # the root's output made distinct (see above)
                copy_back.append((prep.outs[i], user_out))
            if in_place:
                base_user = user_out if user_out.size >= user_in.size else user_in
                hin = self._heap_of(user_in) if heaps else None
                hout = self._heap_of(user_out) if heaps else None
                if hin is not None and hout is not None:
                    assert loc is not None
                    loc[i] = (*hin, *hout)
                    mine_in[r], mine_out[r] = user_in, user_out
                elif (r, IN) in lay:
                    m = self._base_mirror(prep, r, lay, arena, mirrors)
                    mine_in[r], mine_out[r] = mirrors[(r, IN)], mirrors[(r, OUT)]
                    self._copy(mine_in[r], user_in)
                    if (r, IN) in c.writes or (r, OUT) in c.writes:
                        copy_back.insert(0, (base_user, m))
                else:
                    mine_in[r], mine_out[r] = user_in, user_out
                continue
            for j, role in enumerate((IN, OUT)):
                arr = user_in if role == IN else user_out
                table = mine_in if role == IN else mine_out
                heap = self._heap_of(arr) if heaps else None
                if heap is not None:
                    assert loc is not None
                    loc[i, 2 * j], loc[i, 2 * j + 1] = heap
                    table[r] = arr
                elif (r, role) in lay:
                    m = self._role_mirror(prep, r, role, arr.size, lay, arena, mirrors)
                    table[r] = m
                    if role == IN:
                        self._copy(m, arr)
                    if (r, role) in c.writes:
                        # before the de-aliased root output's own copy back
                        copy_back.insert(0, (arr, m))
                else:
                    table[r] = arr
        # 3. publish the signature and the locations, arrive
        parity = seq & 1
        d, head, dloc = self._own_desc[parity]
        raw = c.sig_raw
        if self._desc_written[parity] is not raw:  # the same signature as last time: as is
            d[16 : 16 + len(raw)] = raw
            head[1] = len(raw)
            self._desc_written[parity] = raw
        head[0] = seq
        if loc is not None:
            dloc[:] = loc.reshape(-1)
            self._desc_written[parity] = None  # rewrite the locations next time
        elif self._desc_loc_set[parity]:
            dloc[:] = -1
        self._desc_loc_set[parity] = loc is not None
        self._own_gen[0] = self._arena_gen[self.proc]
        reqs, recv = self._post_receives(c, dt)
        ctl = self._exchange_signatures(sig, seq)
        if g is not None:
            g.published()  # the copies into the arena, before anybody reads them
        self._arrive[self.proc].add(1)
        entry.state = "arrived"
        # 4. everybody's signature
        for p in self._node_procs:
            if p == self.proc:
                continue
            self._wait_counter(self._arrive[p], seq, p, "arrival")
        theirs = self._finish_signatures(ctl)
        self._refresh_arenas()
        for p in self._node_procs:
            if p != self.proc:
                pd, phead, _ = self._peer_desc[p][parity]
                n = int(phead[1])
                if bytes(pd[16 : 16 + n]) != raw:
                    theirs[p] = bytes(pd[16 : 16 + n]).decode(errors="replace")
        bad = {p: s for p, s in theirs.items() if s != sig}
        if bad:
            for req in reqs.values():
                req.Cancel()
                req.Wait()
            raise ValueError(_mismatch(self, sig, bad))
        entry.state = "running"
        if g is not None:
            g.after([p for p in self._node_procs if p != self.proc])
        # 5. the buffers of every rank this process touches
        bufs = self._buffers(c, prep, mine_in, mine_out, parity, recv, extra)
        runs = c.staged_runs if staged and c.staged_runs is not None else c.runs
        if g is not None:
            self._execute_gpu(c, runs, bufs, recv)
        else:
            self._execute(runs, bufs, reqs)
        for dst, src in copy_back:
            self._copy(dst, src)
        if g is not None:
            g.end(sig, (prep, bufs, recv))
        for q in self._node_procs:
            self._base[q] += c.scheds[q].n_steps
        self._settle_arenas()

    def _copy(self, dst: Array, src: Array) -> None:
        """A staging copy: on a GPU, on the group's stream; on the host, the library's
        copy (streaming stores, the process's threads) from 64 KiB, numpy's below, where
        a call costs more than the copy."""
        if self._gpu is not None:
            self._gpu.copy(dst, src)
        elif dst.nbytes >= 1 << 16 and dst.dtype in _native.DTYPES:
            _native.copy_checked(dst, src, self._threads)
        else:
            np.copyto(dst, src)

    def _base_mirror(
        self,
        prep: Prepared,
        r: int,
        lay: dict[tuple[int, str], int],
        arena: _Mem | None,
        mirrors: dict[tuple[int, str], np.ndarray],
    ) -> np.ndarray:
        """In place: rank ``r``'s one mirror, with its input and output views (cached in
        ``mirrors`` under ``(r, BASE)``, ``(r, IN)``, ``(r, OUT)``)."""
        m = mirrors.get((r, BASE))
        if m is None:
            assert arena is not None
            coll = COLLECTIVES[prep.collective]
            nin, nout = coll.in_count(prep.count, self.size), coll.out_count(prep.count, self.size)
            shift, base = _in_place_shape(prep.collective, r, prep.count, self.size)
            m = mirrors[(r, BASE)] = arena.view(prep.array_dtype, base, lay[(r, BASE)])
            mirrors[(r, IN)] = m[max(shift, 0) : max(shift, 0) + nin]
            mirrors[(r, OUT)] = m[max(-shift, 0) : max(-shift, 0) + nout]
        return m

    @staticmethod
    def _role_mirror(
        prep: Prepared,
        r: int,
        role: str,
        size: int,
        lay: dict[tuple[int, str], int],
        arena: _Mem | None,
        mirrors: dict[tuple[int, str], np.ndarray],
    ) -> np.ndarray:
        """Rank ``r``'s mirror of its ``role`` buffer (cached in ``mirrors``)."""
        m = mirrors.get((r, role))
        if m is None:
            assert arena is not None
            m = mirrors[(r, role)] = arena.view(prep.array_dtype, size, lay[(r, role)])
        return m

    def _stage(
        self,
        c: _Compiled,
        prep: Prepared,
        ins: dict[int, np.ndarray],
        outs: dict[int, np.ndarray],
        mirrors: dict[tuple[int, str], np.ndarray],
        arena: _Mem | None,
        copy_back: list[tuple[np.ndarray, np.ndarray]],
        mine_in: dict[int, np.ndarray],
        mine_out: dict[int, np.ndarray],
        extra: dict[int, dict[str, np.ndarray]],
    ) -> None:
        """The staged call's buffers: the user's as the ranks' own, the mirrors beside
        them (roles ``m:in``/``m:out``), the ranges the staging plan copies in done now
        and those it copies back queued."""
        staging = c.staging
        assert staging is not None
        lay = c.layouts[self.proc][0]
        pairs: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}
        for i, r in enumerate(self.ranks):
            user_in, user_out = ins[r], outs[r]
            if user_out is not prep.outs[i]:  # the root's output made distinct
                copy_back.append((prep.outs[i], user_out))
            mine_in[r], mine_out[r] = user_in, user_out
            views: dict[str, np.ndarray] = {}
            if (r, BASE) in lay:
                m = self._base_mirror(prep, r, lay, arena, mirrors)
                views = {MIRROR[IN]: mirrors[(r, IN)], MIRROR[OUT]: mirrors[(r, OUT)]}
                pairs[(r, 0)] = (user_out if user_out.size >= user_in.size else user_in, m)
            else:
                for bid, (role, arr) in enumerate(((IN, user_in), (OUT, user_out))):
                    if (r, role) not in lay:
                        continue
                    got = self._role_mirror(prep, r, role, arr.size, lay, arena, mirrors)
                    views[MIRROR[role]] = got
                    pairs[(r, bid)] = (arr, got)
            extra[r] = views
        for r, bid, lo, cnt in staging.copy_in:
            u, m = pairs[(r, bid)]
            self._copy(m[lo : lo + cnt], u[lo : lo + cnt])
        for r, bid, lo, cnt in staging.copy_out:
            u, m = pairs[(r, bid)]
            copy_back.insert(0, (u[lo : lo + cnt], m[lo : lo + cnt]))

    def _buffers(self, c: _Compiled, prep: Prepared, mine_in: dict[int, np.ndarray],
                 mine_out: dict[int, np.ndarray], parity: int, recv: np.ndarray | None,
                 extra: dict[int, dict[str, np.ndarray]]) -> Buffers:  # fmt: skip
        """Every rank's buffers for this call: this process's ranks' from the call, the
        node's other ranks' from their arenas (or their symmetric buffers), kept from the
        last call while the arenas are the same and no symmetric buffer is in use."""
        key: tuple[object, ...] = (
            tuple(self._arena_gen[q] for q in self._node_procs),
            parity if self._heaps else -1,
        )
        arrays = c.arrays
        if arrays is None or c.arrays_for != key:
            arrays = self._remote_arrays(c, prep, parity)
            c.arrays, c.arrays_for = arrays, key
        for r in self.ranks:
            a = arrays[r]
            a[IN], a[OUT] = mine_in[r], mine_out[r]
            views = extra.get(r)
            if views:
                a.update(views)
        if recv is not None:
            for a in arrays:
                a[RECV] = recv
        b = Buffers.__new__(Buffers)
        b.arrays = arrays
        return b

    def _remote_arrays(
        self, c: _Compiled, prep: Prepared, parity: int
    ) -> list[dict[str, np.ndarray]]:
        n = self.size
        dt = prep.array_dtype
        coll = COLLECTIVES[prep.collective]
        nin, nout = coll.in_count(prep.count, n), coll.out_count(prep.count, n)
        empty = np.empty(0, dt)
        arrays: list[dict[str, np.ndarray]] = [
            {IN: empty, OUT: empty, TMP: empty, STAGE: empty, RECV: empty} for _ in range(n)
        ]
        for q in self._node_procs:
            lay, _ = c.layouts[q]
            seg = self._arenas.get(q)
            for r in range(n):
                if self._proc_of_rank[r] != q:
                    continue
                a = arrays[r]
                for role, cnt in ((TMP, c.plan.scratch.get(r, 0)), (STAGE, c.plan.stage.get(r, 0))):
                    if cnt and seg is not None:
                        a[role] = seg.view(dt, cnt, lay[(r, role)])
                if q == self.proc:
                    continue
                loc = self._peer_desc[q][parity][2]
                i = r - self._first_rank_of_proc[q]
                for j, (role, cnt) in enumerate(((IN, nin), (OUT, nout))):
                    h, off = int(loc[4 * i + 2 * j]), int(loc[4 * i + 2 * j + 1])
                    if h >= 0 and self._heaps:
                        a[role] = self._heaps[h][q].view(dt, cnt, off)
                    elif (r, role) in lay and seg is not None:
                        a[role] = seg.view(dt, cnt, lay[(r, role)])
        return arrays

    def _execute(self, runs: list[_Run], bufs: Buffers, reqs: _Requests) -> None:
        mine = self._progress[self.proc]
        sends: list[_MPI.Request] = []
        self._inflight = sends
        MPI = self._MPI
        for run in runs:
            if run.program is not None:
                run.program.run_inline(
                    bufs, cast("list[HostDevice]", self._all_devices), self._threads
                )
                mine.add(run.count)
                continue
            it = run.item
            assert it is not None
            if it.kind != "notify":
                self._wait_steps(it)
            if run.kind == "wait":
                for q, tag in it.recvs:
                    self._wait_request(reqs[(q, tag)], q, "a message")
                continue
            dest = self._mpi_rank_of_proc[it.peer]
            if it.kind == "send":
                assert it.src is not None
                src = bufs.view(it.src)
                sends.append(
                    self._comm.Isend([src, mpi_type(MPI, src.dtype)], dest, it.tag % 32768)
                )
                self.sent_bytes += src.nbytes
            else:
                sends.append(self._comm.Isend([_NOTHING, MPI.BYTE], dest, it.tag % 32768))
        self._inflight = []
        for req in sends:
            self._wait_request(req, -1, "a send to finish")
        for (q, _), req in reqs.items():
            self._wait_request(req, q, "a message")

    def _wait_steps(self, it: Item) -> None:
        """The steps of the node's other processes that ``it`` needs, done."""
        for q, k in it.waits:
            self._wait_counter(self._progress[q], self._base[q] + k, q, "a step")

    def _execute_gpu(self, c: _Compiled, runs: list[_Run], bufs: Buffers,
                     recv: Array | None) -> None:  # fmt: skip
        """This process's runs on the group's stream (gpu.py: the two ordering modes)."""
        g = self._gpu
        assert g is not None
        mine = self._progress[self.proc]
        streams = [g.stream] * self.size
        for run in runs:
            if run.program is not None:
                run.program.enqueue(bufs, streams, run.program.call_events(False))
                g.published()
                mine.add(run.count)
                continue
            if run.kind == "recv":
                assert recv is not None
                for j in run.recvs:
                    q, _, count, off = c.mine.recvs[j]
                    if count:
                        g.recv(recv[off : off + count], q)
                    else:
                        g.notify(q, receive=True)
                continue
            it = run.item
            assert it is not None
            if it.kind != "notify":
                self._wait_steps(it)
                g.after([q for q, _ in it.waits])
            if run.kind == "wait":
                continue  # its messages were received in order, on the stream
            if it.kind == "send":
                assert it.src is not None
                src = bufs.view(it.src)
                g.send(src, it.peer)
                self.sent_bytes += src.nbytes
            else:
                g.notify(it.peer, receive=False)

    def _post_receives(self, c: _Compiled, dt: np.dtype) -> tuple[_Requests, Array | None]:
        """Every message this process will receive in the call, posted at once (GPU
        groups: only the receive arena; the receives are issued in order)."""
        reqs: _Requests = {}
        if not c.mine.recvs:
            return reqs, None
        if self._gpu is not None:
            if c.recv_arena is None:
                c.recv_arena = self.devices[0].empty(max(1, c.mine.arena), dt)
            return reqs, c.recv_arena
        arena = c.recv_arena
        if arena is None:
            arena = c.recv_arena = np.empty(max(1, c.mine.arena), dt)
        MPI = self._MPI
        for q, tag, count, off in c.mine.recvs:
            src = self._mpi_rank_of_proc[q]
            if count:
                view = arena[off : off + count]
                reqs[(q, tag)] = self._comm.Irecv([view, mpi_type(MPI, dt)], src, tag % 32768)
            else:
                reqs[(q, tag)] = self._comm.Irecv([_NOTHING, MPI.BYTE], src, tag % 32768)
        return reqs, arena

    def _exchange_signatures(
        self, sig: str, seq: int
    ) -> list[tuple[int, _MPI.Request, np.ndarray]]:
        """Non-blocking: this call's signature to every process of another node."""
        if not self._remote_procs:
            return []
        MPI = self._MPI
        raw = np.frombuffer(sig.encode()[:_SIG_BYTES].ljust(_SIG_BYTES, b"\0"), np.uint8).copy()
        tag = 0
        out = []
        for p in self._remote_procs:
            dest = self._mpi_rank_of_proc[p]
            box = np.zeros(_SIG_BYTES, np.uint8)
            out.append((p, self._ctl_comm.Irecv([box, MPI.BYTE], dest, tag), box))
            out.append((p, self._ctl_comm.Isend([raw, MPI.BYTE], dest, tag), raw))
        return out

    def _finish_signatures(self, ctl: list[tuple[int, _MPI.Request, np.ndarray]]) -> dict[int, str]:
        got: dict[int, str] = {}
        for i, (p, req, box) in enumerate(ctl):
            self._wait_request(req, p, "its signature")
            if i % 2 == 0:
                got[p] = bytes(box).rstrip(b"\0").decode(errors="replace")
        return got

    # -- shared arenas ---------------------------------------------------------------------
    def _ensure_arena(self, need: int) -> None:
        cur = self._arenas.get(self.proc)
        if need == 0 or (cur is not None and cur.size >= need):
            return
        size = 1 << max(16, (need - 1).bit_length())
        gen = self._arena_gen[self.proc] + 1
        if self._gpu is not None:
            # device memory; the old arena stays allocated until close (another process's
            # stream may still read it)
            blk = DeviceBlock(self._gpu.device, size)
            if cur is not None:
                self._gpu.retired.append(cast("DeviceBlock", cur))
            self._arenas[self.proc] = blk
            self._arena_gen[self.proc] = gen
            self._slot_i64(self.proc, _ARENA_SIZE)[0] = size
            at = _SLOTS + _SLOT * self._slot_of[self.proc] + _IPC_ARENA
            self._ctl.buf[at : at + _IPC_BYTES] = blk.handle
            return
        seg = Segment.create(segment_name(self._job, f"arena{gen}"), size)
        if cur is not None:
            cur.close()
        self._arenas[self.proc] = seg
        self._arena_gen[self.proc] = gen
        self._slot_i64(self.proc, _ARENA_SIZE)[0] = size
        if len(self._node_procs) > 1:
            self._pending_unlink.append((seg, gen))
        else:
            seg.unlink()

    def _refresh_arenas(self) -> None:
        """Map the node's arenas that grew since the last call."""
        for q in self._node_procs:
            if q != self.proc:
                self._refresh_arena(q)

    def _refresh_arena(self, q: int) -> None:
        """Map process ``q``'s arena if it grew, and say so in the mailboxes: its creator
        unlinks an arena's name once every process of the node mapped it or a newer one
        (send/recv map only their peers' arenas, when they need them)."""
        gen = int(self._peer_gen[q][0])
        if gen and self._arena_gen[q] != gen:
            old = self._arenas.pop(q, None)
            if old is not None:
                if self._gpu is not None:
                    self._gpu.wait_stream()  # this process's GPU may still read it
                old.close()
            if self._gpu is not None:
                at = _SLOTS + _SLOT * self._slot_of[q] + _IPC_ARENA
                handle = bytes(self._ctl.buf[at : at + _IPC_BYTES])
                size = int(self._slot_i64(q, _ARENA_SIZE)[0])
                self._arenas[q] = PeerBlock(
                    self._gpu.device, self._gpu.owner_ordinal(q), handle, size
                )
            else:
                pid = int(self._slot_i64(q, _PID)[0])
                self._arenas[q] = Segment.attach(name_for(self._job, pid, f"arena{gen}"))
            self._arena_gen[q] = gen
            self._mail.set_mapped(q, self.proc, gen)

    def _settle_arenas(self) -> None:
        """Unlink this process's new arenas once every process of the node mapped them
        (or a newer one: a process maps only an arena's newest generation)."""
        keep = []
        others = [p for p in self._node_procs if p != self.proc]
        for seg, gen in self._pending_unlink:
            if all(self._mail.mapped(self.proc, p) >= gen for p in others):
                seg.unlink()
            else:
                keep.append((seg, gen))
        self._pending_unlink = keep

    def _heap_of(self, arr: np.ndarray) -> tuple[int, int] | None:
        if not self._heaps:
            return None
        p = data_ptr(arr)
        for i, heap in enumerate(self._heaps):
            seg = heap[self.proc]
            base = self._heap_bases[i]
            if base <= p < base + seg.size:
                return i, p - base
        return None

    # -- waits ----------------------------------------------------------------------------
    def _wait_counter(self, counter: _native.Counter, target: int, proc: int, what: str) -> None:
        if counter.wait(target, 0.0005):
            return
        deadline = time.monotonic() + self.timeout
        # while sends are in flight, MPI moves their data only inside MPI calls (large
        # messages go in pieces, each handed over when both sides call MPI): wait in
        # short slices and let MPI progress between them
        slice_s = _MPI_SLICE if self._inflight else _POLL
        last_check = time.monotonic()
        while not counter.wait(target, slice_s):
            if self._inflight:
                self._progress_mpi()
            now = time.monotonic()
            if now - last_check >= _POLL:
                last_check = now
                self._check_peers()
                if now > deadline:
                    raise CommTimeout(self._timed_out(proc, what))

    def _progress_mpi(self) -> None:
        """Let MPI move the data of the call's sends (finished ones are null requests,
        which cost nothing to test)."""
        self._MPI.Request.Testall(self._inflight)

    def _wait_request(
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
            if self._inflight:
                self._progress_mpi()
            if time.perf_counter() < spin_until:
                continue
            time.sleep(0.00005)
            now = time.monotonic()
            if now - last_check > _POLL:
                last_check = now
                self._check_peers()
                if now > deadline:
                    raise CommTimeout(self._timed_out(proc, what))

    def _ranks_of(self, proc: int) -> list[int]:
        return [r for r in range(self.size) if self._proc_of_rank[r] == proc]

    def _timed_out(self, proc: int, what: str) -> str:
        who = f"ranks {self._ranks_of(proc)} (process {proc})" if proc >= 0 else "a peer"
        return (
            f"rank {self.rank}: waited {self.timeout:g} s for {who}: {what} of collective "
            f"#{self._seq} never came"
        )

    def _check_peers(self) -> None:
        word = int(self._i64[_ABORT // 8])
        if word:
            raw = bytes(self._ctl.buf[_REASON : _REASON + _REASON_BYTES]).rstrip(b"\0")
            raise PeerFailure(f"rank {self.rank}: {raw.decode(errors='replace')}")
        for p in self._node_procs:
            if p == self.proc:
                continue
            pid = int(self._slot_i64(p, _PID)[0])
            if not alive(pid):
                raise PeerFailure(
                    f"rank {self.rank}: the process of ranks {self._ranks_of(p)} (pid {pid}) "
                    f"died during collective #{self._seq}"
                )
        self._check_launcher()

    def _check_launcher(self) -> None:
        if self._launcher_reported:
            raise PeerFailure(
                f"rank {self.rank}: the launcher reported that a process of the job died "
                f"(SIGUSR1) during collective #{self._seq}"
            )

    def _fail(self, exc: BaseException) -> None:
        """Close the group for good; tell the node; print the flight recorder."""
        if self._failure is None:
            self._failure = exc
            # nobody may map this process's new segments any more: free their names now
            for seg, _ in self._pending_unlink:
                seg.unlink()
            self._pending_unlink = []
            if self.shm and len(self._node_procs) > 1:
                # ... nor a dead process's: an arena that only its send/recv peers mapped
                # keeps its name until every process of the node has mapped it
                remove_stale()
            if not isinstance(exc, PeerFailure) and not self._closed:
                reason = f"ranks {list(self.ranks)} failed: {type(exc).__name__}: {exc}"
                raw = reason.encode()[: _REASON_BYTES - 1]
                self._ctl.buf[_REASON : _REASON + len(raw)] = raw
                self._i64[_ABORT // 8] = self.proc + 1
            # MPI_Finalize would wait for processes that may never come (a dead one, one
            # stuck, or peers of an aborted group): leave without it, whatever failed
            import atexit

            atexit.register(exit_without_finalize)
            text = self.flight.dump(f"rank {self.rank} (process {self.proc}, node {self.node})")
            text = f"nccltree: {type(exc).__name__}: {exc}\n{text}"
            if isinstance(exc, CommError) and hasattr(exc, "add_note"):
                exc.add_note(text)  # Python >= 3.11
            print(text, file=sys.stderr, flush=True)

    # -- algorithm="mpi" ------------------------------------------------------------------


def _p2p_buffer(pg: ProcessGroup, buf: Array, what: str, dtype: object) -> Array:
    """A send's or receive's buffer with its ``dtype=`` checked as a collective's is: a
    numpy buffer that carries the dtype viewed as it (MPI moves bfloat16 as 16-bit
    words); a CuPy one as it is (NCCL moves a uint16 buffer as the bfloat16 it holds)."""
    logical = check_call_dtype(dtype)
    if logical is None:
        return buf
    arr = _device_array(pg.devices[0], buf, f"rank {pg.rank}: {what} buffer")
    return carry(arr, carried_dtype(arr, logical, f"rank {pg.rank}: {what} buffer"))[0]


def _mismatch(pg: ProcessGroup, sig: str, bad: dict[int, str]) -> str:
    lines = [f"collective arguments differ between processes: ranks {list(pg.ranks)} call {sig}"]
    for p, s in sorted(bad.items()):
        lines.append(f"  ranks {pg._ranks_of(p)} call {s}")
    return "\n".join(lines)


_current: ProcessGroup | None = None
_NOTHING = np.empty(0, np.uint8)  # the payload of a notify


def init_process_group(
    comm: _MPI.Intracomm | None = None,
    devices: str = "cpu",
    algorithm: str = "auto",
    timeout: float = 60.0,
    shm: bool | None = None,
) -> ProcessGroup:
    """The process group of every process of ``comm`` (default ``MPI.COMM_WORLD``: run
    under ``mpiexec`` or ``srun``). ``devices``: ``"cpu"`` (one rank in this process) or
    ``"cpu:N"``. Ranks are numbered node-major, then by process, then by local rank; the
    node of a process is its host name, or ``NCCLTREE_NODE`` where set. ``shm``: whether
    the processes of a node share memory (default: where ``/dev/shm`` has 64 MiB free, or
    as ``NCCLTREE_SHM`` says; otherwise their data goes over MPI). Collective: every
    process calls it. ``close()`` the group before calling it again."""
    global _current
    if _current is not None and not _current._closed:
        raise CommError("a process group is open in this process; close() it first")
    try:
        import mpi4py  # noqa: F401
    except ImportError as exc:
        from ..._errors import BackendUnavailable

        raise BackendUnavailable(
            "process groups need mpi4py and an MPI library: pip install 'nccltree[mpi]'"
        ) from exc
    _current = ProcessGroup(comm, devices, algorithm, timeout, shm)
    return _current


__all__ = ["ProcessGroup", "init_process_group", "GROUP_ALGORITHMS"]
