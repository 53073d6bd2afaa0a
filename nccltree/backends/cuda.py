"""CUDA backend: CuPy arrays, ``cupy.cuda.Stream``/``Event``, peer access.

The same interface as ``host.py`` (docstrings in ``base.py``). CuPy is imported on first use
only. Every method enters ``cupy.cuda.Device(physical_id)`` itself, so a device works from
any thread whatever that thread's current GPU is. Several logical devices may share one GPU
(``"gpu:0,0"``): each has its own streams, and copies between them are plain device copies.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np

from .._errors import BackendUnavailable, CommTimeout
from .base import REDUCE_OPS, Device, Event, Stream, timeout_or_default

_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: direction inferred through unified addressing
_PEER_ALREADY_ENABLED = 704  # cudaErrorPeerAccessAlreadyEnabled
_MAX_FUSED = 8  # sources one reduce kernel takes


def _cupy() -> Any:
    try:
        import cupy
    except Exception as exc:  # ImportError, or OSError for missing CUDA libraries
        raise BackendUnavailable(
            "the CUDA backend needs CuPy, which could not be imported "
            f"({type(exc).__name__}: {exc}); install nccltree[cuda12] or nccltree[cuda13]"
        ) from exc
    return cupy


def _kernels() -> Any:
    from .. import _cuda_kernels

    return _cuda_kernels


def gpu_count() -> int:
    """GPUs visible to CuPy; ``BackendUnavailable`` if CuPy or the driver is missing."""
    cp = _cupy()
    try:
        return int(cp.cuda.runtime.getDeviceCount())
    except Exception as exc:  # CUDARuntimeError: no driver, no device, driver too old
        raise BackendUnavailable(f"no usable CUDA driver or GPU: {exc}") from exc


def _poll(done: Any, timeout: float | None, what: str) -> None:
    """Wait for ``done()`` by polling: CUDA's blocking waits cannot be timed out."""
    if done():
        return
    limit = timeout_or_default(timeout)
    deadline = time.monotonic() + limit
    pause = 2e-5
    while not done():
        if time.monotonic() >= deadline:
            raise CommTimeout(f"{what} not done after {limit:g} s")
        time.sleep(pause)
        pause = min(pause * 2, 1e-3)  # short waits stay short; long ones cost little CPU


# peer access is a property of a (physical) GPU pair in the process: enable it once
_peer_lock = threading.Lock()
_peer_state: dict[tuple[int, int], bool] = {}


def _enable_peer(a: int, b: int) -> bool:
    """Enable access from GPU ``a`` to GPU ``b`` memory where possible; True if enabled."""
    if a == b:
        return True
    with _peer_lock:
        state = _peer_state.get((a, b))
        if state is not None:
            return state
        cp = _cupy()
        rt = cp.cuda.runtime
        ok = bool(rt.deviceCanAccessPeer(a, b))
        if ok:
            with cp.cuda.Device(a):
                try:
                    rt.deviceEnablePeerAccess(b)
                except rt.CUDARuntimeError as exc:
                    if exc.status != _PEER_ALREADY_ENABLED:
                        raise
        _peer_state[(a, b)] = ok
        return ok


class CudaEvent(Event):
    """A ``cupy.cuda.Event(disable_timing=True)``, created on the device that records it."""

    def __init__(self) -> None:
        self._ev: Any = None
        self._pid = -1

    def record(self, stream: Stream) -> None:
        if not isinstance(stream, CudaStream):
            raise TypeError(f"a CUDA event records on a CUDA stream, got {stream!r}")
        cp = _cupy()
        pid = stream.device.physical_id
        with cp.cuda.Device(pid):
            # an event belongs to the device it was created on: recreate it if needed
            if self._ev is None or self._pid != pid:
                self._ev = cp.cuda.Event(disable_timing=True)
                self._pid = pid
            self._ev.record(stream._cs)

    def synchronize(self, timeout: float | None = None) -> None:
        if self._ev is not None:
            _poll(self.query, timeout, f"event on GPU {self._pid}")

    def query(self) -> bool:
        if self._ev is None:
            return True
        with _cupy().cuda.Device(self._pid):
            return bool(self._ev.done)


