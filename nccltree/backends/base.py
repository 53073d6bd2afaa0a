"""The device interface every backend implements.

Docstrings live here only; ``host.py`` and ``cuda.py`` implement the same methods with the
same meaning. A backend is one small file: arrays, streams, events, copies (including peer
copies), the native kernels and pinned host memory.
"""

from __future__ import annotations

import abc
import threading
import time
import types
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple, Protocol, SupportsIndex, TypeVar

import numpy as np
import numpy.typing as npt

from .._validate import check_real, check_shape, check_timeout

#: Reduction operators every backend's ``Stream.reduce`` accepts.
REDUCE_OPS = ("sum", "prod", "max", "min")

#: Sources one reduce kernel takes (host and CUDA); longer lists are folded in passes.
#: The one definition: ``_native`` and ``_cuda_kernels`` import it, the host library is
#: asserted to agree when it is loaded (``nt_max_sources()``), and a test reads the CUDA
#: source's ``NT_MAX_SOURCES``.
MAX_FUSED = 8

try:  # bfloat16 alone needs ml_dtypes: everything else runs without it
    import ml_dtypes

    _ML_BFLOAT16: np.dtype | None = np.dtype(ml_dtypes.bfloat16)
except ImportError:
    _ML_BFLOAT16 = None

#: bfloat16, as numpy arrays carry it (the ``ml_dtypes`` package's dtype, whose numpy
#: ``kind`` is ``"V"``, not ``"f"``: test floating dtypes with ``FLOAT_DTYPES``). Without
#: ``ml_dtypes`` a stand-in that no array has, and asking for bfloat16 by name raises
#: ``ImportError`` (:func:`bfloat16`).
BFLOAT16: np.dtype = (
    _ML_BFLOAT16 if _ML_BFLOAT16 is not None else np.dtype([("bfloat16 (needs ml_dtypes)", "<u2")])
)


def bfloat16() -> np.dtype:
    """:data:`BFLOAT16`, or an ``ImportError`` naming ``ml_dtypes`` where it is missing."""
    if _ML_BFLOAT16 is None:
        raise ImportError("bfloat16 needs the ml_dtypes package (pip install ml_dtypes)")
    return BFLOAT16


#: The dtypes of the kernels (host and CUDA alike); ``FLOAT_DTYPES`` those that scale,
#: the SGD step and a scaled sum accept; ``HALF_DTYPES`` the 16-bit floats, which the
#: kernels accumulate in float32 and round once, at the store.
DTYPES: tuple[np.dtype[Any], ...] = (
    *(np.dtype(t) for t in ("float16", "float32", "float64", "int32", "int64")),
    BFLOAT16,
    np.dtype(np.int8),
    np.dtype(np.uint8),
)
FLOAT_DTYPES: tuple[np.dtype[Any], ...] = tuple(
    dt for dt in DTYPES if dt.kind == "f" or dt == BFLOAT16
)
HALF_DTYPES = (np.dtype(np.float16), BFLOAT16)

#: The array dtype that carries each kernel dtype an array library may lack: CuPy has no
#: bfloat16, so a bfloat16 buffer on a GPU is a ``uint16`` array of its bits, and every
#: call that computes on it names the dtype (``dtype="bfloat16"``).
CARRIERS: dict[np.dtype, np.dtype] = {BFLOAT16: np.dtype(np.uint16)}

#: A device's array: ``numpy.ndarray`` on the host backend, ``cupy.ndarray`` on CUDA (CuPy
#: ships no type information, hence ``Any``).
Array = Any
#: An array shape: an integer or a sequence of them (numpy integers included).
ShapeLike = SupportsIndex | Sequence[SupportsIndex]

#: Default timeout (seconds) of a wait when the caller passes ``timeout=None``: no wait is
#: unbounded, so a lost event turns into an error instead of a hang.
DEFAULT_TIMEOUT = 300.0


class Transfer(NamedTuple):
    """One cross-device data movement, as recorded by ``record_transfers()``.

    ``src`` and ``dst`` are device indices; ``kind`` is ``"copy"`` (a stream copy whose
    source lies on another device) or ``"peer_read"`` (a reduction reading a source that
    lies on another device).
    """

    src: int
    dst: int
    nbytes: int
    kind: str


