"""The GPU side of a process group: CUDA IPC within a node, NCCL between nodes.

A process of a GPU group holds one rank on one GPU. The node's processes reach each
other's device memory through CUDA IPC: each exports the handles of its staging arena and
of its symmetric buffers (``pg.empty``); the others open them once (cached per group,
closed at ``close()``) and read or write them with peer copies and the fused peer-read
reduce, exactly as ranks of one process do.

Ordering, in two modes (chosen per group, the same in every process):

- ``events`` (every process on one node): each process records its one inter-process
  event (``cudaEventInterprocess``) on its stream after every run of steps, then moves its
  progress counter on (shared memory, as host groups do). A process that needs a peer's
  progress waits for the counter on the host, then for the peer's event, also on the
  host (``cudaEventQuery``, bounded by the group's timeout, checking the node's processes
  while it waits), and only then issues the work that reads the peer's memory. Its stream
  never waits on a peer's event: a peer that dies with its work pending leaves that event
  incomplete for good, and a stream waiting on it (and the caller's stream after it)
  would wait forever, where a host wait names the dead process. The query sees the
  event's latest record, which may cover more of the peer's work than needed: that is
  safe because a peer's work never depends on work a process has not issued yet (every
  dependency between processes goes through a host wait first).
- ``sync`` (several nodes): NCCL point-to-point operations enter the streams without a
  host wait, so a latest record could make a stream wait for work that depends on its own
  future. Each process therefore completes each run of steps (stream synchronisation)
  before moving its counter on, and a counter then means the memory is written. Messages
  between nodes are ``ncclSend``/``ncclRecv`` on the group's stream, issued in one global
  order (:func:`message_order`: a receive at the position of its send), so the operations
  of every pair of processes match and none waits for one that cannot start.

Everything CUDA is reached through CuPy's ``cupy.cuda.runtime`` and ``cupy.cuda.nccl``.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, cast

import numpy as np

from ..._errors import BackendUnavailable, CommError, CommTimeout, PeerFailure
from ...backends.base import Array
from ...backends.cuda import _cupy
from ...topology import Link, LinkKind

if TYPE_CHECKING:
    from ...backends.base import Device, Event, Stream
    from ...backends.cuda import CudaDevice, CudaStream
    from .._args import Prepared
    from ..nccl import NcclEngine
    from ..watchdog import Watchdog
    from .lifecycle import Lifecycle
    from .links import Links
    from .placement import Placement
    from .schedule import Schedule

_EVENT_FLAGS = 2 | 4  # cudaEventDisableTiming | cudaEventInterprocess
_NOT_READY = 600  # cudaErrorNotReady
_IPC_HANDLE_BYTES = 64  # cudaIpcMemHandle_t
#: Test-only: lets processes that share a GPU make an NCCL communicator, which nccltree
#: refuses otherwise (NCCL refuses two ranks on one GPU unless each process claims its own
#: host, ``NCCL_HOSTID``). The GPU check sets it to try NCCL across processes on one GPU;
#: NVIDIA does not support that, and nothing outside the check should set it.
SHARED_GPU_NCCL_ENV = "NCCLTREE_TEST_NCCL_SHARED_GPU"
_SELF = Link(LinkKind.SELF)


class _Block:
    """GPU memory at ``ptr`` of ``size`` bytes, seen as CuPy arrays; ``_release`` frees
    it (or unmaps it), once, on this process's GPU."""

    device: CudaDevice
    ptr: int
    size: int

    def _wrap(self, owner_id: int) -> None:
        cp = _cupy()
        self._mem = cp.cuda.UnownedMemory(self.ptr, self.size, self, owner_id)
        self._open = True

    def view(self, dtype: np.dtype, count: int, offset: int) -> Array:
        """``count`` elements of ``dtype`` from byte ``offset``, as a CuPy array."""
        cp = _cupy()
        return cp.ndarray((count,), dtype, cp.cuda.MemoryPointer(self._mem, offset))

    def close(self) -> None:
        if self._open:
            self._open = False
            with _cupy().cuda.Device(self.device.physical_id):
                self._release()

    def _release(self) -> None:
        raise NotImplementedError


