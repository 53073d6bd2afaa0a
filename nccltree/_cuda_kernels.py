"""The CUDA kernels of ``csrc/nccltree_kernels.cu`` through CuPy.

A module is loaded once per GPU: the fatbin built beside the host library when nvcc was
present, else (missing, or no image for this GPU and driver) the shipped ``.cu`` source
compiled at run time by NVRTC.  Wrappers take CuPy arrays and a ``cupy.cuda.Stream`` (or
None for the current stream) and enqueue one kernel; nothing here synchronises.  CuPy is
imported only when a kernel is first needed.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ._errors import BackendUnavailable

FATBIN = "nccltree_kernels.fatbin"
SOURCE = "nccltree_kernels.cu"
MAX_SOURCES = 8
#: NVRTC options; no fused multiply-add, as in the fatbin and the host library
NVRTC_OPTIONS = ("--std=c++14", "--fmad=false")

_SUFFIX = {
    np.dtype(np.float16): "f16",
    np.dtype(np.float32): "f32",
    np.dtype(np.float64): "f64",
    np.dtype(np.int32): "i32",
    np.dtype(np.int64): "i64",
}
# scalar argument type of scale / sgd_update (float16 computes in float32)
_SCALAR = {
    np.dtype(np.float16): np.float32,
    np.dtype(np.float32): np.float32,
    np.dtype(np.float64): np.float64,
}
OPS = ("sum", "prod", "max", "min")
# the nt_srcs struct: eight device pointers passed by value
_SRCS = np.dtype([("p", "<u8", (MAX_SOURCES,))])
_BLOCK = 256
_MAX_GRID = 8192  # grid-stride loops cover the rest

_lock = threading.Lock()
_modules: dict[int, Any] = {}  # GPU ordinal -> loaded cupy.RawModule
_origin: dict[int, str] = {}  # GPU ordinal -> "fatbin" | "source"
_functions: dict[tuple[int, str], Any] = {}  # (GPU ordinal, kernel name) -> kernel


def _cupy() -> Any:
    try:
        import cupy
    except Exception as exc:  # ImportError, or OSError for missing CUDA libraries
        raise BackendUnavailable(
            f"CUDA kernels need CuPy ({type(exc).__name__}: {exc}); "
            "install nccltree[cuda12] or nccltree[cuda13]"
        ) from exc
    return cupy


def lib_file(name: str) -> Path | None:
    """A file of the package's ``_lib`` directory, searched over the whole package path."""
    import nccltree

    for d in nccltree.__path__:
        p = Path(d) / "_lib" / name
        if p.is_file():
            return p
    return None


def source_text() -> str:
    """The CUDA source shipped with the package (the repository copy as a fallback)."""
    path = lib_file(SOURCE)
    if path is None:
        import nccltree

        for d in nccltree.__path__:
            candidate = Path(d).parent / "csrc" / SOURCE
            if candidate.is_file():
                path = candidate
                break
    if path is None:
        raise BackendUnavailable(f"{SOURCE} is missing from the nccltree installation")
    return path.read_text()


def _load(device_id: int, use_fatbin: bool = True) -> tuple[Any, str]:
    cp = _cupy()
    probe = "nt_sum_into_f32"
    with cp.cuda.Device(device_id):
        fatbin = lib_file(FATBIN) if use_fatbin else None
        if fatbin is not None:
            try:
                mod = cp.RawModule(path=str(fatbin))
                mod.compile()  # loads it now: fails if no image fits this GPU and driver
                mod.get_function(probe)
                return mod, "fatbin"
            except Exception:  # any load failure means: compile the source instead
                pass
        mod = cp.RawModule(code=source_text(), options=NVRTC_OPTIONS)
        mod.compile()  # now, so that errors surface here and not in the middle of a stream
        mod.get_function(probe)
        return mod, "source"


def module(device_id: int | None = None) -> Any:
    """The kernel module for a GPU (the current one by default), loaded once."""
    cp = _cupy()
    if device_id is None:
        device_id = cp.cuda.Device().id
    mod = _modules.get(device_id)
    if mod is None:
        with _lock:
            mod = _modules.get(device_id)
            if mod is None:
                mod, origin = _load(device_id)
                _modules[device_id] = mod
                _origin[device_id] = origin
    return mod


def origin(device_id: int) -> str | None:
    """Where a loaded module came from: "fatbin", "source", or None if not loaded yet."""
    return _origin.get(device_id)


# ---- argument checks ----


def _array(x: Any, name: str) -> Any:
    cp = _cupy()
    if not isinstance(x, cp.ndarray):
        raise TypeError(f"{name} must be a cupy.ndarray, got {type(x).__name__}")
    if not x.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous")
    return x


def _suffix(x: Any, name: str, accepted: dict) -> str:
    if x.dtype not in accepted:
        names = ", ".join(str(dt) for dt in accepted)
        raise TypeError(f"{name} has dtype {x.dtype}; accepted: {names}")
    return _SUFFIX[x.dtype]