class Event(abc.ABC):
    """A point in a stream. Completed once the stream's work up to that point has run.

    An event that was never recorded counts as completed (as in CUDA).
    """

    @abc.abstractmethod
    def record(self, stream: Stream) -> None:
        """Mark the current end of ``stream``; replaces any earlier point."""

    def synchronize(self, timeout: float | None = None) -> None:
        """Block until the event completed.

        Raises ``CommTimeout`` after ``timeout`` seconds (None: ``DEFAULT_TIMEOUT``; a
        finite number >= 0 otherwise) and re-raises the error of a failed op that precedes
        the event in its stream.
        """
        self._synchronize(timeout_or_default(timeout))

    @abc.abstractmethod
    def _synchronize(self, timeout: float) -> None:
        """Block until the event completed, for at most ``timeout`` (checked) seconds."""

    @abc.abstractmethod
    def query(self) -> bool:
        """True if the event completed (raises like ``synchronize`` on a failed stream)."""


class Stream(abc.ABC):
    """An ordered queue of asynchronous work on one device.

    Every operation returns at once; work runs in the order it was enqueued. Arguments are
    checked when the operation is enqueued (TypeError/ValueError), here, once for every
    backend, so a bad call never leaves half-done work behind and both backends refuse it
    with the same message. ``with stream:`` makes it this thread's current stream on its
    device.
    """

    device: Device

    def copy(
        self,
        dst: Array,
        src: Array,
        *,
        src_device: Device | None = None,
        dst_device: Device | None = None,
    ) -> None:
        """Copy ``src`` into ``dst`` (same number of bytes), in this stream's order.

        ``dst`` is on ``dst_device`` (None: this stream's device, or host memory); ``src``
        is on ``src_device`` (a peer copy) or, when None, on this device or in host memory.
        The host backend records a ``"copy"`` transfer from ``src_device`` to
        ``dst_device`` when both are devices and differ.
        """
        self._copy(check_copy(self.device, dst, src, src_device, dst_device))

    def reduce(
        self,
        dst: Array,
        srcs: Sequence[Array],
        op: str = "sum",
        *,
        src_devices: Sequence[Device | None] | None = None,
        dst_device: Device | None = None,
        alpha: float = 1.0,
        dtype: npt.DTypeLike | None = None,
    ) -> None:
        """``dst = op(*srcs)`` elementwise in one fused pass, in this stream's order.

        ``dst`` may be one of ``srcs``; it is on ``dst_device`` (None: this stream's
        device). ``src_devices[i]`` names the device holding ``srcs[i]`` (None: the dst's
        device); sources on other devices are read directly where the backend can (the
        host backend records a ``"peer_read"`` transfer from each to the dst's device).
        ``op`` is one of ``REDUCE_OPS``; the dtype one of ``DTYPES``. More sources than
        one kernel takes (``MAX_FUSED``) are folded in passes (``run_fold``).

        ``alpha != 1.0`` (``op="sum"``, floating dtypes) writes ``alpha * sum(srcs)`` in the
        same pass: alpha is rounded to the compute type and multiplies the finished sum, so
        float32/float64 results are bitwise those of the reduce followed by
        ``scale(dst, alpha)``; float16 is scaled before its one rounding (slightly more
        accurate than the two steps).

        ``dtype``: the dtype to compute in when the arrays carry it (``"bfloat16"`` for
        ``uint16`` arrays of its bits, see :func:`carried_dtype`); None: the arrays' own.
        """
        self._reduce(
            check_reduce(self.device, dst, srcs, op, src_devices, dst_device, alpha, dtype)
        )

    def scale(self, x: Array, alpha: float, *, dtype: npt.DTypeLike | None = None) -> None:
        """``x *= alpha`` (floating dtypes; alpha a finite real number; ``dtype`` as in
        :meth:`reduce`)."""
        x, a, carried = check_scale(self.device, x, alpha, dtype)
        self._scale(x, a, carried)

    def sgd_update(
        self, w: Array, g: Array, v: Array, lr: float, momentum: float, weight_decay: float
    ) -> None:
        """Caffe's SGD step in one pass: ``g += weight_decay*w; v = momentum*v + lr*g;
        w -= v`` (``w``, ``g``, ``v`` of one floating dtype and one size; finite
        hyperparameters ``lr``, ``momentum``, ``weight_decay``)."""
        self._sgd_update(check_sgd(self.device, w, g, v, lr, momentum, weight_decay))

    def call(self, fn: Callable[..., object], *args: object) -> None:
        """Run ``fn(*args)`` in stream order.

        Host: on the stream's worker thread, after all earlier work. CUDA: now, with this
        stream current, so the array operations ``fn`` issues are enqueued on it.
        """
        if not callable(fn):
            raise TypeError(f"call needs a callable, got {fn!r}")
        self._call(fn, args)

    def record(self, event: Event | None = None) -> Event:
        """Record ``event`` (a new one when None) at the current end; return it."""
        if event is None:
            event = self.device.new_event()
        event.record(self)
        return event

    @abc.abstractmethod
    def wait_event(self, event: Event) -> None:
        """Make later work on this stream wait for ``event``; never blocks the caller."""

    def synchronize(self, timeout: float | None = None) -> None:
        """Block until all enqueued work ran.

        Raises ``CommTimeout`` after ``timeout`` seconds (None: ``DEFAULT_TIMEOUT``; a
        finite number >= 0 otherwise) and re-raises the error of a failed op (the stream
        stays failed).
        """
        self._synchronize(timeout_or_default(timeout))

    @abc.abstractmethod
    def query(self) -> bool:
        """True if all enqueued work ran (raises the error of a failed op)."""

    # -- the engine's entry: arguments checked once for a whole collective ---------------

    def copy_checked(self, c: CopyArgs) -> None:
        """``copy`` of arguments ``c`` already checked: by :func:`check_copy`, or by the engine,
        which checks every rank's buffers once per collective and then issues many steps
        on views of them (checking each step again cost more than the step on small
        messages). Nothing is checked here."""
        self._copy(c)

    def reduce_checked(self, r: ReduceArgs) -> None:
        """``reduce`` of arguments ``r`` already checked (see :meth:`copy_checked`)."""
        self._reduce(r)

    def scale_checked(self, x: Array, alpha: float, dtype: np.dtype | None = None) -> None:
        """``scale`` (``x *= alpha``) of arguments already checked (see
        :meth:`copy_checked`); ``dtype``:
        the dtype ``x`` carries (None: its own)."""
        self._scale(x, alpha, dtype)

    # -- what a backend implements: the operations with their arguments checked ----------

    @abc.abstractmethod
    def _copy(self, c: CopyArgs) -> None:
        """Enqueue a checked copy."""

    @abc.abstractmethod
    def _reduce(self, r: ReduceArgs) -> None:
        """Enqueue a checked reduction (folded with ``run_fold`` beyond ``MAX_FUSED``)."""

    @abc.abstractmethod
    def _scale(self, x: Array, alpha: float, dtype: np.dtype | None = None) -> None:
        """Enqueue a checked ``x *= alpha``; ``dtype``: the dtype ``x`` carries (a
        ``uint16`` CuPy array of bfloat16 bits), None: its own."""

    @abc.abstractmethod
    def _sgd_update(self, a: SgdArgs) -> None:
        """Enqueue a checked SGD step."""

    @abc.abstractmethod
    def _call(self, fn: Callable[..., object], args: tuple[object, ...]) -> None:
        """Run ``fn(*args)`` in stream order (``fn`` is callable)."""

    @abc.abstractmethod
    def _synchronize(self, timeout: float) -> None:
        """Block until all enqueued work ran, for at most ``timeout`` (checked) seconds."""

    # `with stream:` -- the per-thread current-stream stack lives on the device.
    def __enter__(self) -> Stream:
        self.device._push_stream(self)
        return self

    def __exit__(self, *exc: object) -> None:
        self.device._pop_stream(self)


