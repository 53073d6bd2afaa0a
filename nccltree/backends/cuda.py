"""CUDA backend: CuPy arrays, ``cupy.cuda.Stream``/``Event``, peer access.

The same interface as ``host.py`` (docstrings in ``base.py``). CuPy is imported on first use
only. Every method makes its GPU current itself where CUDA needs it (``cupy.cuda.Device``,
at most once per operation; an event record or a stream wait needs none), so a device
works from any thread whatever that thread's current GPU is. Several logical devices may
share one GPU
(``"gpu:0,0"``): each has its own streams, and copies between them are plain device copies.
"""

from __future__ import annotations

import threading
import time
import types
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import numpy.typing as npt

from .. import _cuda_kernels as _k
from .._errors import BackendUnavailable, CommError, CommTimeout
from .._native import check_host_array, ranges_overlap
from .._validate import check_int
from .base import (
    Array,
    CopyArgs,
    Device,
    Event,
    ReduceArgs,
    SgdArgs,
    ShapeLike,
    Stream,
    as_shape,
    check_host_out,
    data_ptr,
    run_fold,
)

_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: direction inferred through unified addressing
_PEER_ALREADY_ENABLED = 704  # cudaErrorPeerAccessAlreadyEnabled
_NOT_READY = 600  # cudaErrorNotReady: what a stream or event query says of pending work
_HOST_ALLOC_PORTABLE = 1  # cudaHostAllocPortable: page-locked for every GPU of the process


class CudaError(CommError):
    """A CUDA error reported by a stream or event query: an op before that point failed
    (an illegal address, a trap, a failed copy), or the GPU's context is broken.

    ``status`` is the ``cudaError_t`` code and ``device`` the GPU ordinal; the CuPy
    ``CUDARuntimeError`` is the ``__cause__``.
    """

    def __init__(self, message: str, status: int, device: int) -> None:
        super().__init__(message)
        self.status = status
        self.device = device


# CuPy, imported on first use (a module global, so tests can replace it)
_cupy = _k.import_cupy


def gpu_count() -> int:
    """GPUs visible to CuPy; ``BackendUnavailable`` if CuPy or the driver is missing."""
    cp = _cupy()
    try:
        return int(cp.cuda.runtime.getDeviceCount())
    except Exception as exc:  # CUDARuntimeError: no driver, no device, driver too old
        raise BackendUnavailable(f"no usable CUDA driver or GPU: {exc}") from exc


def _query_status(query: Callable[[int], int], ptr: int, pid: int, what: str) -> bool:
    """Ask CUDA whether the work behind a stream or event handle is done, with GPU ``pid``
    current: True if done, False if pending, ``CudaError`` for any other status.

    CuPy's ``done`` properties compare the status with success only, so a failed op would
    look pending forever and a wait would end in a timeout instead of the error.
    """
    cp = _cupy()
    rt = cp.cuda.runtime
    try:
        with cp.cuda.Device(pid):
            status = int(query(ptr))
    except rt.CUDARuntimeError as exc:  # making the GPU current failed: a broken context
        status = int(exc.status)
        cause: BaseException = exc
    else:
        if status == 0:
            return True
        if status == _NOT_READY:
            return False
        cause = rt.CUDARuntimeError(status)
    raise CudaError(f"{what} on GPU {pid} failed: {cause}", status, pid) from cause


def _poll(done: Callable[[], bool], limit: float, what: str) -> None:
    """Wait for ``done()`` for at most ``limit`` seconds by polling: CUDA's blocking waits
    cannot be timed out."""
    if done():
        return
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
_peer_warned: set[int] = set()  # CUDA statuses already reported by a warning


def _enable_peer(a: int, b: int) -> bool:
    """Enable access from GPU ``a`` to GPU ``b`` memory where possible; True if enabled.

    A pair whose access cannot be enabled (e.g. cudaErrorTooManyPeers on a large PCIe
    machine: a GPU has a limited number of peer mappings) counts as having none, so plans
    stage through host memory instead of failing device creation; a warning says so once
    per kind of error.
    """
    if a == b:
        return True
    with _peer_lock:
        state = _peer_state.get((a, b))
        if state is not None:
            return state
        cp = _cupy()
        rt = cp.cuda.runtime
        try:
            ok = bool(rt.deviceCanAccessPeer(a, b))
            if ok:
                with cp.cuda.Device(a):
                    try:
                        rt.deviceEnablePeerAccess(b)
                    except rt.CUDARuntimeError as exc:
                        if exc.status != _PEER_ALREADY_ENABLED:
                            raise
        except rt.CUDARuntimeError as exc:
            ok = False
            if exc.status not in _peer_warned:
                _peer_warned.add(exc.status)
                warnings.warn(
                    f"peer access from GPU {a} to GPU {b} could not be enabled ({exc}); "
                    "copies between such GPUs are staged through host memory (later pairs "
                    "failing the same way are not reported again)",
                    RuntimeWarning,
                    stacklevel=2,
                )
        _peer_state[(a, b)] = ok
        return ok


