"""The simulated machine behind the fake ``cupy``: GPUs, memory, streams, events, logs.

Everything here is host memory and Python; nothing is a GPU. The fake modules (``cupy``,
``cupy.cuda.runtime``, ``cupy.cuda.nccl``, ...) call into one :class:`FakeCuda` object,
which tests reach through the ``fake_cupy`` fixture to inject faults and inspect what was
called. See the package docstring for the rules.
"""

from __future__ import annotations

import bisect
import ctypes
import itertools
import os
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# cudaError_t codes the fake produces (names as cudaGetErrorName prints them)
SUCCESS = 0
ERROR_INVALID_VALUE = 1
ERROR_MEMORY_ALLOCATION = 2
ERROR_INVALID_DEVICE_POINTER = 17
ERROR_INVALID_MEMCPY_DIRECTION = 21
ERROR_NO_DEVICE = 100
ERROR_INVALID_DEVICE = 101
ERROR_PEER_ACCESS_UNSUPPORTED = 217
ERROR_INVALID_CONTEXT = 201
ERROR_INVALID_RESOURCE_HANDLE = 400
ERROR_NOT_READY = 600
ERROR_ILLEGAL_ADDRESS = 700
ERROR_PEER_ACCESS_ALREADY_ENABLED = 704
ERROR_PEER_ACCESS_NOT_ENABLED = 705
ERROR_TOO_MANY_PEERS = 711
ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712
ERROR_HOST_MEMORY_NOT_REGISTERED = 713
ERROR_LAUNCH_FAILURE = 719

ERROR_NAMES: dict[int, tuple[str, str]] = {
    0: ("cudaSuccess", "no error"),
    1: ("cudaErrorInvalidValue", "invalid argument"),
    2: ("cudaErrorMemoryAllocation", "out of memory"),
    17: ("cudaErrorInvalidDevicePointer", "invalid device pointer"),
    21: ("cudaErrorInvalidMemcpyDirection", "invalid copy direction for memcpy"),
    100: ("cudaErrorNoDevice", "no CUDA-capable device is detected"),
    101: ("cudaErrorInvalidDevice", "invalid device ordinal"),
    217: (
        "cudaErrorPeerAccessUnsupported",
        "peer access is not supported between these two devices",
    ),
    201: ("cudaErrorInvalidContext", "invalid device context"),
    400: ("cudaErrorInvalidResourceHandle", "invalid resource handle"),
    600: ("cudaErrorNotReady", "device not ready"),
    700: ("cudaErrorIllegalAddress", "an illegal memory access was encountered"),
    704: ("cudaErrorPeerAccessAlreadyEnabled", "peer access is already enabled"),
    705: ("cudaErrorPeerAccessNotEnabled", "peer access has not been enabled"),
    711: ("cudaErrorTooManyPeers", "peer mapping resources exhausted"),
    712: (
        "cudaErrorHostMemoryAlreadyRegistered",
        "part or all of the requested memory range is already mapped",
    ),
    713: (
        "cudaErrorHostMemoryNotRegistered",
        "pointer does not correspond to a registered memory region",
    ),
    719: ("cudaErrorLaunchFailure", "unspecified launch failure"),
}

# Device memory lives at fake addresses far above any user-space host address (x86-64 user
# space ends below 2**47), so a device pointer can never be taken for host memory, nor the
# other way round; stream, event and program handles live in a range of their own.
DEVICE_BASE = 1 << 48
DEVICE_SPAN = 1 << 40
HANDLE_BASE = 1 << 56
ALIGN = 512  # CuPy's pool hands out 512-byte aligned blocks
HOST_MIN = 1 << 16  # Linux never maps the first 64 KiB
HOST_MAX = 1 << 47


class FakeMisuse(AssertionError):
    """Something real CUDA, NCCL or CuPy would not report but that is certainly a bug
    (a call that would block forever, mismatched collectives, a kernel argument CUDA would
    misread). Also recorded in :attr:`FakeCuda.misuse`, which the fixture checks after the
    test, so swallowing it in a broad ``except`` does not hide it."""


#: set by the tests' conftest to its process id, inherited by every process a test starts
SESSION_ENV = "NCCLTREE_TEST_SESSION"