class DeviceBlock(_Block):
    """Device memory of this process's GPU, exported for the node's other processes
    (``handle``: the ``cudaIpcMemHandle_t`` bytes). ``cudaMalloc``'d directly, not from
    CuPy's pool: an IPC handle names a whole allocation."""

    def __init__(self, device: CudaDevice, nbytes: int) -> None:
        cp = _cupy()
        rt = cp.cuda.runtime
        self.device = device
        self.size = max(1, int(nbytes))
        with cp.cuda.Device(device.physical_id):
            try:
                self.ptr = int(rt.malloc(self.size))
            except rt.CUDARuntimeError as exc:
                raise CommError(
                    f"GPU {device.physical_id}: cannot allocate {self.size} bytes for the "
                    f"process group's shared buffers: {exc}"
                ) from exc
            try:
                self.handle = bytes(rt.ipcGetMemHandle(self.ptr))
            except BaseException:
                rt.free(self.ptr)
                raise
        self._wrap(device.physical_id)

    def _release(self) -> None:
        _cupy().cuda.runtime.free(self.ptr)


class PeerBlock(_Block):
    """Another process's :class:`DeviceBlock`, opened here through its IPC handle
    (mapped for this process's GPU, ``device``; ``owner_id``: the GPU holding it, as this
    process numbers GPUs)."""

    def __init__(self, device: CudaDevice, owner_id: int, handle: bytes, size: int) -> None:
        cp = _cupy()
        rt = cp.cuda.runtime
        self.device = device
        self.size = size
        with cp.cuda.Device(device.physical_id):
            try:
                # cudaIpcMemLazyEnablePeerAccess (CuPy's default flag)
                self.ptr = int(rt.ipcOpenMemHandle(handle))
            except rt.CUDARuntimeError as exc:
                raise CommError(
                    f"GPU {device.physical_id}: cannot open another process's GPU memory "
                    f"through CUDA IPC: {exc}"
                ) from exc
        self._wrap(owner_id)

    def _release(self) -> None:
        _cupy().cuda.runtime.ipcCloseMemHandle(self.ptr)


class IpcEvent:
    """An inter-process CUDA event: this process's own (``handle`` exported), or a peer's
    opened from its handle (``handle`` given). Recorded only by its owner; waited on by
    the node's other processes."""

    def __init__(self, device: CudaDevice, handle: bytes | None = None) -> None:
        cp = _cupy()
        rt = cp.cuda.runtime
        self.device = device
        with cp.cuda.Device(device.physical_id):
            if handle is None:
                self.ptr = int(rt.eventCreateWithFlags(_EVENT_FLAGS))
                self.handle = bytes(rt.ipcGetEventHandle(self.ptr))
            else:
                self.ptr = int(rt.ipcOpenEventHandle(handle))
                self.handle = handle
        self._open = True

    def record(self, stream_ptr: int) -> None:
        _cupy().cuda.runtime.eventRecord(self.ptr, stream_ptr)

    def wait(self, stream_ptr: int) -> None:
        """Make the stream ``stream_ptr`` wait for the event's latest record."""
        _cupy().cuda.runtime.streamWaitEvent(stream_ptr, self.ptr, 0)

    def done(self) -> bool:
        """Whether the event's latest record completed (``cudaEventQuery``); a failed one
        raises ``CommError``."""
        rt = _cupy().cuda.runtime
        status = int(rt.eventQuery(self.ptr))
        if status == 0:
            return True
        if status == _NOT_READY:
            return False
        raise CommError(f"a peer process's GPU work failed (CUDA error {status})")

    def close(self) -> None:
        if self._open:
            self._open = False
            cp = _cupy()
            with cp.cuda.Device(self.device.physical_id):
                cp.cuda.runtime.eventDestroy(self.ptr)


# -- the arenas' IPC handles, one per generation ------------------------------------------

#: entries of a process's table of arena handles (in its control-block slot): generation g
#: goes to entry g % ARENA_HANDLES. An arena's size at least doubles with each generation
#: (from 64 KiB), so no GPU's memory holds enough generations for two to share an entry.
ARENA_HANDLES = 32
_HANDLE_ENTRY = 80  # the generation (int64), the size (int64), the 64-byte handle
ARENA_TABLE_BYTES = ARENA_HANDLES * _HANDLE_ENTRY


def put_arena_handle(buf: mmap.mmap, at: int, gen: int, size: int, handle: bytes) -> None:
    """Publish generation ``gen`` of this process's arena (``size`` bytes, its IPC
    ``handle``) in the table at ``at``: the generation goes in last, so a reader that
    sees it sees the rest."""
    e = at + (gen % ARENA_HANDLES) * _HANDLE_ENTRY
    buf[e + 16 : e + 16 + len(handle)] = handle
    buf[e + 8 : e + 16] = int(size).to_bytes(8, "little", signed=True)
    buf[e : e + 8] = int(gen).to_bytes(8, "little", signed=True)


