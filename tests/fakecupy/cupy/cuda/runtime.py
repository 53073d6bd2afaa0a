"""Fake ``cupy.cuda.runtime`` (``cupy_backends/cuda/api/runtime.pyx`` of CuPy 14.2).

Same names, parameters and return values; ``intptr_t`` parameters take Python ints only.
``streamQuery``/``eventQuery`` return the status (0, 600 cudaErrorNotReady or an error)
and never raise, as CuPy's do; every other call raises ``CUDARuntimeError(status)``.
Work runs at once on host memory; see the ``fakecupy`` package docstring.
"""

from __future__ import annotations

import atexit
import mmap
import os
import struct
import time
from typing import Any

import numpy as np

from ... import _core
from ..._core import as_int, as_intptr

is_hip = False
_is_hip_environment = False

# constants (cupy_backends/cuda/api/runtime.pxd and _runtime_enum.pxd)
memcpyHostToHost = 0
memcpyHostToDevice = 1
memcpyDeviceToHost = 2
memcpyDeviceToDevice = 3
memcpyDefault = 4
hostAllocDefault = 0
hostAllocPortable = 1
hostAllocMapped = 2
hostAllocWriteCombined = 4
streamDefault = 0
streamNonBlocking = 1
streamLegacy = 1
streamPerThread = 2
eventDefault = 0
eventBlockingSync = 1
eventDisableTiming = 2
eventInterprocess = 4
memoryTypeUnregistered = 0
memoryTypeHost = 1
memoryTypeDevice = 2
memoryTypeManaged = 3
cudaMemoryTypeHost = 1
cudaMemoryTypeDevice = 2
cudaCpuDeviceId = -1
cudaInvalidDeviceId = -2
errorInvalidValue = _core.ERROR_INVALID_VALUE
errorMemoryAllocation = _core.ERROR_MEMORY_ALLOCATION
errorPeerAccessAlreadyEnabled = _core.ERROR_PEER_ACCESS_ALREADY_ENABLED
errorContextIsDestroyed = 709
errorInvalidResourceHandle = _core.ERROR_INVALID_RESOURCE_HANDLE
deviceAttributeComputeCapabilityMajor = 75
deviceAttributeComputeCapabilityMinor = 76
cudaDevAttrComputeCapabilityMajor = 75
cudaDevAttrComputeCapabilityMinor = 76
cudaDevAttrMultiProcessorCount = 16
cudaErrorNotReady = _core.ERROR_NOT_READY
cudaErrorIllegalAddress = _core.ERROR_ILLEGAL_ADDRESS
cudaErrorPeerAccessAlreadyEnabled = _core.ERROR_PEER_ACCESS_ALREADY_ENABLED
cudaErrorTooManyPeers = _core.ERROR_TOO_MANY_PEERS

#: how long a blocking call (stream/event/device synchronisation) waits for hung work to be
#: released by another thread before the fake calls it a deadlock
BLOCK_LIMIT_S = 5.0


class CUDARuntimeError(RuntimeError):
    def __init__(self, status: int) -> None:
        self.status = status
        super().__init__(_core.error_text(status))

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.status,))


def check_status(status: int) -> None:
    if status != 0:
        raise CUDARuntimeError(status)


class PointerAttributes:
    def __init__(self, device: int, devicePointer: int, hostPointer: int, type: int = -1) -> None:
        self.type = type
        self.device = device
        self.devicePointer = devicePointer
        self.hostPointer = hostPointer


def _fake() -> _core.FakeCuda:
    return _core.active()


# -- versions and devices ----------------------------------------------------------------


def driverGetVersion() -> int:
    return 13000


def runtimeGetVersion() -> int:
    return 13000


def getDeviceCount() -> int:
    return _fake().n_gpus


def getDevice() -> int:
    return _fake().tls.device


def setDevice(device: int) -> None:
    f = _fake()
    d = as_int(device, "device")
    f.check_device(d)
    f.tls.device = d


