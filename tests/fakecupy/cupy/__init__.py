"""Fake ``cupy`` (CuPy 14.2's names and signatures) over host memory, for wiring tests.

Not a GPU and not GPU verification: see the ``fakecupy`` package docstring.
``ndarray`` is numpy-backed but, like CuPy's, exposes no ``__array_interface__`` and
refuses implicit conversion to numpy; element-wise operations run on the current stream
and refuse arrays of another GPU than the current one, as CuPy's kernels do.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .. import _core, _kernels
from . import cuda
from .cuda import compiler, driver, nvrtc, runtime

float16 = np.float16
float32 = np.float32
float64 = np.float64
int32 = np.int32
int64 = np.int64
uint8 = np.uint8
uint16 = np.uint16
int8 = np.int8
dtype = np.dtype

__version__ = "14.2.0"


def _shape(shape: Any) -> tuple[int, ...]:
    if isinstance(shape, (int, np.integer)):
        return (int(shape),)
    return tuple(int(s) for s in shape)


def _check_current_device(*arrays: ndarray) -> int:
    dev = runtime.getDevice()
    for a in arrays:
        if a.device.id != dev:
            raise ValueError(
                f"Array device must be same as the current device: array device = "
                f"{a.device.id} while current = {dev}"
            )
    return dev


def _log_kernel(detail: str, dst: int, nbytes: int) -> None:
    f = _core.active()
    sp = cuda._current_stream_ptr()
    with f.lock:
        s = f.stream(sp)
        f.check_enqueue(s)
        f.log("kernel", s, sp, dst=dst, nbytes=nbytes, detail=detail)


class _Flags:
    def __init__(self, a: np.ndarray) -> None:
        self.c_contiguous = bool(a.flags.c_contiguous)
        self.f_contiguous = bool(a.flags.f_contiguous)
        self.owndata = False

    def __getitem__(self, key: str) -> bool:
        return {"C_CONTIGUOUS": self.c_contiguous, "F_CONTIGUOUS": self.f_contiguous}[key]


class _Capsule:
    def __init__(self, array: ndarray) -> None:
        self.array = array


class ndarray:
    """A CuPy array: device memory (fake addresses, numpy storage) of one GPU."""

    def __init__(
        self,
        shape: Any,
        dtype: Any = float,
        memptr: cuda.MemoryPointer | None = None,
        strides: Any = None,
        order: str = "C",
    ) -> None:
        dt = np.dtype(dtype)
        shp = _shape(shape)
        nbytes = int(np.prod(shp, dtype=np.int64)) * dt.itemsize
        if memptr is None:
            memptr = cuda.alloc(nbytes)
        elif not isinstance(memptr, cuda.MemoryPointer):
            raise TypeError("memptr must be a cupy.cuda.MemoryPointer")
        self.data = memptr
        fake = _core.active()
        if nbytes == 0:
            raw = np.empty(0, np.uint8)
        else:
            kind, _, alloc = fake.resolve(memptr.ptr, nbytes)
            if kind != "device" or alloc is None or alloc.buffer is None:
                raise fake.misuse_error(
                    f"an ndarray over {memptr.ptr:#x}+{nbytes}, which no live device "
                    "allocation holds"
                )
            raw = alloc.view(memptr.ptr, nbytes)
        if strides is None:
            self._np = raw.view(dt).reshape(shp, order="F" if order == "F" else "C")
        else:
            self._np = np.lib.stride_tricks.as_strided(raw.view(dt), shp, tuple(strides))

    @classmethod
    def _view(cls, base: ndarray, view: np.ndarray) -> ndarray:
        off = view.__array_interface__["data"][0] - base._np.__array_interface__["data"][0]
        obj = cls.__new__(cls)
        obj.data = cuda.MemoryPointer(base.data.mem, base.data.ptr - base.data.mem.ptr + off)
        obj._np = view
        return obj

    # -- attributes --

    @property
    def device(self) -> cuda.Device:
        return cuda.Device(self.data.device_id)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._np.shape)

    @property
    def dtype(self) -> np.dtype[Any]:
        return self._np.dtype

    @property
    def size(self) -> int:
        return int(self._np.size)

    @property
    def nbytes(self) -> int:
        return int(self._np.nbytes)

    @property
    def itemsize(self) -> int:
        return int(self._np.itemsize)

    @property
    def ndim(self) -> int:
        return int(self._np.ndim)

    @property
    def strides(self) -> tuple[int, ...]:
        return tuple(self._np.strides)

    @property
    def flags(self) -> _Flags:
        return _Flags(self._np)

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {
            "shape": self.shape,
            "typestr": self.dtype.str,
            "descr": self.dtype.descr,
            "data": (self.data.ptr, False),
            "version": 3,
            "strides": None if self._np.flags.c_contiguous else self.strides,
            "stream": cuda._current_stream_ptr() or 1,
        }

    def __dlpack_device__(self) -> tuple[int, int]:
        return (2, self.data.device_id)  # kDLCUDA

    def __dlpack__(self, stream: Any = None) -> _Capsule:
        return _Capsule(self)

    def __array__(self, *args: Any, **kwargs: Any) -> np.ndarray:
        raise TypeError(
            "Implicit conversion to a NumPy array is not allowed. Please use `.get()` to "
            "construct a NumPy array explicitly."
        )

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of unsized object")
        return self.shape[0]

    def __repr__(self) -> str:
        return f"<fake cupy.ndarray {self.dtype}{list(self.shape)} on GPU {self.data.device_id}>"

    # -- views --

    def __getitem__(self, key: Any) -> ndarray:
        v = self._np[key]
        if not isinstance(v, np.ndarray):
            k = key if isinstance(key, tuple) else (key,)
            v = self._np[k + (Ellipsis,)]
        if not np.shares_memory(v, self._np) and v.size:
            raise NotImplementedError("fake cupy: advanced indexing is not modelled")
        return ndarray._view(self, v)

    def reshape(self, *shape: Any, order: str = "C") -> ndarray:
        shp = shape[0] if len(shape) == 1 else shape
        v = self._np.reshape(shp, order=order)
        if not np.shares_memory(v, self._np) and v.size:
            return self.copy().reshape(shp, order=order)
        return ndarray._view(self, v)

    def ravel(self, order: str = "C") -> ndarray:
        return self.reshape(-1, order=order)

    def view(self, dtype: Any = None) -> ndarray:
        return ndarray._view(self, self._np if dtype is None else self._np.view(dtype))

    # -- copies --

    def get(
        self,
        stream: Any = None,
        order: str = "C",
        out: np.ndarray | None = None,
        blocking: bool = True,
    ) -> np.ndarray:
        if stream is None:
            stream = cuda.get_current_stream()
        if out is not None:
            if not isinstance(out, np.ndarray):
                raise TypeError("Only numpy.ndarray can be obtained fromcupy.ndarray")
            if self.dtype != out.dtype:
                raise TypeError(f"{out.dtype} array cannot be obtained from {self.dtype} array")
            if self.shape != out.shape:
                raise ValueError(
                    f"Shape mismatch. Expected shape: {self.shape}, actual shape: {out.shape}"
                )
            a_cpu = out
        else:
            a_cpu = np.empty(self.shape, dtype=self.dtype, order="F" if order == "F" else "C")
        a_gpu = self
        if not (
            (a_cpu.flags.c_contiguous and self._np.flags.c_contiguous)
            or (a_cpu.flags.f_contiguous and self._np.flags.f_contiguous and self.ndim > 1)
        ):
            prev = runtime.getDevice()
            try:
                runtime.setDevice(self.device.id)
                with stream:
                    a_gpu = self.copy(order="F" if a_cpu.flags.f_contiguous else "C")
            finally:
                runtime.setDevice(prev)
        prev = runtime.getDevice()
        try:
            runtime.setDevice(self.device.id)
            a_gpu.data.copy_to_host_async(a_cpu.ctypes.data, a_gpu.nbytes, stream)
            if blocking:
                stream.synchronize()
        finally:
            runtime.setDevice(prev)
        return a_cpu

    def set(self, arr: np.ndarray, stream: Any = None) -> None:
        if not isinstance(arr, np.ndarray):
            raise TypeError("Only numpy.ndarray can be set to cupy.ndarray")
        if self.dtype != arr.dtype:
            raise TypeError(f"{arr.dtype} array cannot be set to {self.dtype} array")
        if self.shape != arr.shape:
            raise ValueError(f"Shape mismatch. Old shape: {self.shape}, new shape: {arr.shape}")
        if self._np.flags.c_contiguous:
            arr = np.ascontiguousarray(arr)
        elif self._np.flags.f_contiguous:
            arr = np.asfortranarray(arr)
        else:
            raise RuntimeError("Cannot set to non-contiguous array")
        if stream is None:
            stream = cuda.get_current_stream()
        prev = runtime.getDevice()
        try:
            runtime.setDevice(self.device.id)
            self.data.copy_from_host_async(arr.ctypes.data, self.nbytes, stream)
        finally:
            runtime.setDevice(prev)

    def copy(self, order: str = "C") -> ndarray:
        _check_current_device(self)
        out = empty(self.shape, self.dtype, order=order)
        out._np[...] = self._np
        _log_kernel("copy", out.data.ptr, out.nbytes)
        return out

    def astype(self, dtype: Any, copy: bool = True) -> ndarray:
        if not copy and np.dtype(dtype) == self.dtype:
            return self
        _check_current_device(self)
        out = empty(self.shape, dtype)
        out._np[...] = self._np
        _log_kernel("astype", out.data.ptr, out.nbytes)
        return out

    def __float__(self) -> float:
        # CuPy: a one-element array only, read with get() on the current stream
        if self.size != 1:
            raise TypeError("only length-1 arrays can be converted to Python scalars")
        return float(self.get().reshape(()))

    def fill(self, value: Any) -> None:
        if value == 0 and self._np.flags.c_contiguous:
            self.data.memset_async(0, self.nbytes)
            return
        _check_current_device(self)
        self._np.fill(value)
        _log_kernel("fill", self.data.ptr, self.nbytes)

    def __setitem__(self, key: Any, value: Any) -> None:
        target = self[key]
        if isinstance(value, ndarray):
            _check_current_device(target, value)
            target._np[...] = value._np
        elif isinstance(value, np.ndarray):
            raise TypeError("fake cupy: assign numpy data with set() or cupy.asarray()")
        else:
            _check_current_device(target)
            target._np[...] = value
        _log_kernel("setitem", target.data.ptr, target.nbytes)

    # -- element-wise arithmetic (kernels on the current stream and GPU) --

    def _binary(self, other: Any, fn: Callable[[Any, Any], Any], name: str) -> ndarray:
        ops: list[ndarray] = [self]
        rhs = other
        if isinstance(other, ndarray):
            ops.append(other)
            rhs = other._np
        elif isinstance(other, np.ndarray):
            raise TypeError(f"Unsupported type {type(other)}")
        _check_current_device(*ops)
        res = np.asarray(fn(self._np, rhs))
        out = empty(res.shape, res.dtype)
        out._np[...] = res
        _log_kernel(name, out.data.ptr, out.nbytes)
        return out

    def _inplace(self, other: Any, fn: Callable[[Any, Any, Any], Any], name: str) -> ndarray:
        rhs = other._np if isinstance(other, ndarray) else other
        _check_current_device(self, *([other] if isinstance(other, ndarray) else []))
        fn(self._np, rhs, self._np)
        _log_kernel(name, self.data.ptr, self.nbytes)
        return self

    def __add__(self, o: Any) -> ndarray:
        return self._binary(o, np.add, "add")

    def __radd__(self, o: Any) -> ndarray:
        return self._binary(o, lambda a, b: np.add(b, a), "add")

    def __sub__(self, o: Any) -> ndarray:
        return self._binary(o, np.subtract, "subtract")

    def __rsub__(self, o: Any) -> ndarray:
        return self._binary(o, lambda a, b: np.subtract(b, a), "subtract")

    def __mul__(self, o: Any) -> ndarray:
        return self._binary(o, np.multiply, "multiply")

    def __rmul__(self, o: Any) -> ndarray:
        return self._binary(o, lambda a, b: np.multiply(b, a), "multiply")

    def __truediv__(self, o: Any) -> ndarray:
        return self._binary(o, np.true_divide, "true_divide")

    def __neg__(self) -> ndarray:
        return self._binary(0, lambda a, _: np.negative(a), "negative")

    def __iadd__(self, o: Any) -> ndarray:
        return self._inplace(o, np.add, "add")

    def __isub__(self, o: Any) -> ndarray:
        return self._inplace(o, np.subtract, "subtract")

    def __imul__(self, o: Any) -> ndarray:
        return self._inplace(o, np.multiply, "multiply")

    def __itruediv__(self, o: Any) -> ndarray:
        return self._inplace(o, np.true_divide, "true_divide")


# -- creation ----------------------------------------------------------------------------


def empty(shape: Any, dtype: Any = float, order: str = "C") -> ndarray:
    return ndarray(shape, dtype, order=order)


def zeros(shape: Any, dtype: Any = float, order: str = "C") -> ndarray:
    a = ndarray(shape, dtype, order=order)
    a.data.memset_async(0, a.nbytes)  # on the current stream, as CuPy's
    return a


def full(shape: Any, fill_value: Any, dtype: Any = None, order: str = "C") -> ndarray:
    a = empty(shape, np.result_type(fill_value) if dtype is None else dtype, order=order)
    a.fill(fill_value)
    return a


def empty_like(a: ndarray, dtype: Any = None) -> ndarray:
    return empty(a.shape, a.dtype if dtype is None else dtype)


def zeros_like(a: ndarray, dtype: Any = None) -> ndarray:
    return zeros(a.shape, a.dtype if dtype is None else dtype)


def asarray(a: Any, dtype: Any = None, order: Any = None, *, blocking: bool = False) -> ndarray:
    if isinstance(a, ndarray):
        return a if dtype is None or np.dtype(dtype) == a.dtype else a.astype(dtype)
    iface = getattr(a, "__cuda_array_interface__", None)
    if iface is not None:
        ptr = int(iface["data"][0])
        dt = np.dtype(iface["typestr"])
        shp = tuple(iface["shape"])
        nbytes = int(np.prod(shp, dtype=np.int64)) * dt.itemsize
        mem = cuda.UnownedMemory(ptr, nbytes, a, -1 if ptr else runtime.getDevice())
        arr = ndarray(shp, dt, cuda.MemoryPointer(mem, 0), iface.get("strides"))
        return arr if dtype is None else arr.astype(dtype)
    host = np.asarray(a, dtype=dtype)
    out = empty(host.shape, host.dtype)
    out.set(host)
    return out


def array(obj: Any, dtype: Any = None, copy: bool = True) -> ndarray:
    if isinstance(obj, ndarray) and copy:
        return obj.astype(obj.dtype if dtype is None else dtype)
    return asarray(obj, dtype)


def asnumpy(
    a: Any,
    stream: Any = None,
    order: str = "C",
    out: np.ndarray | None = None,
    *,
    blocking: bool = True,
) -> np.ndarray:
    if isinstance(a, ndarray):
        return a.get(stream=stream, order=order, out=out, blocking=blocking)
    arr = np.asarray(a, order=order)  # type: ignore[call-overload]
    if out is not None:
        out[...] = arr
        return out
    return arr


def from_dlpack(array: Any, *, device: Any = None, copy: bool | None = None) -> ndarray:
    if not hasattr(array, "__dlpack__"):
        raise TypeError(f"{type(array).__name__} does not support the DLPack protocol")
    cap = array.__dlpack__()
    if not isinstance(cap, _Capsule):
        raise TypeError("fake cupy: only fake cupy arrays can be exchanged through DLPack")
    return ndarray._view(cap.array, cap.array._np)


def get_default_pinned_memory_pool() -> cuda.PinnedMemoryPool:
    pool: cuda.PinnedMemoryPool = _core.active().default_pinned_pool
    return pool


# -- raw kernels (cupy/_core/raw.pyx) ----------------------------------------------------


class RawModule:
    def __init__(
        self,
        *,
        code: str | None = None,
        path: str | None = None,
        options: tuple[str, ...] = (),
        backend: str = "nvrtc",
        translate_cucomplex: bool = False,
        enable_cooperative_groups: bool = False,
        name_expressions: Sequence[str] | None = None,
        jitify: bool | None = None,
    ) -> None:
        if (code is None) == (path is None):
            raise TypeError("Exactly one of `code` and `path` keyword arguments must be given.")
        for what, v, t in (("code", code, str), ("path", path, str), ("backend", backend, str)):
            if v is not None and not isinstance(v, t):
                raise TypeError(f"Argument '{what}' has incorrect type (expected str)")
        if not isinstance(options, tuple):
            raise TypeError(
                f"Argument 'options' has incorrect type (expected tuple, got {type(options).__name__})"
            )
        self.code = code
        self.file_path = path
        self.options = options if code is not None else ()
        self.backend = backend if code is not None else "nvcc"
        self.enable_cooperative_groups = enable_cooperative_groups
        self.name_expressions = name_expressions
        self._loaded: dict[int, dict[str, Any]] = {}

    def _module(self) -> dict[str, Any]:
        fake = _core.active()
        dev = runtime.getDevice()
        mod = self._loaded.get(dev)
        if mod is not None:
            return mod
        cc = fake.compute_capability[dev]
        if self.code is not None:
            doc = self._compile(cc)
            origin = "code"
        else:
            assert self.file_path is not None
            try:
                with open(self.file_path, "rb") as fh:
                    data = fh.read()
            except FileNotFoundError:
                raise driver.CUDADriverError(driver.CUDA_ERROR_FILE_NOT_FOUND) from None
            parsed = _kernels.parse_image(data)
            if parsed is None:
                raise driver.CUDADriverError(driver.CUDA_ERROR_INVALID_IMAGE)
            doc = parsed
            origin = "path"
        if not _kernels.image_fits(doc["archs"], cc):
            raise driver.CUDADriverError(driver.CUDA_ERROR_NO_BINARY_FOR_GPU)
        mod = dict(doc, origin=origin)
        self._loaded[dev] = mod
        return mod

    def _compile(self, cc: str) -> dict[str, Any]:
        assert self.code is not None
        if self.backend != "nvrtc":
            raise compiler.CompileException(
                "nvcc not found", self.code, "kern", self.options, self.backend
            )
        options = self.options
        if not any(o.startswith(("-std", "--std")) for o in options):
            options += ("-std=c++17",)
        arch = f"-arch=sm_{cc}" if int(cc) in nvrtc.SUPPORTED_ARCHS else f"-arch=compute_{cc}"
        # cupy/cuda/compiler.py _compile_with_cache_cuda: appended after the caller's options
        options += (arch, "-ftz=true")
        prog = nvrtc.createProgram(self.code, "kern.cu", (), ())
        try:
            try:
                nvrtc.compileProgram(prog, options)
            except nvrtc.NVRTCError as exc:
                log = nvrtc.getProgramLog(prog)
                raise compiler.CompileException(
                    f"{exc}\n{log}", self.code, "kern", options
                ) from None
            img = nvrtc.getCUBIN(prog) if arch.startswith("-arch=sm") else nvrtc.getPTX(prog)
        finally:
            nvrtc.destroyProgram(prog)
        doc = _kernels.parse_image(img)
        assert doc is not None
        return doc

    @property
    def module(self) -> dict[str, Any]:
        return self._module()

    def compile(self, log_stream: Any = None) -> None:
        self._module()

    def get_function(self, name: str) -> RawKernel:
        if not isinstance(name, str):
            raise TypeError("Argument 'name' has incorrect type (expected str)")
        if name not in self._module()["kernels"]:
            raise driver.CUDADriverError(driver.CUDA_ERROR_NOT_FOUND)
        return RawKernel(self, name)


class RawKernel:
    """A kernel of a :class:`RawModule`; calls execute at once (see ``fakecupy._kernels``)."""

    def __init__(self, module: RawModule, name: str) -> None:
        self._raw_module = module
        self.name = name

    def __call__(
        self, grid: tuple[int, ...], block: tuple[int, ...], args: Sequence[Any], *,
        shared_mem: int = 0, stream: Any = None,
    ) -> None:  # fmt: skip
        if not isinstance(grid, tuple):
            raise TypeError(
                f"Argument 'grid' has incorrect type (expected tuple, got {type(grid).__name__})"
            )
        if not isinstance(block, tuple):
            raise TypeError(
                f"Argument 'block' has incorrect type (expected tuple, got {type(block).__name__})"
            )
        smem = _core.as_int(shared_mem, "shared_mem", unsigned=True, bits=64)
        fake = _core.active()
        dev = runtime.getDevice()
        mod = self._raw_module._module()
        if self.name not in mod["kernels"]:
            raise driver.CUDADriverError(driver.CUDA_ERROR_NOT_FOUND)
        gx, gy, gz = (max(1, int(x)) for x in (grid + (1, 1))[:3])
        bx, by, bz = (max(1, int(x)) for x in (block + (1, 1))[:3])
        g, b = (gx, gy, gz), (bx, by, bz)
        sp = cuda._current_stream_ptr() if stream is None else int(stream.ptr)
        with fake.lock:
            try:
                s = fake.stream(sp)
            except runtime.CUDARuntimeError:
                raise driver.CUDADriverError(driver.CUDA_ERROR_INVALID_HANDLE) from None
            if s.device != dev:
                # a kernel launch fails on a stream of another GPU than the current one
                raise driver.CUDADriverError(driver.CUDA_ERROR_INVALID_HANDLE)
            if fake.device_error[dev]:
                raise driver.CUDADriverError(fake.device_error[dev])
            if b[0] * b[1] * b[2] > 1024 or g[0] >= 1 << 31 or max(g[1:]) > 65535:
                raise driver.CUDADriverError(driver.CUDA_ERROR_INVALID_VALUE)
            conv = _kernels.convert_args(fake, self.name, list(args))
            fake.launches.append(
                _core.KernelLaunch(
                    self.name, g, b, conv, sp, dev, smem, mod["origin"], bool(mod["ftz"])
                )
            )  # fmt: skip
            span = _kernels.accesses(self.name, conv)
            fake.log(
                "kernel", s, sp, dst=span[0][0] if span else 0,
                nbytes=span[0][1] if span else 0, detail=self.name,
            )  # fmt: skip
            for ptr, nb in span:
                kind, owner, _ = fake.resolve(ptr, nb)
                if kind != "device" or not fake.peer_ok(dev, owner):
                    if fake.fault_mode == "async":
                        s.error = _core.ERROR_ILLEGAL_ADDRESS
                        return
                    raise runtime.CUDARuntimeError(_core.ERROR_ILLEGAL_ADDRESS)
            _kernels.execute(fake, self.name, conv, bool(mod["ftz"]))