class Runtime(Protocol):
    """The backend object shared by the devices of one ``devices()`` call."""

    name: str

    @property
    def devices(self) -> Sequence[Device]:
        """The devices, in the order ``devices()`` returned them."""

    def shutdown(self) -> None:
        """Stop the backend's work: host workers exit, CUDA streams are waited for."""


class Device(abc.ABC):
    """One device of a ``devices()`` list.

    Attributes: ``backend`` ("host" | "cuda"), ``index`` (position in the list, the rank by
    default), ``physical_id`` (GPU ordinal; == index on host), ``xp`` (numpy or cupy),
    ``name``, ``threads`` (kernel threads this device may use), ``runtime`` (the backend
    object shared by all devices of one ``devices()`` call).
    """

    backend: str
    index: int
    physical_id: int
    name: str
    runtime: Runtime

    def __init__(self) -> None:
        self._tls = threading.local()
        self._default: Stream | None = None
        self._stream_lock = threading.Lock()  # guards stream creation and the device's set

    @property
    @abc.abstractmethod
    def xp(self) -> types.ModuleType:
        """The array module of this device (numpy or cupy)."""

    @property
    def default_stream(self) -> Stream:
        """The device's default stream (created on first use)."""
        if self._default is None:
            with self._stream_lock:
                if self._default is None:
                    self._default = self._make_stream()
        return self._default

    @abc.abstractmethod
    def empty(
        self, shape: ShapeLike, dtype: npt.DTypeLike = "float32", *, stream: Stream | None = None
    ) -> Array:
        """An uninitialised C-contiguous array of ``shape`` and ``dtype`` on this device.

        ``stream``: the stream of this device that uses the memory first. A GPU memory pool
        hands a freed block out again in the order of the stream it was allocated for, so
        memory allocated for one stream and written by another can race with work still
        pending on the first; with ``stream=`` the array is ready in that stream's order.
        ``None``: the stream of an enclosing ``with stream:`` if there is one; otherwise
        the array may be used on any stream once this returns (CUDA waits for the work
        pending on the current stream). Host memory is ready at once, whatever the stream.
        """

    @abc.abstractmethod
    def zeros(
        self, shape: ShapeLike, dtype: npt.DTypeLike = "float32", *, stream: Stream | None = None
    ) -> Array:
        """A zero-filled C-contiguous array of ``shape`` and ``dtype`` on this device;
        ``stream`` as in ``empty``
        (on CUDA the zero fill runs on that stream, so it too is ready in its order)."""

    @abc.abstractmethod
    def asarray(self, obj: Array) -> Array:
        """A zero-copy view of ``obj``, a buffer on this device (numpy, CUDA array
        interface, DLPack); TypeError for a buffer that lives elsewhere."""

    def check_array(self, arr: Array) -> None:
        """TypeError/ValueError unless ``arr`` is a C-contiguous array usable here."""
        self._check_operand(arr, "the array")

    @abc.abstractmethod
    def _check_operand(
        self, arr: Array, what: str, *, writable: bool = False, host_ok: bool = False
    ) -> None:
        """TypeError/ValueError, naming ``what``, unless ``arr`` is a C-contiguous array a
        kernel on this device can use (``writable``: and write); ``host_ok``: or a numpy
        array in host memory, which copies also take."""

    def _same_backend(self, dev: object, what: str) -> Device | None:
        """``dev`` if it is None or a device of this backend, else TypeError."""
        if dev is None or isinstance(dev, type(self)):
            return dev
        raise TypeError(f"{what} must be a {self.backend} device or None, got {dev!r}")

    @abc.abstractmethod
    def from_host(self, host: Array, stream: Stream | None = None) -> Array:
        """A new device array holding a copy of the host array ``host``.

        ``stream=None``: the copy is complete on return. With a stream the copy is enqueued
        on it and ``host`` must stay unchanged until the stream reaches it.
        """

    @abc.abstractmethod
    def to_host(self, arr: Array, out: Array = None, stream: Stream | None = None) -> Array:
        """Copy the device array ``arr`` to host memory (``out`` or a new numpy array).

        ``stream=None``: complete on return; else enqueued on ``stream``.
        """

    def new_stream(self) -> Stream:
        """A new stream on this device."""
        with self._stream_lock:
            return self._make_stream()

    @abc.abstractmethod
    def _make_stream(self) -> Stream:
        """Create a stream of this device (called with the device's stream lock held)."""

    @abc.abstractmethod
    def new_event(self) -> Event:
        """A new (unrecorded, hence completed) event."""

    def synchronize(self, timeout: float | None = None) -> None:
        """Block until all work on all of this device's streams ran (``timeout`` as in
        ``Stream.synchronize``, for all of them together)."""
        deadline = time.monotonic() + timeout_or_default(timeout)
        for wait in self._stream_waits():
            wait(max(0.0, deadline - time.monotonic()))

    @abc.abstractmethod
    def _stream_waits(self) -> list[Callable[[float], None]]:
        """One wait per stream of this device, for the work enqueued on it so far, each
        bounded by the seconds it is given."""

    @abc.abstractmethod
    def can_access_peer(self, other: Device) -> bool:
        """True if kernels on this device can read ``other``'s memory directly."""

    def sum_into(self, dst: Array, src: Array) -> None:
        """``dst += src`` in the caller's order (host: now, in this thread; CUDA: on the
        thread's current stream)."""
        self._run_kernel("sum_into", dst, src)

    def scale(self, x: Array, alpha: float) -> None:
        """``x *= alpha`` in the caller's order."""
        self._run_kernel("scale", x, alpha)

    def sgd_update(
        self, w: Array, g: Array, v: Array, lr: float, momentum: float, weight_decay: float
    ) -> None:
        """Caffe's fused SGD step in the caller's order (``w``, ``g``, ``v``, ``lr``,
        ``momentum``, ``weight_decay`` as in :meth:`Stream.sgd_update`)."""
        self._run_kernel("sgd_update", w, g, v, lr, momentum, weight_decay)

    def _run_kernel(self, name: str, *args: object) -> None:
        """Run the kernel ``name`` of this backend's kernel module (``nccltree._native`` or
        ``nccltree._cuda_kernels``, which have the same names and arguments) on ``args``,
        in the caller's order. A backend without such a module overrides the three
        operations above instead."""
        raise NotImplementedError(f"the {self.backend} backend has no kernel {name}")

    @abc.abstractmethod
    def pinned_empty(self, shape: ShapeLike, dtype: npt.DTypeLike = "float32") -> Array:
        """A host numpy array of ``shape`` and ``dtype`` for fast transfers to and from
        this device (page-locked on CUDA, 64-byte-aligned plain memory on host)."""

    @contextmanager
    def activate(self) -> Iterator[Device]:
        """Make this the thread's current device for the duration of the block."""
        yield self

    def current_stream(self) -> Stream:
        """This thread's current stream on this device (``with stream:``), else the
        default stream."""
        stack = getattr(self._tls, "streams", None)
        if stack:
            return stack[-1]
        return self.default_stream

    def explicit_current_stream(self) -> Stream | None:
        """The stream of an enclosing ``with stream:`` in this thread, else None (on the
        host backend the calling thread itself is then the caller's order)."""
        stack = getattr(self._tls, "streams", None)
        return stack[-1] if stack else None

    def _push_stream(self, stream: Stream) -> None:
        stack = getattr(self._tls, "streams", None)
        if stack is None:
            stack = self._tls.streams = []
        stack.append(stream)

    def _pop_stream(self, stream: Stream) -> None:
        stack = self._tls.streams
        if not stack or stack[-1] is not stream:
            raise RuntimeError("streams must be exited in the reverse order of entering")
        stack.pop()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} index={self.index}>"