def _wait(fake: _core.FakeCuda, status_of: Any, what: str) -> None:
    """Block until ``status_of()`` is not cudaErrorNotReady (another thread may release
    hung work); raise its error; a wait past BLOCK_LIMIT_S is a deadlock."""
    deadline = time.monotonic() + BLOCK_LIMIT_S
    while True:
        with fake.lock:
            status = status_of()
        if status != _core.ERROR_NOT_READY:
            check_status(status)
            return
        if time.monotonic() > deadline:
            raise fake.misuse_error(
                f"{what} would block forever: its work never completes (hung and not released)"
            )
        time.sleep(1e-3)


def deviceSynchronize() -> None:
    f = _fake()
    d = f.tls.device

    def status() -> int:
        for s in f.streams_of(d):
            st = s.status(f)
            if st:
                return st
        return 0

    _wait(f, status, f"cudaDeviceSynchronize on GPU {d}")


def deviceCanAccessPeer(device: int, peerDevice: int) -> int:
    f = _fake()
    a, b = as_int(device, "device"), as_int(peerDevice, "peerDevice")
    f.check_device(a)
    f.check_device(b)
    return int((a, b) in f.peer_capable)


def deviceEnablePeerAccess(peerDevice: int) -> None:
    f = _fake()
    b = as_int(peerDevice, "peerDevice")
    a = f.tls.device
    f.check_device(b)
    with f.lock:
        injected = f.peer_errors.get((a, b))
        if injected:
            raise CUDARuntimeError(injected)
        if a == b:
            raise CUDARuntimeError(_core.ERROR_INVALID_DEVICE)
        if (a, b) not in f.peer_capable:
            raise CUDARuntimeError(_core.ERROR_PEER_ACCESS_UNSUPPORTED)
        if (a, b) in f.peer_enabled:
            raise CUDARuntimeError(_core.ERROR_PEER_ACCESS_ALREADY_ENABLED)
        f.peer_enabled.add((a, b))


def deviceDisablePeerAccess(peerDevice: int) -> None:
    f = _fake()
    b = as_int(peerDevice, "peerDevice")
    with f.lock:
        if (f.tls.device, b) not in f.peer_enabled:
            raise CUDARuntimeError(_core.ERROR_PEER_ACCESS_NOT_ENABLED)
        f.peer_enabled.discard((f.tls.device, b))


def _deviceEnsurePeerAccess(peerDevice: int) -> None:
    try:
        deviceEnablePeerAccess(peerDevice)
    except CUDARuntimeError as exc:
        if exc.status != _core.ERROR_PEER_ACCESS_ALREADY_ENABLED:
            raise


def deviceGetAttribute(attrib: int, device: int) -> int:
    f = _fake()
    a, d = as_int(attrib, "attrib"), as_int(device, "device")
    f.check_device(d)
    cc = f.compute_capability[d]
    if a == cudaDevAttrComputeCapabilityMajor:
        return int(cc[:-1])
    if a == cudaDevAttrComputeCapabilityMinor:
        return int(cc[-1])
    if a == cudaDevAttrMultiProcessorCount:
        return 132
    return 0


def getDeviceProperties(device: int) -> dict[str, Any]:
    f = _fake()
    d = as_int(device, "device")
    f.check_device(d)
    cc = f.compute_capability[d]
    return {
        "name": f"Fake GPU {d}".encode(),
        "totalGlobalMem": 80 << 30,
        "major": int(cc[:-1]),
        "minor": int(cc[-1]),
        "multiProcessorCount": 132,
        "pciBusID": 0x10 + d,
        "pciDeviceID": 0,
        "pciDomainID": 0,
    }


def deviceGetPCIBusId(device: int) -> str:
    f = _fake()
    d = as_int(device, "device")
    f.check_device(d)
    return f"0000:{0x10 + d:02X}:00.0"


def deviceGetByPCIBusId(pci_bus_id: str) -> int:
    if not isinstance(pci_bus_id, str):
        raise TypeError(f"pci_bus_id: expected str, got {type(pci_bus_id).__name__}")
    for d in range(_fake().n_gpus):
        if deviceGetPCIBusId(d).lower() == pci_bus_id.lower():
            return d
    raise CUDARuntimeError(_core.ERROR_INVALID_DEVICE)


def memGetInfo() -> tuple[int, int]:
    return (64 << 30, 80 << 30)


# -- memory ------------------------------------------------------------------------------


