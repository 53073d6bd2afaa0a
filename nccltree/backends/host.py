"""Host backend: N virtual devices made of CPU memory and threads.

Arrays are plain numpy arrays. Each stream owns a worker thread and a FIFO, so work runs
asynchronously and in order per stream, and a missing ``wait_event`` gives a wrong answer
here just as on a GPU. An event is a sequence number in its stream: completed once the
stream's worker finished every op enqueued before it was recorded.
"""

from __future__ import annotations

import functools
import itertools
import os
import queue
import random
import threading
import time
import types
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import numpy.typing as npt

from .. import _native
from .._errors import CommTimeout, NcclTreeError
from .._validate import check_int, check_real
from .base import (
    HALF_DTYPES,
    CopyArgs,
    Device,
    Event,
    ReduceArgs,
    SgdArgs,
    ShapeLike,
    Stream,
    Transfer,
    as_shape,
    carry,
    check_host_out,
    run_fold,
    timeout_or_default,
)

JITTER_ENV = "NCCLTREE_HOST_JITTER"
_JITTER_DEFAULT_MAX_US = 200.0
ALIGNMENT = 64  # one cache line; also what the C kernels' vector loads like best

__all__ = [
    "ALIGNMENT",
    "HostDevice",
    "HostEvent",
    "HostRuntime",
    "HostStream",
    "Transfer",
    "aligned_empty",
    "record_transfers",
]

# -- aligned allocation ---------------------------------------------------------------------


def aligned_empty(
    shape: object, dtype: npt.DTypeLike = "float32", alignment: int = ALIGNMENT
) -> np.ndarray:
    """An uninitialised C-contiguous numpy array whose data starts on an ``alignment``
    boundary (plain pageable memory, never locked)."""
    dt = np.dtype(dtype)
    dims = as_shape(shape)
    alignment = check_int(alignment, "alignment", min=1)
    nbytes = int(np.prod(dims, dtype=np.int64)) * dt.itemsize
    raw = np.empty(nbytes + alignment, dtype=np.uint8)
    offset = (-raw.ctypes.data) % alignment
    return raw[offset : offset + nbytes].view(dt).reshape(dims)


# -- transfer recording ---------------------------------------------------------------------

_recorders: list[list[Transfer]] = []
_recorders_lock = threading.Lock()


@contextmanager
def record_transfers() -> Iterator[list[Transfer]]:
    """Collect a ``Transfer`` for every cross-device copy or peer read that *runs* on any
    host stream while the block is active (nested and concurrent recorders all see it)."""
    log: list[Transfer] = []
    with _recorders_lock:
        _recorders.append(log)
    try:
        yield log
    finally:
        with _recorders_lock:
            # by identity: two recorders' lists may compare equal
            for i, other in enumerate(_recorders):
                if other is log:
                    del _recorders[i]
                    break


def recording_transfers() -> bool:
    """Whether a ``record_transfers()`` block is open (then each operation is logged)."""
    return bool(_recorders)


def _record(src: int, dst: int, nbytes: int, kind: str) -> None:
    if not _recorders:  # the common case costs one truth test
        return
    t = Transfer(src, dst, nbytes, kind)
    with _recorders_lock:
        for log in _recorders:
            log.append(t)


# -- jitter ---------------------------------------------------------------------------------


def _jitter_config() -> tuple[int, float] | None:
    """(seed, max seconds) from ``NCCLTREE_HOST_JITTER=SEED[:MAX_US]``, or None."""
    raw = os.environ.get(JITTER_ENV, "").strip()
    if not raw:
        return None
    seed_s, _, max_s = raw.partition(":")
    try:
        seed = int(seed_s)
        max_us = float(max_s) if max_s else _JITTER_DEFAULT_MAX_US
    except ValueError:
        raise ValueError(
            f"{JITTER_ENV} must be SEED or SEED:MAX_US (integers/microseconds), got {raw!r}"
        ) from None
    return seed, check_real(max_us, f"{JITTER_ENV}: MAX_US", min=0.0) * 1e-6


