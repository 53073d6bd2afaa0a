"""The CUDA kernels of ``csrc/nccltree_kernels.cu`` through CuPy.

A module is loaded once per GPU: the fatbin built beside the host library when nvcc was
present, else (missing, or no image for this GPU and driver) the shipped ``.cu`` source
compiled at run time by NVRTC.  Wrappers take CuPy arrays and a ``cupy.cuda.Stream`` (or
None for the current stream) and enqueue one kernel; nothing here synchronises.  CuPy is
imported only when a kernel is first needed.

CuPy has no bfloat16 dtype: a bfloat16 array lives in a ``uint16`` CuPy array and the
call names the dtype, ``reduce_n(dst, srcs, dtype="bfloat16")`` (likewise ``sum_into``,
``scale`` and ``sgd_update``); int8 and uint8 are CuPy's own.

The run-time compilation calls NVRTC itself rather than ``cupy.RawModule(code=...)``:
CuPy appends ``-ftz=true`` after the caller's options and the last one wins, so a module
compiled that way flushes float32 subnormals to zero and differs bitwise from the fatbin,
the host kernels and numpy.  The cubin (or PTX) goes to a per-user cache file, keyed by
everything that determines its contents, and is loaded by path.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
import threading
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import DTypeLike

from ._errors import BackendUnavailable
from ._validate import check_real
from .backends.base import BFLOAT16, MAX_FUSED, REDUCE_OPS, Array, check_dtype, check_same

FATBIN = "nccltree_kernels.fatbin"
SOURCE = "nccltree_kernels.cu"
#: sources one kernel takes: the backends' one constant (the source's ``NT_MAX_SOURCES``
#: is checked against it before compiling, and by a test for the shipped file)
MAX_SOURCES = MAX_FUSED
#: NVRTC options: the floating-point semantics of the nvcc build (see CMakeLists.txt) and of
#: the host library, spelled out: no fused multiply-add, subnormals kept, IEEE division
#: and square root.  The target architecture is added per GPU.
NVRTC_OPTIONS = (
    "--std=c++14",
    "--fmad=false",
    "--ftz=false",
    "--prec-div=true",
    "--prec-sqrt=true",
)
#: where compiled modules are cached (default: ``$XDG_CACHE_HOME/nccltree`` or
#: ``~/.cache/nccltree``)
CACHE_ENV = "NCCLTREE_CACHE_DIR"

_SUFFIX: dict[np.dtype[Any], str] = {
    np.dtype(np.float16): "f16",
    np.dtype(np.float32): "f32",
    np.dtype(np.float64): "f64",
    np.dtype(np.int32): "i32",
    np.dtype(np.int64): "i64",
    BFLOAT16: "bf16",
    np.dtype(np.int8): "i8",
    np.dtype(np.uint8): "u8",
}
# scalar argument type of scale / sgd_update (float16 and bfloat16 compute in float32)
_SCALAR: dict[np.dtype[Any], type[np.floating[Any]]] = {
    np.dtype(np.float16): np.float32,
    np.dtype(np.float32): np.float32,
    np.dtype(np.float64): np.float64,
    BFLOAT16: np.float32,
}
#: the CuPy dtype that carries each dtype CuPy lacks
CARRIER = {BFLOAT16: np.dtype(np.uint16)}
OPS = REDUCE_OPS
# the nt_srcs struct: eight device pointers passed by value
_SRCS = np.dtype([("p", "<u8", (MAX_SOURCES,))])
_BLOCK = 256
_MAX_GRID = 8192  # grid-stride loops cover the rest
_PROBE = "nt_sum_into_f32"

_lock = threading.Lock()
_modules: dict[int, Any] = {}  # GPU ordinal -> loaded cupy.RawModule
_origin: dict[int, str] = {}  # GPU ordinal -> "fatbin" | "source"
_target: dict[int, str] = {}  # GPU ordinal -> "sm_XY" | "compute_XY" (source modules)
_functions: dict[tuple[int, str], Any] = {}  # (GPU ordinal, kernel name) -> kernel
#: False makes :func:`module` compile the source even where the fatbin loads (tests of
#: the run-time path patch it, together with the caches above)
_use_fatbin = True


def import_cupy() -> Any:
    """The ``cupy`` module; ``BackendUnavailable`` saying what is missing if it cannot be
    imported (the CUDA backend imports it through here too)."""
    try:
        import cupy
    except Exception as exc:  # ImportError, or OSError for missing CUDA libraries
        raise BackendUnavailable(
            "nccltree's CUDA backend and kernels need CuPy, which could not be imported "
            f"({type(exc).__name__}: {exc}); install nccltree[cuda12] or nccltree[cuda13]"
        ) from exc
    return cupy


_cupy = import_cupy


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


def source_max_sources(text: str) -> int:
    """The ``NT_MAX_SOURCES`` a CUDA source defines (the size of the pointer struct its
    reduce kernels take by value)."""
    m = re.search(r"^\s*#\s*define\s+NT_MAX_SOURCES\s+(\d+)\b", text, re.MULTILINE)
    if m is None:
        raise BackendUnavailable(f"{SOURCE} does not define NT_MAX_SOURCES")
    return int(m.group(1))


# ---- run-time compilation ----


def nvrtc_target(capability: int, supported: Sequence[int]) -> tuple[str, str]:
    """(``--gpu-architecture`` value, "cubin" | "ptx") for a GPU of compute capability
    ``capability`` (e.g. 90) and the architectures NVRTC supports.

    A cubin for the GPU itself when NVRTC knows it; for a GPU newer than NVRTC, PTX for
    the newest architecture it knows below the GPU's, which the driver compiles on load
    (honouring the ``.ftz`` choice written into each PTX instruction, so subnormals are
    still kept)."""
    if capability in supported:
        return f"sm_{capability}", "cubin"
    older = [a for a in supported if a < capability]
    if not older:
        have = ", ".join(str(a) for a in sorted(supported)) or "none"
        raise BackendUnavailable(
            f"NVRTC cannot compile for compute capability {capability} "
            f"(it supports {have}) and the fatbin has no image for it"
        )
    return f"compute_{max(older)}", "ptx"


def cache_dir() -> Path:
    """The per-user directory of compiled modules (created on demand)."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "nccltree"