def malloc(size: int) -> int:
    f = _fake()
    n = as_int(size, "size", unsigned=True, bits=64)
    d = f.tls.device
    return f.malloc_device(d, n, f.current_stream_ptr(d)).base


def free(ptr: int) -> None:
    f = _fake()
    p = as_intptr(ptr, "ptr")
    a = f.find_device(p)
    if a is None or a.base != p or a.ipc_opened:
        raise CUDARuntimeError(_core.ERROR_INVALID_VALUE)
    if a.ipc_path:
        try:
            os.unlink(a.ipc_path)  # processes that opened it keep their mapping
        except FileNotFoundError:
            pass
        _ipc_files.discard(a.ipc_path)
    f.free_device(a)


def hostAlloc(size: int, flags: int) -> int:
    f = _fake()
    n = as_int(size, "size", unsigned=True, bits=64)
    fl = as_int(flags, "flags", unsigned=True)
    if fl & ~0x7:
        raise CUDARuntimeError(_core.ERROR_INVALID_VALUE)
    if n == 0:
        return 0
    return f.alloc_host(n, fl).base


def freeHost(ptr: int) -> None:
    f = _fake()
    p = as_intptr(ptr, "ptr")
    if p == 0:
        return
    a = f.host_allocation(p)
    if a is None or a.kind != "pinned":
        raise CUDARuntimeError(_core.ERROR_INVALID_VALUE)
    f.remove_host(a)


def hostRegister(ptr: int, size: int, flags: int) -> None:
    f = _fake()
    p = as_intptr(ptr, "ptr")
    n = as_int(size, "size", unsigned=True, bits=64)
    fl = as_int(flags, "flags", unsigned=True)
    if n == 0 or not _core.HOST_MIN <= p < _core.HOST_MAX:
        raise CUDARuntimeError(_core.ERROR_INVALID_VALUE)
    with f.lock:
        for a in f.pinned_blocks():
            if a.base < p + n and p < a.base + a.size:
                raise CUDARuntimeError(_core.ERROR_HOST_MEMORY_ALREADY_REGISTERED)
        f._add_host(_core.Allocation("registered", -1, p, n, None, None, flags=fl))


def hostUnregister(ptr: int) -> None:
    f = _fake()
    p = as_intptr(ptr, "ptr")
    a = f.host_allocation(p)
    if a is None or a.kind != "registered":
        raise CUDARuntimeError(_core.ERROR_HOST_MEMORY_NOT_REGISTERED)
    f.remove_host(a)


def _copy(
    kind_name: str, dst: int, src: int, size: int, kind: int, stream: int, detail: str = ""
) -> None:
    f = _fake()
    with f.lock:
        s = f.stream(stream)
        f.check_enqueue(s)
        if size == 0:
            return
        dkind, _, _ = f.resolve(dst, size)
        skind, _, _ = f.resolve(src, size)
        if dkind == "bad" or skind == "bad":
            raise CUDARuntimeError(_core.ERROR_INVALID_VALUE)
        if kind != memcpyDefault:
            want = {
                memcpyHostToHost: (False, False),
                memcpyHostToDevice: (True, False),
                memcpyDeviceToHost: (False, True),
                memcpyDeviceToDevice: (True, True),
            }.get(kind)
            if want is None:
                raise CUDARuntimeError(_core.ERROR_INVALID_MEMCPY_DIRECTION)
            if want != (dkind == "device", skind == "device"):
                raise CUDARuntimeError(_core.ERROR_INVALID_VALUE)
        np.copyto(f.bytes_at(dst, size), f.bytes_at(src, size))
        f.log(kind_name, s, stream, dst=dst, src=src, nbytes=size, detail=detail)


def memcpyAsync(dst: int, src: int, size: int, kind: int, stream: int) -> None:
    _copy(
        "memcpy",
        as_intptr(dst, "dst"),
        as_intptr(src, "src"),
        as_int(size, "size", unsigned=True, bits=64),
        as_int(kind, "kind"),
        as_intptr(stream, "stream"),
        f"kind={kind}",
    )


def memcpy(dst: int, src: int, size: int, kind: int) -> None:
    memcpyAsync(dst, src, size, kind, 0)
    streamSynchronize(0)