class FoldPass(NamedTuple):
    """One kernel launch of a reduce over more sources than one kernel takes.

    The pass reads the running result first when ``accumulate`` (the output of the
    previous pass), then ``srcs[i]`` for ``i`` in ``sources``, in that order. It writes the
    scratch accumulator when ``into_scratch``, else ``dst``. ``last``: the pass that applies
    ``alpha``, so a scale follows the whole sum.
    """

    sources: tuple[int, ...]
    accumulate: bool
    into_scratch: bool
    last: bool


def fold_schedule(
    n_srcs: int, dst_aliases: Collection[int] = (), max_fused: int = MAX_FUSED
) -> list[FoldPass]:
    """The passes of ``dst = op(srcs[0], ..., srcs[n_srcs - 1])`` with kernels of at most
    ``max_fused`` sources, folding left to right, so the order of the reduction (and hence
    every rounding) is that of the sources whatever the number of passes.

    ``dst_aliases``: indices of the sources that are ``dst`` itself. A pass reads each
    element of its inputs before writing it, so a source read in the pass that writes
    ``dst`` may be ``dst``; one read in a later pass would see the partial result. Then
    every pass but the last accumulates into a scratch buffer and only the last writes
    ``dst``.
    """
    if n_srcs < 1:
        raise ValueError(f"a reduce needs at least one source, got {n_srcs}")
    if max_fused < 2:
        raise ValueError(f"max_fused must be >= 2 to make progress, got {max_fused}")
    # the first pass takes max_fused sources; each later one the accumulator and
    # max_fused - 1 more
    starts = [0, *range(max_fused, n_srcs, max_fused - 1)]
    scratch = len(starts) > 1 and any(k >= max_fused for k in dst_aliases)
    passes = []
    for p, start in enumerate(starts):
        end = min(n_srcs, start + (max_fused if p == 0 else max_fused - 1))
        last = p == len(starts) - 1
        passes.append(FoldPass(tuple(range(start, end)), p > 0, scratch and not last, last))
    return passes