def get_arena_handle(buf: mmap.mmap, at: int, gen: int) -> tuple[bytes, int]:
    """(IPC handle, size) of generation ``gen`` of a peer's arena, from its table at
    ``at``: the block of that generation, never a newer one the peer made since (its
    call's data is in the generation it named)."""
    e = at + (gen % ARENA_HANDLES) * _HANDLE_ENTRY
    stamp = int.from_bytes(bytes(buf[e : e + 8]), "little", signed=True)
    if stamp != gen:
        raise CommError(
            f"generation {gen} of a peer's GPU arena is not in its table (entry holds "
            f"generation {stamp})"
        )
    size = int.from_bytes(bytes(buf[e + 8 : e + 16]), "little", signed=True)
    return bytes(buf[e + 16 : e + 16 + _IPC_HANDLE_BYTES]), size


# -- which GPU, and where it sits --------------------------------------------------------


def pick_gpu(spec: str, local_index: int) -> int:
    """The CUDA ordinal of this process's GPU: ``gpu`` picks by the process's index among
    its node's processes (modulo the GPUs it sees; with one GPU visible per process, as
    launchers that set ``CUDA_VISIBLE_DEVICES`` give, that one), ``gpu:K`` names it."""
    from ...backends.cuda import gpu_count

    count = gpu_count()
    if count == 0:
        raise BackendUnavailable("devices='gpu' asks for a GPU, but CuPy sees none")
    if spec == "gpu":
        return local_index % count
    k = int(spec[4:])
    if k >= count:
        raise ValueError(f"devices={spec!r}: GPU {k} does not exist ({count} visible)")
    return k


def bus_id(ordinal: int) -> str:
    """The PCI bus id of a CUDA ordinal: the one name of a GPU that every process of a
    node shares (each may number the GPUs differently)."""
    return str(_cupy().cuda.runtime.deviceGetPCIBusId(ordinal))


def visible_ordinals(buses: Sequence[str]) -> list[int]:
    """This process's CUDA ordinal of each bus id (-1 where it cannot see that GPU)."""
    rt = _cupy().cuda.runtime
    out = []
    for b in buses:
        try:
            out.append(int(rt.deviceGetByPCIBusId(b)))
        except rt.CUDARuntimeError:
            out.append(-1)
    return out


def link_row(mine: str, buses: Sequence[str]) -> list[Link]:
    """The links from this process's GPU (bus id ``mine``) to the GPUs ``buses`` of its
    node: NVML where it answers (it sees every GPU of the machine whatever
    ``CUDA_VISIBLE_DEVICES`` says), else CUDA peer access between the GPUs this process
    sees, else a guess (``SYS`` without peer access)."""
    from ...topology import _bus_key, links_by_bus

    key = _bus_key(mine)
    try:
        return links_by_bus([mine, *buses])[0][1:]
    except (BackendUnavailable, ValueError):
        pass
    ords = visible_ordinals([mine, *buses])
    rt = _cupy().cuda.runtime
    row = []
    for b, o in zip(buses, ords[1:], strict=True):
        if _bus_key(b) == key:
            row.append(Link(LinkKind.SAME_DEVICE))
        elif o >= 0 and ords[0] >= 0 and rt.deviceCanAccessPeer(ords[0], o):
            row.append(Link(LinkKind.PHB))
        else:
            row.append(Link(LinkKind.SYS, 0, False))
    return row


def node_matrix(rows: Sequence[Sequence[Link]]) -> list[list[Link]]:
    """The node's link matrix from every process's row (``rows[i][j]``: process i's view
    of the link to process j), made symmetric by the lower-numbered process's view."""
    n = len(rows)
    return [[_SELF if i == j else rows[min(i, j)][max(i, j)] for j in range(n)] for i in range(n)]


# -- NCCL ----------------------------------------------------------------------------------