def memcpyPeerAsync(
    dst: int, dstDevice: int, src: int, srcDevice: int, size: int, stream: int
) -> None:
    f = _fake()
    d, s = as_intptr(dst, "dst"), as_intptr(src, "src")
    dd, sd = as_int(dstDevice, "dstDevice"), as_int(srcDevice, "srcDevice")
    n = as_int(size, "size", unsigned=True, bits=64)
    sp = as_intptr(stream, "stream")
    f.check_device(dd)
    f.check_device(sd)
    if n:
        for ptr, dev in ((d, dd), (s, sd)):
            kind, owner, _ = f.resolve(ptr, n)
            if kind != "device" or owner != dev:
                raise CUDARuntimeError(_core.ERROR_INVALID_VALUE)
    # CUDA copies between any two GPUs, staging through host memory without peer access
    path = "direct" if (dd, sd) in f.peer_enabled or (sd, dd) in f.peer_enabled else "staged"
    _copy("memcpy_peer", d, s, n, memcpyDefault, sp, f"{sd}->{dd} {path}")


def memcpyPeer(dst: int, dstDevice: int, src: int, srcDevice: int, size: int) -> None:
    memcpyPeerAsync(dst, dstDevice, src, srcDevice, size, 0)
    streamSynchronize(0)


def memsetAsync(ptr: int, value: int, size: int, stream: int) -> None:
    f = _fake()
    p = as_intptr(ptr, "ptr")
    v = as_int(value, "value")
    n = as_int(size, "size", unsigned=True, bits=64)
    sp = as_intptr(stream, "stream")
    with f.lock:
        s = f.stream(sp)
        f.check_enqueue(s)
        if n == 0:
            return
        kind, _, _ = f.resolve(p, n)
        if kind != "device":
            raise CUDARuntimeError(_core.ERROR_INVALID_VALUE)
        f.bytes_at(p, n).fill(v & 0xFF)
        f.log("memset", s, sp, dst=p, nbytes=n, detail=f"value={v & 0xFF}")


def memset(ptr: int, value: int, size: int) -> None:
    memsetAsync(ptr, value, size, 0)
    streamSynchronize(0)


def pointerGetAttributes(ptr: int) -> PointerAttributes:
    f = _fake()
    p = as_intptr(ptr, "ptr")
    kind, dev, a = f.resolve(p, 1)
    if kind == "device":
        return PointerAttributes(dev, p, 0, memoryTypeDevice)
    if kind in ("pinned", "registered"):
        return PointerAttributes(0, p, p, memoryTypeHost)
    if kind == "host":
        return PointerAttributes(cudaInvalidDeviceId, 0, 0, memoryTypeUnregistered)
    raise CUDARuntimeError(_core.ERROR_INVALID_VALUE)


def pointerGetMemoryType(ptr: int) -> int:
    return pointerGetAttributes(ptr).type


# -- streams -----------------------------------------------------------------------------


def streamCreateWithPriority(flags: int, priority: int) -> int:
    f = _fake()
    fl = as_int(flags, "flags", unsigned=True)
    pr = as_int(priority, "priority")
    with f.lock:
        ptr = f.new_handle()
        f.streams[ptr] = _core.StreamState(ptr, f.tls.device, fl, pr)
    return ptr


def streamCreate() -> int:
    return streamCreateWithPriority(0, 0)


def streamCreateWithFlags(flags: int) -> int:
    return streamCreateWithPriority(flags, 0)


def streamDestroy(stream: int) -> None:
    f = _fake()
    p = as_intptr(stream, "stream")
    if p in (0, 1, 2):
        raise CUDARuntimeError(_core.ERROR_INVALID_RESOURCE_HANDLE)
    f.stream(p).destroyed = True


def streamGetFlags(stream: int) -> int:
    return _fake().stream(as_intptr(stream, "stream")).flags


def streamGetPriority(stream: int) -> int:
    return _fake().stream(as_intptr(stream, "stream")).priority


def streamIsCapturing(stream: int) -> bool:
    _fake().stream(as_intptr(stream, "stream"))
    return False


def streamQuery(stream: int) -> int:
    f = _fake()
    p = as_intptr(stream, "stream")
    with f.lock:
        try:
            return f.stream(p).status(f)
        except CUDARuntimeError as exc:
            return exc.status


