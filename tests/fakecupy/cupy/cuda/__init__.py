"""Fake ``cupy.cuda``: ``Device``, ``Stream``, ``Event``, device and pinned memory.

Mirrors ``cupy/cuda/device.pyx``, ``stream.pyx``, ``memory.pyx`` and ``pinned_memory.pyx``
of CuPy 14.2, including their traps: ``Stream.done``/``Event.done`` compare the query
status with 0 and never raise; a stream can only be made current while its GPU is the
current device; ``alloc_pinned_memory`` goes through CuPy's pinned pool, which rounds
every request up to a power of two and keeps freed blocks page-locked.
"""

from __future__ import annotations

import ctypes
import threading
import weakref
from typing import Any

from ... import _core
from . import compiler, driver, nccl, nvrtc, runtime
from .runtime import CUDARuntimeError

__all__ = [
    "BaseMemory",
    "CUDARuntimeError",
    "Device",
    "Event",
    "ExternalStream",
    "Memory",
    "MemoryPointer",
    "PinnedMemory",
    "PinnedMemoryPointer",
    "PinnedMemoryPool",
    "Stream",
    "UnownedMemory",
    "alloc_pinned_memory",
    "compiler",
    "driver",
    "get_current_stream",
    "get_device_id",
    "get_elapsed_time",
    "is_available",
    "nccl",
    "nvrtc",
    "runtime",
    "set_pinned_memory_allocator",
]


def is_available() -> bool:
    return _core.active().n_gpus > 0


def get_device_id() -> int:
    return runtime.getDevice()


# -- devices (cupy/cuda/device.pyx) ------------------------------------------------------


class Device:
    def __init__(self, device: Any = None) -> None:
        self.id = runtime.getDevice() if device is None else int(device)

    def __int__(self) -> int:
        return self.id

    def __enter__(self) -> Device:
        tls = _core.active().tls
        cur = runtime.getDevice()
        tls.device_stack.append(cur)
        if self.id != cur:
            try:
                runtime.setDevice(self.id)
            except BaseException:
                tls.device_stack.pop()
                raise
        return self

    def __exit__(self, *args: object) -> None:
        runtime.setDevice(_core.active().tls.device_stack.pop())

    def __repr__(self) -> str:
        return f"<CUDA Device {self.id}>"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Device) and self.id == other.id

    __hash__ = None  # type: ignore[assignment]  # CuPy's Device defines __richcmp__ only

    def use(self) -> Device:
        runtime.setDevice(self.id)
        return self

    def synchronize(self) -> None:
        prev = runtime.getDevice()
        try:
            runtime.setDevice(self.id)
            runtime.deviceSynchronize()
        finally:
            runtime.setDevice(prev)

    @property
    def compute_capability(self) -> str:
        prev = runtime.getDevice()
        try:
            runtime.setDevice(self.id)
            major = runtime.deviceGetAttribute(
                runtime.deviceAttributeComputeCapabilityMajor, self.id
            )
            minor = runtime.deviceGetAttribute(
                runtime.deviceAttributeComputeCapabilityMinor, self.id
            )
            return f"{major}{minor}"
        finally:
            runtime.setDevice(prev)

    @property
    def pci_bus_id(self) -> str:
        return runtime.deviceGetPCIBusId(self.id)

    @property
    def mem_info(self) -> tuple[int, int]:
        return runtime.memGetInfo()


def _enable_peer_access(device: int, peer: int) -> bool:
    """CuPy's device._enable_peer_access: called by MemoryPointer copies between GPUs."""
    if device == peer:
        return True
    if runtime.deviceCanAccessPeer(device, peer) == 0:
        return False
    current = runtime.getDevice()
    runtime.setDevice(device)
    try:
        runtime._deviceEnsurePeerAccess(peer)
    finally:
        runtime.setDevice(current)
    return True


# -- streams and events (cupy/cuda/stream.pyx) -------------------------------------------


def _tls() -> Any:
    return _core.active().tls