def nccl_comm(
    share: Callable[[object], object],
    first: bool,
    rank_of: int,
    size: int,
    device: CudaDevice,
    *,
    timeout: float | None = None,
    check_peers: Callable[[], None] | None = None,
) -> object:
    """One NCCL communicator over the group: the unique id made by the ``first``
    process and handed to every other by ``share`` (its value on every process: over MPI,
    or the group's bootstrap, as hex); every process joins with its rank (``rank_of``) on
    its GPU.

    ``ncclCommInitRank`` blocks until every rank joined, and CuPy offers no non-blocking
    form: with ``timeout``, it runs in a helper thread while this one waits at most
    ``timeout`` seconds, calling ``check_peers`` (which raises for a dead process) every
    10 ms; past the timeout, ``CommTimeout`` (the helper stays blocked in NCCL, a daemon
    thread that exits with the process)."""
    from ..nccl import _nccl_module

    nccl = _nccl_module()
    uid = _uid_from_json(share(_uid_json(nccl.get_unique_id()) if first else None))
    cp = _cupy()
    made: list[object] = []
    failed: list[BaseException] = []
    done = threading.Event()

    def init() -> None:
        try:
            with cp.cuda.Device(device.physical_id):
                made.append(nccl.NcclCommunicator(size, uid, rank_of))
        except BaseException as exc:  # noqa: BLE001 - raised in the waiting thread
            failed.append(exc)
        finally:
            done.set()

    if timeout is None:
        init()
    else:
        threading.Thread(target=init, name="nccltree-nccl-init", daemon=True).start()
        deadline = time.monotonic() + timeout
        while not done.wait(0.01):
            if check_peers is not None:
                check_peers()
            if time.monotonic() > deadline:
                raise CommTimeout(
                    f"rank {rank_of}: NCCL's communicator (ncclCommInitRank, {size} ranks, "
                    f"GPU {device.physical_id}) was not made within {timeout:g} s: a "
                    "process never joined it"
                )
    if failed:
        exc = failed[0]
        if isinstance(exc, (PeerFailure, CommTimeout)):
            raise exc
        raise BackendUnavailable(
            f"NCCL could not create the group's communicator (rank {rank_of} of {size} "
            f"on GPU {device.physical_id}): {type(exc).__name__}: {exc}; NCCL needs one "
            "GPU per process (two processes sharing a GPU can use the tree, ring or "
            "direct algorithm, over CUDA IPC)"
        ) from exc
    return made[0]


def _uid_json(uid: object) -> object:
    """NCCL's unique id as JSON: CuPy gives it as a tuple of 128 small integers (bytes
    as hex, for a CuPy that gives bytes)."""
    if isinstance(uid, bytes):
        return uid.hex()
    return [int(v) for v in cast("tuple[int, ...]", uid)]


def _uid_from_json(got: object) -> object:
    if isinstance(got, str):
        return bytes.fromhex(got)
    return tuple(int(v) for v in cast("list[int]", got))


def link_json(link: Link) -> list[object]:
    """A link as JSON (the bootstrap carries nothing else)."""
    return [int(link.kind), link.nvlinks, link.p2p, link.gbps, link.latency_s]


_LinkJson = tuple[int, int, bool, "float | None", "float | None"]


def link_of(got: object) -> Link:
    kind, nvlinks, p2p, gbps, latency = cast("_LinkJson", tuple(cast("list[object]", got)))
    return Link(LinkKind(kind), nvlinks, p2p, gbps, latency)


def nccl_move(arr: Array) -> tuple[int, int]:
    """(count, NCCL datatype) of a buffer that is only moved (a send or a receive): its
    bytes, as ``ncclUint8``. NCCL moves bytes alike whatever they hold, so a plain move
    needs no datatype of its own (bfloat16 and the other carried dtypes included)."""
    from ..nccl import _nccl_module

    return int(arr.nbytes), int(_nccl_module().NCCL_UINT8)


# -- the order of a process's work in sync mode ---------------------------------------------

Key = tuple[tuple[int, int, int], int, int]


def message_order(scheds: Sequence[Schedule], proc: int) -> list[tuple[str, int]]:
    """Process ``proc``'s work in the group's one global order: ``("item", i)`` for its
    schedule's items and ``("recv", j)`` for its receives (``scheds[proc].recvs[j]``),
    sorted by one key that both ends of a message share: the sender's item key, the
    sender, the tag. A process then performs its NCCL sends and receives in an order
    every other process agrees with (the n-th message between two processes is the same
    at both ends, as NCCL matches them), and the earliest unfinished operation of the
    whole group can always complete."""
    mine = scheds[proc]
    sender_key: dict[tuple[int, int], tuple[int, int, int]] = {}
    for q, s in enumerate(scheds):
        for it in s.items:
            if it.kind in ("send", "notify") and it.peer == proc:
                sender_key[(q, it.tag)] = it.key
    keyed: list[tuple[Key, tuple[str, int]]] = []
    for i, it in enumerate(mine.items):
        tag = it.tag if it.kind in ("send", "notify") else -1
        keyed.append(((it.key, proc, tag), ("item", i)))
    for j, (q, tag, _, _) in enumerate(mine.recvs):
        keyed.append(((sender_key[(q, tag)], q, tag), ("recv", j)))
    keyed.sort(key=lambda kv: kv[0])
    return [v for _, v in keyed]