#: the handles of a GPU's default streams (legacy, per-thread): they mean "the current
#: GPU's", so work on them needs the right GPU current; a created stream names its GPU
_DEFAULT_STREAMS = (0, 1, 2)


class CudaEvent(Event):
    """A ``cupy.cuda.Event(disable_timing=True)``, created on the device that records it.

    A failure seen by a query is sticky, as on the host backend: the event keeps raising
    it until it is recorded again; recording on a stream that already failed carries that
    stream's error over.
    """

    def __init__(self) -> None:
        self._ev: Any = None
        self._pid = -1
        self._error: CudaError | None = None

    def record(self, stream: Stream) -> None:
        if not isinstance(stream, CudaStream):
            raise TypeError(f"a CUDA event records on a CUDA stream, got {stream!r}")
        pid = stream.device.physical_id
        if self._ev is None or self._pid != pid or stream._cs.ptr in _DEFAULT_STREAMS:
            cp = _cupy()
            with cp.cuda.Device(pid):
                # an event belongs to the device it was created on: recreate it if needed
                if self._ev is None or self._pid != pid:
                    self._ev = cp.cuda.Event(disable_timing=True)
                    self._pid = pid
                self._ev.record(stream._cs)
        else:
            # a created stream names its GPU: recording needs no current device
            self._ev.record(stream._cs)
        self._error = stream._error

    def _synchronize(self, timeout: float) -> None:
        if self._ev is not None:
            _poll(self.query, timeout, f"event on GPU {self._pid}")

    def query(self) -> bool:
        if self._error is not None:
            raise self._error
        if self._ev is None:
            return True
        rt = _cupy().cuda.runtime
        try:
            return _query_status(rt.eventQuery, self._ev.ptr, self._pid, "an event")
        except CudaError as exc:
            self._error = exc
            raise


class CudaStream(Stream):
    """A CuPy stream (non-blocking) of one logical device."""

    def __init__(self, device: CudaDevice, cupy_stream: Any) -> None:
        self.device: CudaDevice = device
        self._cs = cupy_stream
        self._error: CudaError | None = None  # sticky, as on the host backend

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

    def _copy(self, c: CopyArgs) -> None:
        dst, src, nbytes = c.dst, c.src, c.dst.nbytes
        dptr, sptr = data_ptr(dst), data_ptr(src)
        dpid = c.dst_device.physical_id
        # -1: host memory or the stream's own GPU
        spid = -1 if c.src_device is None else c.src_device.physical_id
        if nbytes == 0:
            return
        cp = _cupy()
        # the stream's GPU current (not the stream: the copy names it), once per step
        with cp.cuda.Device(self.device.physical_id):
            if spid >= 0 and spid != dpid:
                cp.cuda.runtime.memcpyPeerAsync(dptr, dpid, sptr, spid, nbytes, self._cs.ptr)
            else:
                cp.cuda.runtime.memcpyAsync(dptr, sptr, nbytes, _MEMCPY_DEFAULT, self._cs.ptr)

    def _reduce(self, r: ReduceArgs) -> None:
        dst = r.dst
        pid = self.device.physical_id
        dpid = r.dst_device.physical_id
        if (dpid == pid or _enable_peer(pid, dpid)) and all(
            d.physical_id == pid or _enable_peer(pid, d.physical_id) for d in r.src_devices
        ):
            # every operand here or over peer access: one kernel (or a fold of them) on
            # this stream; the kernel wrapper makes the GPU current, once
            def launch(o: Array, ins: list[Array], a: float) -> None:
                _k.reduce_n(o, ins, r.op, self._cs, alpha=a, dtype=r.dtype)

            def scratch() -> Array:
                with self._on() as cp:
                    return cp.empty(dst.shape, dst.dtype)

            srcs = list(r.srcs)
            aliases = [i for i, s in enumerate(srcs) if _overlap(s, dst)]
            run_fold(dst, srcs, r.alpha, aliases, launch, scratch)
            return
        self._reduce_staged(r)

    def _reduce_staged(self, r: ReduceArgs) -> None:
        """A reduction with an operand on a GPU this one cannot reach: staged copies."""
        dst = r.dst
        pid = self.device.physical_id
        dpid = r.dst_device.physical_id
        stream_ptr = self._cs.ptr
        with self._on() as cp:
            inputs = []
            for s, d in zip(r.srcs, r.src_devices, strict=True):
                spid = d.physical_id
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
            # the kernel runs on this stream's GPU: it stores to dst there or, with peer
            # access, on the peer directly; else into a buffer here that is copied over
            direct = dpid == pid or _enable_peer(pid, dpid)
            out = dst if direct else cp.empty(dst.shape, dst.dtype)
            aliases = [i for i, s in enumerate(inputs) if _overlap(s, out)]

            def launch(o: Array, ins: list[Array], a: float) -> None:
                _k.reduce_n(o, ins, r.op, self._cs, alpha=a, dtype=r.dtype)

            run_fold(out, inputs, r.alpha, aliases, launch, lambda: cp.empty(dst.shape, dst.dtype))
            if not direct and dst.nbytes:
                cp.cuda.runtime.memcpyPeerAsync(
                    dst.data.ptr, dpid, out.data.ptr, pid, dst.nbytes, stream_ptr
                )

    def _scale(self, x: Array, alpha: float, dtype: np.dtype | None = None) -> None:
        _k.scale(x, alpha, self._cs, dtype=dtype)  # makes the stream's GPU current itself

    def _sgd_update(self, a: SgdArgs) -> None:
        _k.sgd_update(*a, stream=self._cs)

    def _call(self, fn: Callable[..., object], args: tuple[object, ...]) -> None:
        with self._on():
            fn(*args)

    def wait_event(self, event: Event) -> None:
        if not isinstance(event, CudaEvent):
            raise TypeError(f"a CUDA stream waits on CUDA events, got {event!r}")
        if event._ev is None:
            return
        if self._cs.ptr in _DEFAULT_STREAMS:  # "the current GPU's default stream"
            with _cupy().cuda.Device(self.device.physical_id):
                self._cs.wait_event(event._ev)
        else:
            # cudaStreamWaitEvent on a created stream needs no current GPU (the event may
            # be another GPU's)
            self._cs.wait_event(event._ev)

    def _synchronize(self, timeout: float) -> None:
        _poll(self.query, timeout, repr(self))

    def query(self) -> bool:
        if self._error is not None:
            raise self._error
        rt = _cupy().cuda.runtime
        try:
            return _query_status(
                rt.streamQuery, self._cs.ptr, self.device.physical_id, f"stream {self._cs.ptr:#x}"
            )
        except CudaError as exc:
            self._error = exc
            raise