def _set_current_stream(stream: _BaseStream) -> None:
    device_id = stream.device_id
    if device_id == -1:
        device_id = runtime.getDevice()
    _tls().current_stream[device_id] = stream


def _push_stream(stream: _BaseStream, device_id: int) -> None:
    tls = _tls()
    stack = tls.stream_stack.setdefault(device_id, [Stream.null])
    stack.append(stream)
    tls.stream_device_stack.append(device_id)
    _set_current_stream(stream)


def _pop_stream() -> None:
    tls = _tls()
    device_id = tls.stream_device_stack.pop()
    stack = tls.stream_stack[device_id]
    stack.pop()
    prev = stack[-1]
    # set_current_stream with the previous stream, as CuPy does
    d = prev.device_id if prev.device_id != -1 else runtime.getDevice()
    tls.current_stream[d] = prev


def _check_stream_device_match(device_id: int) -> int:
    cur = runtime.getDevice()
    if device_id == -1:
        device_id = cur
    if device_id != cur:
        raise RuntimeError(
            f"The device that the stream is created on ({device_id})"
            f" does not match with the current device ({cur})"
        )
    return device_id


def get_current_stream(device_id: int = -1) -> _BaseStream:
    d = _core.as_int(device_id, "device_id")
    if d == -1:
        d = runtime.getDevice()
    if not 0 <= d < _core.active().n_gpus:
        raise IndexError("list index out of range")
    cur = _tls().current_stream.get(d)
    return Stream.null if cur is None else cur


def _current_stream_ptr() -> int:
    return int(get_current_stream().ptr)


class Event:
    def __init__(
        self, block: bool = False, disable_timing: bool = False, interprocess: bool = False
    ) -> None:
        self.ptr = 0
        if interprocess and not disable_timing:
            raise ValueError("Timing must be disabled for interprocess events")
        flag = (
            (block and runtime.eventBlockingSync)
            | (disable_timing and runtime.eventDisableTiming)
            | (interprocess and runtime.eventInterprocess)
        )
        self.ptr = runtime.eventCreateWithFlags(int(flag))
        self._fake = _core.active()

    def __del__(self) -> None:
        if self.ptr and _core._active is self._fake:
            try:
                runtime.eventDestroy(self.ptr)
            except Exception:  # noqa: BLE001 - a destructor has nobody to raise to
                pass

    @property
    def done(self) -> bool:
        """True if the event is done (CuPy compares the status with success only)."""
        return runtime.eventQuery(self.ptr) == 0

    def record(self, stream: _BaseStream | None = None) -> None:
        stream_ptr = _current_stream_ptr() if stream is None else stream.ptr
        runtime.eventRecord(self.ptr, stream_ptr)

    def synchronize(self) -> None:
        runtime.eventSynchronize(self.ptr)


def get_elapsed_time(start_event: Event, end_event: Event) -> float:
    return runtime.eventElapsedTime(start_event.ptr, end_event.ptr)


class _BaseStream:
    def __init__(self, ptr: int, device_id: int) -> None:
        self.ptr = ptr
        self.device_id = device_id

    def __eq__(self, other: object) -> bool:
        if isinstance(other, _BaseStream):
            return bool(self.ptr == other.ptr)
        return False

    def __hash__(self) -> int:
        return self.ptr

    def __enter__(self) -> _BaseStream:
        device_id = _check_stream_device_match(self.device_id)
        _push_stream(self, device_id)
        return self

    def __exit__(self, *args: object) -> None:
        _pop_stream()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.ptr} (device {self.device_id})>"

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.ptr)

    def use(self) -> _BaseStream:
        _check_stream_device_match(self.device_id)
        _set_current_stream(self)
        return self

    @property
    def done(self) -> bool:
        """True if all work on this stream has been done (status == 0 only: a failed
        stream reads as "not done" forever, exactly like CuPy's)."""
        return runtime.streamQuery(self.ptr) == 0

    def synchronize(self) -> None:
        runtime.streamSynchronize(self.ptr)

    def record(self, event: Event | None = None) -> Event:
        if event is None:
            event = Event()
        runtime.eventRecord(event.ptr, self.ptr)
        return event

    def wait_event(self, event: Event) -> None:
        runtime.streamWaitEvent(self.ptr, event.ptr)

    def is_capturing(self) -> bool:
        return runtime.streamIsCapturing(self.ptr)

    @property
    def is_non_blocking(self) -> bool:
        return (runtime.streamGetFlags(self.ptr) & runtime.streamNonBlocking) != 0

    @property
    def priority(self) -> int:
        return runtime.streamGetPriority(self.ptr)


