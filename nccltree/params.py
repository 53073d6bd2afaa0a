"""FlatParams: every parameter and every gradient in one contiguous buffer.

One buffer per role means one collective moves all gradients (Caffe's P2PSync does the same
with its ``GPUParams``), and one fused kernel updates all parameters. Per-parameter views
alias the flat buffers, so models read and write parameters by name without copies.
"""

from __future__ import annotations

import math
import types
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import DTypeLike

from ._validate import check_shape
from .memory import ShapeLike

if TYPE_CHECKING:
    from .backends.base import Device

# 64 bytes: a cache line and an AVX-512 vector, so every parameter starts where vectorised
# kernels and BLAS like it; the padding between parameters stays zero (see FlatParams).
ALIGN_BYTES = 64

_DTYPES = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))


def _aligned_slice(raw: np.ndarray, n: int) -> np.ndarray:
    """The n elements of ``raw`` starting at its first ALIGN_BYTES boundary.

    numpy aligns allocations to 16 bytes only, so host buffers are over-allocated by one
    alignment unit and sliced.
    """
    shift = (-raw.__array_interface__["data"][0] % ALIGN_BYTES) // raw.itemsize
    return raw[shift : shift + n]


class FlatParams:
    """Named parameters and gradients stored in two contiguous buffers on one device.

    ``shapes`` maps parameter names to shapes; the insertion order is the layout order.
    ``dtype`` is the buffers' (floating) dtype. ``device`` is a device from
    :func:`nccltree.devices` or None for plain numpy arrays.

    ``data`` and ``grad`` are the flat 1-D buffers; ``views[name]`` and
    ``grad_views[name]`` are views of them with the parameter's shape. Each parameter
    starts on a 64-byte boundary; the few padding elements between parameters are zero
    and stay zero under SGD (zero gradient, zero weight), so a collective or a kernel may
    treat the flat buffers as one array. ``size`` counts the flat buffer (padding
    included), ``count`` only the parameters' own elements.
    """

    def __init__(
        self,
        shapes: Mapping[str, ShapeLike],
        dtype: DTypeLike = np.float32,
        device: Device | None = None,
    ) -> None:
        if not isinstance(shapes, Mapping):
            raise TypeError(f"shapes must be a dict of name -> shape, got {type(shapes).__name__}")
        if not shapes:
            raise ValueError("shapes must name at least one parameter")
        dt = np.dtype(dtype)
        if dt not in _DTYPES:
            raise ValueError(f"dtype must be float16, float32 or float64, got {dt}")
        if device is not None and not hasattr(device, "xp"):
            raise TypeError(
                f"device must be a device from nccltree.devices() or None, got {device!r}"
            )
        self._dtype = dt
        self._device = device
        step = ALIGN_BYTES // dt.itemsize
        layout: dict[str, tuple[int, tuple[int, ...]]] = {}
        offset = 0
        for name, shape in shapes.items():
            if not isinstance(name, str) or not name:
                raise TypeError(f"parameter names must be non-empty strings, got {name!r}")
            dims = check_shape(shape, f"parameter {name!r} shape")
            offset = -(-offset // step) * step
            layout[name] = (offset, dims)
            offset += math.prod(dims)
        self._layout = layout
        self._size = offset
        self.data = self._zeros(offset)
        self.grad = self._zeros(offset)
        self.views = types.MappingProxyType(self._make_views(self.data))
        self.grad_views = types.MappingProxyType(self._make_views(self.grad))

    def place_grad(self, buffer: np.ndarray) -> None:
        """Use ``buffer`` (flat, this dtype, ``size`` elements: e.g. a process group's
        symmetric buffer, which other processes read without staging) as the gradient
        from now on; the gradient values move into it."""
        if buffer.shape != (self._size,) or buffer.dtype != self._dtype:
            raise ValueError(
                f"the gradient buffer must be ({self._size},) {self._dtype}, got "
                f"{buffer.shape} {buffer.dtype}"
            )
        buffer[...] = self.grad
        self.grad = buffer
        self.grad_views = types.MappingProxyType(self._make_views(self.grad))

    # -- construction helpers -------------------------------------------------------------
    def _zeros(self, n: int) -> Any:
        extra = ALIGN_BYTES // self._dtype.itemsize
        if self._device is None:
            return _aligned_slice(np.zeros(n + extra, dtype=self._dtype), n)
        if self._device.xp is np:
            return _aligned_slice(self._device.zeros((n + extra,), self._dtype), n)
        # CUDA allocations are already 256-byte aligned.
        return self._device.zeros((n,), self._dtype)

    def _make_views(self, flat: Any) -> dict[str, Any]:
        return {
            name: flat[off : off + math.prod(dims)].reshape(dims)
            for name, (off, dims) in self._layout.items()
        }

    # -- description ----------------------------------------------------------------------
    @property
    def names(self) -> tuple[str, ...]:
        """Parameter names in layout order."""
        return tuple(self._layout)

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Parameter shapes by name, in layout order."""
        return {name: dims for name, (_, dims) in self._layout.items()}

    @property
    def offsets(self) -> dict[str, int]:
        """Element offset of each parameter in the flat buffers."""
        return {name: off for name, (off, _) in self._layout.items()}

    @property
    def dtype(self) -> np.dtype:
        """The dtype of both buffers."""
        return self._dtype

    @property
    def device(self) -> Device | None:
        """The device the buffers live on (None: plain numpy arrays)."""
        return self._device

    @property
    def xp(self) -> types.ModuleType:
        """The array module of the buffers: numpy, or CuPy on a CUDA device."""
        return np if self._device is None else self._device.xp

    @property
    def size(self) -> int:
        """Elements in each flat buffer, alignment padding included."""
        return self._size

    @property
    def count(self) -> int:
        """Elements of the parameters themselves (no padding)."""
        return sum(math.prod(dims) for _, dims in self._layout.values())

    @property
    def nbytes(self) -> int:
        """Bytes in each flat buffer (``size * itemsize``)."""
        return self._size * self._dtype.itemsize

    def __repr__(self) -> str:
        where = "numpy" if self._device is None else getattr(self._device, "name", self._device)
        return (
            f"FlatParams({len(self._layout)} params, {self.count} elements, {self._dtype}, {where})"
        )

    # -- operations -----------------------------------------------------------------------
    def zero_grad(self) -> None:
        """Set every gradient (and the padding) to zero."""
        self.grad.fill(0)

    def _to_host(self, arr: Any) -> np.ndarray:
        if self._device is None:
            return np.array(arr, copy=True)
        return np.asarray(self._device.to_host(arr))

    def state_dict(self, grad: bool = False) -> dict[str, np.ndarray]:
        """Fresh host numpy arrays of the parameters (or of the gradients), by name."""
        host = self._to_host(self.grad if grad else self.data)
        return {
            name: host[off : off + math.prod(dims)].reshape(dims).copy()
            for name, (off, dims) in self._layout.items()
        }

    def load(self, state: Mapping[str, Any]) -> None:
        """Copy parameter values from ``state``, a dict of arrays by name (exactly these
        names).

        Values are cast to this dtype; every name and shape is checked before anything is
        written, so a bad dict leaves the parameters unchanged.
        """
        if not isinstance(state, Mapping):
            raise TypeError(f"state must be a dict of name -> array, got {type(state).__name__}")
        missing = [n for n in self._layout if n not in state]
        unexpected = [n for n in state if n not in self._layout]
        if missing or unexpected:
            raise ValueError(
                f"state must hold exactly the parameters {list(self._layout)}; "
                f"missing {missing}, unexpected {unexpected}"
            )
        host = np.zeros(self._size, dtype=self._dtype)
        for name, (off, dims) in self._layout.items():
            value = state[name]
            if hasattr(value, "get") and not isinstance(value, np.ndarray):
                value = value.get()  # a CuPy array: bring it to the host first
            value = np.asarray(value)
            if value.shape != dims:
                raise ValueError(
                    f"parameter {name!r} has shape {dims}, the state gives {value.shape}"
                )
            host[off : off + value.size] = value.reshape(-1)
        self._assign(self.data, host)

    def _assign(self, dst: Any, host: np.ndarray) -> None:
        if self._device is None or self._device.xp is np:
            dst[...] = host
        else:
            with self._device.activate():
                dst[...] = self._device.from_host(host)

    def copy_from(self, other: FlatParams, grad: bool = False) -> None:
        """Copy ``other``'s parameters (and its gradients if ``grad``) into these buffers.

        ``other`` must have the same names, shapes and dtype; it may live on another device.
        """
        if not isinstance(other, FlatParams):
            raise TypeError(f"other must be a FlatParams, got {type(other).__name__}")
        if other._layout != self._layout or other._dtype != self._dtype:
            raise ValueError(
                f"copy_from needs the same names, shapes and dtype: {self!r} vs {other!r}"
            )
        pairs = [(self.data, other.data)]
        if grad:
            pairs.append((self.grad, other.grad))
        for dst, src in pairs:
            if self.xp is np and other.xp is np:
                dst[...] = src
            elif self._device is not None and self._same_gpu(other):
                with self._device.activate():
                    dst[...] = src
            else:
                self._assign(dst, other._to_host(src))

    def _same_gpu(self, other: FlatParams) -> bool:
        a, b = self._device, other._device
        return (
            a is not None
            and b is not None
            and a.backend == b.backend
            and a.physical_id == b.physical_id
        )