# -- streams --------------------------------------------------------------------------------


class _StreamShutdown(NcclTreeError):
    """The backend was shut down while work was pending or being waited for."""


_Item = tuple[int, Callable[..., object], tuple[object, ...]]  # (sequence number, fn, args)


class _Core:
    """The state a stream's worker needs, kept apart from the ``HostStream`` object so the
    worker does not keep the stream alive: when the stream is garbage collected its worker
    finishes the queued work and exits.

    Completion is published on ``changed``, a native wait counter: the worker adds one per
    op it completes, so its value is ``done`` (mod 2**32) and a waiter for op ``seq``
    sleeps until the counter reaches ``seq``, with the GIL released. A failure or a
    shutdown jumps the counter once by 2**30, past every op still queued, which wakes
    every waiter to see why."""

    __slots__ = (
        "name",
        "q",
        "lock",
        "changed",
        "enqueued",
        "done",
        "error",
        "failed_seq",
        "jumped",
        "thread",
        "closed",
        "rng",
        "jitter_max",
        "__weakref__",
    )

    def __init__(self, name: str, jitter: tuple[int, float] | None, rng_key: int) -> None:
        self.name = name
        self.q: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.changed = _native.new_counter()
        self.enqueued = 0  # sequence number of the last op enqueued
        self.done = 0  # sequence number of the last op completed
        self.error: BaseException | None = None
        self.failed_seq = 0
        self.jumped = False  # the counter was moved past every queued op (under lock)
        self.thread: threading.Thread | None = None
        self.closed = False
        if jitter is None:
            self.rng: random.Random | None = None
            self.jitter_max = 0.0
        else:
            self.rng = random.Random(jitter[0] * 1_000_003 + rng_key)
            self.jitter_max = jitter[1]

    def enqueue(self, fn: Callable[..., object], args: tuple[object, ...]) -> None:
        with self.lock:
            if self.closed:
                raise _StreamShutdown(f"stream {self.name} is shut down")
            seq = self.enqueued = self.enqueued + 1
            # put under the lock so queue order == sequence order with several producers
            self.q.put((seq, fn, args))
            if self.thread is None:
                self.thread = threading.Thread(
                    target=_worker, args=(self,), name=f"nccltree-{self.name}", daemon=True
                )
                self.thread.start()

    def wait_for(self, seq: int, limit: float) -> None:
        """Block until op ``seq`` completed, for at most ``limit`` seconds; re-raise a
        failure at or before it."""
        if self.done >= seq:
            return
        deadline = time.monotonic() + limit
        while self.done < seq:
            # the flags are set before the counter jumps: read them first, then wait
            if self.error is not None and self.failed_seq <= seq:
                raise self.error
            if self.closed:
                raise _StreamShutdown(f"stream {self.name} was shut down")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise CommTimeout(
                    f"stream {self.name}: op {seq} not done after {limit:g} s "
                    f"({self.done} of {self.enqueued} ops done)"
                )
            # at most 2**30 ops are ever queued, so seq is never more than 2**31 ahead;
            # no spin: the worker that completes the op needs the GIL to say so
            self.changed.wait(seq, remaining, 0.0)

    def check(self, seq: int) -> bool:
        """Non-blocking ``wait_for``: True if done, raises a failure at or before it."""
        if self.done >= seq:
            return True
        err = self.error
        if err is not None and self.failed_seq <= seq:
            raise err
        return False

    def retire(self) -> None:
        """The stream object is gone: let the worker finish the queue, then exit."""
        self.q.put(None)

    def _jump(self) -> None:
        """Wake every waiter for good (called with the lock held, flags already set)."""
        if not self.jumped:
            self.jumped = True
            self.changed.add(1 << 30)

    def close(self) -> None:
        """Shut down: drop pending work and wake every waiter with an error."""
        with self.lock:
            if self.closed:
                return
            self.closed = True
            self.q.put(None)
            self._jump()