def env_gpu_note() -> str:
    """What ``CUDA_VISIBLE_DEVICES`` says, for error messages."""
    v = os.environ.get("CUDA_VISIBLE_DEVICES")
    return "CUDA_VISIBLE_DEVICES is unset" if v is None else f"CUDA_VISIBLE_DEVICES={v!r}"


# -- the GPU half of a ProcessGroup -----------------------------------------------------------


class _NcclComm(Protocol):
    def allReduce(self, sendbuf: int, recvbuf: int, count: int, datatype: int, op: int,
                  stream: int) -> None: ...  # fmt: skip

    def abort(self) -> None: ...

    def destroy(self) -> None: ...


class _Agree:
    """Without MPI across nodes, what the argument agreement's NCCL ``all_reduce`` of
    ``[h, -h]`` uses (:meth:`GpuSide.agree`): a communicator of its own, made once at
    start, a stream of its own (nothing of the group's work waits for it, nor it for that
    work), two int64 on the GPU and two in pinned host memory."""

    def __init__(self, side: GpuSide) -> None:
        from ...memory import pinned_empty
        from ..nccl import _nccl_module

        ctx = side.ctx
        pl = ctx.placement
        self.nccl = _nccl_module()
        self.comm = cast("_NcclComm", nccl_comm(ctx.links.share, ctx.links.first, pl.proc, pl.nprocs,
                                   side.device, timeout=ctx.timeout,
                                   check_peers=ctx.check_peers))  # fmt: skip
        self.stream: CudaStream = cast("CudaStream", side.device.new_stream())
        self.host = pinned_empty((2,), np.int64, pinned=True)
        self.dev = side.device.empty(2, np.int64)

    def close(self, abort: bool) -> None:
        try:
            self.comm.abort() if abort else self.comm.destroy()
        except Exception:  # noqa: BLE001 - best effort while tearing down
            pass


@dataclass
class GpuContext:
    """What the GPU side needs of its group: who is where, its links (:mod:`.links`: the
    start's exchanges, NCCL's unique id), its algorithm and timeout, its life cycle (whether it
    failed; the call number, for messages), and two hooks: the node's liveness check and
    the group's failure."""

    placement: Placement
    links: Links
    algorithm: str
    timeout: float
    life: Lifecycle
    check_peers: Callable[[], None]
    fail: Callable[[BaseException], None]