def session_tag() -> str:
    """``<uid>-s<session>``: what the names of the fake's files in /dev/shm start with, so
    that a test run can tell its own leftovers from those of other runs on the machine."""
    uid = os.getuid() if hasattr(os, "getuid") else 0
    return f"{uid}-s{os.environ.get(SESSION_ENV, '0')}"


def error_text(status: int) -> str:
    name, msg = ERROR_NAMES.get(status, (f"cudaError{status}", "unknown error"))
    return f"{name}: {msg}"


# -- memory ------------------------------------------------------------------------------


@dataclass(eq=False)
class Allocation:
    """One block of memory the fake knows: ``kind`` is ``"device"`` (a GPU allocation),
    ``"pinned"`` (``cudaHostAlloc``) or ``"registered"`` (``cudaHostRegister``)."""

    kind: str
    device: int  # GPU ordinal; -1 for host memory
    base: int
    size: int
    buffer: np.ndarray | None  # uint8 backing store (None for registered user memory)
    stream: int | None  # device memory: handle of the current stream when allocated
    thread: str = ""  # name of the allocating thread
    flags: int = 0
    freed: bool = False
    #: CUDA IPC: the file that backs an exported block (shared with the processes that
    #: open it), or "" ; ``ipc_opened``: this block is another process's, opened here
    ipc_path: str = ""
    ipc_opened: bool = False
    ipc_map: Any = None

    def contains(self, ptr: int, nbytes: int) -> bool:
        return self.base <= ptr and ptr + nbytes <= self.base + self.size

    def view(self, ptr: int, nbytes: int) -> np.ndarray:
        """The bytes [ptr, ptr + nbytes) of this block as a writable uint8 array."""
        off = ptr - self.base
        if self.buffer is not None:
            return self.buffer[off : off + nbytes]
        return host_bytes(ptr, nbytes)


def host_bytes(ptr: int, nbytes: int) -> np.ndarray:
    """Plain host memory at ``ptr`` (a numpy array's buffer) as a uint8 array."""
    if nbytes == 0:
        return np.empty(0, np.uint8)
    return np.ctypeslib.as_array((ctypes.c_ubyte * nbytes).from_address(ptr))


# -- streams and events ------------------------------------------------------------------


class Token:
    """A piece of work that has not completed yet (a hung stream, NCCL work waiting for its
    peers or hung by injection). ``status`` stays None until it is released: 0 when it
    completes, a CUDA error code when it fails."""

    _ids = itertools.count(1)

    def __init__(self, what: str, comm: object | None = None) -> None:
        self.id = next(Token._ids)
        self.what = what
        self.comm = comm
        self.status: int | None = None

    def release(self, status: int = 0) -> None:
        if self.status is None:
            self.status = status

    def __repr__(self) -> str:
        return f"<Token {self.id} {self.what} status={self.status}>"


@dataclass(eq=False)
class StreamState:
    ptr: int  # the handle CuPy shows as Stream.ptr (0 for a device's legacy null stream)
    device: int
    flags: int = 0
    priority: int = 0
    error: int = 0  # sticky: once set, every query of the stream returns it
    pending: set[Token] = field(default_factory=set)
    destroyed: bool = False

    def status(self, fake: FakeCuda) -> int:
        dev_err = fake.device_error[self.device]
        if dev_err:
            return dev_err
        if self.error:
            return self.error
        busy = False
        for t in list(self.pending):
            if t.status is None:
                busy = True
            elif t.status:
                self.error = t.status
                return t.status
            else:
                self.pending.discard(t)
        return ERROR_NOT_READY if busy else SUCCESS


@dataclass(eq=False)
class EventState:
    ptr: int
    device: int
    flags: int
    recorded: bool = False
    stream: int | None = None
    error: int = 0
    tokens: frozenset[Token] = frozenset()
    destroyed: bool = False

    def status(self, fake: FakeCuda) -> int:
        if not self.recorded:
            return SUCCESS
        dev_err = fake.device_error[self.device]
        if dev_err:
            return dev_err
        if self.error:
            return self.error
        busy = False
        for t in self.tokens:
            if t.status is None:
                busy = True
            elif t.status:
                return t.status
        return ERROR_NOT_READY if busy else SUCCESS