def _write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that no reader, in this or another process, can see
    a partial file: a temporary file in the same directory renamed over it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _nvrtc_compile(nvrtc: Any, source: str, options: Sequence[str], kind: str) -> bytes:
    prog = nvrtc.createProgram(source, SOURCE, (), ())
    try:
        try:
            nvrtc.compileProgram(prog, list(options))
        except Exception as exc:
            try:
                log = nvrtc.getProgramLog(prog)
            except Exception:  # noqa: BLE001 - the log only adds detail to the error below
                log = ""
            raise RuntimeError(f"{exc}\n{log}".rstrip()) from exc
        return bytes(nvrtc.getCUBIN(prog) if kind == "cubin" else nvrtc.getPTX(prog))
    finally:
        nvrtc.destroyProgram(prog)


def compile_source(device_id: int) -> tuple[Path, str]:
    """Compile the shipped source for a GPU with NVRTC (or find it compiled in the cache);
    returns (the cubin or PTX file, the architecture it targets)."""
    cp = _cupy()
    nvrtc = cp.cuda.nvrtc
    capability = int(cp.cuda.Device(device_id).compute_capability)
    version = tuple(nvrtc.getVersion())
    arch, kind = nvrtc_target(capability, tuple(nvrtc.getSupportedArchs()))
    if kind == "ptx":
        warnings.warn(
            f"NVRTC {version[0]}.{version[1]} does not know compute capability "
            f"{capability}: compiled PTX for {arch}, which the driver compiles on load",
            RuntimeWarning,
            stacklevel=3,
        )
    options = (*NVRTC_OPTIONS, f"--gpu-architecture={arch}")
    source = source_text()
    if source_max_sources(source) != MAX_SOURCES:
        raise BackendUnavailable(
            f"{SOURCE} takes {source_max_sources(source)} sources per reduce but this "
            f"nccltree passes {MAX_SOURCES} (backends.base.MAX_FUSED); reinstall nccltree"
        )
    key = hashlib.sha256(repr((source, options, version, kind)).encode()).hexdigest()
    path = cache_dir() / f"nccltree_kernels-{arch}-{key[:24]}.{kind}"
    if not path.is_file():
        _write_atomic(path, _nvrtc_compile(nvrtc, source, options, kind))
    return path, arch


def _load_path(cp: Any, path: Path) -> Any:
    mod = cp.RawModule(path=str(path))
    mod.compile()  # loads it now: fails if no image fits this GPU and driver
    mod.get_function(_PROBE)
    return mod