class CudaStream(Stream):
    """A CuPy stream (non-blocking) of one logical device."""

    def __init__(self, device: CudaDevice, cupy_stream: Any) -> None:
        self.device = device
        self._cs = cupy_stream

    @property
    def cupy_stream(self) -> Any:
        """The underlying ``cupy.cuda.Stream``."""
        return self._cs

    def __repr__(self) -> str:
        return f"<CudaStream {self.device.name} ptr={self._cs.ptr:#x}>"

    def __enter__(self) -> CudaStream:
        # also CuPy's current stream, so array ops land on it; CuPy only lets a stream
        # become current while its GPU is the current device, so that switches too
        dctx = _cupy().cuda.Device(self.device.physical_id)
        dctx.__enter__()
        try:
            self._cs.__enter__()
        except BaseException:
            dctx.__exit__(None, None, None)
            raise
        tls = self.device._tls
        if not hasattr(tls, "device_ctx"):
            tls.device_ctx = []
        tls.device_ctx.append(dctx)
        super().__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        self._cs.__exit__(*exc)
        self.device._tls.device_ctx.pop().__exit__(None, None, None)

    @contextmanager
    def _on(self) -> Iterator[Any]:
        cp = _cupy()
        with cp.cuda.Device(self.device.physical_id), self._cs:
            yield cp

    def _pid(self, dev: Device | None, default: int) -> int:
        if dev is None:
            return default
        if not isinstance(dev, CudaDevice):
            raise TypeError(f"source and destination devices must be CUDA devices, got {dev!r}")
        return dev.physical_id

    def copy(
        self,
        dst: Any,
        src: Any,
        *,
        src_device: Device | None = None,
        dst_device: Device | None = None,
    ) -> None:
        dptr, dbytes = _ptr_nbytes(dst, "dst")
        sptr, sbytes = _ptr_nbytes(src, "src")
        if dbytes != sbytes:
            raise ValueError(f"copy needs equal sizes: dst {dbytes} B, src {sbytes} B")
        pid = self.device.physical_id
        dpid = self._pid(dst_device, pid)
        spid = self._pid(src_device, -1)  # -1: host memory or the stream's own GPU
        with self._on() as cp:
            if dbytes == 0:
                return
            if spid >= 0 and spid != dpid:
                cp.cuda.runtime.memcpyPeerAsync(dptr, dpid, sptr, spid, dbytes, self._cs.ptr)
            else:
                cp.cuda.runtime.memcpyAsync(dptr, sptr, dbytes, _MEMCPY_DEFAULT, self._cs.ptr)

    def reduce(
        self,
        dst: Any,
        srcs: Sequence[Any],
        op: str = "sum",
        *,
        src_devices: Sequence[Device | None] | None = None,
        dst_device: Device | None = None,
        alpha: float = 1.0,
    ) -> None:
        if op not in REDUCE_OPS:
            raise ValueError(f"op must be one of {', '.join(REDUCE_OPS)}; got {op!r}")
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float, np.integer, np.floating)):
            raise TypeError(f"alpha must be a real number, got {type(alpha).__name__}")
        alpha = float(alpha)
        pid = self.device.physical_id
        dst_dev = dst_device or self.device
        dpid = self._pid(dst_dev, pid)
        dst_dev.check_array(dst)
        if alpha != 1.0:
            # checked before anything is enqueued (the kernel wrapper would refuse it later)
            if op != "sum":
                raise ValueError(f"alpha != 1.0 needs op='sum'; got op={op!r}")
            if dst.dtype.kind != "f":
                raise TypeError(f"alpha != 1.0 needs a floating dtype; dst has {dst.dtype}")
        srcs = list(srcs)
        if not srcs:
            raise ValueError("reduce needs at least one source")
        if src_devices is None:
            src_devices = [None] * len(srcs)
        src_devices = list(src_devices)
        if len(src_devices) != len(srcs):
            raise ValueError(f"src_devices has {len(src_devices)} entries for {len(srcs)} sources")
        for i, (s, d) in enumerate(zip(srcs, src_devices, strict=True)):
            (d or dst_dev).check_array(s)
            if s.dtype != dst.dtype or s.size != dst.size:
                raise ValueError(
                    f"srcs[{i}] is {s.dtype}[{s.size}] but dst is {dst.dtype}[{dst.size}]"
                )
        k = _kernels()
        stream_ptr = self._cs.ptr
        with self._on() as cp:
            inputs = []
            for s, d in zip(srcs, src_devices, strict=True):
                spid = self._pid(d, dpid)
                if spid == pid or _enable_peer(pid, spid):
                    inputs.append(s)  # read in place (this GPU, or over peer access)
                else:
                    # no peer access: stage a copy here; allocated with this stream current,
                    # so CuPy's pool reuses the block only in this stream's order
                    tmp = cp.empty(s.shape, s.dtype)
                    cp.cuda.runtime.memcpyPeerAsync(
                        tmp.data.ptr, pid, s.data.ptr, spid, s.nbytes, stream_ptr
                    )
                    inputs.append(tmp)
            # the kernel runs on this stream's GPU, so its output must live there too
            out = dst if dpid == pid else cp.empty(dst.shape, dst.dtype)
            # longer lists fold in chunks into the running result; only the last chunk
            # applies alpha, so the scale follows the whole sum
            starts = [0, *range(_MAX_FUSED, len(inputs), _MAX_FUSED - 1)]
            for i in starts:
                chunk = inputs[:_MAX_FUSED] if i == 0 else [out, *inputs[i : i + _MAX_FUSED - 1]]
                a = alpha if i == starts[-1] else 1.0
                k.reduce_n(out, chunk, op, self._cs, alpha=a)
            if out is not dst and dst.nbytes:
                cp.cuda.runtime.memcpyPeerAsync(
                    dst.data.ptr, dpid, out.data.ptr, pid, dst.nbytes, stream_ptr
                )

    def scale(self, x: Any, alpha: float) -> None:
        self.device.check_array(x)
        with self._on():
            _kernels().scale(x, float(alpha), self._cs)

    def sgd_update(
        self, w: Any, g: Any, v: Any, lr: float, momentum: float, weight_decay: float
    ) -> None:
        for a in (w, g, v):
            self.device.check_array(a)
        if not (w.dtype == g.dtype == v.dtype and w.size == g.size == v.size):
            raise ValueError("w, g and v must have one dtype and one size")
        with self._on():
            _kernels().sgd_update(
                w, g, v, float(lr), float(momentum), float(weight_decay), self._cs
            )

    def call(self, fn: Any, *args: Any) -> None:
        if not callable(fn):
            raise TypeError(f"call needs a callable, got {fn!r}")
        with self._on():
            fn(*args)

    def record(self, event: Event | None = None) -> Event:
        if event is None:
            event = CudaEvent()
        event.record(self)
        return event

    def wait_event(self, event: Event) -> None:
        if not isinstance(event, CudaEvent):
            raise TypeError(f"a CUDA stream waits on CUDA events, got {event!r}")
        if event._ev is None:
            return
        with _cupy().cuda.Device(self.device.physical_id):
            self._cs.wait_event(event._ev)

    def synchronize(self, timeout: float | None = None) -> None:
        _poll(self.query, timeout, repr(self))

    def query(self) -> bool:
        with _cupy().cuda.Device(self.device.physical_id):
            return bool(self._cs.done)