def streamSynchronize(stream: int) -> None:
    f = _fake()
    s = f.stream(as_intptr(stream, "stream"))
    _wait(f, lambda: s.status(f), f"cudaStreamSynchronize({s.ptr:#x})")


def streamWaitEvent(stream: int, event: int, flags: int = 0) -> None:
    f = _fake()
    sp = as_intptr(stream, "stream")
    ep = as_intptr(event, "event")
    as_int(flags, "flags", unsigned=True)
    with f.lock:
        s = f.stream(sp)
        e = f.event(ep)
        f.check_enqueue(s)
        if e.recorded:
            s.pending |= {t for t in e.tokens if t.status is None}
            st = e.status(f)
            if st not in (0, _core.ERROR_NOT_READY) and not s.error:
                s.error = st  # a failed dependency: the waiting stream cannot succeed
        f.log("wait_event", s, sp, src=ep)


# -- events ------------------------------------------------------------------------------


def eventCreateWithFlags(flags: int) -> int:
    f = _fake()
    fl = as_int(flags, "flags", unsigned=True)
    with f.lock:
        ptr = f.new_handle()
        f.events[ptr] = _core.EventState(ptr, f.tls.device, fl)
    return ptr


def eventCreate() -> int:
    return eventCreateWithFlags(0)


def eventDestroy(event: int) -> None:
    _fake().event(as_intptr(event, "event")).destroyed = True


def eventRecord(event: int, stream: int) -> None:
    f = _fake()
    ep, sp = as_intptr(event, "event"), as_intptr(stream, "stream")
    with f.lock:
        e = f.event(ep)
        s = f.stream(sp)
        if e.device != s.device:
            # cudaEventRecord fails when the event and the stream are on different GPUs
            raise CUDARuntimeError(_core.ERROR_INVALID_RESOURCE_HANDLE)
        f.check_enqueue(s)
        st = s.status(f)
        e.recorded = True
        e.stream = sp
        e.error = st if st not in (0, _core.ERROR_NOT_READY) else 0
        e.tokens = frozenset(t for t in s.pending if t.status is None)
        f.log("event_record", s, sp, dst=ep)


def eventQuery(event: int) -> int:
    f = _fake()
    p = as_intptr(event, "event")
    with f.lock:
        f.event_queries[p] = f.event_queries.get(p, 0) + 1
        try:
            return f.event(p).status(f)
        except CUDARuntimeError as exc:
            return exc.status


def eventSynchronize(event: int) -> None:
    f = _fake()
    e = f.event(as_intptr(event, "event"))
    _wait(f, lambda: e.status(f), f"cudaEventSynchronize({e.ptr:#x})")


def eventElapsedTime(start: int, end: int) -> float:
    f = _fake()
    a, b = f.event(as_intptr(start, "start")), f.event(as_intptr(end, "end"))
    if (a.flags | b.flags) & eventDisableTiming or not (a.recorded and b.recorded):
        raise CUDARuntimeError(_core.ERROR_INVALID_RESOURCE_HANDLE)
    check_status(a.status(f) or b.status(f))
    return 0.001  # one microsecond: the fake has no clock worth measuring


# -- IPC (between processes: each runs its own fake; exported blocks live in /dev/shm) --------

_IPC_HANDLE_BYTES = 64
_ipc_files: set[str] = set()


def _ipc_path(pid: int, base: int) -> str:
    # the test session in the name: a test run blames leftovers of its own processes only
    return f"/dev/shm/fakecupy-ipc-{_core.session_tag()}-{pid}-{base:x}"


def _remove_ipc_files() -> None:
    """Remove this process's exported blocks (at exit; :func:`fakecupy.release_process`)."""
    for path in list(_ipc_files):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    _ipc_files.clear()


atexit.register(_remove_ipc_files)


def _handle_bytes(handle: Any) -> bytes:
    if not isinstance(handle, bytes):
        raise TypeError(f"Argument 'handle' has incorrect type (expected bytes, got "
                        f"{type(handle).__name__})")  # fmt: skip
    if len(handle) != _IPC_HANDLE_BYTES:
        # CuPy assigns the bytes to a char[64]: Cython refuses another length
        raise ValueError(f"Assignment to reserved of length {len(handle)} != 64")
    return handle


