"""ProcessGroup: the collectives of a World whose ranks live in several processes.

Every process builds the same plan and cuts it into one schedule per process
(:mod:`.schedule`); each performs its own. Within a node, processes read and write each
other's buffers in shared memory and order their steps with progress counters there
(the C wait primitive: a short spin, then a futex; every wait bounded). Between nodes,
data and "I have got this far" notifications travel as non-blocking MPI point-to-point
messages. After bootstrap no MPI collective runs (except with ``algorithm="mpi"``), and
no payload between processes of one node goes through MPI. A group started without MPI
(torchrun's or Slurm's variables, ``nccltree-run``: :mod:`.links`) keeps its bootstrap
for the rare exchanges, moves GPU data between nodes over NCCL, and refuses at start
what would need MPI (host data between nodes, ``algorithm="mpi"``).

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

The pieces, each with a narrow context of what it needs (none reads another's private
names): :mod:`.placement` (who is where), :mod:`.node_memory` (the control block, the
arenas, the symmetric buffers), :mod:`.waits` (every bounded wait), :mod:`.lifecycle`
(closed, failed, the call numbering), :mod:`.engine` (a call compiled into this
process's runs and performed), :mod:`.p2p` (send/recv), :mod:`.mpi_collectives`
(``algorithm="mpi"``) and :mod:`.gpu` (the GPU side). This module holds the public
face: argument checks, dispatch, and the objects' assembly.
"""

from __future__ import annotations

import atexit
import os
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, cast

import numpy as np

from ..._errors import CommError, CommTimeout, PeerFailure
from ..._validate import check_call_timeout, check_choice, check_index, check_int
from ...backends import devices as make_devices
from ...backends.base import Array, Device, carried_dtype, carry
from ...topology import Topology
from .. import auto, debug
from .._args import Prepared, _device_array, check_call_dtype, prepare
from ..algorithms import build_plan
from ..collectives import COLLECTIVES, collective_name
from ..faces import PointToPoint, RankCall, RankCollectives
from ..flight import FlightRecorder
from ..interop import StreamArg, as_stream
from ..lifecycle import HasLifeCycle
from ..plan import CHUNK_BYTES, Plan, chunk_elements
from ..work import Work
from . import small
from .agreement import call_signature, check_enabled, make_agreement, refusal_signature
from .async_p2p import ArgumentErrorWork, AsyncP2pContext, post_async
from .bootstrap import MpiBootstrap
from .core import Core
from .engine import Engine, EngineContext
from .gpu import GpuContext, GpuSide
from .lifecycle import Lifecycle
from .links import BootOwner, Links, SubBootstrap, refuse_without_mpi
from .local import GroupComm, LocalRendezvous, run_local
from .mpi_collectives import MpiContext, mpi_reduces, run_mpi
from .node_memory import MAX_LOCAL_RANKS, LauncherWatch, NodeMemory
from .p2p import GroupP2p, P2pContext
from .placement import Placement, place
from .small import SmallPath
from .waits import Waits

if TYPE_CHECKING:
    from mpi4py import MPI as _MPI
    from numpy.typing import DTypeLike

    from ...backends.base import Stream
    from ...backends.host import HostDevice
    from ...tree import Tree
    from .bootstrap import Bootstrap
    from .launch_env import Started

GROUP_ALGORITHMS = ("tree", "ring", "direct", "mpi", "nccl", "auto")
_GPU_SPEC = re.compile(r"gpu(:\d+)?")


def _check_args(devices: str, algorithm: str, timeout: float) -> tuple[float, bool, int]:
    """The group's arguments checked: (the timeout, whether it is a GPU group, the ranks
    of this process)."""
    check_choice(algorithm, "algorithm", GROUP_ALGORITHMS)
    timeout = check_call_timeout(timeout)
    gpu = isinstance(devices, str) and _GPU_SPEC.fullmatch(devices) is not None
    if not isinstance(devices, str) or not (devices == "cpu" or devices.startswith("cpu:") or gpu):
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
    nlocal = (
        1
        if devices == "cpu" or gpu
        else check_int(int(devices[4:]) if devices[4:].isdigit() else -1, "ranks in devices", min=1)
    )
    if nlocal > MAX_LOCAL_RANKS:
        raise ValueError(f"at most {MAX_LOCAL_RANKS} ranks per process, got {nlocal}")
    return timeout, gpu, nlocal