def _load(device_id: int, use_fatbin: bool = True) -> tuple[Any, str]:
    cp = _cupy()
    with cp.cuda.Device(device_id):
        fatbin = lib_file(FATBIN) if use_fatbin else None
        why = "not installed" if use_fatbin else "not requested"
        if fatbin is not None:
            try:
                return _load_path(cp, fatbin), "fatbin"
            except Exception as exc:  # noqa: BLE001 - any load failure: compile the source
                why = f"{type(exc).__name__}: {exc}"
        try:
            path, arch = compile_source(device_id)
            try:
                mod = _load_path(cp, path)
            except Exception:  # noqa: BLE001 - a damaged cache file: compile again, once
                path.unlink(missing_ok=True)
                path, arch = compile_source(device_id)
                mod = _load_path(cp, path)
        except BackendUnavailable:
            raise
        except Exception as exc:
            raise BackendUnavailable(
                f"no CUDA kernels for GPU {device_id}: the fatbin did not load ({why}) and "
                f"NVRTC could not compile {SOURCE} into {cache_dir()} ({CACHE_ENV} moves "
                f"it) ({type(exc).__name__}: {exc}); a GPU machine needs NVRTC, e.g. "
                "nccltree[cuda13]"
            ) from exc
        _target[device_id] = arch
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
                mod, origin = _load(device_id, use_fatbin=_use_fatbin)
                _modules[device_id] = mod
                _origin[device_id] = origin
    return mod


def origin(device_id: int) -> str | None:
    """Where a loaded module came from: "fatbin", "source", or None if not loaded yet."""
    return _origin.get(device_id)


def target(device_id: int) -> str | None:
    """The architecture a run-time compiled module targets ("sm_90" for a cubin,
    "compute_90" for PTX the driver compiled); None for a fatbin or before loading."""
    return _target.get(device_id) if _origin.get(device_id) == "source" else None


# ---- argument checks ----


def _array(x: Array, name: str) -> Array:
    cp = _cupy()
    if not isinstance(x, cp.ndarray):
        raise TypeError(f"{name} must be a cupy.ndarray, got {type(x).__name__}")
    if not x.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous")
    return x


def kernel_dtype(
    x: Array, name: str, accepted: Mapping[np.dtype, object], dtype: DTypeLike | None = None
) -> np.dtype:
    """The dtype a kernel computes ``x`` in: its own (one of ``accepted``), or ``dtype``,
    which names bfloat16 for the ``uint16`` array that carries it (TypeError otherwise)."""
    if dtype is None:
        check_dtype(x, name, tuple(accepted))
        return np.dtype(x.dtype)
    want = np.dtype(dtype)
    if want == x.dtype and want not in CARRIER:
        check_dtype(x, name, tuple(accepted))
        return want
    if want not in CARRIER or want not in accepted:
        names = ", ".join(str(d) for d in accepted)
        raise TypeError(f"dtype={want} is not one of the kernels' {names} for {name}")
    if x.dtype != CARRIER[want]:
        raise TypeError(
            f"dtype={want} needs {name} to be a {CARRIER[want]} array holding its bits "
            f"(CuPy has no {want} dtype); got {x.dtype}"
        )
    return want


def _suffix(
    x: Array, name: str, accepted: Mapping[np.dtype, object], dtype: DTypeLike | None = None
) -> tuple[str, np.dtype]:
    logical = kernel_dtype(x, name, accepted, dtype)
    return _SUFFIX[logical], logical


def _device_of(dst: Array, stream: Any) -> int:
    """The GPU that runs an operation: the stream's (a kernel must be launched on its
    stream's device; it may then store to a peer's ``dst`` over peer access), else
    ``dst``'s, whose current stream is used."""
    dev = getattr(stream, "device_id", -1) if stream is not None else -1
    return int(dev) if dev is not None and dev >= 0 else int(dst.device.id)