class Stream(_BaseStream):
    null: Stream
    ptds: Stream

    def __init__(
        self,
        null: bool = False,
        non_blocking: bool = False,
        ptds: bool = False,
        priority: int | None = None,
    ) -> None:
        self._fake: _core.FakeCuda | None = None
        if null:
            ptr, device_id = 0, -1
        elif ptds:
            ptr, device_id = runtime.streamPerThread, -1
        else:
            if priority is None:
                priority = 0
            flag = runtime.streamNonBlocking if non_blocking else runtime.streamDefault
            ptr = runtime.streamCreateWithPriority(flag, priority)
            device_id = runtime.getDevice()
            self._fake = _core.active()
        super().__init__(ptr, device_id)

    def __del__(self) -> None:
        if self._fake is not None and _core._active is self._fake:
            try:
                runtime.streamDestroy(self.ptr)
            except Exception:  # noqa: BLE001 - a destructor has nobody to raise to
                pass


Stream.null = Stream(null=True)
Stream.ptds = Stream(ptds=True)


class ExternalStream(_BaseStream):
    def __init__(self, ptr: int, device_id: int = -1) -> None:
        super().__init__(_core.as_intptr(ptr, "ptr"), _core.as_int(device_id, "device_id"))


# -- device memory (cupy/cuda/memory.pyx) ------------------------------------------------


class BaseMemory:
    ptr: int
    size: int
    device_id: int

    def __int__(self) -> int:
        return self.ptr

    @property
    def device(self) -> Device:
        return Device(self.device_id)


def _free_allocation(fake: _core.FakeCuda, a: _core.Allocation) -> None:
    if _core._active is fake:
        fake.free_device(a)


class Memory(BaseMemory):
    """A block from CuPy's pool: allocated on the current GPU, in the arena of the current
    stream (the fake remembers that stream in ``Allocation.stream``)."""

    def __init__(self, size: int) -> None:
        self.size = _core.as_int(size, "size", unsigned=True, bits=64)
        self.device_id = runtime.getDevice()
        self.ptr = 0
        self.allocation: _core.Allocation | None = None
        if self.size > 0:
            fake = _core.active()
            a = fake.malloc_device(self.device_id, self.size, _current_stream_ptr())
            self.allocation = a
            self.ptr = a.base
            # CuPy returns the block to its pool when the last array using it is gone
            weakref.finalize(self, _free_allocation, fake, a)


class UnownedMemory(BaseMemory):
    def __init__(self, ptr: int, size: int, owner: object, device_id: int = -1) -> None:
        p = _core.as_intptr(ptr, "ptr")
        n = _core.as_int(size, "size", unsigned=True, bits=64)
        d = _core.as_int(device_id, "device_id")
        if d < 0:
            if p == 0:
                raise RuntimeError("UnownedMemory requires explicit device ID for a null pointer.")
            d = runtime.pointerGetAttributes(p).device
            if d in (runtime.cudaCpuDeviceId, runtime.cudaInvalidDeviceId):
                d = runtime.getDevice()
        self.size = n
        self.device_id = d
        self.ptr = p
        self._owner = owner


def _host_ptr(mem: Any) -> int:
    if isinstance(mem, int):
        return mem
    if isinstance(mem, ctypes.c_void_p):
        return int(mem.value or 0)
    raise TypeError(
        f"a host pointer (int or ctypes.c_void_p) is required, got {type(mem).__name__}"
    )