def _host_devices(pl: Placement, nlocal: int, threads: int) -> tuple[list[Device], list[Device]]:
    """A host group's devices: this process's ranks', and one per rank of the group (other
    ranks' steps never run here, but the executor names a device per rank: they share
    this process's first)."""
    local_devs = cast("list[HostDevice]", make_devices(f"cpu:{nlocal}"))
    for d in local_devs:
        d.threads = max(1, threads // nlocal)
    every: list[Device] = [
        local_devs[r - pl.rank] if r in pl.ranks else local_devs[0] for r in range(pl.size)
    ]
    return list(local_devs), every


def _start_links(
    comm: _MPI.Intracomm | None,
    bootstrap: Bootstrap | None,
    owner: BootOwner | None,
    method: str,
    nlocal: int,
    shm: bool | None,
    settings: Mapping[str, object],
    timeout: float,
) -> tuple[Placement, Links]:
    """Where a new group's processes stand, and the links between them: over MPI
    (``comm``, default ``MPI.COMM_WORLD``; ``bootstrap`` may be its
    :class:`MpiBootstrap`), or without MPI over ``bootstrap``."""
    gpu = settings["devices"] == "gpu"
    if bootstrap is None or isinstance(bootstrap, MpiBootstrap):
        from mpi4py import MPI

        if comm is None:
            comm = MPI.COMM_WORLD
        # every process here (or each names the missing ones), within the timeout
        boot = bootstrap or MpiBootstrap(comm, timeout, MPI)
        try:
            pl = place(boot, nlocal, shm, settings)
        finally:
            boot.close()
        return pl, Links.over_mpi(comm, pl, MPI)
    # (without MPI a node without shared memory has only NCCL, on GPUs)
    pl = place(bootstrap, nlocal, shm, settings, "NCCL" if gpu else None, "processes")
    refuse_without_mpi(pl, gpu, str(settings["algorithm"]), method or "without MPI")
    return pl, Links.over_boot(bootstrap, pl, owner or BootOwner(bootstrap))


def _split_group(
    links: Links, args: tuple[str, str, float, bool | None], c: int | None, k: int, order: int
) -> ProcessGroup | None:
    """The new group of a split (``args``: the parent's devices, algorithm, timeout and
    shm; ``c``/``k``: color and key; ``order``: the key made unique by the parent's
    rank), once the processes agreed they split."""
    if links.comm is None:
        # without MPI: the members' own bootstrap (boot.sub), one exchange
        made = links.split_boot(c, k)
        if made is None:
            return None
        sub, owner = made
        return ProcessGroup(None, *args, bootstrap=sub, owner=owner, method="split")
    MPI = links.mpi
    assert MPI is not None
    # MPI orders by key, then by rank in the parent: the group's rank breaks ties
    split = links.comm.Split(MPI.UNDEFINED if c is None else c, order)
    if split == MPI.COMM_NULL:
        return None
    try:
        return ProcessGroup(cast("_MPI.Intracomm", split), *args)
    finally:
        split.Free()  # the group keeps its own duplicates


class ProcessGroup(RankCollectives, PointToPoint, HasLifeCycle):
    """Ranks across processes and nodes (see the module docstring). Made by
    :func:`init_process_group`, whose arguments (``comm``, ``devices``, ``algorithm``,
    ``timeout``, ``shm``) it takes.

    With one rank in this process, the group is that rank's face: the collectives,
    point-to-point calls and their arguments, stream order and errors are those of every
    per-rank face (:class:`~nccltree.comm.faces.RankCollectives`); ``pg.call`` takes a
    list per rank, and with several ranks here ``pg.comm(i)`` is rank i's face, used from
    its own thread. ``pg.rank``, ``pg.size``, ``pg.local_rank``, ``pg.local_size`` and
    ``pg.node`` say where this process stands.
    """

    _life: Lifecycle  # the shared life cycle with the group's own steps

    def __init__(
        self,
        comm: _MPI.Intracomm | None = None,
        devices: str = "cpu",
        algorithm: str = "auto",
        timeout: float = 60.0,
        shm: bool | None = None,
        *,
        bootstrap: Bootstrap | None = None,
        owner: BootOwner | None = None,
        method: str = "",
    ) -> None:
        """Over MPI (``comm``, default ``MPI.COMM_WORLD``; ``bootstrap`` may be its
        :class:`MpiBootstrap`, already past the roll call), or without MPI over
        ``bootstrap`` (kept for the group's life; ``owner``: who closes it, for the
        groups ``split`` makes; ``method``: how the job was started, for messages)."""
        self.timeout, gpu, nlocal = _check_args(devices, algorithm, timeout)
        self.algorithm, self.gpu = algorithm, gpu
        settings = {"algorithm": algorithm, "devices": "gpu" if gpu else "cpu",
                    "NCCLTREE_CHECK": check_enabled(), "NCCLTREE_SMALL": small.setting()}  # fmt: skip
        args = (comm, bootstrap, owner, method, nlocal, shm, settings, self.timeout)
        pl, links = _start_links(*args)
        self.placement, self._links = pl, links
        self._MPI = links.mpi
        self.proc, self.nprocs, self.size, self.ranks = pl.proc, pl.nprocs, pl.size, pl.ranks
        self.node, self.node_index, self.nodes, self.shm = pl.node, pl.node_index, pl.nodes, pl.shm
        self.rank, self.local_rank, self.local_size = pl.rank, pl.local_rank, pl.local_size
        self._mpi_rank_of_proc = pl.mpi_rank_of_proc  # (auto: is MPI's order the group's?)
        threads = max(1, (os.cpu_count() or 1) // max(1, len(pl.node_procs)))
        self.flight = FlightRecorder()
        self._life = Lifecycle(pl, self.flight)
        self._gpu: GpuSide | None = None
        if gpu:
            ctx = GpuContext(
                placement=pl,
                links=links,
                algorithm=algorithm,
                timeout=self.timeout,
                life=self._life,
                check_peers=lambda: self._waits.check_peers(),
                fail=self._fail,
            )
            self._gpu = GpuSide(ctx, devices)
            self.devices: list[Device] = [self._gpu.device]
            all_devices = self._gpu.rank_devices
            self.topology = self._gpu.topology
        else:
            self.devices, all_devices = _host_devices(pl, nlocal, threads)
            # topology: one memory within a node, the network between nodes
            self.topology = Topology.cluster(
                [pl.node_of_proc[pl.proc_of_rank[r]] for r in range(self.size)]
            )
        self._trees: dict[int, Tree] = {}
        self._lock = threading.RLock()
        self._stream: Stream | None = None  # the group's stream (async and stream calls)
        small_on = small.eligible(pl, gpu, algorithm) and small.setting() > 0
        self._mem = NodeMemory(pl, links, self._gpu,
                               small.region_bytes(pl.nprocs) if small_on else 0)  # fmt: skip
        self._life.mem = self._mem
        self._launcher = LauncherWatch()
        self._waits = Waits(pl, self._mem, self._life, self._launcher, links.mpi, self.timeout)
        if self._gpu is not None:
            self._gpu.connect()
        core = Core(pl, self._mem, self._waits, self._gpu, links.comm, links.mpi)
        self._engine = Engine(
            EngineContext(core, links.ctl, self.devices, all_devices, threads, self.plan)
        )
        self._agreement = make_agreement(pl, links, self._waits, self._engine, self._gpu)
        self._mpi = MpiContext(core, self._one)
        self._p2p = GroupP2p(
            P2pContext(
                core=core,
                life=self._life,
                flight=self.flight,
                device=self.devices[0],
                lock=self._lock,
                copy=self._engine.copy,
                check_usable=self._check_usable,
                one=self._one,
                fail=self._fail,
                drain=self._drain,
            )
        )
        # what split() gives the groups it makes: the same GPU, not one picked again
        self._spec = devices if self._gpu is None else f"gpu:{self._gpu.device.physical_id}"
        self._shm_arg = shm
        self._launcher.watch()
        self._local = LocalRendezvous(self)
        self._comms = [GroupComm(self, i) for i in range(len(self.ranks))]
        # small calls within one node: one native call each (small.py)
        self._small: SmallPath | None = None
        if small_on:
            self._small = SmallPath(pl, self._mem, self._waits, self._life, self.flight,
                                    self._engine, self._lock, self._fail_call)  # fmt: skip

    # -- life cycle -----------------------------------------------------------------------
    def close(self) -> None:
        """Release shared memory and the group's communicator. Collective within a node:
        it first waits (at most the timeout) for the node's other processes to close too,
        so that none still needs a segment about to go. Idempotent; after it,
        :func:`init_process_group` may be called again."""
        if self._life.closed:
            return
        # closing is collective: wait (bounded) until every process of the node is here,
        # so each has mapped the arenas a last call made before their creator unlinks them
        sync = self._node_sync if len(self.placement.node_procs) > 1 else None
        release = [self._p2p.close, self._mem.close, self._launcher.restore, self._free_comms]
        if self._gpu is not None:
            # its stream finished first: nothing uses the blocks the node's memory frees
            release.insert(0, self._gpu.close)
        self._life.close(sync, release)
        global _current
        if _current is self:
            _current = None

    def _free_comms(self) -> None:
        self._links.close()  # the communicators, or this group's hold on its bootstrap

    @property
    def sent_bytes(self) -> int:
        """Payload this process sent to other nodes (its own count)."""
        return self._engine.sent_bytes

    def abort(self, reason: str = "aborted by the caller") -> None:
        """Fail the group now: this process's ranks waiting in a collective, and the
        node's other processes, raise ``PeerFailure`` (with ``reason`` in its cause).
        Nothing is printed here (the caller knows why); the other processes report the
        failure they learn of."""
        self._life.fail(CommError(reason), report=False)
        self._local.abort(CommError(reason))

    def _fail(self, exc: BaseException) -> None:
        """A failure found inside: close the group for good; tell the node; print the
        failure and the flight recorder."""
        self._life.fail(exc)

    def _fail_call(self, exc: BaseException) -> None:
        """A call that failed: as ``_perform`` handles it."""
        self._fail(exc)
        self._local.abort(exc)

    def comm(self, index: int) -> GroupComm:
        """The per-rank face of this process's ``index``-th rank (``ranks[index]``), used
        from that rank's own thread."""
        return self._comms[check_index(index, "local rank index", len(self.ranks))]

    def run(self, fn: Callable[..., object], *args: object) -> list[object]:
        """``fn(pg.comm(i), *args)`` in a thread per rank of this process; each result."""
        self._check_usable()
        return run_local(self, fn, *args)

    # -- public collectives (one rank per process) ---------------------------------------
    def _plain_all_reduce(self, x: Array, out: Array | None, op: str) -> Array | None:
        """A plain :meth:`all_reduce` that is small and within a node: one native call
        (:mod:`.small`); else None (the general path)."""
        if self._small is not None and self._stream is None:
            return cast("Array | None", self._small.all_reduce(x, out, op))
        return None

    def _one(self, name: str) -> None:
        if len(self.ranks) != 1:
            raise ValueError(
                f"{name}: this process holds {len(self.ranks)} ranks; call the collectives "
                f"of each from its own thread through pg.comm(i), or pass a list per rank "
                f"to pg.call"
            )

    def _call(self, call: RankCall) -> np.ndarray | Work:
        """One rank per process: a synchronous call, or (``stream``/``async_op``, as for
        ``Comm``) one run on the group's own stream, a worker thread, ordered after the
        work ``stream`` holds (else after what this thread did, as host calls are), with
        ``stream`` (else the returned ``Work``) ordered after it. Calls keep their order:
        a synchronous one first waits for those in flight. Arguments are checked before
        the call returns; a fault surfaces from ``Work.synchronize``/``result``, and the
        group's later calls fail. ``dtype``: as for a World's collectives."""
        self._one(call.collective)
        call.stream = as_stream(self.devices[0], call.stream)
        if self._small is not None and self._stream is None:
            got = self._small.fast(call)  # a small call within a node: one native call
            if got is not None:
                return cast("Array", got)
        if self._gpu is not None:
            return self._gpu_call(call)
        outs = None if call.out is None else [call.out]
        if not call.async_op and call.stream is None:
            return self.call(
                call.collective, [call.x], outs, op=call.op, root=call.root, dtype=call.dtype
            )[0]
        with self._lock:
            prep = self._prepare(call.collective, [call.x], outs, call.op, call.root, call.dtype)
            return self._enqueue(prep, call.stream, call.async_op)

    def _gpu_call(self, call: RankCall) -> Array | Work:
        """A GPU group's call: issued on the group's stream after the work of ``stream``
        (default: the caller's current stream); ``stream`` is ordered after it unless
        ``async_op``, which returns a ``Work`` instead. The host returns once the work is
        issued. ``dtype="bfloat16"``: the ``uint16`` CuPy arrays hold bfloat16."""
        g = self._gpu
        assert g is not None
        outs = None if call.out is None else [call.out]
        async_op = call.async_op
        with self._lock:
            prep = self._prepare(call.collective, [call.x], outs, call.op, call.root, call.dtype)
            given = as_stream(self.devices[0], call.stream)
            caller = given if given is not None else self.devices[0].current_stream()
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
        self, kind: str, buf: Array, peer: int, stream: StreamArg, dtype: DTypeLike | None
    ) -> None:
        buf = _p2p_buffer(self, buf, kind, dtype)
        stream = as_stream(self.devices[0], stream)
        self._p2p.drain()
        with self._lock:
            self._p2p.post(kind, buf, peer, stream)

    def batch(self) -> AbstractContextManager[None]:
        return self._p2p.batch()

    def _own(self) -> tuple[int, int, Device]:
        return self.rank, self.size, self.devices[0]

    def _post_p2p_async(
        self, kind: str, buf: Array, peer: int, stream: StreamArg, dtype: DTypeLike | None
    ) -> Work:
        """``isend``/``irecv``: see :mod:`.async_p2p`."""

        def check() -> None:
            self._one(f"i{kind}")
            self._check_usable()

        def queued(arr: Array) -> None:  # on the group's stream, in order
            with self._lock:
                self._p2p.post(kind, arr, peer, None)

        def group_stream() -> Stream:
            if self._stream is None:
                self._stream = self.devices[0].new_stream()
            return self._stream

        ctx = AsyncP2pContext(
            rank=self.rank, device=self.devices[0], timeout=self.timeout,
            gpu=self._gpu is not None, check=check, in_batch=self._p2p.in_batch,
            post_now=lambda b, s: self._post_p2p(kind, b, peer, s, dtype),
            queued=queued, group_stream=group_stream,
        )  # fmt: skip
        return post_async(ctx, kind, buf, stream, dtype)

    def _all_to_all_v(self, xa: Array, oa: Array, sc: list[int], rc: list[int],
                      stream: StreamArg, dtype: DTypeLike | None) -> None:  # fmt: skip
        """One rank per process: one batch of p2p.py (within the node through the arenas,
        shared memory or CUDA IPC; to other nodes as MPI messages or NCCL sends and
        receives). A block of another size than its receiver expects raises
        ``ValueError`` (within the node on both sides, the group going on)."""
        self._one("all_to_all_v")
        if xa.dtype != oa.dtype:
            raise TypeError(f"rank {self.rank}: output dtype {oa.dtype} differs from {xa.dtype}")
        xa = _p2p_buffer(self, xa, "input", dtype)
        oa = _p2p_buffer(self, oa, "output", dtype)
        self._p2p.all_to_all_v(xa, oa, sc, rc, as_stream(self.devices[0], stream))

    def split(self, color: int | None, key: int = 0) -> ProcessGroup | None:
        """MPI's ``Comm_split`` over the group's processes: every process calls it (in the
        same order as the group's collectives); the processes of one ``color`` form a new
        group (its own communicator, shared memory, plans and, on GPUs, the same GPU),
        None for color None. Within a node the new group orders processes by ``(key,
        rank)``; ranks stay node-major. The new group is independent: close it when done
        (closing this one does not). One rank per process. The processes first agree that
        they all split (a process that calls a collective instead raises ``ValueError``
        with every other one, or, in a call that cannot agree first, each names the
        other within the timeout); the split itself is then an MPI collective, as the
        bootstrap is."""
        return self._split(color, key, "split")

    def _split(self, color: int | None, key: int, sig: str) -> ProcessGroup | None:
        self._check_usable()
        self._one("split")
        c = None if color is None else check_int(color, "color", min=0)
        k = check_int(key, "key", min=0)
        self._life.seq += 1
        entry = self.flight.start(self._life.seq, sig.split()[0], 0, np.dtype(np.uint8), "mpi")
        try:
            if self._small is not None:
                self._small.agree(sig)  # where the node's calls agree: by arrival
            else:
                self._agreement.check(sig, sig.split()[0])
        except ValueError:
            entry.state = "argument error"
            raise
        except BaseException as exc:
            entry.state = f"failed: {type(exc).__name__}"
            self._fail(exc)
            raise
        entry.state = "done"
        args = (self._spec, self.algorithm, self.timeout, self._shm_arg)
        return _split_group(self._links, args, c, k, k * self.size + self.rank)

    def new_group(self, ranks: Sequence[int]) -> ProcessGroup | None:
        """The group of ``ranks`` (ordered as given within a node), from :meth:`split`:
        every process calls it with the same ``ranks`` (different lists raise
        ``ValueError`` on every process); those outside get None."""
        picked = [check_index(r, "a rank of the group", self.size) for r in ranks]
        if len(set(picked)) != len(picked) or not picked:
            raise ValueError(f"ranks of a group must be distinct and not empty, got {ranks!r}")
        sig = f"new_group {picked}"
        if self.rank not in picked:
            return self._split(None, 0, sig)
        return self._split(0, picked.index(self.rank), sig)

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
        if len(self.placement.node_procs) == 1:
            # no process shares this one's memory (alone on its node, or shared memory off)
            return np.zeros(shape_t, dt)
        nbytes = max(1, int(np.prod(shape_t)) * dt.itemsize)
        own = self._mem.host_heap(nbytes, self._node_sync)
        return np.frombuffer(own.buf, dt, int(np.prod(shape_t))).reshape(shape_t)

    def _gpu_empty(self, shape: tuple[int, ...], dt: np.dtype) -> Array:
        """``empty`` of a GPU group: device memory whose IPC handle every process of the
        node opens (the handles travel through the control segment, once per buffer)."""
        count = int(np.prod(shape))
        if len(self.placement.node_procs) == 1:
            return self.devices[0].empty(shape, dt)
        own = self._mem.gpu_heap(max(1, count * dt.itemsize), self._node_sync)
        return own.view(dt, count, 0).reshape(shape)

    def _node_sync(self) -> None:
        """Every process of the node got this far (a symmetric allocation); a dead or
        absent process fails the group, as in a collective."""
        try:
            self._waits.node_sync()
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
        ``ranks[i]``, ``outs[i]`` its output, None: in place where the collective allows
        it), synchronous; returns each rank's result. ``collective``: a name of the
        collectives table (``"all_reduce"``, ``"reduce"``, ``"broadcast"``, ...; its
        ``"sendrecv"`` is the ring shift). ``op``, ``root`` and ``dtype``: as for a
        World's collectives (``"bfloat16"`` for ``uint16`` arrays of its bits). Errors as
        for every collective."""
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
        try:
            return prepare(
                self.devices, collective_name(collective), list(xs),
                None if outs is None else list(outs), op, root, ranks=self.ranks,
                size=self.size, dtype=dtype,
            )  # fmt: skip
        except (ValueError, TypeError) as exc:
            self._refuse(str(collective), exc)
            raise

    def _refuse(self, collective: str, exc: BaseException) -> None:
        """This process's own checks refused a call: take part in the call's agreement
        all the same, saying so, so that the other processes raise ``ValueError`` naming
        it and no later call is matched with the wrong partner. (This process then
        raises its own error.) Host calls in flight on the group's stream go first: the
        refusal is queued behind them."""
        sig = refusal_signature(collective, exc)
        if self._stream is not None:
            self._stream.call(self._exchange_refusal, sig)
        else:
            self._exchange_refusal(sig)

    def _exchange_refusal(self, sig: str) -> None:
        with self._lock:
            if self._life.failed or self._life.closed:
                return
            try:
                if self._small is not None:
                    self._life.seq += 1
                    self._small.agree(sig)
                elif self._agreement.first(self.algorithm):
                    self._life.seq += 1
                    self._agreement.check(sig)
                elif self.nprocs > 1 and (self._gpu is None or self._agreement.in_node):
                    self._life.seq += 1
                    self._engine.refuse(sig)
            except ValueError:
                pass  # the others differ: they raise, naming this process
            except BaseException as err:
                self._fail(err)
                raise

    def _perform(self, prep: Prepared) -> None:
        with self._lock:
            self._check_usable()
            algorithm = self._choose(prep)
            self._life.seq += 1
            seq = self._life.seq
            entry = self.flight.start(seq, prep.collective, prep.count, prep.dtype, algorithm)
            debug.trace_call(f"process group rank {self.rank} #{seq}", prep, algorithm)
            try:
                if self._small is not None:
                    # the node's calls agree by arrival (small.py): MPI's calls first
                    if algorithm == "mpi":
                        self._small.agree(call_signature(prep))
                elif self._agreement.first(self.algorithm) or self._agreement.first(algorithm):
                    self._agreement.check(call_signature(prep))
                if algorithm == "small":
                    assert self._small is not None
                    self._small.run(prep)
                elif algorithm == "mpi":
                    run_mpi(self._mpi, prep, entry)
                elif algorithm == "nccl":
                    assert self._gpu is not None
                    self._gpu.run_nccl(prep)
                else:
                    self._engine.run(algorithm, prep, entry)
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
        result = cast("np.ndarray", prep.results[0])
        if async_op:
            # an argument error (a mismatch) is the call's own, raised by its Work: the
            # stream, and the calls behind it, go on
            work = ArgumentErrorWork([], [caller], result, prep, self.timeout, self._stream_error)
            self._stream.call(work.perform, self._perform, prep)
            work.add_event(self._stream.record())
            return work
        self._stream.call(self._perform, prep)
        done = self._stream.record()
        assert caller is not None  # a stream was given
        caller.wait_event(done)
        return result

    def _stream_error(self, exc: BaseException) -> BaseException:
        """A call that failed on the group's stream: its own error."""
        return exc

    def _drain(self) -> None:
        """A host group's calls in flight on its stream finished (send/recv use the
        arena they use)."""
        if self._gpu is None and self._stream is not None:
            self._stream.synchronize(self.timeout)

    def _choose(self, prep: Prepared) -> str:
        """``auto``: the process-group rows of the one rule table (``auto.AUTO``, read
        through ``auto.choose_group`` with this group's facts): MPI's own collectives for
        small messages where MPI can run the call (never in a group started without MPI),
        NCCL on GPUs where it can serve the group, else the tree across nodes and direct
        within one node."""
        if self.algorithm != "auto":
            return self.algorithm
        if self._small is not None and self._small.takes(prep):
            return "small"
        return auto.choose_group(
            gpu=self._gpu is not None,
            nccl_usable=self._gpu is not None and self._gpu.nccl_ok,
            nodes=self.nodes,
            ranks_per_process=len(self.ranks),
            # (no MPI: never MPI's collectives)
            mpi_order=self._MPI is not None and self._mpi_rank_of_proc == list(range(self.nprocs)),
            nbytes=prep.nbytes,
            reduces=COLLECTIVES[prep.collective].reduces,
            mpi_reduces=mpi_reduces(prep.dtype),
        )

    def tree(self, root: int = 0) -> Tree:
        """The tree the group's ``tree`` algorithm reduces and broadcasts over, rooted at
        rank ``root`` (built from the group's topology once per root, then cached).
        ``ValueError`` for a root outside the group."""
        root = check_index(root, "root", self.size)
        if root not in self._trees:
            from ...tree import build_tree

            self._trees[root] = build_tree(self.topology, root=root)
        return self._trees[root]

    def plan(self, collective: str, count: int, *, algorithm: str = "tree", op: str = "sum",
             root: int = 0, in_place: bool = False, dtype: DTypeLike = np.float32) -> Plan:  # fmt: skip
        """The plan a call runs (every process builds the same): ``collective`` (a name
        of the collectives table) over ``count`` elements per rank of ``dtype``, with
        ``algorithm`` (``"tree"``, ``"ring"`` or ``"direct"``), ``op``, ``root`` and
        ``in_place`` as the call would have them. Pure data: nothing runs."""
        return build_plan(
            algorithm, collective_name(collective), size=self.size, count=count, op=op,
            root=root, in_place=in_place, chunk=chunk_elements(CHUNK_BYTES, np.dtype(dtype).itemsize),
            tree_for=self.tree, itemsize=np.dtype(dtype).itemsize,
        )  # fmt: skip