def _ptr_nbytes(a: Any, what: str) -> tuple[int, int]:
    """Device or host pointer and size of a C-contiguous CuPy or numpy array."""
    if isinstance(a, np.ndarray):
        if not a.flags.c_contiguous:
            raise ValueError(f"{what} must be C-contiguous")
        return a.ctypes.data, a.nbytes
    cp = _cupy()
    if isinstance(a, cp.ndarray):
        if not a.flags.c_contiguous:
            raise ValueError(f"{what} must be C-contiguous")
        return a.data.ptr, a.nbytes
    raise TypeError(f"{what} must be a cupy.ndarray or a numpy.ndarray, got {type(a)}")


class CudaDevice(Device):
    """One logical device on a physical GPU."""

    backend = "cuda"
    threads = 1  # kernel launch configuration is the GPU's business, not a thread count

    def __init__(self, runtime: CudaRuntime, index: int, physical_id: int) -> None:
        super().__init__()
        self.runtime = runtime
        self.index = index
        self.physical_id = physical_id
        self.name = f"gpu:{physical_id}"
        self._streams: weakref.WeakSet[CudaStream] = weakref.WeakSet()
        self._lock = self._stream_lock  # the set of streams changes with stream creation

    @property
    def xp(self) -> Any:
        return _cupy()

    @contextmanager
    def activate(self) -> Iterator[Device]:
        with _cupy().cuda.Device(self.physical_id):
            yield self

    def _make_stream(self) -> CudaStream:
        # non-blocking streams of their own (the default one too, not CUDA's null stream),
        # so logical devices sharing one GPU run independently, as on the host backend
        cp = _cupy()
        with cp.cuda.Device(self.physical_id):
            s = CudaStream(self, cp.cuda.Stream(non_blocking=True))
        self._streams.add(s)
        return s

    def current_stream(self) -> Stream:
        """The stream of ``with stream:``, else CuPy's current stream on this GPU (the
        caller's order, possibly CUDA's null stream)."""
        stack = getattr(self._tls, "streams", None)
        if stack:
            return stack[-1]
        cp = _cupy()
        with cp.cuda.Device(self.physical_id):
            return CudaStream(self, cp.cuda.get_current_stream())

    def new_event(self) -> CudaEvent:
        return CudaEvent()

    def empty(self, shape: Any, dtype: Any = "float32") -> Any:
        cp = _cupy()
        with cp.cuda.Device(self.physical_id):
            return cp.empty(shape, dtype)

    def zeros(self, shape: Any, dtype: Any = "float32") -> Any:
        cp = _cupy()
        with cp.cuda.Device(self.physical_id):
            return cp.zeros(shape, dtype)

    def pinned_empty(self, shape: Any, dtype: Any = "float32") -> np.ndarray:
        return pinned_empty(shape, dtype)

    def asarray(self, obj: Any) -> Any:
        cp = _cupy()
        if isinstance(obj, np.ndarray) or not (
            hasattr(obj, "__cuda_array_interface__") or hasattr(obj, "__dlpack__")
        ):
            raise TypeError(
                f"{self.name} views GPU buffers (__cuda_array_interface__ or DLPack); "
                f"got {type(obj).__name__} (use from_host to copy host data)"
            )
        with cp.cuda.Device(self.physical_id):
            if hasattr(obj, "__cuda_array_interface__"):
                arr = cp.asarray(obj)
            else:
                arr = cp.from_dlpack(obj)
        if arr.device.id != self.physical_id:
            raise TypeError(f"the buffer is on GPU {arr.device.id}, not on {self.name}")
        return arr

    def check_array(self, arr: Any) -> None:
        cp = _cupy()
        if not isinstance(arr, cp.ndarray):
            raise TypeError(
                f"{self.name} takes cupy.ndarray buffers, got {type(arr).__module__}."
                f"{type(arr).__name__}"
            )
        if arr.device.id != self.physical_id:
            raise ValueError(f"the array is on GPU {arr.device.id}, not on {self.name}")
        if not arr.flags.c_contiguous:
            raise ValueError(f"{self.name}: the array must be C-contiguous")

    def from_host(self, host: Any, stream: Stream | None = None) -> Any:
        cp = _cupy()
        src = np.ascontiguousarray(host)
        with cp.cuda.Device(self.physical_id):
            out = cp.empty(src.shape, src.dtype)
            if stream is None:
                out.set(src)  # on the current stream, then wait: complete on return
                cp.cuda.get_current_stream().synchronize()
            else:
                stream.copy(out, src)
        return out

    def to_host(self, arr: Any, out: Any = None, stream: Stream | None = None) -> np.ndarray:
        self.check_array(arr)
        cp = _cupy()
        if out is None:
            out = pinned_empty(arr.shape, arr.dtype) if stream is not None else None
        elif not isinstance(out, np.ndarray) or out.nbytes != arr.nbytes:
            raise ValueError(f"out must be a numpy array of {arr.nbytes} bytes")
        with cp.cuda.Device(self.physical_id):
            if stream is None:
                res = arr.get(out=out)  # blocking
                return res
            stream.copy(out, arr)
        return out

    def synchronize(self, timeout: float | None = None) -> None:
        deadline = time.monotonic() + timeout_or_default(timeout)
        with self._lock:
            streams = list(self._streams)
        cp = _cupy()
        with cp.cuda.Device(self.physical_id):
            streams.append(CudaStream(self, cp.cuda.get_current_stream()))
        for s in streams:
            s.synchronize(max(0.0, deadline - time.monotonic()))

    def can_access_peer(self, other: Device) -> bool:
        if not isinstance(other, CudaDevice):
            return False
        return _enable_peer(self.physical_id, other.physical_id)

    def _current(self) -> Any:
        return _cupy().cuda.get_current_stream()

    def sum_into(self, dst: Any, src: Any) -> None:
        with self.activate():
            _kernels().sum_into(dst, src, self._current())

    def scale(self, x: Any, alpha: float) -> None:
        with self.activate():
            _kernels().scale(x, float(alpha), self._current())

    def sgd_update(
        self, w: Any, g: Any, v: Any, lr: float, momentum: float, weight_decay: float
    ) -> None:
        with self.activate():
            _kernels().sgd_update(
                w, g, v, float(lr), float(momentum), float(weight_decay), self._current()
            )