A = TypeVar("A")


def run_fold(
    dst: A,
    srcs: Sequence[A],
    alpha: float,
    dst_aliases: Collection[int],
    launch: Callable[[A, list[A], float], object],
    new_scratch: Callable[[], A],
    max_fused: int = MAX_FUSED,
) -> None:
    """Run ``fold_schedule``: ``launch(out, inputs, alpha)`` once per pass, alpha 1.0 in
    every pass but the last; ``new_scratch()`` makes the accumulator when one is needed."""
    passes = fold_schedule(len(srcs), dst_aliases, max_fused)
    acc = new_scratch() if passes[0].into_scratch else dst
    for p in passes:
        inputs = [srcs[i] for i in p.sources]
        if p.accumulate:
            inputs.insert(0, acc)
        launch(acc if p.into_scratch else dst, inputs, alpha if p.last else 1.0)


def timeout_or_default(timeout: object) -> float:
    """The effective timeout of a wait: ``timeout`` (a finite number >= 0), else
    ``DEFAULT_TIMEOUT``."""
    checked = check_timeout(timeout)
    return DEFAULT_TIMEOUT if checked is None else checked


# -- argument checks every backend shares (``Stream`` calls them before a backend sees the
# -- arguments, so both refuse a bad call alike, before anything is enqueued) --------------