def _stream_ptr(stream: _BaseStream | None) -> int:
    return _current_stream_ptr() if stream is None else int(stream.ptr)


class MemoryPointer:
    def __init__(self, mem: BaseMemory, offset: int) -> None:
        if not isinstance(mem, BaseMemory):
            raise TypeError(
                f"Argument 'mem' has incorrect type (expected BaseMemory, got {type(mem).__name__})"
            )
        off = _core.as_int(offset, "offset", bits=64)
        assert mem.ptr != 0 or off == 0
        self.ptr = mem.ptr + off
        self.device_id = mem.device_id
        self.mem = mem

    def __int__(self) -> int:
        return self.ptr

    def __repr__(self) -> str:
        return f"<MemoryPointer 0x{self.ptr:x} device={self.device_id} mem={self.mem!r}>"

    @property
    def device(self) -> Device:
        return Device(self.device_id)

    def __add__(self, offset: int) -> MemoryPointer:
        assert self.ptr != 0 or offset == 0
        return MemoryPointer(self.mem, self.ptr - self.mem.ptr + offset)

    def __sub__(self, offset: int) -> MemoryPointer:
        return self + -offset

    def copy_from_device_async(
        self, src: MemoryPointer, size: int, stream: _BaseStream | None = None
    ) -> None:
        if not isinstance(src, MemoryPointer):
            raise TypeError("Argument 'src' has incorrect type (expected MemoryPointer)")
        n = _core.as_int(size, "size", unsigned=True, bits=64)
        sp = _stream_ptr(stream)
        if n > 0:
            _enable_peer_access(src.device_id, self.device_id)
            runtime.memcpyAsync(self.ptr, src.ptr, n, runtime.memcpyDefault, sp)

    def copy_from_device(self, src: MemoryPointer, size: int) -> None:
        self.copy_from_device_async(src, size)
        runtime.streamSynchronize(_current_stream_ptr())

    def copy_from_host_async(self, mem: Any, size: int, stream: _BaseStream | None = None) -> None:
        n = _core.as_int(size, "size", unsigned=True, bits=64)
        if n > 0:
            runtime.memcpyAsync(
                self.ptr, _host_ptr(mem), n, runtime.memcpyHostToDevice, _stream_ptr(stream)
            )

    def copy_from_host(self, mem: Any, size: int) -> None:
        self.copy_from_host_async(mem, size)
        runtime.streamSynchronize(_current_stream_ptr())

    def copy_to_host_async(self, mem: Any, size: int, stream: _BaseStream | None = None) -> None:
        n = _core.as_int(size, "size", unsigned=True, bits=64)
        if n > 0:
            runtime.memcpyAsync(
                _host_ptr(mem), self.ptr, n, runtime.memcpyDeviceToHost, _stream_ptr(stream)
            )

    def copy_to_host(self, mem: Any, size: int) -> None:
        self.copy_to_host_async(mem, size)
        runtime.streamSynchronize(_current_stream_ptr())

    def memset_async(self, value: int, size: int, stream: _BaseStream | None = None) -> None:
        n = _core.as_int(size, "size", unsigned=True, bits=64)
        if n > 0:
            runtime.memsetAsync(self.ptr, value, n, _stream_ptr(stream))

    def memset(self, value: int, size: int) -> None:
        self.memset_async(value, size)
        runtime.streamSynchronize(_current_stream_ptr())


def alloc(size: int) -> MemoryPointer:
    return MemoryPointer(Memory(size), 0)


# -- pinned memory (cupy/cuda/pinned_memory.pyx) -----------------------------------------


class PinnedMemory:
    def __init__(self, size: int, flags: int = 0) -> None:
        self.size = _core.as_int(size, "size", unsigned=True, bits=64)
        self.ptr = 0
        self._fake = _core.active()
        if self.size > 0:
            self.ptr = runtime.hostAlloc(self.size, flags)

    def __del__(self) -> None:
        if self.ptr and _core._active is self._fake:
            try:
                runtime.freeHost(self.ptr)
            except Exception:  # noqa: BLE001 - a destructor has nobody to raise to
                pass

    def __int__(self) -> int:
        return self.ptr