def _worker(core: _Core) -> None:
    q = core.q
    sleep = time.sleep
    changed = core.changed
    while True:
        item = q.get()
        if item is None:
            return
        seq, fn, args = item
        item = None  # drop references to finished work's buffers promptly
        if core.error is not None or core.closed:
            del fn, args  # a failed stream drops the rest of its queue (sticky error)
            continue
        if core.rng is not None:
            sleep(core.rng.random() * core.jitter_max)
        try:
            fn(*args)
        except BaseException as exc:  # noqa: BLE001 - any failure must reach the waiters
            with core.lock:
                core.error = exc
                core.failed_seq = seq
                core._jump()
        else:
            core.done = seq
            changed.add(1)  # wakes a waiter for this op (no system call if none sleeps)
        del fn, args


_wait_timeout: float | None = None  # None: DEFAULT_TIMEOUT; tests may shorten it


def _op_wait(core: _Core, seq: int) -> None:
    core.wait_for(seq, timeout_or_default(_wait_timeout))


# Below this many bytes of passes numpy's ufuncs beat a native call: the work is a few
# cache lines and the ctypes call dominates (measured: a 32 KiB two-source sum took 1.4 us
# in np.add and 5.1 us through the kernel, a 1 MiB one 132 against 80 us). numpy sums k
# sources in k - 1 passes over the destination, so a reduce counts its bytes that many
# times. Results are bitwise the same (both combine sources left to right, rounding to the
# dtype after each step, no FMA), except for float16 and bfloat16, which the native kernels
# accumulate in float32 and therefore always run.
SMALL_BYTES = 64 << 10
_UFUNCS = {"sum": np.add, "prod": np.multiply, "max": np.maximum, "min": np.minimum}


def _op_copy(threads: int, dst: np.ndarray, src: np.ndarray, rec: tuple[int, int] | None) -> None:
    if dst.nbytes <= SMALL_BYTES:
        np.copyto(dst, src)
    else:
        _native.copy_checked(dst, src, threads)
    if rec is not None:
        _record(rec[0], rec[1], dst.nbytes, "copy")


def _copy_op(
    threads: int, c: CopyArgs
) -> tuple[int, np.ndarray, np.ndarray, tuple[int, int] | None]:
    """The arguments of ``_op_copy`` for a checked copy."""
    dst, src = c.dst, c.src
    if dst.dtype != src.dtype or dst.size != src.size:
        # a copy moves bytes: reinterpret both sides as flat byte arrays
        dst, src = dst.reshape(-1).view(np.uint8), src.reshape(-1).view(np.uint8)
    # no src_device: host memory or this device, not a transfer between devices
    s_idx, d_idx = None if c.src_device is None else c.src_device.index, c.dst_device.index
    return threads, dst, src, (s_idx, d_idx) if s_idx is not None and s_idx != d_idx else None


def _op_reduce(threads: int, r: ReduceArgs) -> None:
    dst, srcs, op, alpha = r.dst, r.srcs, r.op, r.alpha
    if r.dtype is not None:  # numpy has every dtype: view arrays that carry one as it
        dst, srcs = carry(dst, r.dtype)[0], [carry(s, r.dtype)[0] for s in srcs]
    if dst.nbytes * max(1, len(srcs) - 1) <= SMALL_BYTES and dst.dtype not in HALF_DTYPES:
        _small_reduce(dst, srcs, _UFUNCS[op], alpha)
    else:

        def launch(out: np.ndarray, inputs: list[np.ndarray], a: float) -> None:
            _native.reduce_n_checked(out, inputs, op, threads, a)

        # longer lists than one kernel takes fold in passes, in the order of the sources
        aliases = [i for i, s in enumerate(srcs) if np.may_share_memory(dst, s)]
        run_fold(dst, srcs, alpha, aliases, launch, lambda: aligned_empty(dst.shape, dst.dtype))
    d_idx = r.dst_device.index
    for s, d in zip(srcs, r.src_devices, strict=True):
        if d.index != d_idx:
            _record(d.index, d_idx, s.nbytes, "peer_read")


