"""Host buffers for transfers, and memory that lives on both sides of a device.

- ``pinned_empty``: page-locked host memory from the CUDA runtime when a GPU is usable (DMA
  transfers need it, and many GPUs copying at once stay stable with it), of exactly the
  size asked and unpinned when the array is gone (not CuPy's pinned pool, which rounds to
  powers of two and never unpins), else 64-byte-aligned plain numpy memory -- never
  locked with ``mlock``, so tests and CPU-only runs cannot exhaust locked RAM.
- ``PinnedPool``: reuses freed pinned blocks, because page-locking is slow (a system call
  and page-table work per allocation), with a hard cap on the bytes it keeps locked.
- ``SyncedMemory``: Caffe's syncedmem: one logical array with a host copy and a device copy,
  and a ``head`` saying which copy is fresh, so data moves only when the other side asks.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import DTypeLike

from ._errors import BackendUnavailable
from ._validate import check_int, check_shape
from .backends.base import Device, ShapeLike, Stream
from .backends.host import aligned_empty

__all__ = [
    "PinnedPool",
    "PoolStats",
    "ShapeLike",
    "SyncedMemory",
    "pinned_empty",
    "size_class",
]


_gpu_usable: bool | None = None
_gpu_lock = threading.Lock()


def _use_cuda_pinned() -> bool:
    """Whether a GPU is usable, decided once per process (asking CuPy is not free)."""
    global _gpu_usable
    if _gpu_usable is None:
        with _gpu_lock:
            if _gpu_usable is None:
                try:
                    from .backends.cuda import gpu_count

                    _gpu_usable = gpu_count() > 0
                except BackendUnavailable:
                    _gpu_usable = False
    return _gpu_usable


def pinned_empty(
    shape: ShapeLike, dtype: DTypeLike = "float32", *, pinned: bool | None = None
) -> np.ndarray:
    """An uninitialised C-contiguous host array of ``shape`` and ``dtype`` for fast
    device transfers.

    ``pinned=None``: page-locked (``cudaHostAlloc``, freed with the last view of the array)
    when a GPU is usable, else 64-byte-aligned pageable memory. ``pinned=True`` insists on page-locked memory (``BackendUnavailable``
    without CuPy and a GPU); ``False`` always gives aligned pageable memory.
    """
    if pinned is None:
        pinned = _use_cuda_pinned()
    if pinned:
        from .backends.cuda import pinned_empty as cuda_pinned_empty

        return cuda_pinned_empty(shape, dtype)
    return aligned_empty(shape, dtype)


# -- pool -----------------------------------------------------------------------------------

_MIN_CLASS = 512  # below this a block is rounded up to a multiple of 64 bytes


def size_class(nbytes: int) -> int:
    """The block size a request of ``nbytes`` gets: the next of 8 geometric steps per
    power of two (at most 12.5% waste, unlike power-of-two rounding's 50%)."""
    nbytes = check_int(nbytes, "nbytes", min=0)
    if nbytes <= _MIN_CLASS:
        return max(64, -(-nbytes // 64) * 64)
    step = 1 << (nbytes.bit_length() - 4)  # 1/8 of the power of two below nbytes
    return -(-nbytes // step) * step


@dataclass(frozen=True)
class PoolStats:
    """A snapshot of a ``PinnedPool``: ``in_use_bytes`` (blocks handed out, by block
    size), ``cached_bytes`` (freed blocks kept for reuse), ``peak_bytes`` (the highest
    in use plus cached so far), ``hits`` and ``misses`` (allocations served from the
    cache, and those that needed new memory) and the pool's ``max_bytes``."""

    in_use_bytes: int  # bytes of blocks handed out (block sizes, not requested sizes)
    cached_bytes: int  # bytes of freed blocks kept for reuse
    peak_bytes: int  # the highest in_use + cached so far
    hits: int  # allocations served from the cache
    misses: int  # allocations that needed new memory
    max_bytes: int


class PinnedPool:
    """A size-class pool of host transfer buffers with a hard cap.

    ``alloc(shape, dtype)`` returns an array backed by a block of ``size_class(nbytes)``
    bytes, taken from the cache if one is free; ``free(arr)`` returns it to the cache. Past
    ``max_bytes`` (blocks in use plus cached: the bytes the pool keeps page-locked), cached
    blocks are released (unpinned) first, then a ``MemoryError`` says how much is in use.
    Thread-safe. An array must not be used after ``free``: its block is handed out again.
    ``pinned``: the kind of memory, as for :func:`pinned_empty` (None: page-locked where
    a GPU is usable).
    """

    def __init__(self, max_bytes: int = 1 << 30, *, pinned: bool | None = None) -> None:
        self.max_bytes = check_int(max_bytes, "max_bytes", min=1)
        self._pinned = pinned
        self._lock = threading.Lock()
        self._free: dict[int, list[np.ndarray]] = {}  # size class -> cached raw blocks
        self._used: dict[int, np.ndarray] = {}  # data pointer -> raw block handed out
        self._in_use = 0
        self._cached = 0
        self._peak = 0
        self._hits = 0
        self._misses = 0

    def alloc(self, shape: ShapeLike, dtype: DTypeLike = "float32") -> np.ndarray:
        """An uninitialised C-contiguous array of ``shape`` and ``dtype`` from the pool;
        give it back with ``free``. ``MemoryError`` when it does not fit under
        ``max_bytes`` even after the cached blocks are released."""
        dt = np.dtype(dtype)
        shape = check_shape(shape)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        cls = size_class(nbytes)
        with self._lock:
            cached = self._free.get(cls)
            if cached:
                raw = cached.pop()
                self._cached -= cls
                self._hits += 1
            else:
                self._make_room(cls, nbytes)
                raw = pinned_empty(cls, np.uint8, pinned=self._pinned)
                self._misses += 1
            self._in_use += cls
            self._peak = max(self._peak, self._in_use + self._cached)
            arr = raw[:nbytes].view(dt).reshape(shape)
            self._used[arr.ctypes.data] = raw
        return arr

    def _make_room(self, cls: int, nbytes: int) -> None:
        if self._in_use + self._cached + cls <= self.max_bytes:
            return
        # cached blocks of other sizes are worth less than a failed allocation
        for size in sorted(self._free, reverse=True):
            blocks = self._free[size]
            while blocks and self._in_use + self._cached + cls > self.max_bytes:
                blocks.pop()
                self._cached -= size
        if self._in_use + self._cached + cls > self.max_bytes:
            raise MemoryError(
                f"PinnedPool: a {nbytes}-byte request (block {cls} B) would exceed max_bytes="
                f"{self.max_bytes} ({self._in_use} B in use); free buffers or raise max_bytes"
            )

    def free(self, arr: np.ndarray) -> None:
        """Return ``arr``, an array from ``alloc``, to the pool (ValueError for any other
        array or a second free)."""
        ptr = arr.ctypes.data if isinstance(arr, np.ndarray) else None
        with self._lock:
            raw = self._used.pop(ptr, None) if ptr is not None else None
            if raw is None:
                raise ValueError("free() takes an array that alloc() of this pool handed out")
            cls = raw.nbytes
            self._in_use -= cls
            self._free.setdefault(cls, []).append(raw)
            self._cached += cls

    @contextmanager
    def borrow(self, shape: ShapeLike, dtype: DTypeLike = "float32") -> Iterator[np.ndarray]:
        """``alloc(shape, dtype)`` for the duration of a ``with`` block."""
        arr = self.alloc(shape, dtype)
        try:
            yield arr
        finally:
            self.free(arr)

    def trim(self) -> int:
        """Release every cached block (page-locked blocks are unpinned and freed once
        nothing views them); returns the number of bytes released."""
        with self._lock:
            released = self._cached
            self._free.clear()
            self._cached = 0
        return released

    def stats(self) -> PoolStats:
        """Bytes in use, cached and at peak; cache hits and misses."""
        with self._lock:
            return PoolStats(
                self._in_use, self._cached, self._peak, self._hits, self._misses, self.max_bytes
            )


# -- synced memory --------------------------------------------------------------------------

UNINITIALIZED, HOST, DEVICE, SYNCED = "uninitialized", "host", "device", "synced"


class SyncedMemory:
    """One array of ``shape`` and ``dtype`` with a host copy and a copy on ``device``;
    ``head`` names the fresh one.

    ``head`` is ``"uninitialized"`` (nothing allocated; the first touch allocates
    zero-filled memory), ``"host"`` or ``"device"`` (only that copy is current) or
    ``"synced"`` (both are). Readers (``host()``, ``device_array()``) copy only when the
    fresh copy is on the other side; the ``mutable_*`` accessors also make their side the
    only fresh one. Memory is allocated and copied on the device given at construction,
    whatever the calling thread's current device. Not thread-safe (one owner, as in Caffe).
    """

    def __init__(self, shape: ShapeLike, dtype: DTypeLike, device: Device) -> None:
        if not isinstance(device, Device):
            raise TypeError(f"device must be a nccltree Device, got {device!r}")
        self.shape = check_shape(shape)
        self.dtype = np.dtype(dtype)
        self.device = device
        self.head = UNINITIALIZED
        self._host: np.ndarray | None = None
        self._dev: Any = None

    @property
    def nbytes(self) -> int:
        """The size of the array in bytes (of each copy)."""
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    def __repr__(self) -> str:
        return (
            f"<SyncedMemory {self.dtype}{list(self.shape)} on {self.device.name} head={self.head}>"
        )

    # -- the two transitions (Caffe's to_cpu / to_gpu) --

    def _alloc_host(self) -> np.ndarray:
        if self._host is None:
            self._host = self.device.pinned_empty(self.shape, self.dtype)
        return self._host

    def _alloc_dev(self, stream: Stream) -> Any:
        # allocated in the order of the stream that writes it first: a GPU pool may hand
        # out a block still used by work pending on the stream it was allocated for
        if self._dev is None:
            self._dev = self.device.empty(self.shape, self.dtype, stream=stream)
        return self._dev

    def _to_host(self) -> np.ndarray:
        """Make the host copy fresh; returns it."""
        if self.head == UNINITIALIZED:
            self._alloc_host().fill(0)
            self.head = HOST
        elif self.head == DEVICE:
            self.device.to_host(self._dev, out=self._alloc_host())
            self.head = SYNCED
        return self._alloc_host()

    def _to_device(self) -> None:
        if self.head == UNINITIALIZED:
            if self._dev is None:
                self._dev = self.device.zeros(self.shape, self.dtype)
            else:
                self._dev.fill(0)
            self.head = DEVICE
        elif self.head == HOST:
            stream = self.device.current_stream()
            dev = self._alloc_dev(stream)
            stream.copy(dev, self._host)
            stream.synchronize()
            self.head = SYNCED

    # -- accessors --

    def host(self) -> np.ndarray:
        """The host copy, fresh, read-only."""
        view = self._to_host().view()
        view.flags.writeable = False
        return view

    def mutable_host(self) -> np.ndarray:
        """The host copy, fresh and writable; the device copy becomes stale."""
        host = self._to_host()
        self.head = HOST
        return host

    def device_array(self) -> Any:
        """The device copy, fresh (read-only where the array type supports it)."""
        self._to_device()
        if isinstance(self._dev, np.ndarray):
            view = self._dev.view()
            view.flags.writeable = False
            return view
        return self._dev

    def mutable_device_array(self) -> Any:
        """The device copy, fresh and writable; the host copy becomes stale."""
        self._to_device()
        self.head = DEVICE
        return self._dev

    def set_host(self, arr: np.ndarray) -> None:
        """Adopt ``arr`` (same shape and dtype, C-contiguous) as the host copy, without a
        copy; head becomes ``"host"``."""
        if not isinstance(arr, np.ndarray) or not arr.flags.c_contiguous:
            raise TypeError("set_host takes a C-contiguous numpy array")
        if arr.shape != self.shape or arr.dtype != self.dtype:
            raise ValueError(
                f"set_host needs {self.dtype}{list(self.shape)}, got {arr.dtype}{list(arr.shape)}"
            )
        self._host = arr
        self.head = HOST

    def async_device_push(self, stream: Stream) -> None:
        """Enqueue the host-to-device copy on ``stream`` (head must be ``"host"``); head
        becomes ``"synced"`` at once: the caller synchronises ``stream`` before relying on
        the device copy and must not write the host copy until then."""
        if self.head != HOST:
            raise ValueError(f"async_device_push needs head 'host', head is {self.head!r}")
        if stream.device is not self.device:
            raise ValueError(f"the stream is on {stream.device.name}, not on {self.device.name}")
        stream.copy(self._alloc_dev(stream), self._host)
        self.head = SYNCED