_sized_types: dict[int, type] = {}


class PinnedMemoryPointer:
    """Exposes the buffer protocol (``numpy.frombuffer(ptr, ...)``) like CuPy's: the object
    is a ctypes array over the pinned bytes."""

    mem: Any
    ptr: int

    def __new__(cls, mem: Any, offset: int) -> PinnedMemoryPointer:
        off = _core.as_int(offset, "offset", bits=64)
        n = int(mem.size) - off
        typ: Any = _sized_types.get(n)
        if typ is None:
            typ = type("PinnedMemoryPointer", (PinnedMemoryPointer, ctypes.c_ubyte * n), {})
            _sized_types[n] = typ
        obj: PinnedMemoryPointer = typ.from_address(int(mem.ptr) + off if n else 0)
        obj.mem = mem
        obj.ptr = int(mem.ptr) + off
        return obj

    def __init__(self, mem: Any, offset: int) -> None:
        pass

    def __int__(self) -> int:
        return self.ptr

    def size(self) -> int:
        return int(self.mem.size) - (self.ptr - int(self.mem.ptr))


class PooledPinnedMemory(PinnedMemory):
    def __init__(self, mem: PinnedMemory, pool: weakref.ref[PinnedMemoryPool]) -> None:
        self.ptr = mem.ptr
        self.size = mem.size
        self.pool = pool
        self.mem = mem
        self._fake = mem._fake

    def free(self) -> None:
        pool = self.pool()
        if pool is not None and self.ptr != 0:
            pool._return(self.mem, self.size)
        self.ptr = 0
        self.size = 0

    __del__ = free


def _clp2(x: int) -> int:
    return 1 << (x - 1).bit_length() if x > 1 else x


class PinnedMemoryPool:
    """CuPy's pinned pool: requests rounded up to a power of two (of 512-byte units), freed
    blocks kept (still page-locked) for reuse until ``free_all_blocks``."""

    def __init__(self, allocator: Any = None) -> None:
        self._free: dict[int, list[PinnedMemory]] = {}
        self._in_use: set[PinnedMemory] = set()
        self._alloc = _malloc if allocator is None else allocator
        self._weakref = weakref.ref(self)
        self._allocation_unit_size = 512
        self._lock = threading.Lock()

    def malloc(self, size: int) -> PinnedMemoryPointer:
        n = _core.as_int(size, "size", unsigned=True, bits=64)
        if n == 0:
            return PinnedMemoryPointer(PinnedMemory(0), 0)
        unit = self._allocation_unit_size
        n = _clp2(((n + unit - 1) // unit) * unit)
        with self._lock:
            free = self._free.get(n)
            mem = free.pop() if free else self._alloc(n).mem
        self._in_use.add(mem)
        return PinnedMemoryPointer(PooledPinnedMemory(mem, self._weakref), 0)

    def _return(self, mem: PinnedMemory, size: int) -> None:
        self._in_use.discard(mem)
        self._free.setdefault(size, []).append(mem)

    def free_all_blocks(self) -> None:
        self._free.clear()

    def n_free_blocks(self) -> int:
        return sum(len(v) for v in self._free.copy().values())


def _malloc(size: int) -> PinnedMemoryPointer:
    return PinnedMemoryPointer(PinnedMemory(size, runtime.hostAllocPortable), 0)


def alloc_pinned_memory(size: int) -> PinnedMemoryPointer:
    n = _core.as_int(size, "size", unsigned=True, bits=64)
    allocator = _core.active().pinned_pool
    return allocator(n) if allocator is not None else _malloc(n)


def set_pinned_memory_allocator(allocator: Any = None) -> None:
    _core.active().pinned_pool = allocator if allocator is not None else _malloc