class GpuSide:
    """What a :class:`~nccltree.comm.group.group.ProcessGroup` with ``devices="gpu"``
    adds: its GPU and stream, the node's GPUs and links, the inter-process events, the
    NCCL communicator, and the operations the engine performs on the GPU (see the module
    docstring for the two ordering modes)."""

    def __init__(self, ctx: GpuContext, spec: str) -> None:
        from ...backends.cuda import CudaRuntime
        from ...topology import Topology, _bus_key

        self.ctx = ctx
        pl = ctx.placement
        phys = pl.phys
        gather = ctx.links.gather
        nprocs = pl.nprocs
        ordinal = pick_gpu(spec, list(phys).index(pl.proc))
        # the group's GPU becomes the calling thread's current one, where the user's
        # arrays are then made (as torch.cuda.set_device(local_rank) does)
        _cupy().cuda.Device(ordinal).use()
        mine = bus_id(ordinal)
        buses = [str(b) for b in gather(mine)]
        self.buses = buses
        node_buses = [buses[p] for p in phys]
        ords = visible_ordinals(node_buses)
        sees_all = all(o >= 0 for o in ords)
        row = link_row(mine, node_buses)
        info = [(bool(x[0]), [link_of(v) for v in x[1]])
                for x in cast("list[tuple[bool, list[object]]]",
                              gather([sees_all, [link_json(k) for k in row]]))]  # fmt: skip
        # IPC reaches another GPU only where the process sees it; NCCL needs one GPU per
        # process. Both judged from every process's answers, so all judge alike.
        self.ipc_problem: str | None = None
        self.nccl_ok = True
        shared_ok = os.environ.get(SHARED_GPU_NCCL_ENV) == "1"  # test-only, see its note
        for node in range(pl.nodes):
            procs = [p for p in range(nprocs) if pl.node_of_proc[p] == node]
            gpus = {_bus_key(buses[p]) for p in procs}
            if len(gpus) != len(procs) and not shared_ok:
                self.nccl_ok = False
            blind = [p for p in procs if not info[p][0]]
            if len(gpus) > 1 and blind and self.ipc_problem is None:
                self.ipc_problem = (
                    f"processes {blind} of node {node} do not see every GPU of their node "
                    f"({env_gpu_note()} in this process), and CUDA IPC between two GPUs "
                    "needs both visible: leave CUDA_VISIBLE_DEVICES unset and pass "
                    "devices='gpu' (each process picks its GPU by its index on the node), "
                    "or use algorithm='nccl'"
                )
        # devices: this process's GPU first, then the node's other GPUs it sees
        others = sorted({o for o in ords if o >= 0 and o != ordinal})
        runtime = CudaRuntime([ordinal, *others])
        by_ordinal = {d.physical_id: d for d in runtime.devices}
        self.device: CudaDevice = runtime.devices[0]
        self.runtime = runtime
        node_of = pl.node_of_proc
        self._ordinal = {p: ords[i] for i, p in enumerate(phys)}
        self.rank_devices: list[Device] = [
            by_ordinal.get(self._ordinal.get(pl.proc_of_rank[r], -1), self.device)
            for r in range(pl.size)
        ]
        # the topology: each node's matrix from its processes' rows, NET between nodes
        rows = [info[p][1] for p in range(nprocs)]
        local = {p: [q for q in range(nprocs) if node_of[q] == node_of[p]].index(p)
                 for p in range(nprocs)}  # fmt: skip
        net = Link(LinkKind.NET, p2p=False)
        links = []
        for a in range(nprocs):
            row_links = []
            for b in range(nprocs):
                if a == b:
                    row_links.append(_SELF)
                elif node_of[a] != node_of[b]:
                    row_links.append(net)
                else:
                    lo, hi = (a, b) if local[a] < local[b] else (b, a)
                    row_links.append(rows[lo][local[hi]])
            links.append(row_links)
        self.topology = Topology(links)
        # several transport nodes: NCCL messages between them, so counters must mean
        # "done" (sync mode); one: inter-process events (events mode)
        self.sync_mode = len(set(pl.tnode_of_proc)) > 1
        self.stream: CudaStream = cast("CudaStream", self.device.new_stream())
        self.event: IpcEvent | None = None
        self.peer_events: dict[int, IpcEvent] = {}
        self.comm: object = None
        self.engine: NcclEngine | None = None
        self.retired: list[DeviceBlock] = []
        self.nccl_missing = ""  # why NCCL could not be made, where it could not
        self.caller: Stream | None = None
        self.caller_waits = True  # the caller's stream waits for the call (not async_op)
        self._defaulted = False  # begin() took the current stream (no caller was given)
        self.last_end: Event | None = None
        self._watchdog: Watchdog | None = None
        self._notify = self.device.empty(1, np.uint8)
        self._agree: _Agree | None = None  # without MPI across nodes (connect)

    @property
    def stream_ptr(self) -> int:
        return int(self.stream.cupy_stream.ptr)

    def owner_ordinal(self, proc: int) -> int:
        """This process's CUDA ordinal of process ``proc``'s GPU (its own where unseen)."""
        o = self._ordinal.get(proc, -1)
        return o if o >= 0 else self.device.physical_id

    def wait_end(self) -> None:
        """The last call's work finished (bounded by the group's timeout)."""
        if self.last_end is not None:
            self.last_end.synchronize(self.ctx.timeout)

    def connect(self) -> None:
        """After the control segment exists: the node's events exchanged and opened (over
        the links: the node's processes); the NCCL communicator made where the group
        needs one (collective: every process); without MPI across nodes, a second one
        for the argument agreement (:meth:`agree`)."""
        pl = self.ctx.placement
        algorithm = self.ctx.algorithm
        if not self.nccl_ok and (algorithm == "nccl" or self.sync_mode):
            why = "algorithm='nccl'" if algorithm == "nccl" else "a GPU group across nodes"
            raise ValueError(
                f"{why} needs NCCL, and NCCL needs one GPU per process, but processes of "
                f"one node share a GPU (GPUs by process: {self.buses}); give each process "
                "its own GPU, or keep to one node with the tree, ring or direct algorithm "
                "(CUDA IPC works between processes sharing a GPU)"
            )
        if not self.sync_mode and len(pl.node_procs) > 1:
            self.event = IpcEvent(self.device)
            handles = self.ctx.links.node_gather([pl.proc, self.event.handle.hex()])
            for p, h in cast("list[tuple[int, str]]", handles):
                if p != pl.proc:
                    self.peer_events[p] = IpcEvent(self.device, bytes.fromhex(h))
        if self.sync_mode or algorithm == "nccl":
            self.ensure_nccl()  # needed from the first call on
        if self.sync_mode and self.ctx.links.comm is None:
            self._agree = _Agree(self)
        elif self.nccl_ok and self.ipc_problem:
            # send/recv within the node go over NCCL where IPC cannot reach the peers'
            # GPUs, between two processes only: the (collective) creation cannot wait
            # for them, it happens now, while every process is here
            try:
                self.ensure_nccl()
            except BackendUnavailable as exc:
                self.nccl_ok = False
                self.nccl_missing = str(exc)
        elif self.nccl_ok:
            # One node: nothing needs NCCL unless a call chooses it (auto's large
            # messages), and that call, made by every process in the same order, creates
            # the communicator (ensure_nccl). Whether NCCL is there at all is known now,
            # locally, so auto never chooses a NCCL that is missing.
            from ..nccl import _nccl_module

            try:
                _nccl_module()
            except BackendUnavailable as exc:
                self.nccl_ok = False
                self.nccl_missing = str(exc)

    def ensure_nccl(self) -> NcclEngine:
        """The group's NCCL communicator, made at the first call that needs it: every
        process makes that call, in the same order, so the creation is collective (the
        unique id goes over MPI: the one MPI collective after bootstrap, once)."""
        if self.engine is None:
            if self.nccl_missing:
                raise BackendUnavailable(self.nccl_missing)
            if not self.nccl_ok:
                raise ValueError(
                    "NCCL (algorithm='nccl', send/recv on GPUs) needs one GPU per process, "
                    f"but processes of one node share a GPU (GPUs by process: {self.buses})"
                )
            from ..nccl import NcclEngine

            pl = self.ctx.placement
            links = self.ctx.links
            self.comm = nccl_comm(links.share, links.first, pl.proc, pl.nprocs, self.device,
                                  timeout=self.ctx.timeout, check_peers=self.ctx.check_peers)  # fmt: skip
            self.engine = NcclEngine([self.device], comms=[self.comm], size=pl.nprocs)
            self.engine.rank0 = pl.proc  # one rank per process: NCCL rank = group rank
        return self.engine

    def close(self) -> None:
        if self._watchdog is not None:
            self._watchdog.close()
        if self.engine is not None:
            self.engine.close(abort=self.ctx.life.failure is not None)
        if self._agree is not None:
            self._agree.close(abort=self.ctx.life.failure is not None)
        try:
            if self.ctx.life.failure is None:
                self.stream.synchronize(self.ctx.timeout)
        except Exception:  # noqa: BLE001 - best effort at teardown
            pass
        for ev in self.peer_events.values():
            ev.close()
        if self.event is not None:
            self.event.close()
        for blk in self.retired:
            blk.close()

    # -- one call --------------------------------------------------------------------------
    def begin(self) -> None:
        """The group's stream after the caller's work (the inputs are written there)."""
        caller = self.caller
        self._defaulted = caller is None
        if caller is None:  # pg.call: the caller's current stream, for this call only
            caller = self.caller = self.device.current_stream()
        self.stream.wait_event(caller.record())

    def end(self, what: str, keepalive: object) -> None:
        """The caller's stream after the group's work; the watchdog holds ``keepalive``
        until the work is done, and fails the group if it is not done in time."""
        done = self.stream.record()
        self.last_end = done
        caller = self.caller
        if caller is not None and self.caller_waits:
            caller.wait_event(done)
        if self._defaulted:
            self.caller = None
        self.watch(what, [done], keepalive)

    def watch(self, what: str, events: Sequence[Event], keepalive: object) -> None:
        if self._watchdog is None:
            from ..watchdog import Watchdog

            self._watchdog = Watchdog(self._on_watchdog, name="nccltree-group-watchdog")
        self._watchdog.watch(what, events, self.ctx.timeout, keepalive)

    def _on_watchdog(self, exc: BaseException) -> None:
        if self.engine is not None:
            self.engine.close(abort=True)
        self.ctx.fail(exc)

    def copy(self, dst: Array, src: Array) -> None:
        from ...backends.base import CopyArgs

        if dst.size:
            self.stream.copy_checked(CopyArgs(dst, src, self.device, self.device))

    def published(self) -> None:
        """This process's writes so far are what the node's other processes may read
        next: recorded (events mode) or finished (sync mode)."""
        if self.sync_mode:
            self.wait_stream()
        elif self.event is not None:
            self.event.record(self.stream_ptr)

    def after(self, procs: Sequence[int]) -> None:
        """Events mode: what this process issues next comes after the latest published
        work of ``procs`` (their host counters already say they published it): each one's
        event completed, waited for on the host, bounded by the group's timeout and
        watching the node's processes (a process that died with its work pending is
        named; nothing on the GPU waits for its event)."""
        if self.sync_mode:
            return
        for p in procs:
            ev = self.peer_events.get(p)
            if ev is not None and not ev.done():
                self._wait_peer(ev, p)

    def _wait_peer(self, ev: IpcEvent, proc: int) -> None:
        self._poll(
            ev.done,
            f"the GPU work process {proc} published for collective #{self.ctx.life.seq} did "
            f"not finish",
            spin=1e-4,  # the first 100 us: the peer's work is often just ending
        )

    def wait_stream(self) -> None:
        """The group's stream finished, bounded by the timeout, checking the node's
        processes while it waits."""
        st = self.stream
        if st.query():
            return
        self._poll(
            st.query,
            f"the GPU work of collective #{self.ctx.life.seq} did not finish",
            why=" (a peer's message never came?)",
        )

    def _poll(self, done: Callable[[], bool], what: str, spin: float = 0.0,
              why: str = "") -> None:  # fmt: skip
        """Until ``done()``: a short spin, then sleeps growing to 1 ms, the node's
        processes checked every 10 ms; ``CommTimeout`` naming ``what`` after the
        timeout."""
        ctx = self.ctx
        start = time.monotonic()
        deadline = start + ctx.timeout
        last = start
        pause = 2e-5
        while not done():
            if time.monotonic() < start + spin:
                continue
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)
            now = time.monotonic()
            if now - last >= 0.01:
                last = now
                ctx.check_peers()
                if now > deadline:
                    raise CommTimeout(
                        f"rank {ctx.placement.rank}: {what} within {ctx.timeout:g} s{why}"
                    )

    def agree(self, h: int) -> tuple[int, int]:
        """Without MPI across nodes: the NCCL ``MAX`` of every process's ``[h, -h]`` (the
        argument agreement's digests, :mod:`.agreement`), on the agreement's own
        communicator and stream, waited for on the host (bounded, watching the node)."""
        a = self._agree
        assert a is not None
        from ...backends.base import data_ptr

        rt = _cupy().cuda.runtime
        a.host[0], a.host[1] = h, -h
        st = int(a.stream.cupy_stream.ptr)
        dev, host = data_ptr(a.dev), int(a.host.ctypes.data)
        try:
            with _cupy().cuda.Device(self.device.physical_id):
                rt.memcpyAsync(dev, host, 16, rt.memcpyHostToDevice, st)
                a.comm.allReduce(dev, dev, 2, a.nccl.NCCL_INT64, a.nccl.NCCL_MAX, st)
                rt.memcpyAsync(host, dev, 16, rt.memcpyDeviceToHost, st)
        except Exception as exc:  # NcclError, CUDARuntimeError
            raise CommError(
                f"rank {self.ctx.placement.rank}: NCCL's agreement on the call's arguments "
                f"failed: {type(exc).__name__}: {exc}"
            ) from exc
        self._poll(a.stream.query, "the agreement on the call's arguments (NCCL) did not end",
                   why=" (a process called something else?)")  # fmt: skip
        return int(a.host[0]), int(a.host[1])

    # -- NCCL point-to-point (sync mode) ---------------------------------------------------------
    def send(self, arr: Array, proc: int) -> None:
        self._p2p("send", arr, proc)

    def recv(self, arr: Array, proc: int) -> None:
        self._p2p("recv", arr, proc)

    def notify(self, proc: int, receive: bool) -> None:
        """An empty message's stand-in: one byte (NCCL orders nothing for zero bytes)."""
        self._p2p("recv" if receive else "send", self._notify, proc)

    def _p2p(self, method: str, arr: Array, proc: int) -> None:
        from ...backends.base import data_ptr

        assert self.comm is not None
        fn = getattr(self.comm, method)
        try:
            fn(data_ptr(arr), *nccl_move(arr), proc, self.stream_ptr)
        except Exception as exc:  # NcclError, CUDARuntimeError
            raise CommError(
                f"rank {self.ctx.placement.rank}: NCCL {method} {'to' if method == 'send' else 'from'} "
                f"process {proc} failed: {type(exc).__name__}: {exc}"
            ) from exc

    # -- algorithm="nccl" ------------------------------------------------------------------------
    def run_nccl(self, prep: Prepared) -> None:
        """NCCL's own collective on the caller's stream; the watchdog watches its end."""
        engine = self.ensure_nccl()
        caller = self.caller if self.caller is not None else self.device.current_stream()
        launched = engine.launch(prep, [caller])
        events = launched.events or []
        self.last_end = events[0] if events else None
        self.watch(f"NCCL {prep.collective}", events, prep)