def _same(x: Any, ref: Any, name: str, ref_name: str) -> None:
    if x.dtype != ref.dtype:
        raise TypeError(f"{name} has dtype {x.dtype} but {ref_name} has {ref.dtype}")
    if x.size != ref.size:
        raise ValueError(f"{name} has {x.size} elements but {ref_name} has {ref.size}")


def _launch(dst: Any, name: str, n: int, args: tuple, stream: Any) -> None:
    cp = _cupy()
    vec = max(1, 16 // dst.itemsize)
    grid = min(_MAX_GRID, max(1, -(-n // (_BLOCK * vec))))
    dev = dst.device.id
    with cp.cuda.Device(dev):
        fn = _functions.get((dev, name))
        if fn is None:
            fn = _functions[(dev, name)] = module(dev).get_function(name)
        if stream is None:
            fn((grid,), (_BLOCK,), args)
        else:
            with stream:
                fn((grid,), (_BLOCK,), args)


# ---- wrappers ----


def reduce_n(
    dst: Any, srcs: Sequence[Any], op: str = "sum", stream: Any = None, alpha: float = 1.0
) -> Any:
    """``dst = op(srcs[0], ..., srcs[k-1])``, 1 <= k <= 8, one kernel; returns ``dst``.

    Sources may live on peer GPUs (read over peer access); ``dst`` may be one of them.
    ``alpha != 1.0`` writes ``alpha * sum(srcs)`` in the same kernel (``op="sum"``,
    floating dtypes; the host library's rule: bitwise a sum then :func:`scale` for
    float32/float64, float16 rounded once).
    """
    if op not in OPS:
        raise ValueError(f"op must be one of {', '.join(OPS)}; got {op!r}")
    dst = _array(dst, "dst")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float, np.integer, np.floating)):
        raise TypeError(f"alpha must be a real number, got {type(alpha).__name__}")
    scaled = float(alpha) != 1.0
    if scaled and op != "sum":
        raise ValueError(f"alpha != 1.0 needs op='sum'; got op={op!r}")
    suffix = _suffix(dst, "dst", _SCALAR if scaled else _SUFFIX)
    if not isinstance(srcs, (list, tuple)):
        raise TypeError("srcs must be a list or tuple of cupy arrays")
    if not 1 <= len(srcs) <= MAX_SOURCES:
        raise ValueError(f"reduce_n takes 1 to {MAX_SOURCES} sources, got {len(srcs)}")
    ptrs = np.zeros(1, _SRCS)
    for j, s in enumerate(srcs):
        _same(_array(s, f"srcs[{j}]"), dst, f"srcs[{j}]", "dst")
        ptrs["p"][0, j] = s.data.ptr
    n = dst.size
    if n:
        args = (dst, ptrs, np.int32(len(srcs)), np.int64(n))
        if scaled:
            args += (_SCALAR[dst.dtype](alpha),)
            _launch(dst, f"nt_reduce_n_scaled_sum_{suffix}", n, args, stream)
        else:
            _launch(dst, f"nt_reduce_n_{op}_{suffix}", n, args, stream)
    return dst


def sum_into(dst: Any, src: Any, stream: Any = None) -> Any:
    """``dst += src``; returns ``dst``."""
    dst = _array(dst, "dst")
    suffix = _suffix(dst, "dst", _SUFFIX)
    _same(_array(src, "src"), dst, "src", "dst")
    if dst.size:
        _launch(dst, f"nt_sum_into_{suffix}", dst.size, (dst, src, np.int64(dst.size)), stream)
    return dst


def scale(x: Any, alpha: float, stream: Any = None) -> Any:
    """``x *= alpha`` for floating arrays; returns ``x``."""
    x = _array(x, "x")
    suffix = _suffix(x, "x", _SCALAR)
    if x.size:
        a = _SCALAR[x.dtype](alpha)
        _launch(x, f"nt_scale_{suffix}", x.size, (x, a, np.int64(x.size)), stream)
    return x


def sgd_update(
    w: Any,
    g: Any,
    v: Any,
    lr: float,
    momentum: float,
    weight_decay: float,
    stream: Any = None,
) -> Any:
    """Caffe's step in one kernel: ``g += wd*w; v = momentum*v + lr*g; w -= v``; returns w."""
    w = _array(w, "w")
    suffix = _suffix(w, "w", _SCALAR)
    _same(_array(g, "g"), w, "g", "w")
    _same(_array(v, "v"), w, "v", "w")
    if w.size:
        t = _SCALAR[w.dtype]
        args = (w, g, v, t(lr), t(momentum), t(weight_decay), np.int64(w.size))
        _launch(w, f"nt_sgd_update_{suffix}", w.size, args, stream)
    return w


def copy(dst: Any, src: Any, stream: Any = None) -> Any:
    """``dst[...] = src`` as one asynchronous device (or peer) copy; returns ``dst``."""
    dst = _array(dst, "dst")
    _same(_array(src, "src"), dst, "src", "dst")
    if dst.nbytes:
        cp = _cupy()
        s = stream if stream is not None else cp.cuda.get_current_stream()
        with cp.cuda.Device(dst.device.id):
            dst.data.copy_from_device_async(src.data, dst.nbytes, s)
    return dst