def _small_reduce(
    dst: np.ndarray, srcs: list[np.ndarray], ufunc: np.ufunc, alpha: float = 1.0
) -> None:
    """``dst = ufunc(...ufunc(srcs[0], srcs[1])..., srcs[-1])`` with numpy, left to right.

    ``alpha != 1.0`` (a sum of floats) then multiplies by alpha rounded to the dtype, as
    the native scaled sum does, so the result stays bitwise the kernel's.
    """
    if alpha != 1.0:
        factor = dst.dtype.type(alpha)
        if len(srcs) == 1:
            np.multiply(srcs[0], factor, out=dst)
            return
        _small_reduce(dst, srcs, ufunc)
        np.multiply(dst, factor, out=dst)
        return
    if len(srcs) == 1:
        if srcs[0] is not dst:
            np.copyto(dst, srcs[0])
        return
    # dst may be one of the sources: only the first may be overwritten before it is read
    acc = dst if not any(np.may_share_memory(dst, s) for s in srcs[1:]) else np.empty_like(dst)
    with np.errstate(all="ignore"):  # overflow and NaN pass silently, as in the kernels
        ufunc(srcs[0], srcs[1], out=acc)
        for s in srcs[2:]:
            ufunc(acc, s, out=acc)
    if acc is not dst:
        np.copyto(dst, acc)


def _op_scale(threads: int, x: np.ndarray, alpha: float) -> None:
    _native.scale(x, alpha, nthreads=threads)


def _op_sgd(threads: int, a: SgdArgs) -> None:
    _native.sgd_update(*a, nthreads=threads)


class HostEvent(Event):
    """A (stream, sequence number) pair; completed when the stream's worker passed it."""

    __slots__ = ("_core", "_seq")

    def __init__(self) -> None:
        self._core: _Core | None = None
        self._seq = 0

    def record(self, stream: Stream) -> None:
        if not isinstance(stream, HostStream):
            raise TypeError(f"a host event records on a host stream, got {stream!r}")
        core = stream._core
        with core.lock:
            self._core, self._seq = core, core.enqueued

    def _synchronize(self, timeout: float) -> None:
        if self._core is not None:
            self._core.wait_for(self._seq, timeout)

    def query(self) -> bool:
        return self._core is None or self._core.check(self._seq)


class HostStream(Stream):
    """A FIFO of work run by this stream's own worker thread (started on first use)."""

    def __init__(self, device: HostDevice, serial: int) -> None:
        self.device: HostDevice = device
        inline = serial < 0  # an _InlineStream: nothing queued, so nothing to delay
        jitter = None if inline else _jitter_config()
        name = f"cpu{device.index}-" + ("inline" if inline else f"s{serial}")
        self._core = _Core(name, jitter, device.index * 1009 + serial)
        #: how an op is issued: queued for the worker (``_InlineStream``: run now)
        self._submit: Callable[[Callable[..., object], tuple[object, ...]], None]
        self._submit = self._core.enqueue
        # when the stream object goes away its worker drains the queue and exits
        weakref.finalize(self, _Core.retire, self._core)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self._core.name}>"

    def _threads(self) -> int:
        """The threads each kernel of this stream uses: the device's."""
        return self.device.threads

    def _copy(self, c: CopyArgs) -> None:
        self._submit(_op_copy, _copy_op(self._threads(), c))

    def _reduce(self, r: ReduceArgs) -> None:
        self._submit(_op_reduce, (self._threads(), r))

    def _scale(self, x: np.ndarray, alpha: float, dtype: np.dtype | None = None) -> None:
        self._submit(_op_scale, (self._threads(), carry(x, dtype)[0], alpha))

    def _sgd_update(self, a: SgdArgs) -> None:
        self._submit(_op_sgd, (self._threads(), a))

    def _call(self, fn: Callable[..., object], args: tuple[object, ...]) -> None:
        self._submit(fn, args)

    def wait_event(self, event: Event) -> None:
        if not isinstance(event, HostEvent):
            raise TypeError(f"a host stream waits on host events, got {event!r}")
        core, seq = event._core, event._seq
        # an unrecorded event, one of this stream (FIFO order suffices) or one already
        # passed costs nothing
        if core is None or core is self._core or core.done >= seq:
            return
        self._submit(_op_wait, (core, seq))

    def _synchronize(self, timeout: float) -> None:
        core = self._core
        core.wait_for(core.enqueued, timeout)

    def query(self) -> bool:
        core = self._core
        return core.check(core.enqueued)