def _launch(dst: Array, name: str, n: int, args: tuple[Any, ...], stream: Any) -> None:
    cp = _cupy()
    vec = max(1, 16 // dst.itemsize)
    # The vector body covers at most n / vec vectors (less a head of fewer than vec
    # elements peeled off to reach 16-byte alignment): one thread per vector up to a cap.
    grid = min(_MAX_GRID, max(1, -(-n // (_BLOCK * vec))))
    dev = _device_of(dst, stream)
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
    dst: Array,
    srcs: Sequence[Array],
    op: str = "sum",
    stream: Any = None,
    alpha: float = 1.0,
    *,
    dtype: DTypeLike | None = None,
) -> Array:
    """``dst = op(srcs[0], ..., srcs[k-1])``, 1 <= k <= 8, one kernel; returns ``dst``.

    Sources may live on peer GPUs (read over peer access); ``dst`` may be one of them.
    ``alpha != 1.0`` writes ``alpha * sum(srcs)`` in the same kernel (``op="sum"``,
    floating dtypes; the host library's rule: bitwise a sum then :func:`scale` for
    float32/float64, float16 and bfloat16 rounded once). ``dtype="bfloat16"``: the
    arrays are ``uint16`` CuPy arrays holding bfloat16 bits.
    """
    if op not in OPS:
        raise ValueError(f"op must be one of {', '.join(OPS)}; got {op!r}")
    dst = _array(dst, "dst")
    alpha = check_real(alpha, "alpha")
    scaled = alpha != 1.0
    if scaled and op != "sum":
        raise ValueError(f"alpha != 1.0 needs op='sum'; got op={op!r}")
    suffix, logical = _suffix(dst, "dst", _SCALAR if scaled else _SUFFIX, dtype)
    if not isinstance(srcs, (list, tuple)):
        raise TypeError("srcs must be a list or tuple of cupy arrays")
    if not 1 <= len(srcs) <= MAX_SOURCES:
        raise ValueError(f"reduce_n takes 1 to {MAX_SOURCES} sources, got {len(srcs)}")
    ptrs = np.zeros(1, _SRCS)
    for j, s in enumerate(srcs):
        check_same(_array(s, f"srcs[{j}]"), dst, f"srcs[{j}]", "dst")
        ptrs["p"][0, j] = s.data.ptr
    n = dst.size
    if n:
        args: tuple[Any, ...] = (dst, ptrs, np.int32(len(srcs)), np.int64(n))
        if scaled:
            args += (_SCALAR[logical](alpha),)
            _launch(dst, f"nt_reduce_n_scaled_sum_{suffix}", n, args, stream)
        else:
            _launch(dst, f"nt_reduce_n_{op}_{suffix}", n, args, stream)
    return dst


def sum_into(
    dst: Array, src: Array, stream: Any = None, *, dtype: DTypeLike | None = None
) -> Array:
    """``dst += src``; returns ``dst``."""
    dst = _array(dst, "dst")
    suffix, _ = _suffix(dst, "dst", _SUFFIX, dtype)
    check_same(_array(src, "src"), dst, "src", "dst")
    if dst.size:
        _launch(dst, f"nt_sum_into_{suffix}", dst.size, (dst, src, np.int64(dst.size)), stream)
    return dst


def scale(x: Array, alpha: float, stream: Any = None, *, dtype: DTypeLike | None = None) -> Array:
    """``x *= alpha`` for floating arrays; returns ``x``."""
    x = _array(x, "x")
    suffix, logical = _suffix(x, "x", _SCALAR, dtype)
    alpha = check_real(alpha, "alpha")
    if x.size:
        a = _SCALAR[logical](alpha)
        _launch(x, f"nt_scale_{suffix}", x.size, (x, a, np.int64(x.size)), stream)
    return x


def sgd_update(
    w: Array,
    g: Array,
    v: Array,
    lr: float,
    momentum: float,
    weight_decay: float,
    stream: Any = None,
    *,
    dtype: DTypeLike | None = None,
) -> Array:
    """Caffe's step in one kernel: ``g += wd*w; v = momentum*v + lr*g; w -= v``; returns w."""
    w = _array(w, "w")
    suffix, logical = _suffix(w, "w", _SCALAR, dtype)
    check_same(_array(g, "g"), w, "g", "w")
    check_same(_array(v, "v"), w, "v", "w")
    hyper = [
        check_real(x, name)
        for x, name in ((lr, "lr"), (momentum, "momentum"), (weight_decay, "weight_decay"))
    ]
    if w.size:
        t = _SCALAR[logical]
        args = (w, g, v, *(t(x) for x in hyper), np.int64(w.size))
        _launch(w, f"nt_sgd_update_{suffix}", w.size, args, stream)
    return w


def copy(dst: Array, src: Array, stream: Any = None) -> Array:
    """``dst[...] = src`` as one asynchronous device (or peer) copy; returns ``dst``."""
    dst = _array(dst, "dst")
    check_same(_array(src, "src"), dst, "src", "dst")
    if dst.nbytes:
        cp = _cupy()
        with cp.cuda.Device(_device_of(dst, stream)):
            s = stream if stream is not None else cp.cuda.get_current_stream()
            dst.data.copy_from_device_async(src.data, dst.nbytes, s)
    return dst