class CopyArgs(NamedTuple):
    """A checked ``Stream.copy``: ``src_device`` None means host memory or the stream's
    own device; ``dst_device`` is the stream's device when the caller gave none."""

    dst: Array
    src: Array
    src_device: Device | None
    dst_device: Device


class ReduceArgs(NamedTuple):
    """A checked ``Stream.reduce``: one device per source (the dst's where none was
    given), ``alpha`` a float (1.0 unless ``op`` is ``"sum"`` and the dtype floating),
    ``dtype`` the dtype the arrays carry (None: their own; see :func:`carried_dtype`)."""

    dst: Array
    srcs: list[Array]
    op: str
    src_devices: list[Device]
    dst_device: Device
    alpha: float
    dtype: np.dtype | None = None


class SgdArgs(NamedTuple):
    """A checked ``sgd_update``: three arrays of one floating dtype and size, finite
    hyperparameters."""

    w: Array
    g: Array
    v: Array
    lr: float
    momentum: float
    weight_decay: float


def carried_dtype(arr: Array, dtype: npt.DTypeLike | None, what: str) -> np.dtype | None:
    """The dtype a call computes ``arr`` in when it differs from the array's own: None
    when ``dtype`` is None or the array's dtype; bfloat16 for ``dtype="bfloat16"`` and a
    ``uint16`` array of its bits (its :data:`CARRIERS`). Anything else: ``TypeError``
    (``ValueError`` for an unknown name), naming ``what`` and the argument."""
    if dtype is None:
        return None
    try:
        want = bfloat16() if isinstance(dtype, str) and dtype == "bfloat16" else np.dtype(dtype)
    except TypeError as exc:
        raise ValueError(f"dtype={dtype!r} is not a dtype name: {exc}") from None
    if want == arr.dtype:
        return None
    carrier = CARRIERS.get(want)
    if carrier is None:
        carried = ", ".join(f"{d} in {c}" for d, c in CARRIERS.items())
        raise TypeError(
            f"{what}: dtype={want} differs from the array's dtype {arr.dtype}; a dtype= "
            f"other than the arrays' own names one they carry ({carried})"
        )
    if arr.dtype != carrier:
        raise TypeError(
            f"{what}: dtype={want} takes {want} arrays or {carrier} arrays holding its bits "
            f"(2-byte items); got {arr.dtype}"
        )
    return want