def _run_now(fn: Callable[..., object], args: tuple[object, ...]) -> None:
    fn(*args)


class _InlineStream(HostStream):
    """A stream whose operations run at once, in the calling thread, checked and recorded
    as on any stream (``HostDevice.copy_now`` / ``reduce_now``); a wait blocks the
    caller. Nothing is ever queued, so it is always idle. ``threads``: the threads each
    kernel uses (None: the device's)."""

    def __init__(self, device: HostDevice, threads: int | None = None) -> None:
        super().__init__(device, -1)
        self._submit = _run_now
        self._fixed_threads = threads

    def _threads(self) -> int:
        return self._fixed_threads or self.device.threads


class HostDevice(Device):
    """A virtual device: host memory plus worker-thread streams.

    ``inline_stream`` is a stream whose operations run now, in the calling thread (checked
    and recorded the same way); ``copy_now`` and ``reduce_now`` are its ``copy`` and
    ``reduce``.
    """

    backend = "host"
    runtime: HostRuntime

    def __init__(self, runtime: HostRuntime, index: int, threads: int) -> None:
        super().__init__()
        self.runtime = runtime
        self.index = index
        self.physical_id = index
        self.name = f"cpu:{index}"
        self.threads = threads
        self._serial = itertools.count()
        self._cores: weakref.WeakSet[_Core] = weakref.WeakSet()
        self._cores_lock = self._stream_lock  # the set of cores changes with the streams
        #: a stream whose operations run at once in the calling thread (what the engine
        #: uses to perform a plan inline); ``copy_now``/``reduce_now`` are its copy/reduce
        self.inline_stream: Stream = _InlineStream(self)
        self.copy_now = self.inline_stream.copy
        self.reduce_now = self.inline_stream.reduce
        self._inline_by_threads: dict[int, Stream] = {}

    def inline_stream_with(self, threads: int) -> Stream:
        """An inline stream (see ``inline_stream``) whose kernels use ``threads`` threads:
        a caller that performs every rank's steps itself, one after another, gives each
        kernel the threads of all the ranks' devices."""
        threads = check_int(threads, "threads", min=1)
        stream = self._inline_by_threads.get(threads)
        if stream is None:
            stream = self._inline_by_threads[threads] = _InlineStream(self, threads)
        return stream

    @property
    def threads(self) -> int:
        return self._threads

    @threads.setter
    def threads(self, n: int) -> None:
        self._threads = check_int(n, "threads", min=1)

    @property
    def xp(self) -> types.ModuleType:
        return np

    def _make_stream(self) -> HostStream:
        self.runtime._check_open()
        s = HostStream(self, next(self._serial))
        self._cores.add(s._core)
        return s

    def new_event(self) -> HostEvent:
        return HostEvent()

    def empty(
        self, shape: ShapeLike, dtype: npt.DTypeLike = "float32", *, stream: Stream | None = None
    ) -> np.ndarray:
        # host memory is not handed out in any stream's order: ready for every stream
        return aligned_empty(shape, dtype)

    def zeros(
        self, shape: ShapeLike, dtype: npt.DTypeLike = "float32", *, stream: Stream | None = None
    ) -> np.ndarray:
        a = aligned_empty(shape, dtype)
        a.fill(0)
        return a

    def pinned_empty(self, shape: ShapeLike, dtype: npt.DTypeLike = "float32") -> np.ndarray:
        return aligned_empty(shape, dtype)

    def asarray(self, obj: Any) -> np.ndarray:
        if isinstance(obj, np.ndarray):
            return obj
        if hasattr(obj, "__cuda_array_interface__"):
            raise TypeError(
                f"{type(obj).__name__} lives in GPU memory; a host device takes numpy arrays "
                "or host buffers (copy it to the host first)"
            )
        if hasattr(obj, "__array_interface__"):
            return np.asarray(obj)
        if hasattr(obj, "__dlpack__"):
            # before __array__, which may copy: DLPack is a view or an error (a torch CPU
            # tensor comes here: the collective writes into the tensor's own memory)
            try:
                arr = np.from_dlpack(obj)
                if not arr.flags.writeable and hasattr(obj, "__array__"):
                    # an unversioned DLPack import is read-only; __array__ may give the
                    # same memory writable (a torch tensor's .numpy()): only then is it used
                    alt = np.asarray(obj)
                    if alt.flags.writeable and alt.ctypes.data == arr.ctypes.data:
                        return alt
                return arr
            except (BufferError, RuntimeError, TypeError, ValueError) as exc:
                raise TypeError(
                    f"cannot view {type(obj).__name__} as a host array: {exc}"
                ) from None
        if hasattr(obj, "__array__"):
            return np.asarray(obj)
        try:
            return np.asarray(memoryview(obj))
        except TypeError:
            raise TypeError(
                f"cannot view {type(obj).__name__} as a host array: expected a numpy array, "
                "an object with __array_interface__, the buffer protocol or DLPack"
            ) from None

    def _check_operand(
        self, arr: object, what: str, *, writable: bool = False, host_ok: bool = False
    ) -> None:
        # every host device's buffer is host memory: the kernel wrappers' own check
        _native.check_host_array(arr, f"{what} (a host device's buffer)", writable=writable)

    def from_host(self, host: npt.ArrayLike, stream: Stream | None = None) -> np.ndarray:
        src = np.ascontiguousarray(host)
        out = aligned_empty(src.shape, src.dtype)
        if stream is None:
            _native.copy(out, src, nthreads=self.threads)
        else:
            stream.copy(out, src)
        return out

    def to_host(
        self, arr: np.ndarray, out: np.ndarray | None = None, stream: Stream | None = None
    ) -> np.ndarray:
        self.check_array(arr)
        if out is None:
            out = aligned_empty(arr.shape, arr.dtype)
        else:
            check_host_out(out, arr.nbytes)
        if stream is None:
            self.copy_now(out, arr)  # moves bytes, as the stream path does
        else:
            stream.copy(out, arr)
        return out

    def _stream_waits(self) -> list[Callable[[float], None]]:
        # the cores, not the streams: a dropped stream's worker may still have work
        with self._cores_lock:
            cores = list(self._cores)
        return [functools.partial(core.wait_for, core.enqueued) for core in cores]

    def can_access_peer(self, other: Device) -> bool:
        # all virtual devices share one address space
        return isinstance(other, HostDevice)

    def _run_kernel(self, name: str, *args: object) -> None:
        getattr(_native, name)(*args, nthreads=self.threads)

    def _close(self) -> None:
        with self._cores_lock:
            cores = list(self._cores)
        for core in cores:
            core.close()


class HostRuntime:
    """The backend object shared by the devices of one ``devices("cpu:N")`` call."""

    name = "host"

    def __init__(self, n: int) -> None:
        n = check_int(n, "the number of host devices", min=1)
        threads = max(1, (os.cpu_count() or 1) // n)
        self.closed = False
        self.devices: list[HostDevice] = [HostDevice(self, i, threads) for i in range(n)]

    def _check_open(self) -> None:
        if self.closed:
            raise NcclTreeError("the host backend was shut down")

    def shutdown(self) -> None:
        """Stop every stream worker; pending and later waits raise instead of hanging."""
        self.closed = True
        for d in self.devices:
            d._close()

    def __repr__(self) -> str:
        return f"<HostRuntime {len(self.devices)} devices>"