# -- logs --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Op:
    """One piece of work enqueued on a stream: ``kind`` is ``memcpy``, ``memcpy_peer``,
    ``memset``, ``kernel``, ``event_record``, ``wait_event`` or ``nccl``.

    ``stream`` is the handle passed (0 for the legacy null stream), ``device`` the GPU the
    stream belongs to and ``current`` the calling thread's current GPU; ``dst``/``src`` are
    the pointers touched and ``nbytes`` the size."""

    kind: str
    stream: int
    device: int
    current: int
    dst: int = 0
    src: int = 0
    nbytes: int = 0
    detail: str = ""


@dataclass(frozen=True)
class KernelLaunch:
    """One kernel launch: the arguments as CUDA saw them (pointers as ints, scalars as
    numpy scalars, ``nt_srcs`` as a tuple of 8 pointers)."""

    name: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    args: tuple[Any, ...]
    stream: int
    device: int
    shared_mem: int
    origin: str  # "path" (a module loaded from a file) or "code" (cupy.RawModule(code=))
    ftz: bool


class _TLS(threading.local):
    def __init__(self) -> None:
        self.device = 0
        self.device_stack: list[int] = []
        # CuPy's per-thread stream bookkeeping (cupy/cuda/stream.pyx _ThreadLocal)
        self.current_stream: dict[int, Any] = {}
        self.stream_stack: dict[int, list[Any]] = {}
        self.stream_device_stack: list[int] = []
        # NCCL's per-thread group state (src/group.cc)
        self.group_depth = 0
        self.group_error = 0
        self.group_calls: list[Any] = []
        self.group_id = 0