def carry(arr: Array, dtype: np.dtype | None) -> tuple[Array, np.dtype | None]:
    """``arr`` ready for a kernel of ``dtype`` (from :func:`carried_dtype`): a numpy array
    is viewed as that dtype (numpy has it, through ``ml_dtypes``), so nothing downstream
    needs to know; another library's array stays as it is and the dtype is returned with
    it, for the kernel to be told."""
    if dtype is None:
        return arr, None
    if isinstance(arr, np.ndarray):
        return arr.view(dtype), None
    return arr, dtype


def check_dtype(arr: Array, what: str, accepted: Sequence[np.dtype[Any]]) -> None:
    """TypeError unless ``arr.dtype`` is one of ``accepted``."""
    if arr.dtype not in accepted:
        names = ", ".join(str(dt) for dt in accepted)
        raise TypeError(f"{what} has dtype {arr.dtype}; accepted: {names}")


def check_same(x: Array, ref: Array, name: str, ref_name: str) -> None:
    """TypeError unless ``x`` has ``ref``'s dtype, ValueError unless its size (the kernel
    wrappers' rule for operands that go together)."""
    if x.dtype != ref.dtype:
        raise TypeError(f"{name} has dtype {x.dtype} but {ref_name} has {ref.dtype}")
    if x.size != ref.size:
        raise ValueError(f"{name} has {x.size} elements but {ref_name} has {ref.size}")


def check_copy(
    device: Device, dst: Array, src: Array, src_device: object, dst_device: object
) -> CopyArgs:
    """The arguments of ``device``'s streams' ``copy``, checked."""
    src_dev = device._same_backend(src_device, "src_device")
    dst_dev = device._same_backend(dst_device, "dst_device")
    (dst_dev or device)._check_operand(dst, "dst", writable=True, host_ok=dst_dev is None)
    (src_dev or device)._check_operand(src, "src", host_ok=src_dev is None)
    if dst.nbytes != src.nbytes:
        raise ValueError(f"copy needs equal sizes: dst {dst.nbytes} B, src {src.nbytes} B")
    return CopyArgs(dst, src, src_dev, dst_dev or device)