def _overlap(a: Array, b: Array) -> bool:
    """Whether two CuPy arrays share bytes (unified addressing: one address space)."""
    return ranges_overlap(a.data.ptr, a.nbytes, b.data.ptr, b.nbytes)


class CudaDevice(Device):
    """One logical device on a physical GPU."""

    backend = "cuda"
    runtime: CudaRuntime
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
    def xp(self) -> types.ModuleType:
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

    def _stream_for(self, stream: Stream | None) -> CudaStream | None:
        """The stream an allocation is ordered on (see ``Device.empty``): ``stream``, else
        that of an enclosing ``with stream:``; None: CuPy's current stream, then waited
        for, so the memory suits any stream."""
        if stream is None:
            stream = self.explicit_current_stream()
            if stream is None:
                return None
        if not isinstance(stream, CudaStream) or stream.device.physical_id != self.physical_id:
            raise ValueError(f"stream must be a stream of GPU {self.physical_id}, got {stream!r}")
        return stream

    @contextmanager
    def _allocating(self, stream: Stream | None) -> Iterator[Any]:
        """Allocate in the block (CuPy yielded) in ``stream``'s order: CuPy's pool keeps
        one arena per stream and reuses a freed block in the order of the stream it was
        allocated on, so another stream writing it could race with work still pending
        there; CuPy's ``zeros`` also fills on the current stream."""
        cp = _cupy()
        s = self._stream_for(stream)
        with cp.cuda.Device(self.physical_id):
            if s is not None:
                with s._cs:
                    yield cp
                return
            yield cp
            # no stream named: make the memory safe for every stream
            CudaStream(self, cp.cuda.get_current_stream()).synchronize()

    def empty(
        self, shape: ShapeLike, dtype: npt.DTypeLike = "float32", *, stream: Stream | None = None
    ) -> Array:
        with self._allocating(stream) as cp:
            return cp.empty(shape, dtype)

    def zeros(
        self, shape: ShapeLike, dtype: npt.DTypeLike = "float32", *, stream: Stream | None = None
    ) -> Array:
        with self._allocating(stream) as cp:
            return cp.zeros(shape, dtype)

    def pinned_empty(self, shape: ShapeLike, dtype: npt.DTypeLike = "float32") -> np.ndarray:
        return pinned_empty(shape, dtype)

    def asarray(self, obj: Any) -> Array:
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

    def _check_operand(
        self, arr: object, what: str, *, writable: bool = False, host_ok: bool = False
    ) -> None:
        if host_ok and isinstance(arr, np.ndarray):
            check_host_array(arr, f"{what} (host memory)", writable=writable)
            return
        cp = _cupy()
        if not isinstance(arr, cp.ndarray):
            kinds = "a cupy.ndarray or a numpy.ndarray" if host_ok else "a cupy.ndarray"
            raise TypeError(
                f"{what} must be {kinds} for {self.name}, got {type(arr).__module__}."
                f"{type(arr).__name__}"
            )
        if arr.device.id != self.physical_id:
            raise ValueError(f"{what} is on GPU {arr.device.id}, not on {self.name}")
        if not arr.flags.c_contiguous:
            raise ValueError(f"{what} must be C-contiguous")

    def from_host(self, host: npt.ArrayLike, stream: Stream | None = None) -> Array:
        src = np.ascontiguousarray(host)
        if stream is None:
            cp = _cupy()
            with cp.cuda.Device(self.physical_id):
                cur = CudaStream(self, cp.cuda.get_current_stream())
                out = cp.empty(src.shape, src.dtype)
                cur.copy(out, src)
                cur.synchronize()  # complete on return, a failure reported as CudaError
            return out
        # allocated in the order of the stream that writes it (see Device.empty)
        s = self._stream_for(stream)
        with self._allocating(s) as cp:
            out = cp.empty(src.shape, src.dtype)
        stream.copy(out, src)
        return out

    def to_host(
        self, arr: Array, out: np.ndarray | None = None, stream: Stream | None = None
    ) -> np.ndarray:
        self.check_array(arr)
        if out is not None:
            check_host_out(out, arr.nbytes)
        if stream is not None:
            if out is None:
                out = pinned_empty(arr.shape, arr.dtype)
            stream.copy(out, arr)
            return out
        cp = _cupy()
        with cp.cuda.Device(self.physical_id):
            if out is None:
                return np.asarray(arr.get())  # blocking, on the current stream
            cur = CudaStream(self, cp.cuda.get_current_stream())
            cur.copy(out, arr)
            cur.synchronize()
        return out

    def _stream_waits(self) -> list[Callable[[float], None]]:
        with self._lock:
            streams = list(self._streams)
        cp = _cupy()
        with cp.cuda.Device(self.physical_id):
            streams.append(CudaStream(self, cp.cuda.get_current_stream()))
        return [s._synchronize for s in streams]

    def can_access_peer(self, other: Device) -> bool:
        if not isinstance(other, CudaDevice):
            return False
        return _enable_peer(self.physical_id, other.physical_id)

    def _current(self) -> Any:
        return _cupy().cuda.get_current_stream()

    def _run_kernel(self, name: str, *args: object) -> None:
        with self.activate():
            getattr(_k, name)(*args, self._current())