class FakeCuda:
    """The fake machine: ``n_gpus`` GPUs of compute capability ``compute_capability``;
    ``peer`` says which ordered pairs (a, b) may enable access from a to b's memory (True:
    all, False: none, or an iterable of pairs).

    ``fault_mode`` says what an illegal address in a kernel does: ``"raise"`` raises
    ``CUDARuntimeError(700)`` at the launch (handy for wiring tests); ``"async"`` marks the
    stream failed with 700, reported by later queries and synchronisations, as on a GPU.
    """

    def __init__(
        self,
        n_gpus: int = 4,
        peer: bool | Iterable[tuple[int, int]] = True,
        *,
        compute_capability: str = "90",
        fault_mode: str = "raise",
    ) -> None:
        if fault_mode not in ("raise", "async"):
            raise ValueError(f"fault_mode must be 'raise' or 'async', got {fault_mode!r}")
        self.n_gpus = n_gpus
        if peer is True:
            self.peer_capable = {(a, b) for a in range(n_gpus) for b in range(n_gpus) if a != b}
        elif peer is False:
            self.peer_capable = set()
        else:
            self.peer_capable = {(int(a), int(b)) for a, b in peer if a != b}
        self.compute_capability = [compute_capability] * n_gpus
        self.fault_mode = fault_mode
        self.lock = threading.RLock()
        self.tls = _TLS()
        #: (a, b): access from GPU a to GPU b's memory is enabled
        self.peer_enabled: set[tuple[int, int]] = set()
        #: (a, b) -> status deviceEnablePeerAccess(b) raises on GPU a (injected)
        self.peer_errors: dict[tuple[int, int], int] = {}
        #: GPU -> sticky context error (0: none)
        self.device_error = [0] * n_gpus
        self._dev_allocs: dict[int, Allocation] = {}
        self._dev_bases: list[int] = []
        self._next_dev = [DEVICE_BASE + d * DEVICE_SPAN + ALIGN for d in range(n_gpus)]
        self._host_allocs: dict[int, Allocation] = {}
        self._host_bases: list[int] = []
        self._handles = itertools.count(HANDLE_BASE, 16)
        self.streams: dict[int, StreamState] = {}
        self.null_streams = [StreamState(0, d) for d in range(n_gpus)]
        self.events: dict[int, EventState] = {}
        #: every operation enqueued on a stream, in order
        self.ops: list[Op] = []
        #: every kernel launch, in order
        self.launches: list[KernelLaunch] = []
        #: every problem the fake raised as FakeMisuse
        self.misuse: list[str] = []
        #: CUDA IPC calls: ("export", base, size), ("open", pid, base, size, local base),
        #: ("close", ptr), ("export_event", event), ("open_event", pid, event, local)
        self.ipc_log: list[tuple[Any, ...]] = []
        #: eventQuery calls per event handle (a host-side wait on a peer's event)
        self.event_queries: dict[int, int] = {}
        #: an mpi4py communicator: NCCL communicators of more than one rank made with
        #: ``NcclCommunicator(n, uid, rank)`` then span the processes (cupy/cuda/nccl.py)
        self.mpi_comm: Any = None
        #: without MPI: NCCL communicators of more than one rank span the processes,
        #: their operations carried by files in /dev/shm (fakecupy/_carrier.py)
        self.nccl_files = False
        #: state of cupy.cuda.nccl (see nccl.py)
        self.nccl: Any = None
        #: state of cupy.cuda.nvrtc: handle -> program
        self.programs: dict[int, Any] = {}
        #: the allocator behind cupy.cuda.alloc_pinned_memory (the default pool's malloc)
        self.pinned_pool: Any = None
        #: cupy.get_default_pinned_memory_pool()
        self.default_pinned_pool: Any = None

    # -- errors ----------------------------------------------------------------------------

    def misuse_error(self, message: str) -> FakeMisuse:
        self.misuse.append(message)
        return FakeMisuse(message)

    # -- devices ---------------------------------------------------------------------------

    def check_device(self, device: int) -> None:
        from .cupy.cuda.runtime import CUDARuntimeError

        if not 0 <= device < self.n_gpus:
            raise CUDARuntimeError(ERROR_INVALID_DEVICE)

    def current_device(self) -> int:
        return self.tls.device

    def peer_ok(self, current: int, owner: int) -> bool:
        return current == owner or (current, owner) in self.peer_enabled

    # -- memory ----------------------------------------------------------------------------

    def malloc_device(self, device: int, nbytes: int, stream: int) -> Allocation:
        """A device block of ``nbytes`` on ``device``, remembered with the stream that was
        current (CuPy's pool keeps an arena per stream)."""
        with self.lock:
            base = self._next_dev[device]
            # a guard gap after each block, so an overrun never lands in the next one
            self._next_dev[device] += (-(-max(nbytes, 1) // ALIGN) + 1) * ALIGN
            buf = np.zeros(max(nbytes, 1), np.uint8)
            # uninitialised memory is not zero on a GPU: make reads of it visible
            buf.fill(0xA5)
            a = Allocation(
                "device", device, base, nbytes, buf, stream, threading.current_thread().name
            )
            self._dev_allocs[base] = a
            bisect.insort(self._dev_bases, base)
            return a

    def adopt_device(self, device: int, buffer: np.ndarray) -> Allocation:
        """Another process's device block, opened through CUDA IPC: ``buffer`` is the
        shared memory behind it, mapped at a fresh address of this process."""
        with self.lock:
            a = self.malloc_device(device, buffer.size, 0)
            a.buffer = buffer
            a.ipc_opened = True
            return a

    def free_device(self, a: Allocation) -> None:
        with self.lock:
            a.freed = True
            a.buffer = None
            if self._dev_allocs.get(a.base) is a:
                del self._dev_allocs[a.base]
                self._dev_bases.remove(a.base)

    def alloc_host(self, nbytes: int, flags: int, kind: str = "pinned") -> Allocation:
        with self.lock:
            raw = np.zeros(nbytes + 4096, np.uint8)
            off = (-raw.ctypes.data) % 4096  # page-aligned, as cudaHostAlloc
            buf = raw[off : off + nbytes]
            a = Allocation(kind, -1, buf.ctypes.data, nbytes, buf, None, flags=flags)
            self._add_host(a)
            return a

    def _add_host(self, a: Allocation) -> None:
        self._host_allocs[a.base] = a
        bisect.insort(self._host_bases, a.base)

    def remove_host(self, a: Allocation) -> None:
        with self.lock:
            a.freed = True
            del self._host_allocs[a.base]
            self._host_bases.remove(a.base)

    def find_device(self, ptr: int) -> Allocation | None:
        i = bisect.bisect_right(self._dev_bases, ptr) - 1
        if i >= 0:
            a = self._dev_allocs[self._dev_bases[i]]
            if a.base <= ptr < a.base + max(a.size, 1):
                return a
        return None

    def find_host(self, ptr: int) -> Allocation | None:
        i = bisect.bisect_right(self._host_bases, ptr) - 1
        if i >= 0:
            a = self._host_allocs[self._host_bases[i]]
            if a.base <= ptr < a.base + max(a.size, 1):
                return a
        return None

    def host_allocation(self, ptr: int) -> Allocation | None:
        """The page-locked block starting exactly at ``ptr``, if any."""
        return self._host_allocs.get(ptr)

    def is_device_range(self, ptr: int) -> bool:
        return DEVICE_BASE <= ptr < DEVICE_BASE + self.n_gpus * DEVICE_SPAN

    def device_of_address(self, ptr: int) -> int:
        return (ptr - DEVICE_BASE) // DEVICE_SPAN

    def resolve(self, ptr: int, nbytes: int) -> tuple[str, int, Allocation | None]:
        """(kind, device, allocation) of the range [ptr, ptr + nbytes): kind is
        ``"device"``, ``"pinned"``/``"registered"`` or ``"host"`` (pageable host memory);
        ``"bad"`` for a range no live allocation holds."""
        if self.is_device_range(ptr):
            a = self.find_device(ptr)
            if a is None or not a.contains(ptr, nbytes):
                return "bad", self.device_of_address(ptr), a
            return "device", a.device, a
        h = self.find_host(ptr)
        if h is not None:
            if not h.contains(ptr, nbytes):
                return "bad", -1, h
            return h.kind, -1, h
        if HOST_MIN <= ptr < HOST_MAX and ptr + nbytes <= HOST_MAX:
            return "host", -1, None
        return "bad", -1, None

    def bytes_at(self, ptr: int, nbytes: int) -> np.ndarray:
        """The memory [ptr, ptr + nbytes) (already checked) as a writable uint8 array."""
        kind, _, a = self.resolve(ptr, nbytes)
        if kind == "bad":
            raise self.misuse_error(f"bytes_at on an unchecked range {ptr:#x}+{nbytes}")
        if a is None:
            return host_bytes(ptr, nbytes)
        return a.view(ptr, nbytes)

    # -- streams and events ----------------------------------------------------------------

    def new_handle(self) -> int:
        return next(self._handles)

    def stream(self, ptr: int) -> StreamState:
        """The stream of a handle; 0, 1 (legacy) and 2 (per-thread) are the current GPU's
        default stream. Unknown or destroyed handles raise cudaErrorInvalidResourceHandle."""
        from .cupy.cuda.runtime import CUDARuntimeError

        if ptr in (0, 1, 2):
            return self.null_streams[self.tls.device]
        s = self.streams.get(ptr)
        if s is None or s.destroyed:
            raise CUDARuntimeError(ERROR_INVALID_RESOURCE_HANDLE)
        return s

    def event(self, ptr: int) -> EventState:
        from .cupy.cuda.runtime import CUDARuntimeError

        e = self.events.get(ptr)
        if e is None or e.destroyed:
            raise CUDARuntimeError(ERROR_INVALID_RESOURCE_HANDLE)
        return e

    def check_enqueue(self, s: StreamState) -> None:
        """A sticky context error makes every later call on that GPU fail with it."""
        from .cupy.cuda.runtime import CUDARuntimeError

        if self.device_error[s.device]:
            raise CUDARuntimeError(self.device_error[s.device])

    def log(self, kind: str, s: StreamState, stream_ptr: int, **kw: Any) -> None:
        self.ops.append(Op(kind, stream_ptr, s.device, self.tls.device, **kw))

    def current_stream_ptr(self, device: int | None = None) -> int:
        d = self.tls.device if device is None else device
        cur = self.tls.current_stream.get(d)
        return 0 if cur is None else int(cur.ptr)

    # -- fault injection -------------------------------------------------------------------

    def _stream_arg(self, stream: Any) -> StreamState:
        ptr = stream if isinstance(stream, int) else getattr(stream, "ptr", None)
        if ptr is None:  # a nccltree CudaStream
            ptr = stream.cupy_stream.ptr
        if ptr in (0, 1, 2):
            raise ValueError("name a GPU's null stream with null_stream(device)")
        return self.stream(int(ptr))

    def null_stream(self, device: int) -> StreamState:
        return self.null_streams[device]

    def fail_stream(self, stream: Any, status: int = ERROR_ILLEGAL_ADDRESS) -> None:
        """Make ``stream`` (a ``cupy.cuda.Stream``, a nccltree stream, a handle or a
        StreamState) failed with ``status``: its queries, and those of events recorded on it
        from now on, return ``status``; streams that wait on such events fail too."""
        s = stream if isinstance(stream, StreamState) else self._stream_arg(stream)
        s.error = status

    def fail_device(self, device: int, status: int = ERROR_ILLEGAL_ADDRESS) -> None:
        """A sticky context error on ``device``: every query of its streams and events
        returns ``status`` and every later call enqueuing work there raises it."""
        self.device_error[device] = status

    def hang_stream(self, stream: Any) -> Token:
        """Work on ``stream`` that does not complete: events recorded on it from now on
        report cudaErrorNotReady (600), and so do streams that wait on them, until
        ``token.release(status)`` (0: completes; else fails with that status)."""
        s = stream if isinstance(stream, StreamState) else self._stream_arg(stream)
        t = Token("hang_stream")
        s.pending.add(t)
        return t

    def set_peer_error(self, a: int, b: int, status: int) -> None:
        """``deviceEnablePeerAccess(b)`` with GPU ``a`` current raises ``status`` (e.g.
        711, cudaErrorTooManyPeers)."""
        self.peer_errors[(a, b)] = status

    # -- inspection ------------------------------------------------------------------------

    def allocation_of(self, obj: Any) -> Allocation:
        """The allocation holding a fake ``cupy.ndarray``, a ``MemoryPointer``, a numpy
        array in page-locked memory, or a pointer."""
        if isinstance(obj, np.ndarray):
            ptr = obj.ctypes.data
        elif isinstance(obj, int):
            ptr = obj
        elif hasattr(obj, "data") and hasattr(obj.data, "ptr"):
            ptr = obj.data.ptr
        else:
            ptr = obj.ptr
        a = self.find_device(ptr) if self.is_device_range(ptr) else self.find_host(ptr)
        if a is None:
            raise LookupError(f"no live allocation holds {ptr:#x}")
        return a

    def device_allocations(self) -> list[Allocation]:
        return [self._dev_allocs[b] for b in self._dev_bases]

    def pinned_bytes(self) -> int:
        """Bytes of host memory page-locked right now (cudaHostAlloc + cudaHostRegister)."""
        return sum(a.size for a in self._host_allocs.values())

    def pinned_blocks(self) -> list[Allocation]:
        return [self._host_allocs[b] for b in self._host_bases]

    def ops_of(self, kind: str) -> list[Op]:
        return [op for op in self.ops if op.kind == kind]

    def streams_of(self, device: int) -> Iterator[StreamState]:
        yield self.null_streams[device]
        for s in self.streams.values():
            if s.device == device and not s.destroyed:
                yield s


_active: FakeCuda | None = None


def active() -> FakeCuda:
    """The installed fake machine (the fake modules only work while one is installed)."""
    if _active is None:
        raise RuntimeError("the fake cupy is used outside the fake_cupy fixture")
    return _active


def set_active(fake: FakeCuda | None) -> None:
    global _active
    _active = fake


def as_intptr(value: object, name: str) -> int:
    """An ``intptr_t`` argument: a Python int and nothing else (not a float, not None, not
    a numpy integer, not a CuPy object with ``__int__``)."""
    if type(value) is not int:
        raise TypeError(f"{name}: an integer is required (intptr_t), got {type(value).__name__}")
    if not -(1 << 63) <= value < (1 << 63):
        raise OverflowError(f"{name}: value too large to convert to intptr_t")
    return value


def as_int(value: object, name: str, *, unsigned: bool = False, bits: int = 32) -> int:
    """A C ``int``/``size_t``/``unsigned int`` argument as Cython converts it: any integer
    (``__index__``) but not a bool-free float or None; negative values for unsigned types
    and out-of-range values raise OverflowError."""
    if isinstance(value, (float, complex)) or value is None or isinstance(value, str):
        raise TypeError(f"{name}: an integer is required, got {type(value).__name__}")
    try:
        v = int(value.__index__())  # type: ignore[attr-defined]
    except AttributeError:
        raise TypeError(f"{name}: an integer is required, got {type(value).__name__}") from None
    lo, hi = (0, 1 << bits) if unsigned else (-(1 << (bits - 1)), 1 << (bits - 1))
    if not lo <= v < hi:
        what = "negative value" if v < 0 and unsigned else "value too large"
        raise OverflowError(f"{name}: can't convert {what} to C integer")
    return v