def _p2p_buffer(pg: ProcessGroup, buf: Array, what: str, dtype: object) -> Array:
    """A send's or receive's buffer with its ``dtype=`` checked as a collective's is: a
    numpy buffer that carries the dtype viewed as it (MPI moves bfloat16 as 16-bit
    words); a CuPy one as it is (NCCL moves a uint16 buffer as the bfloat16 it holds)."""
    logical = check_call_dtype(dtype)
    if logical is None:
        return buf
    arr = _device_array(pg.devices[0], buf, f"rank {pg.rank}: {what} buffer")
    return carry(arr, carried_dtype(arr, logical, f"rank {pg.rank}: {what} buffer"))[0]


_current: ProcessGroup | None = None


def init_process_group(
    comm: _MPI.Intracomm | None = None,
    devices: str = "cpu",
    algorithm: str = "auto",
    timeout: float = 60.0,
    shm: bool | None = None,
    *,
    init_method: str | None = None,
    rank: int | None = None,
    world_size: int | None = None,
) -> ProcessGroup:
    """The process group of every process of the job. How the processes meet:
    ``comm`` (an mpi4py communicator: its processes), else ``init_method``:
    ``"env://"`` (torchrun's variables: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
    MASTER_PORT...), ``"tcp://host:port"`` with ``rank=``/``world_size=``,
    ``"file://path"`` (a shared filesystem), ``"slurm"``, ``"mpi"``, or None: what the
    environment shows (MPI under ``mpiexec``, torchrun's or Slurm's variables, else MPI
    where mpi4py imports, else this process alone). Started without MPI, a group keeps
    its data in shared memory within a node and moves GPU data between nodes over NCCL;
    a host group spanning nodes, and ``algorithm="mpi"``, need MPI and are refused.

    ``devices``: ``"cpu"`` (one rank in this process), ``"cpu:N"`` (N ranks), ``"gpu"``
    (one GPU, by the process's index on its node) or ``"gpu:K"`` (CUDA device K).
    ``algorithm``: ``"tree"``, ``"ring"``, ``"direct"``, ``"mpi"``, ``"nccl"`` or
    ``"auto"``. ``timeout``: seconds every wait of the group (its creation included) is
    bounded by; past it the group fails with ``CommTimeout``. ``rank``/``world_size``:
    this process's rank and the number of processes, for ``"tcp://"`` and ``"file://"``
    (the environment's otherwise). Ranks are numbered node-major, then by process, then
    by local rank; the
    node of a process is its host name, or ``NCCLTREE_NODE`` where set. ``shm``: whether
    the processes of a node share memory (default: where ``/dev/shm`` has 64 MiB free, or
    as ``NCCLTREE_SHM`` says; otherwise their data goes over MPI). Collective: every
    process calls it. ``close()`` the group before calling it again.

    Errors: ``ValueError`` for bad arguments or arguments that differ between the
    processes; :class:`~nccltree.BackendUnavailable` where the start is MPI's and
    mpi4py is missing (the message names the ``mpi`` and ``mpich`` extras, and the
    starts without MPI) (or, for GPUs, CuPy); :class:`~nccltree.CommError` when a group is already open here;
    :class:`~nccltree.CommTimeout` or :class:`~nccltree.MissingRanks` when processes do
    not all arrive within ``timeout``."""
    global _current
    if _current is not None and not _current.closed:
        raise CommError("a process group is open in this process; close() it first")
    if comm is not None:
        if init_method is not None or rank is not None or world_size is not None:
            raise ValueError(
                "comm= names an MPI communicator: leave init_method, rank and world_size out"
            )
        _current = ProcessGroup(comm, devices, algorithm, timeout, shm)
        return _current
    timeout = _check_args(devices, algorithm, timeout)[0]
    started, boot, owner = _start(init_method, rank, world_size, timeout)
    try:
        _current = ProcessGroup(
            started.comm, devices, algorithm, timeout, shm,
            bootstrap=boot, owner=owner, method=started.method,
        )  # fmt: skip
    except BaseException as exc:
        if started.mpi is None:
            # the others' waits in the bootstrap end at once, naming this process
            first = str(exc).splitlines()[0] if str(exc) else ""
            boot.abort(f"{type(exc).__name__}: {first}")
            if owner is not None:
                owner.release()
            else:
                close = getattr(boot, "close", None)
                if close is not None:
                    close()
        raise
    return _current