class _PinnedBlock:
    """Page-locked host memory from ``cudaHostAlloc``, outside CuPy's pinned pool (which
    rounds every request up to a power of two and keeps freed blocks locked for good).

    Numpy arrays over the block have it as their base, so it lives as long as any view;
    when the last one is gone the block is unpinned and freed.
    """

    def __init__(self, nbytes: int) -> None:
        rt = _cupy().cuda.runtime
        self.nbytes = nbytes
        self.ptr = int(rt.hostAlloc(nbytes, _HOST_ALLOC_PORTABLE))
        # not at exit: the CUDA runtime may be torn down first, and the OS frees it anyway
        weakref.finalize(self, _free_host, rt, self.ptr).atexit = False

    @property
    def __array_interface__(self) -> dict[str, Any]:
        return {"shape": (self.nbytes,), "typestr": "|u1", "data": (self.ptr, False), "version": 3}


def _free_host(rt: Any, ptr: int) -> None:
    try:
        rt.freeHost(ptr)
    except Exception as exc:  # noqa: BLE001 - a finalizer has nobody to raise to
        warnings.warn(f"freeing page-locked memory failed: {exc}", RuntimeWarning, stacklevel=1)


def pinned_empty(shape: ShapeLike, dtype: npt.DTypeLike = "float32") -> np.ndarray:
    """A numpy array in page-locked memory of exactly its size (rounded up to one byte),
    unpinned and freed when the array and its views are gone."""
    dt = np.dtype(dtype)
    dims = as_shape(shape)
    nbytes = int(np.prod(dims, dtype=np.int64)) * dt.itemsize
    raw: np.ndarray = np.asarray(_PinnedBlock(max(nbytes, 1)))  # base: the block
    return raw[:nbytes].view(dt).reshape(dims)


class CudaRuntime:
    """The backend object shared by the devices of one ``devices("gpu:…")`` call. Peer
    access between its distinct GPUs is enabled once, where the hardware allows."""

    name = "cuda"

    def __init__(self, physical_ids: Sequence[int]) -> None:
        ids = [check_int(i, "a GPU ordinal", min=0) for i in physical_ids]
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