def ipcGetMemHandle(devPtr: int) -> bytes:
    """The block holding ``devPtr`` is moved into a /dev/shm file (its bytes copied), so
    the processes that open the handle share it. Export blocks before making arrays over
    them: an array made earlier keeps the old bytes (a fake-only limit)."""
    f = _fake()
    p = as_intptr(devPtr, "devPtr")
    with f.lock:
        a = f.find_device(p)
        if a is None or a.freed or a.ipc_opened:
            raise CUDARuntimeError(_core.ERROR_INVALID_VALUE)
        if not a.ipc_path:
            size = max(a.size, 1)
            path = _ipc_path(os.getpid(), a.base)
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                os.ftruncate(fd, size)
                mm = mmap.mmap(fd, size)
            finally:
                os.close(fd)
            _ipc_files.add(path)
            buf = np.frombuffer(mm, np.uint8)
            assert a.buffer is not None
            buf[:] = a.buffer[:size]
            a.buffer, a.ipc_path, a.ipc_map = buf, path, mm
        f.ipc_log.append(("export", a.base, a.size))
        return struct.pack("<qqqq", os.getpid(), a.base, a.size, a.device).ljust(
            _IPC_HANDLE_BYTES, b"\0"
        )


def ipcOpenMemHandle(handle: bytes, flags: int = 1) -> int:
    f = _fake()
    raw = _handle_bytes(handle)
    as_int(flags, "flags", unsigned=True)
    pid, base, size, device = struct.unpack_from("<qqqq", raw)
    if pid == os.getpid():
        raise CUDARuntimeError(_core.ERROR_INVALID_CONTEXT)  # not in the exporting process
    try:
        fd = os.open(_ipc_path(pid, base), os.O_RDWR)
    except FileNotFoundError:
        raise CUDARuntimeError(_core.ERROR_INVALID_VALUE) from None
    try:
        mm = mmap.mmap(fd, max(size, 1))
    finally:
        os.close(fd)
    a = f.adopt_device(device, np.frombuffer(mm, np.uint8))
    a.ipc_map = mm
    cur = f.tls.device
    if device != cur:
        f.peer_enabled.add((cur, device))  # cudaIpcMemLazyEnablePeerAccess
    f.ipc_log.append(("open", pid, base, size, a.base))
    return a.base


def ipcCloseMemHandle(devPtr: int) -> None:
    f = _fake()
    p = as_intptr(devPtr, "devPtr")
    a = f.find_device(p)
    if a is None or a.base != p or not a.ipc_opened:
        raise CUDARuntimeError(_core.ERROR_INVALID_VALUE)
    f.free_device(a)
    f.ipc_log.append(("close", p))


def ipcGetEventHandle(event: int) -> bytes:
    f = _fake()
    ep = as_intptr(event, "event")
    e = f.event(ep)
    if (e.flags & (eventInterprocess | eventDisableTiming)) != (
        eventInterprocess | eventDisableTiming
    ):
        # cudaIpcGetEventHandle: only events created with cudaEventInterprocess and
        # cudaEventDisableTiming
        raise CUDARuntimeError(_core.ERROR_INVALID_RESOURCE_HANDLE)
    f.ipc_log.append(("export_event", ep))
    return struct.pack("<qqq", os.getpid(), ep, e.device).ljust(_IPC_HANDLE_BYTES, b"\0")


def ipcOpenEventHandle(handle: bytes) -> int:
    """Another process's event. The fake runs work at enqueue, so whatever the exporter
    recorded is complete: waiting on the opened event orders nothing more (the wait is
    logged, which is what the tests check)."""
    f = _fake()
    raw = _handle_bytes(handle)
    pid, ep, device = struct.unpack_from("<qqq", raw)
    if pid == os.getpid():
        raise CUDARuntimeError(_core.ERROR_INVALID_CONTEXT)
    with f.lock:
        ptr = f.new_handle()
        f.events[ptr] = _core.EventState(ptr, device, eventInterprocess | eventDisableTiming)
    f.ipc_log.append(("open_event", pid, ep, ptr))
    return ptr