def check_reduce(
    device: Device,
    dst: Array,
    srcs: Iterable[Array],
    op: object,
    src_devices: Iterable[object] | None,
    dst_device: object,
    alpha: object,
    dtype: npt.DTypeLike | None = None,
) -> ReduceArgs:
    """The arguments of ``device``'s streams' ``reduce``, checked (numpy arrays that
    carry ``dtype`` viewed as it)."""
    if not isinstance(op, str) or op not in REDUCE_OPS:
        raise ValueError(f"op must be one of {', '.join(REDUCE_OPS)}; got {op!r}")
    a = check_real(alpha, "alpha")
    if a != 1.0 and op != "sum":
        raise ValueError(f"alpha != 1.0 needs op='sum'; got op={op!r}")
    dst_dev = device._same_backend(dst_device, "dst_device") or device
    dst_dev._check_operand(dst, "dst", writable=True)
    logical = carried_dtype(dst, dtype, "dst")
    accepted = DTYPES if a == 1.0 else FLOAT_DTYPES
    if logical is None:
        check_dtype(dst, "dst", accepted)
    elif logical not in accepted:
        raise TypeError(f"dtype={logical} is not accepted for dst; accepted: "
                        f"{', '.join(str(dt) for dt in accepted)}")  # fmt: skip
    srcs = list(srcs)
    if not srcs:
        raise ValueError("reduce needs at least one source")
    if src_devices is None:
        devs = [dst_dev] * len(srcs)
    else:
        given = list(src_devices)
        if len(given) != len(srcs):
            raise ValueError(f"src_devices has {len(given)} entries for {len(srcs)} sources")
        devs = [
            device._same_backend(d, f"src_devices[{i}]") or dst_dev for i, d in enumerate(given)
        ]
    for i, (s, d) in enumerate(zip(srcs, devs, strict=True)):
        d._check_operand(s, f"srcs[{i}]")
        if s.dtype != dst.dtype or s.size != dst.size:
            raise ValueError(f"srcs[{i}] is {s.dtype}[{s.size}] but dst is {dst.dtype}[{dst.size}]")
    if logical is not None:
        dst, carried = carry(dst, logical)
        srcs = [carry(s, logical)[0] for s in srcs]
        return ReduceArgs(dst, srcs, op, devs, dst_dev, a, carried)
    return ReduceArgs(dst, srcs, op, devs, dst_dev, a)


def check_scale(
    device: Device, x: Array, alpha: object, dtype: npt.DTypeLike | None = None
) -> tuple[Array, float, np.dtype | None]:
    """The arguments of ``scale`` on ``device``, checked; returns ``x`` (a numpy array
    that carries ``dtype`` viewed as it), alpha as a float, and the dtype ``x`` carries
    (None: its own)."""
    device._check_operand(x, "x", writable=True)
    x, carried = carry(x, carried_dtype(x, dtype, "x"))
    if carried is None:
        check_dtype(x, "x", FLOAT_DTYPES)
    return x, check_real(alpha, "alpha"), carried


def check_sgd(
    device: Device, w: Array, g: Array, v: Array, lr: object, momentum: object, weight_decay: object
) -> SgdArgs:
    """The arguments of ``sgd_update`` on ``device``, checked."""
    for arr, what in ((w, "w"), (g, "g"), (v, "v")):
        device._check_operand(arr, what, writable=True)
    if not (w.dtype == g.dtype == v.dtype and w.size == g.size == v.size):
        raise ValueError("w, g and v must have one dtype and one size")
    check_dtype(w, "w", FLOAT_DTYPES)
    return SgdArgs(
        w,
        g,
        v,
        check_real(lr, "lr"),
        check_real(momentum, "momentum"),
        check_real(weight_decay, "weight_decay"),
    )


def check_host_out(out: object, nbytes: int) -> None:
    """``to_host``'s ``out``: any writable C-contiguous numpy array of ``nbytes`` bytes (a
    copy moves bytes, whatever the shapes and dtypes)."""
    if (
        not isinstance(out, np.ndarray)
        or out.nbytes != nbytes
        or not out.flags.c_contiguous
        or not out.flags.writeable
    ):
        raise ValueError(f"out must be a writable C-contiguous numpy array of {nbytes} bytes")


def data_ptr(a: Array) -> int:
    """The address of a numpy or CuPy array's first element (with unified addressing,
    host and device memory share one address space)."""
    return int(a.ctypes.data if isinstance(a, np.ndarray) else a.data.ptr)


def as_shape(shape: object) -> tuple[int, ...]:
    """An array shape: an integer or a sequence of integers, none negative."""
    return check_shape(shape)
