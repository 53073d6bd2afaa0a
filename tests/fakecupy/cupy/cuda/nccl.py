"""Fake ``cupy.cuda.nccl`` (``cupy_backends/cuda/libs/nccl.pyx`` of CuPy 14.2, NCCL 2.x).

Calls are validated as NCCL's ``ArgsCheck`` does (communicator, datatype, op, root, device
pointers on the communicator's GPU) plus two stricter checks NCCL cannot make: buffers
must hold ``count`` elements and the stream must belong to the communicator's GPU. Every
call is logged in ``fake.nccl.calls`` (also failed ones, with their status).

A call is *posted* to its clique; a collective executes (numpy, rank order) once every rank
of the clique has posted its k-th collective, inside a group only at ``groupEnd``. Until
then, the streams of the ranks that posted it are pending (their events report 600).
Group semantics follow ``src/group.cc``: an error inside a group is raised by the failing
call *and* by ``groupEnd``, which then launches nothing of the group. See the
``fakecupy`` package docstring for the fault-injection hooks.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ... import _core
from ..._core import as_int, as_intptr

available = True

NCCL_SUM, NCCL_PROD, NCCL_MAX, NCCL_MIN, NCCL_AVG = 0, 1, 2, 3, 4
NCCL_INT8 = NCCL_CHAR = 0
NCCL_UINT8 = 1
NCCL_INT32 = NCCL_INT = 2
NCCL_UINT32 = 3
NCCL_INT64 = 4
NCCL_UINT64 = 5
NCCL_FLOAT16 = NCCL_HALF = 6
NCCL_FLOAT32 = NCCL_FLOAT = 7
NCCL_FLOAT64 = NCCL_DOUBLE = 8
NCCL_BFLOAT16 = 9
_NUM_TYPES = 10
_MAX_REDOP = 4

ncclSuccess = 0
ncclUnhandledCudaError = 1
ncclSystemError = 2
ncclInternalError = 3
ncclInvalidArgument = 4
ncclInvalidUsage = 5
ncclRemoteError = 6
ncclInProgress = 7

_ERRORS = {
    0: ("NCCL_ERROR_SUCCESS", "no error"),
    1: (
        "NCCL_ERROR_UNHANDLED_CUDA_ERROR",
        "unhandled cuda error (run with NCCL_DEBUG=INFO for details)",
    ),
    2: ("NCCL_ERROR_SYSTEM_ERROR", "unhandled system error (run with NCCL_DEBUG=INFO for details)"),
    3: (
        "NCCL_ERROR_INTERNAL_ERROR",
        "internal error - please report this issue to the NCCL developers",
    ),
    4: ("NCCL_ERROR_INVALID_ARGUMENT", "invalid argument (run with NCCL_DEBUG=WARN for details)"),
    5: ("NCCL_ERROR_INVALID_USAGE", "invalid usage (run with NCCL_DEBUG=WARN for details)"),
    6: ("NCCL_ERROR_REMOTE_ERROR", "remote process exited or there was a network error"),
    7: ("NCCL_ERROR_IN_PROGRESS", "NCCL operation in progress"),
}
NCCL_UNIQUE_ID_BYTES = 128

# storage dtype of each ncclDataType_t (bfloat16 as its 16 bits)
_DTYPE: dict[int, np.dtype[Any]] = {
    0: np.dtype(np.int8), 1: np.dtype(np.uint8), 2: np.dtype(np.int32), 3: np.dtype(np.uint32),
    4: np.dtype(np.int64), 5: np.dtype(np.uint64), 6: np.dtype(np.float16),
    7: np.dtype(np.float32), 8: np.dtype(np.float64), 9: np.dtype(np.uint16),
}  # fmt: skip


class NcclError(RuntimeError):
    def __init__(self, status: int) -> None:
        self.status = status
        name, msg = _ERRORS.get(status, ("NCCL_ERROR_UNKNOWN", "unknown result code"))
        super().__init__(f"{name}: {msg}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.status,))


def check_status(status: int) -> None:
    if status != ncclSuccess:
        raise NcclError(status)


def get_build_version() -> int:
    return 23200


def get_version() -> int:
    return 23200


def get_unique_id() -> bytes:
    return os.urandom(NCCL_UNIQUE_ID_BYTES)


# -- the fake's NCCL state ---------------------------------------------------------------


@dataclass
class NcclCall:
    """One call as NCCL received it. ``status`` is 0 or the ncclResult_t it raised;
    ``group`` numbers the outermost group it was issued in (None outside a group)."""

    method: str
    rank: int
    device: int
    clique: int
    sendbuf: int
    recvbuf: int
    count: int
    datatype: int
    op: int | None
    root: int | None
    peer: int | None
    stream: int
    in_group: bool
    group: int | None
    status: int = 0
    executed: bool = False


@dataclass(eq=False)
class _Posted:
    call: NcclCall
    comm: NcclCommunicator
    stream: _core.StreamState
    token: _core.Token
    hang: bool = False


@dataclass(eq=False)
class _Clique:
    id: int
    nranks: int
    comms: dict[int, NcclCommunicator] = field(default_factory=dict)
    queues: dict[int, list[_Posted]] = field(default_factory=dict)
    p2p: dict[tuple[int, int, str], list[_Posted]] = field(default_factory=dict)
    # a communicator spanning processes: what carries its operations between them
    # (fakecupy._carrier: over MPI, or files), and its MPI communicator where MPI does
    across: Any = None
    mpi: Any = None


class NcclState:
    """``fake.nccl``: the log and the injection hooks of the fake NCCL."""

    def __init__(self) -> None:
        self.calls: list[NcclCall] = []
        self.cliques: list[_Clique] = []
        self._clique_ids = itertools.count()
        self._group_ids = itertools.count(1)
        self.hang_next: set[int] = set()
        self.fail_next: dict[int, int] = {}
        self.fail_init: int = 0
        self.aborted: list[tuple[int, int]] = []  # (clique, rank) in abort order
        self.destroyed: list[tuple[int, int]] = []
        self.init_gates: list[threading.Event] = []  # inits blocked by hang_next_init
        self._hang_init = False

    def hang_next_call(self, rank: int) -> None:
        """The next NCCL call of rank ``rank`` (any clique) never completes: its stream stays
        pending and nothing of that collective is written, until the communicator is
        aborted (which fails the stream with cudaErrorLaunchFailure)."""
        self.hang_next.add(rank)

    def fail_next_call(self, rank: int, status: int = ncclInternalError) -> None:
        """The next NCCL call of rank ``rank`` raises ``NcclError(status)`` (inside a group,
        ``groupEnd`` raises it too and launches nothing)."""
        self.fail_next[rank] = status

    def fail_next_init(self, status: int = ncclSystemError) -> None:
        """The next ``initAll`` or ``NcclCommunicator(...)`` raises ``NcclError(status)``."""
        self.fail_init = status

    def hang_next_init(self) -> Callable[[], None]:
        """The next ``NcclCommunicator(...)`` blocks, as ``ncclCommInitRank`` does while a
        rank never joins, until the returned function (or :meth:`release_inits`) is
        called; it then raises ``NcclError(ncclSystemError)`` (the init was given up)."""
        self._hang_init = True
        gate = threading.Event()
        self.init_gates.append(gate)
        return gate.set

    def release_inits(self) -> None:
        for gate in self.init_gates:
            gate.set()

    def calls_of(self, method: str) -> list[NcclCall]:
        return [c for c in self.calls if c.method == method]


def _state() -> NcclState:
    f = _core.active()
    if f.nccl is None:
        f.nccl = NcclState()
    st: NcclState = f.nccl
    return st


def _take_init_failure() -> None:
    st = _state()
    if st.fail_init:
        status, st.fail_init = st.fail_init, 0
        raise NcclError(status)


def _take_init_hang() -> None:
    st = _state()
    if st._hang_init:
        st._hang_init = False
        gate = st.init_gates[-1]
        gate.wait(600)  # a blocked ncclCommInitRank; released by the test
        raise NcclError(ncclSystemError)


# -- groups ------------------------------------------------------------------------------


def groupStart() -> None:
    tls = _core.active().tls
    if tls.group_depth == 0:
        tls.group_id = next(_state()._group_ids)
        tls.group_error = 0
        tls.group_calls = []
    tls.group_depth += 1


def groupEnd() -> None:
    fake = _core.active()
    tls = fake.tls
    if tls.group_depth == 0:
        raise NcclError(ncclInvalidUsage)
    tls.group_depth -= 1
    if tls.group_depth > 0:
        return
    calls, tls.group_calls = tls.group_calls, []
    err, tls.group_error = tls.group_error, 0
    if err:
        # ncclGroupEndInternal: a failed call in the group fails the whole group, and
        # none of its operations is launched
        raise NcclError(err)
    with fake.lock:
        for p in calls:
            _post(p)
        _progress_all()


# -- communicators -----------------------------------------------------------------------


class NcclCommunicator:
    def __init__(self, ndev: int, commId: bytes, rank: int, config: Any = None) -> None:
        n = as_int(ndev, "ndev")
        r = as_int(rank, "rank")
        if not isinstance(commId, bytes):
            raise TypeError("Argument 'commId' has incorrect type (expected bytes)")
        if len(commId) != NCCL_UNIQUE_ID_BYTES:
            raise ValueError(f"commId length {len(commId)} != {NCCL_UNIQUE_ID_BYTES}.")
        _take_init_failure()
        _take_init_hang()
        st = _state()
        if n < 1 or not 0 <= r < n:
            raise NcclError(ncclInvalidArgument)
        fake = _core.active()
        if n > 1 and (fake.mpi_comm is not None or fake.nccl_files):
            self._join_processes(n, commId, r, fake)
            return
        clique = next((c for c in st.cliques if getattr(c, "uid", None) == commId), None)
        if clique is None:
            clique = _Clique(next(st._clique_ids), n)
            clique.uid = commId
            st.cliques.append(clique)
        if r in clique.comms or clique.nranks != n:
            raise NcclError(ncclInvalidUsage)
        self._attach(clique, r, _core.active().tls.device)

    def _join_processes(self, n: int, uid: bytes, r: int, fake: _core.FakeCuda) -> None:
        """A communicator spanning processes (``fake.mpi_comm`` or ``fake.nccl_files``
        set): every process makes its rank at once (collective, as ncclCommInitRank);
        operations run through the carrier when posted (see _run_across). Only the
        communicator's processes take part (a sub-group's): over MPI they find each other
        through files named after the unique id, then make an MPI communicator of just
        them (MPI_Comm_create_group); over files, the unique id names their folder."""
        from ... import _carrier

        mpi = None
        across: Any
        if fake.mpi_comm is not None:
            mpi = _members_comm(fake.mpi_comm, n, uid, r)
        else:
            across = _carrier.FileCarrier(uid, r, n)
        # a GPU is (its machine, its number): NCCL's "Duplicate GPU detected". NCCL
        # (2.28) takes the machine's identity from NCCL_HOSTID where it is set.
        host = (os.environ.get("NCCL_HOSTID") or os.environ.get("NCCLTREE_NODE")
                or os.uname().nodename)  # fmt: skip
        mine = (r, uid, (host, fake.tls.device))
        got = mpi.allgather(mine) if mpi is not None else across.allgather(mine)
        got = sorted(got, key=lambda x: x[0]) if mpi is None else got
        ranks = sorted(x[0] for x in got)
        gpus = [x[2] for x in got]
        if (
            ranks != list(range(n))
            or len({x[1] for x in got}) != 1
            or len(got) != n
            or len(set(gpus)) != len(gpus)
        ):
            if mpi is not None:
                mpi.Free()
            else:
                across.close()
            raise NcclError(ncclInvalidUsage)
        st = _state()
        clique = _Clique(next(st._clique_ids), n)
        if mpi is not None:
            across = _carrier.MpiCarrier(mpi, {x[0]: i for i, x in enumerate(got)})
        clique.mpi = mpi
        clique.across = across
        st.cliques.append(clique)
        self._attach(clique, r, fake.tls.device)
        for rr in range(n):  # the other ranks live elsewhere: the clique is complete
            clique.queues.setdefault(rr, [])

    def _attach(self, clique: _Clique, rank: int, device: int) -> None:
        self._clique = clique
        self._rank = rank
        self._device = device
        self._alive = True
        self._hung: list[_Posted] = []
        clique.comms[rank] = self
        clique.queues[rank] = []

    @property
    def comm(self) -> int:
        return id(self) if self._alive else 0

    @staticmethod
    def initAll(devices: Any) -> list[NcclCommunicator]:
        if isinstance(devices, list):
            devlist = devices
        elif isinstance(devices, int):
            devlist = list(range(devices))
        else:
            raise ValueError('"devices" should be an int or a list of int.')
        ids = [as_int(d, "devices[i]") for d in devlist]
        _take_init_failure()
        fake = _core.active()
        if not ids:
            raise NcclError(ncclInvalidArgument)
        for d in ids:
            if not 0 <= d < fake.n_gpus:
                raise NcclError(ncclInvalidArgument)
        if len(set(ids)) != len(ids):
            raise NcclError(ncclInvalidUsage)  # "Duplicate device" in ncclCommInitAll
        st = _state()
        clique = _Clique(next(st._clique_ids), len(ids))
        st.cliques.append(clique)
        comms = []
        for r, d in enumerate(ids):
            c = NcclCommunicator.__new__(NcclCommunicator)
            c._attach(clique, r, d)
            comms.append(c)
        return comms

    # -- life cycle --

    def _release(self, what: str) -> None:
        """Abort/destroy: the communicator is gone; its unfinished work fails."""
        if not self._alive:
            return
        self._alive = False
        if self._clique.across is not None:
            self._clique.across.close()  # (files: this rank's unread messages, the folder)
        st = _state()
        (st.aborted if what == "abort" else st.destroyed).append((self._clique.id, self._rank))
        with _core.active().lock:
            for p in self._clique.queues.get(self._rank, []):
                p.token.release(_core.ERROR_LAUNCH_FAILURE)
            self._clique.queues[self._rank] = []
            for lst in self._clique.p2p.values():
                for p in [p for p in lst if p.comm is self]:
                    p.token.release(_core.ERROR_LAUNCH_FAILURE)
                    lst.remove(p)
            for p in self._hung:
                p.token.release(_core.ERROR_LAUNCH_FAILURE)
            self._hung = []

    def destroy(self) -> None:
        self._release("destroy")

    def abort(self) -> None:
        self._release("abort")

    def _check_alive(self) -> None:
        if not self._alive:
            raise NcclError(ncclInvalidArgument)  # CuPy passes the NULL comm on

    def device_id(self) -> int:
        self._check_alive()
        return self._device

    def rank_id(self) -> int:
        self._check_alive()
        return self._rank

    def size(self) -> int:
        self._check_alive()
        return self._clique.nranks

    def check_async_error(self) -> None:
        self._check_alive()

    # -- operations --

    def allReduce(
        self, sendbuf: int, recvbuf: int, count: int, datatype: int, op: int, stream: int
    ) -> None:
        self._call("allReduce", sendbuf, recvbuf, count, datatype, op, None, None, stream)

    def reduce(
        self, sendbuf: int, recvbuf: int, count: int, datatype: int, op: int, root: int,
        stream: int,
    ) -> None:  # fmt: skip
        self._call("reduce", sendbuf, recvbuf, count, datatype, op, root, None, stream)

    def broadcast(
        self, sendbuff: int, recvbuff: int, count: int, datatype: int, root: int, stream: int
    ) -> None:
        self._call("broadcast", sendbuff, recvbuff, count, datatype, None, root, None, stream)

    def bcast(self, buff: int, count: int, datatype: int, root: int, stream: int) -> None:
        self._call("broadcast", buff, buff, count, datatype, None, root, None, stream)

    def reduceScatter(
        self, sendbuf: int, recvbuf: int, recvcount: int, datatype: int, op: int, stream: int
    ) -> None:
        self._call("reduceScatter", sendbuf, recvbuf, recvcount, datatype, op, None, None, stream)

    def allGather(self, sendbuf: int, recvbuf: int, count: int, datatype: int, stream: int) -> None:
        self._call("allGather", sendbuf, recvbuf, count, datatype, None, None, None, stream)

    def send(self, sendbuf: int, count: int, datatype: int, peer: int, stream: int) -> None:
        self._call("send", sendbuf, 0, count, datatype, None, None, peer, stream)

    def recv(self, recvbuf: int, count: int, datatype: int, peer: int, stream: int) -> None:
        self._call("recv", 0, recvbuf, count, datatype, None, None, peer, stream)

    def _call(
        self, method: str, sendbuf: Any, recvbuf: Any, count: Any, datatype: Any, op: Any,
        root: Any, peer: Any, stream: Any,
    ) -> None:  # fmt: skip
        # argument conversion first: Cython raises TypeError before NCCL is reached
        sb = as_intptr(sendbuf, "sendbuf")
        rb = as_intptr(recvbuf, "recvbuf")
        n = as_int(count, "count", unsigned=True, bits=64)
        dt = as_int(datatype, "datatype")
        o = None if op is None else as_int(op, "op")
        rt = None if root is None else as_int(root, "root")
        pr = None if peer is None else as_int(peer, "peer")
        sp = as_intptr(stream, "stream")
        fake = _core.active()
        st = _state()
        tls = fake.tls
        in_group = tls.group_depth > 0
        call = NcclCall(
            method, self._rank, self._device, self._clique.id, sb, rb, n, dt, o, rt, pr, sp,
            in_group, tls.group_id if in_group else None,
        )  # fmt: skip
        st.calls.append(call)
        with fake.lock:
            status, s = self._validate(fake, call)
            if status == 0 and self._rank in st.fail_next:
                status = st.fail_next.pop(self._rank)
            if status:
                call.status = status
                if in_group:  # ncclGroupErrCheck
                    tls.group_error = status
                raise NcclError(status)
            assert s is not None
            posted = _Posted(call, self, s, _core.Token(f"nccl {method}", self))
            if self._rank in st.hang_next:
                st.hang_next.discard(self._rank)
                posted.hang = True
            fake.log("nccl", s, sp, dst=rb, src=sb, nbytes=n, detail=method)
            if in_group:
                tls.group_calls.append(posted)
            else:
                _post(posted)
                _progress_all()

    def _validate(self, fake: _core.FakeCuda, c: NcclCall) -> tuple[int, _core.StreamState | None]:
        if not self._alive:
            return ncclInvalidArgument, None
        n = self._clique.nranks
        if c.root is not None and not 0 <= c.root < n:
            return ncclInvalidArgument, None
        if c.peer is not None and not 0 <= c.peer < n:
            return ncclInvalidArgument, None
        if not 0 <= c.datatype < _NUM_TYPES:
            return ncclInvalidArgument, None
        if c.op is not None and not 0 <= c.op <= _MAX_REDOP:
            return ncclInvalidArgument, None
        item = _DTYPE[c.datatype].itemsize
        send_n = recv_n = c.count
        if c.method == "allGather":
            recv_n = c.count * n
        elif c.method == "reduceScatter":
            send_n = c.count * n
        checks = []
        uses_send = c.method not in ("recv",) and (c.method != "broadcast" or self._rank == c.root)
        uses_recv = c.method not in ("send",) and (c.method != "reduce" or self._rank == c.root)
        if c.count > 0:
            if uses_send:
                checks.append((c.sendbuf, send_n * item))
            if uses_recv:
                checks.append((c.recvbuf, recv_n * item))
        for ptr, nb in checks:
            kind, owner, _ = fake.resolve(ptr, nb)
            # CudaPtrCheck: a device pointer of this communicator's GPU (the fake also
            # insists that the count fits the allocation)
            if kind != "device" or owner != self._device:
                return ncclInvalidArgument, None
        try:
            s = (
                fake.stream(c.stream)
                if c.stream not in (0, 1, 2)
                else fake.null_streams[self._device]
            )
        except Exception:  # noqa: BLE001 - an invalid stream handle is a CUDA error in NCCL
            return ncclUnhandledCudaError, None
        if s.device != self._device or fake.device_error[self._device]:
            return ncclUnhandledCudaError, None
        return ncclSuccess, s


# -- matching and execution --------------------------------------------------------------


def _post(p: _Posted) -> None:
    # enqueued on its stream now (inside a group: at groupEnd), pending until it executes
    p.stream.pending.add(p.token)
    c = p.comm._clique
    if c.across is not None:
        _run_across(p)
        return
    if p.call.method in ("send", "recv"):
        src, dst = (
            (p.call.rank, p.call.peer) if p.call.method == "send" else (p.call.peer, p.call.rank)
        )
        assert src is not None and dst is not None
        c.p2p.setdefault((src, dst, p.call.method), []).append(p)
    else:
        c.queues[p.call.rank].append(p)


def _progress_all() -> None:
    for c in _state().cliques:
        _progress(c)


def _progress(c: _Clique) -> None:
    fake = _core.active()
    while len(c.comms) == c.nranks and all(c.queues.get(r) for r in range(c.nranks)):
        ops = [c.queues[r].pop(0) for r in range(c.nranks)]
        first = ops[0].call
        for p in ops[1:]:
            k = p.call
            if (k.method, k.count, k.datatype, k.op, k.root) != (
                first.method, first.count, first.datatype, first.op, first.root
            ):  # fmt: skip
                raise fake.misuse_error(
                    f"mismatched NCCL collectives in clique {c.id}: rank 0 posted "
                    f"{first.method}(count={first.count}, datatype={first.datatype}, "
                    f"op={first.op}, root={first.root}), rank {k.rank} posted {k.method}("
                    f"count={k.count}, datatype={k.datatype}, op={k.op}, root={k.root})"
                )
        if any(p.hang for p in ops):
            for p in ops:
                p.comm._hung.append(p)
            continue
        _execute(fake, ops)
        for p in ops:
            p.call.executed = True
            p.token.release(0)
    for (src, dst, method), sends in list(c.p2p.items()):
        if method != "send":
            continue
        recvs = c.p2p.get((src, dst, "recv"), [])
        while sends and recvs:
            s, r = sends.pop(0), recvs.pop(0)
            if (s.call.count, s.call.datatype) != (r.call.count, r.call.datatype):
                raise fake.misuse_error(f"send/recv {src}->{dst}: count or datatype differ")
            if s.hang or r.hang:
                for p in (s, r):
                    p.comm._hung.append(p)
                continue
            nb = s.call.count * _DTYPE[s.call.datatype].itemsize
            if nb:
                np.copyto(fake.bytes_at(r.call.recvbuf, nb), fake.bytes_at(s.call.sendbuf, nb))
            for p in (s, r):
                p.call.executed = True
                p.token.release(0)


def _to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _from_f32(x: np.ndarray) -> np.ndarray:
    u = x.astype(np.float32).view(np.uint32)
    rounded = u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))  # round to nearest even
    out = (rounded >> 16).astype(np.uint16)
    return np.where(np.isnan(x), np.uint16(0x7FC0), out)


def _reduce(arrays: list[np.ndarray], op: int, datatype: int) -> np.ndarray:
    bf16 = datatype == NCCL_BFLOAT16
    xs = [
        _to_f32(a) if bf16 else a.astype(np.float32) if a.dtype == np.float16 else a for a in arrays
    ]
    n = len(xs)
    with np.errstate(all="ignore"):
        if op == NCCL_AVG and xs[0].dtype.kind == "f":
            # NCCL's ncclDevPreMulSum: each input times 1/n, then summed
            scale = xs[0].dtype.type(1.0 / n)
            acc = xs[0] * scale
            for x in xs[1:]:
                acc = acc + x * scale
        else:
            acc = xs[0].copy()
            for x in xs[1:]:
                if op in (NCCL_SUM, NCCL_AVG):
                    acc = acc + x
                elif op == NCCL_PROD:
                    acc = acc * x
                elif op == NCCL_MAX:
                    acc = np.maximum(acc, x)
                else:
                    acc = np.minimum(acc, x)
            if op == NCCL_AVG:  # integers: ncclDevSumPostDiv, truncating
                acc = (np.trunc(acc / n)).astype(acc.dtype)
    if bf16:
        return _from_f32(acc)
    return acc.astype(arrays[0].dtype)


def _execute(fake: _core.FakeCuda, ops: list[_Posted]) -> None:
    c0 = ops[0].call
    t = _DTYPE[c0.datatype]
    n = c0.count
    nr = len(ops)

    def get(ptr: int, count: int) -> np.ndarray:
        return fake.bytes_at(ptr, count * t.itemsize).view(t)

    if n == 0:
        return
    m = c0.method
    if m == "allReduce":
        res = _reduce([get(p.call.sendbuf, n).copy() for p in ops], c0.op or 0, c0.datatype)
        for p in ops:
            get(p.call.recvbuf, n)[...] = res
    elif m == "reduce":
        assert c0.root is not None
        res = _reduce([get(p.call.sendbuf, n).copy() for p in ops], c0.op or 0, c0.datatype)
        get(ops[c0.root].call.recvbuf, n)[...] = res
    elif m == "broadcast":
        assert c0.root is not None
        src = get(ops[c0.root].call.sendbuf, n).copy()
        for p in ops:
            get(p.call.recvbuf, n)[...] = src
    elif m == "allGather":
        parts = [get(p.call.sendbuf, n).copy() for p in ops]
        for p in ops:
            get(p.call.recvbuf, n * nr)[...] = np.concatenate(parts)
    elif m == "reduceScatter":
        full = _reduce([get(p.call.sendbuf, n * nr).copy() for p in ops], c0.op or 0, c0.datatype)
        for r, p in enumerate(ops):
            get(p.call.recvbuf, n)[...] = full[r * n : (r + 1) * n]


def _members_comm(world: Any, n: int, uid: bytes, r: int) -> Any:
    """An MPI communicator of the ``n`` processes joining ``uid``, ordered by NCCL rank."""
    where = f"/dev/shm/fakecupy-nccl-{_core.session_tag()}-{uid.hex()[:24]}"
    os.makedirs(where, exist_ok=True)
    mine = os.path.join(where, str(r))
    with open(mine + ".tmp", "w") as f:
        f.write(str(world.Get_rank()))
    os.replace(mine + ".tmp", mine)
    deadline = time.monotonic() + 60
    while True:
        names = [x for x in os.listdir(where) if x.isdigit()]
        if len(names) >= n:
            break
        if time.monotonic() > deadline:
            raise NcclError(ncclInvalidUsage)  # a rank never joined
        time.sleep(0.005)
    ranks = []
    for k in range(n):
        with open(os.path.join(where, str(k))) as f:
            ranks.append(int(f.read()))
    group = world.Get_group().Incl(ranks)
    comm = world.Create_group(group)
    group.Free()
    comm.Barrier()  # every member read the files
    os.unlink(mine)
    if r == 0:
        comm.Barrier()
        os.rmdir(where)
    else:
        comm.Barrier()
    return comm


def _run_across(p: _Posted) -> None:
    """An operation of a communicator spanning processes, run at once through its carrier
    (MPI or files, fakecupy._carrier; wiring only): a
    send is buffered (``isend``), a receive waits for its message, a collective gathers
    every rank's input and checks that all posted the same collective. Wiring only: real
    NCCL sends wait for their receive. A call marked to hang (``hang_next_call``) moves
    nothing and stays pending, as on one process: hang every process's call, or the
    others wait in MPI for it."""
    fake = _core.active()
    c = p.comm._clique
    if p.hang:
        p.comm._hung.append(p)
        return
    across = c.across
    k = p.call
    t = _DTYPE[k.datatype]

    def get(ptr: int, count: int) -> np.ndarray:
        return fake.bytes_at(ptr, count * t.itemsize).view(t)

    n = c.nranks
    if k.method == "send":
        assert k.peer is not None
        data = get(k.sendbuf, k.count).copy()
        across.send("p2p", k.peer, (k.count, k.datatype, data))
    elif k.method == "recv":
        assert k.peer is not None
        count, datatype, data = across.recv("p2p", k.peer)
        if (count, datatype) != (k.count, k.datatype):
            raise fake.misuse_error(
                f"send/recv {k.peer}->{k.rank}: count or datatype differ "
                f"({count}, {datatype}) != ({k.count}, {k.datatype})"
            )
        if k.count:
            get(k.recvbuf, k.count)[...] = data
    else:
        send_n = k.count * n if k.method == "reduceScatter" else k.count
        uses_send = k.method != "broadcast" or k.rank == k.root
        mine = get(k.sendbuf, send_n).copy() if uses_send and k.count else None
        sig = (k.method, k.count, k.datatype, k.op, k.root)
        got = sorted(across.allgather((k.rank, sig, mine)), key=lambda x: x[0])
        for rank, other, _ in got:
            if other != sig:
                raise fake.misuse_error(
                    f"mismatched NCCL collectives across processes: rank {k.rank} posted "
                    f"{sig}, rank {rank} posted {other}"
                )
        if k.count:
            datas = [x[2] for x in got]
            m = k.method
            if m == "allReduce":
                get(k.recvbuf, k.count)[...] = _reduce(datas, k.op or 0, k.datatype)
            elif m == "reduce":
                if k.rank == k.root:
                    get(k.recvbuf, k.count)[...] = _reduce(datas, k.op or 0, k.datatype)
            elif m == "broadcast":
                assert k.root is not None
                get(k.recvbuf, k.count)[...] = datas[k.root]
            elif m == "allGather":
                get(k.recvbuf, k.count * n)[...] = np.concatenate(datas)
            elif m == "reduceScatter":
                full = _reduce(datas, k.op or 0, k.datatype)
                get(k.recvbuf, k.count)[...] = full[k.rank * k.count : (k.rank + 1) * k.count]
    k.executed = True
    p.token.release(0)