#: the job's bootstrap without MPI, kept between groups: (how it was started, it, its owner)
_kept: tuple[tuple[object, ...], Started, BootOwner] | None = None


def _start(
    init_method: str | None, rank: int | None, world_size: int | None, timeout: float
) -> tuple[Started, Bootstrap, BootOwner | None]:
    """How this group starts: ``launch_env.start`` (MPI, or a bootstrap over a store).
    A store's bootstrap is kept for the process's life (closed at exit) and each group
    gets one of its own on it (``sub`` of every process, keys under a new prefix): a
    group closed and started again meets on the same store, with no second rendezvous
    at the same port racing the first one's end. Returns (started, the group's
    bootstrap, its owner: None over MPI)."""
    global _kept
    how = (init_method, rank, world_size)
    if _kept is not None and _kept[0] != how:
        _kept[2].release()
        _kept = None
    if _kept is None:
        from .launch_env import start

        started = start(init_method, rank, world_size, timeout)
        if started.mpi is not None or started.size == 1 or not hasattr(started.boot, "sub"):
            return started, started.boot, None
        owner = BootOwner(started.boot)
        atexit.register(owner.release)
        _kept = (how, started, owner)
    _, started, owner = _kept
    owner.groups += 1
    sub = cast("SubBootstrap", started.boot).sub(f"group{owner.groups}", list(range(started.size)))
    return started, sub, owner.hold()


__all__ = ["ProcessGroup", "init_process_group", "GROUP_ALGORITHMS"]
