"""The device interface every backend implements.

Docstrings live here only; ``host.py`` and ``cuda.py`` implement the same methods with the
same meaning. A backend is one small file: arrays, streams, events, copies (including peer
copies), the native kernels and pinned host memory.
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple, TypeVar

#: Reduction operators every backend's ``Stream.reduce`` accepts.
REDUCE_OPS = ("sum", "prod", "max", "min")

#: Sources one reduce kernel takes (host and CUDA); longer lists are folded in passes.
MAX_FUSED = 8

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

    @abc.abstractmethod
    def synchronize(self, timeout: float | None = None) -> None:
        """Block until the event completed.

        Raises ``CommTimeout`` after ``timeout`` seconds (None: the backend default) and
        re-raises the error of a failed op that precedes the event in its stream.
        """

    @abc.abstractmethod
    def query(self) -> bool:
        """True if the event completed (raises like ``synchronize`` on a failed stream)."""


class Stream(abc.ABC):
    """An ordered queue of asynchronous work on one device.

    Every operation returns at once; work runs in the order it was enqueued. Arguments are
    checked when the operation is enqueued (TypeError/ValueError), so a bad call never
    leaves half-done work behind. ``with stream:`` makes it this thread's current stream
    on its device.
    """

    device: Device

    @abc.abstractmethod
    def copy(
        self,
        dst: Any,
        src: Any,
        *,
        src_device: Device | None = None,
        dst_device: Device | None = None,
    ) -> None:
        """Copy ``src`` into ``dst`` (same number of bytes), in this stream's order.

        ``dst`` is on ``dst_device`` (None: this stream's device); ``src`` is on
        ``src_device`` (a peer copy) or, when None, on this device or in host memory. The
        host backend records a ``"copy"`` transfer from ``src_device`` to ``dst_device``
        when both are devices and differ.
        """

    @abc.abstractmethod
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
        """``dst = op(*srcs)`` elementwise in one fused pass, in this stream's order.

        ``dst`` may be one of ``srcs``; it is on ``dst_device`` (None: this stream's
        device). ``src_devices[i]`` names the device holding ``srcs[i]`` (None: the dst's
        device); sources on other devices are read directly where the backend can (the
        host backend records a ``"peer_read"`` transfer from each to the dst's device).
        ``op`` is one of ``REDUCE_OPS``.

        ``alpha != 1.0`` (``op="sum"``, floating dtypes) writes ``alpha * sum(srcs)`` in the
        same pass: alpha is rounded to the compute type and multiplies the finished sum, so
        float32/float64 results are bitwise those of the reduce followed by
        ``scale(dst, alpha)``; float16 is scaled before its one rounding (slightly more
        accurate than the two steps).
        """

    @abc.abstractmethod
    def scale(self, x: Any, alpha: float) -> None:
        """``x *= alpha``."""

    @abc.abstractmethod
    def sgd_update(
        self, w: Any, g: Any, v: Any, lr: float, momentum: float, weight_decay: float
    ) -> None:
        """Caffe's SGD step in one pass: ``g += wd*w; v = momentum*v + lr*g; w -= v``."""

    @abc.abstractmethod
    def call(self, fn: Any, *args: Any) -> None:
        """Run ``fn(*args)`` in stream order.

        Host: on the stream's worker thread, after all earlier work. CUDA: now, with this
        stream current, so the array operations ``fn`` issues are enqueued on it.
        """

    @abc.abstractmethod
    def record(self, event: Event | None = None) -> Event:
        """Record ``event`` (a new one when None) at the current end; return it."""

    @abc.abstractmethod
    def wait_event(self, event: Event) -> None:
        """Make later work on this stream wait for ``event``; never blocks the caller."""

    @abc.abstractmethod
    def synchronize(self, timeout: float | None = None) -> None:
        """Block until all enqueued work ran.

        Raises ``CommTimeout`` after ``timeout`` seconds (None: the backend default) and
        re-raises the error of a failed op (the stream stays failed).
        """

    @abc.abstractmethod
    def query(self) -> bool:
        """True if all enqueued work ran (raises the error of a failed op)."""

    # `with stream:` -- the per-thread current-stream stack lives on the device.
    def __enter__(self) -> Stream:
        self.device._push_stream(self)
        return self

    def __exit__(self, *exc: object) -> None:
        self.device._pop_stream(self)


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
    runtime: Any

    def __init__(self) -> None:
        self._tls = threading.local()
        self._default: Stream | None = None
        self._stream_lock = threading.Lock()  # guards stream creation and the device's set

    @property
    @abc.abstractmethod
    def xp(self) -> Any:
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
    def empty(self, shape: Any, dtype: Any = "float32", *, stream: Stream | None = None) -> Any:
        """An uninitialised C-contiguous array on this device.

        ``stream``: the stream of this device that uses the memory first. A GPU memory pool
        hands a freed block out again in the order of the stream it was allocated for, so
        memory allocated for one stream and written by another can race with work still
        pending on the first; with ``stream=`` the array is ready in that stream's order.
        ``None``: the stream of an enclosing ``with stream:`` if there is one; otherwise
        the array may be used on any stream once this returns (CUDA waits for the work
        pending on the current stream). Host memory is ready at once, whatever the stream.
        """

    @abc.abstractmethod
    def zeros(self, shape: Any, dtype: Any = "float32", *, stream: Stream | None = None) -> Any:
        """A zero-filled C-contiguous array on this device; ``stream`` as in ``empty``
        (on CUDA the zero fill runs on that stream, so it too is ready in its order)."""

    @abc.abstractmethod
    def asarray(self, obj: Any) -> Any:
        """A zero-copy view of a buffer on this device (numpy, CUDA array interface,
        DLPack); TypeError for a buffer that lives elsewhere."""

    @abc.abstractmethod
    def check_array(self, arr: Any) -> None:
        """TypeError/ValueError unless ``arr`` is a C-contiguous array usable here."""

    @abc.abstractmethod
    def from_host(self, host: Any, stream: Stream | None = None) -> Any:
        """A new device array holding a copy of the host array ``host``.

        ``stream=None``: the copy is complete on return. With a stream the copy is enqueued
        on it and ``host`` must stay unchanged until the stream reaches it.
        """

    @abc.abstractmethod
    def to_host(self, arr: Any, out: Any = None, stream: Stream | None = None) -> Any:
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

    @abc.abstractmethod
    def synchronize(self, timeout: float | None = None) -> None:
        """Block until all work on all of this device's streams ran."""

    @abc.abstractmethod
    def can_access_peer(self, other: Device) -> bool:
        """True if kernels on this device can read ``other``'s memory directly."""

    @abc.abstractmethod
    def sum_into(self, dst: Any, src: Any) -> None:
        """``dst += src`` in the caller's order (host: now, in this thread; CUDA: on the
        thread's current stream)."""

    @abc.abstractmethod
    def scale(self, x: Any, alpha: float) -> None:
        """``x *= alpha`` in the caller's order."""

    @abc.abstractmethod
    def sgd_update(
        self, w: Any, g: Any, v: Any, lr: float, momentum: float, weight_decay: float
    ) -> None:
        """Caffe's fused SGD step in the caller's order."""

    @abc.abstractmethod
    def pinned_empty(self, shape: Any, dtype: Any = "float32") -> Any:
        """A host numpy array for fast transfers to and from this device (page-locked on
        CUDA, 64-byte-aligned plain memory on host)."""

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


def timeout_or_default(timeout: float | None) -> float:
    """The effective timeout of a wait: ``timeout``, else ``DEFAULT_TIMEOUT``."""
    if timeout is None:
        return DEFAULT_TIMEOUT
    if timeout < 0:
        raise ValueError(f"timeout must be >= 0 seconds or None, got {timeout!r}")
    return float(timeout)