def pinned_empty(shape: Any, dtype: Any = "float32") -> np.ndarray:
    """A numpy array in page-locked memory from CuPy's pinned allocator."""
    cp = _cupy()
    dt = np.dtype(dtype)
    shape = (int(shape),) if isinstance(shape, (int, np.integer)) else tuple(int(s) for s in shape)
    count = int(np.prod(shape, dtype=np.int64))
    mem = cp.cuda.alloc_pinned_memory(max(count * dt.itemsize, 1))
    # the array's base keeps the pinned block alive
    return np.frombuffer(mem, dt, count).reshape(shape)


class CudaRuntime:
    """The backend object shared by the devices of one ``devices("gpu:…")`` call. Peer
    access between its distinct GPUs is enabled once, where the hardware allows."""

    name = "cuda"

    def __init__(self, physical_ids: Sequence[int]) -> None:
        ids = [int(i) for i in physical_ids]
        if not ids:
            raise ValueError("the CUDA backend needs at least one GPU ordinal")
        self.devices: list[CudaDevice] = [CudaDevice(self, i, p) for i, p in enumerate(ids)]
        distinct = sorted(set(ids))
        for a in distinct:
            for b in distinct:
                if a != b:
                    _enable_peer(a, b)

    def shutdown(self) -> None:
        """Wait for the devices' streams (bounded by the default timeout)."""
        for d in self.devices:
            d.synchronize()

    def __repr__(self) -> str:
        return f"<CudaRuntime {[d.physical_id for d in self.devices]}>"
