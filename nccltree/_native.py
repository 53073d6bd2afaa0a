"""ctypes face of the host kernel library (``csrc/nccltree_host.c``).

The library is loaded once, on first use, from the ``_lib`` directory of the installed
package.  Every wrapper checks its arguments in Python (numpy arrays, C-contiguous, one
supported dtype, equal sizes, 1..8 sources) so that bad calls raise ``TypeError`` or
``ValueError`` naming what is accepted; the C library checks them again and
:func:`check` turns any status it returns into the matching exception.  ctypes releases
the GIL for the duration of each call, so kernels of different devices run in parallel
(one exception: :meth:`Counter.add`, which never blocks, keeps it).

It is also the face of the wait primitive: :class:`Counter`, a futex-backed sequence
counter the host streams and the per-rank rendezvous sleep on, and
:func:`futex_pingpong`, the two-thread hand-off it is measured against.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from ._errors import BackendUnavailable, NativeError
from ._validate import check_int, check_real
from .backends.base import BFLOAT16, FLOAT_DTYPES, MAX_FUSED, check_dtype, check_same

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer

__all__ = [
    "Counter",
    "CounterLike",
    "DTYPES",
    "FLOAT_DTYPES",
    "MAX_SOURCES",
    "OPS",
    "check",
    "check_host_array",
    "copy",
    "futex_pingpong",
    "gather",
    "library",
    "library_path",
    "new_counter",
    "reduce_n",
    "run_steps",
    "scale",
    "sgd_update",
    "sum_into",
    "sum_n",
    "use_avx2",
    "use_f16c",
]

#: numpy dtype -> C dtype code (csrc/nccltree.h); the keys are ``backends.base.DTYPES``
DTYPES: dict[np.dtype[Any], int] = {
    np.dtype(np.float16): 0,
    np.dtype(np.float32): 1,
    np.dtype(np.float64): 2,
    np.dtype(np.int32): 3,
    np.dtype(np.int64): 4,
    BFLOAT16: 5,
    np.dtype(np.int8): 6,
    np.dtype(np.uint8): 7,
}
#: op name -> C op code
OPS: dict[str, int] = {"sum": 0, "prod": 1, "max": 2, "min": 3}
#: sources one call takes: the backends' one constant, which the library is checked
#: against when it is loaded
MAX_SOURCES = MAX_FUSED

# status codes (csrc/nccltree.h) and the exception each one means
OK = 0
ERR_DTYPE = 1
ERR_OP = 2
ERR_NSOURCES = 3
ERR_SIZE = 4
ERR_NULL = 5
ERR_THREADS = 6
ERR_UNSUPPORTED = 7
ERR_OVERLAP = 8
ERR_INTERNAL = 9
TIMEOUT = 10  # nt_counter_wait: not reached in time (no error)
ERR_PLATFORM = 11
ERR_ALIGN = 12
ERR_CPU = 13
_STATUS_EXC: dict[int, type[Exception]] = {
    ERR_DTYPE: TypeError,
    ERR_UNSUPPORTED: TypeError,
    ERR_OP: ValueError,
    ERR_NSOURCES: ValueError,
    ERR_SIZE: ValueError,
    ERR_NULL: ValueError,
    ERR_THREADS: ValueError,
    ERR_OVERLAP: ValueError,
    ERR_ALIGN: ValueError,
    ERR_CPU: ValueError,
    ERR_PLATFORM: NotImplementedError,
}

_LIB_NAMES = {
    "win32": ("nccltree_host.dll", "libnccltree_host.dll"),
    "darwin": ("libnccltree_host.dylib", "libnccltree_host.so"),
}.get(sys.platform, ("libnccltree_host.so",))

_BUILD_HINT = (
    "build it with `pip install --no-build-isolation -e .` (or `pip install .`) from the "
    "nccltree source tree; it needs CMake >= 3.18 and a C11 compiler"
)

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None


def _package_dirs() -> list[Path]:
    # An editable install splits the package over the source tree and site-packages (where
    # the build puts _lib), so every directory of the package path is searched; __file__
    # would only name the source half.
    import nccltree

    return [Path(p) for p in getattr(nccltree, "__path__", [])]


def _find_library(dirs: Iterable[Path]) -> Path | None:
    for d in dirs:
        for name in _LIB_NAMES:
            candidate = Path(d) / "_lib" / name
            if candidate.is_file():
                return candidate
    return None


def library_path() -> Path:
    """Path of the host kernel library; ``BackendUnavailable`` if it is not built."""
    path = _find_library(_package_dirs())
    if path is None:
        raise BackendUnavailable(f"the nccltree host kernel library was not found; {_BUILD_HINT}")
    return path


def _declare(lib: ctypes.CDLL) -> None:
    i32, i64, f64, vp = ctypes.c_int, ctypes.c_int64, ctypes.c_double, ctypes.c_void_p
    vpp = ctypes.POINTER(ctypes.c_void_p)
    sigs = {
        "nt_sum_into": [i32, vp, vp, i64, i32],
        "nt_reduce_n": [i32, i32, vp, vpp, i32, i64, i32],
        "nt_reduce_n_scaled": [i32, i32, vp, vpp, i32, i64, f64, i32],
        "nt_reduce_many": [i32, i32, vpp, i32, vpp, i32, i64, f64, i32],
        "nt_sum_n": [i32, vp, vpp, i32, i64, i32],
        "nt_scale": [i32, vp, f64, i64, i32],
        "nt_sgd_update": [i32, vp, vp, vp, f64, f64, f64, i64, i32],
        "nt_copy": [vp, vp, i64, i32],
        "nt_gather": [vp, vp, vp, i32, i32],
        "nt_use_f16c": [i32],
        "nt_use_avx2": [i32],
        "nt_max_sources": [],
        "nt_counter_wait": [vp, ctypes.c_uint32, i64, i64, i32],
        "nt_counter_add_wake": [vp, ctypes.c_uint32, i32, vp],
        "nt_run_steps": [i32, vp, i32, vp, vp, vp],
    }
    for name, argtypes in sigs.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = i32
    for name, argtypes in {
        "nt_futex_pingpong": [i64, i64, i32, i32],
        "nt_spin_default_ns": [],
    }.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = i64
    lib.nt_strerror.argtypes = [i32]
    lib.nt_strerror.restype = ctypes.c_char_p


def library() -> ctypes.CDLL:
    """The loaded host library (loaded and declared once, thread-safe)."""
    global _lib
    if _lib is None:
        with _lock:
            if _lib is None:
                path = library_path()
                try:
                    lib = ctypes.CDLL(os.fspath(path))
                    _declare(lib)
                except (OSError, AttributeError) as exc:
                    raise BackendUnavailable(
                        f"cannot load the nccltree host kernel library {path}: {exc}; "
                        f"rebuild it: {_BUILD_HINT}"
                    ) from exc
                _check_max_sources(int(lib.nt_max_sources()), path)
                _lib = lib
    return _lib


def _check_max_sources(n: int, path: Path) -> None:
    # the fold schedule above the kernels assumes MAX_FUSED sources per call
    if n != MAX_FUSED:
        raise BackendUnavailable(
            f"the host kernel library {path} takes {n} sources per reduce but this nccltree "
            f"expects {MAX_FUSED} (backends.base.MAX_FUSED); rebuild it: {_BUILD_HINT}"
        )


def use_f16c(enable: bool | None = None) -> bool:
    """Whether the float16 kernels convert with F16C instructions (x86-64 CPUs that have
    them; the default there) rather than with the portable code: both give the same
    results, F16C several times faster. ``enable=False`` switches to the portable code,
    ``True`` back to F16C where the CPU has it; ``None`` only asks."""
    flag = -1 if enable is None else int(bool(enable))
    return bool(library().nt_use_f16c(flag))


def use_avx2(enable: bool | None = None) -> bool:
    """Whether the bfloat16 kernels run their AVX2 build (x86-64 CPUs that have AVX2; the
    default there) rather than the baseline one: both give the same results. ``False``
    switches to the baseline build, ``True`` back; ``None`` only asks."""
    flag = -1 if enable is None else int(bool(enable))
    return bool(library().nt_use_avx2(flag))


def strerror(status: int) -> str:
    """The library's name for a status code."""
    return library().nt_strerror(int(status)).decode()


def check(status: int, what: str = "native kernel") -> None:
    """Turn a status returned by the library into an exception (0 returns quietly).

    Bad-argument statuses become ``TypeError`` (dtype) or ``ValueError`` (the rest);
    anything else is a ``NativeError``.
    """
    if status == OK:
        return
    exc = _STATUS_EXC.get(status, NativeError)
    raise exc(f"{what}: {strerror(status)} (status {status})")


# ---- argument checks ----


def check_host_array(x: object, name: str, *, writable: bool = False) -> np.ndarray:
    """``x`` if it is a C-contiguous numpy array (``writable``: and writeable), else
    TypeError/ValueError naming ``name``: the check of every kernel operand in host
    memory (the host backend's and the CUDA backend's copies to and from the host)."""
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{name} must be a numpy.ndarray, got {type(x).__name__}")
    if not x.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous")
    if writable and not x.flags.writeable:
        raise ValueError(f"{name} must be writeable")
    return x


def _dtype_code(x: np.ndarray, name: str, accepted: Sequence[np.dtype[Any]]) -> int:
    check_dtype(x, name, accepted)
    return DTYPES[x.dtype]


def _threads(nthreads: object) -> int:
    return check_int(nthreads, "nthreads", min=1)


def _addr(x: np.ndarray) -> int:
    return int(x.__array_interface__["data"][0])


def _overlap(a: np.ndarray, b: np.ndarray) -> bool:
    return ranges_overlap(_addr(a), a.nbytes, _addr(b), b.nbytes)


def ranges_overlap(pa: int, na: int, pb: int, nb: int) -> bool:
    """Whether the byte ranges ``[pa, pa + na)`` and ``[pb, pb + nb)`` share a byte: for
    contiguous arrays (host or, through unified addressing, CUDA) it decides overlap
    exactly and cheaply."""
    return na > 0 and nb > 0 and pa < pb + nb and pb < pa + na


# ---- wrappers ----


def reduce_n(
    dst: np.ndarray,
    srcs: Sequence[np.ndarray],
    op: str = "sum",
    nthreads: int = 1,
    alpha: float = 1.0,
) -> np.ndarray:
    """``dst = op(srcs[0], ..., srcs[k-1])`` in one pass, 1 <= k <= 8; returns ``dst``.

    Sources are combined left to right (float16 and bfloat16 in float32, rounded once;
    int8/uint8 sums and products wrap around).  ``dst`` may be one of the
    sources (the same array memory), but must not partially overlap any of them.

    ``alpha != 1.0`` writes ``alpha * sum(srcs)`` in the same pass (a mean needs no second
    pass over ``dst``): only for ``op="sum"`` and floating dtypes, with alpha rounded to
    the compute type as :func:`scale` rounds it, so float32/float64 results are bitwise
    those of the sum followed by :func:`scale`.  float16 and bfloat16 are scaled in float32
    and rounded once, so they are slightly more accurate than the two-pass form.
    """
    code = OPS.get(op) if isinstance(op, str) else None
    if code is None:
        raise ValueError(f"op must be one of {', '.join(OPS)}; got {op!r}")
    dst = check_host_array(dst, "dst", writable=True)
    alpha = check_real(alpha, "alpha")
    scaled = alpha != 1.0
    if scaled and op != "sum":
        raise ValueError(f"alpha != 1.0 needs op='sum'; got op={op!r}")
    dtype = _dtype_code(dst, "dst", FLOAT_DTYPES if scaled else tuple(DTYPES))
    if isinstance(srcs, np.ndarray) or not isinstance(srcs, Sequence):
        raise TypeError("srcs must be a list or tuple of numpy arrays")
    k = len(srcs)
    if not 1 <= k <= MAX_SOURCES:
        raise ValueError(f"reduce_n takes 1 to {MAX_SOURCES} sources, got {k}")
    ptrs = (ctypes.c_void_p * k)()
    dst_addr = _addr(dst)
    nbytes = dst.nbytes
    for j, s in enumerate(srcs):
        s = check_host_array(s, f"srcs[{j}]")
        check_same(s, dst, f"srcs[{j}]", "dst")
        addr = ptrs[j] = _addr(s)
        if addr != dst_addr and ranges_overlap(addr, nbytes, dst_addr, nbytes):
            raise ValueError(f"srcs[{j}] partially overlaps dst (only the same memory is allowed)")
    nthreads = _threads(nthreads)
    lib = library()
    if scaled:
        status = lib.nt_reduce_n_scaled(code, dtype, dst_addr, ptrs, k, dst.size, alpha, nthreads)
    else:
        status = lib.nt_reduce_n(code, dtype, dst_addr, ptrs, k, dst.size, nthreads)
    check(status, "reduce_n")
    return dst


def reduce_many(
    dsts: Sequence[np.ndarray],
    srcs: Sequence[np.ndarray],
    op: str = "sum",
    nthreads: int = 1,
    alpha: float = 1.0,
) -> None:
    """``dsts[0] = op(srcs...)`` (as :func:`reduce_n`) and every other destination a copy
    of it, in one pass: block by block, each source read once and each destination
    written once. A destination may be a source (the same memory) but must not overlap a
    source or another destination otherwise. Bitwise :func:`reduce_n` followed by copies."""
    code = OPS.get(op) if isinstance(op, str) else None
    if code is None:
        raise ValueError(f"op must be one of {', '.join(OPS)}; got {op!r}")
    if not 1 <= len(dsts) <= MAX_SOURCES or not 1 <= len(srcs) <= MAX_SOURCES:
        raise ValueError(f"reduce_many takes 1 to {MAX_SOURCES} destinations and sources")
    alpha = check_real(alpha, "alpha")
    first = check_host_array(dsts[0], "dsts[0]", writable=True)
    scaled = alpha != 1.0
    if scaled and op != "sum":
        raise ValueError(f"alpha != 1.0 needs op='sum'; got op={op!r}")
    dtype = _dtype_code(first, "dsts[0]", FLOAT_DTYPES if scaled else tuple(DTYPES))
    dp = (ctypes.c_void_p * len(dsts))()
    sp = (ctypes.c_void_p * len(srcs))()
    for j, d in enumerate(dsts):
        d = check_host_array(d, f"dsts[{j}]", writable=True)
        check_same(d, first, f"dsts[{j}]", "dsts[0]")
        dp[j] = _addr(d)
    for j, x in enumerate(srcs):
        x = check_host_array(x, f"srcs[{j}]")
        check_same(x, first, f"srcs[{j}]", "dsts[0]")
        sp[j] = _addr(x)
    status = library().nt_reduce_many(
        code, dtype, dp, len(dsts), sp, len(srcs), first.size, alpha, _threads(nthreads)
    )
    check(status, "reduce_many")


def sum_n(dst: np.ndarray, srcs: Sequence[np.ndarray], nthreads: int = 1) -> np.ndarray:
    """``dst = srcs[0] + ... + srcs[k-1]``; see :func:`reduce_n`."""
    return reduce_n(dst, srcs, "sum", nthreads)


def sum_into(dst: np.ndarray, src: np.ndarray, nthreads: int = 1) -> np.ndarray:
    """``dst += src``; returns ``dst``."""
    return reduce_n(dst, (dst, src), "sum", nthreads)


def scale(x: np.ndarray, alpha: float, nthreads: int = 1) -> np.ndarray:
    """``x *= alpha`` for floating arrays (alpha rounded to x's compute type); returns x."""
    x = check_host_array(x, "x", writable=True)
    dtype = _dtype_code(x, "x", FLOAT_DTYPES)
    alpha = check_real(alpha, "alpha")
    nthreads = _threads(nthreads)
    check(library().nt_scale(dtype, _addr(x), alpha, x.size, nthreads), "scale")
    return x


def sgd_update(
    w: np.ndarray,
    g: np.ndarray,
    v: np.ndarray,
    lr: float,
    momentum: float,
    weight_decay: float,
    nthreads: int = 1,
) -> np.ndarray:
    """Caffe's SGD step in one pass: ``g += wd*w; v = momentum*v + lr*g; w -= v``.

    Updates ``w``, ``g`` and ``v`` in place (floating dtypes; float16 and bfloat16 computed
    in float32)
    and returns ``w``.  The three arrays must not overlap.
    """
    w = check_host_array(w, "w", writable=True)
    g = check_host_array(g, "g", writable=True)
    v = check_host_array(v, "v", writable=True)
    dtype = _dtype_code(w, "w", FLOAT_DTYPES)
    check_same(g, w, "g", "w")
    check_same(v, w, "v", "w")
    if _overlap(w, g) or _overlap(w, v) or _overlap(g, v):
        raise ValueError("w, g and v must be distinct, non-overlapping arrays")
    lr = check_real(lr, "lr")
    momentum = check_real(momentum, "momentum")
    weight_decay = check_real(weight_decay, "weight_decay")
    nthreads = _threads(nthreads)
    status = library().nt_sgd_update(
        dtype, _addr(w), _addr(g), _addr(v), lr, momentum, weight_decay, w.size, nthreads
    )
    check(status, "sgd_update")
    return w


def copy(dst: np.ndarray, src: np.ndarray, nthreads: int = 1) -> np.ndarray:
    """``dst[...] = src`` (same dtype and size, any dtype); returns ``dst``."""
    dst = check_host_array(dst, "dst", writable=True)
    src = check_host_array(src, "src")
    check_same(src, dst, "src", "dst")
    pd, ps, nbytes = _addr(dst), _addr(src), dst.nbytes
    if ps != pd and ranges_overlap(ps, nbytes, pd, nbytes):
        raise ValueError("src partially overlaps dst")
    nthreads = _threads(nthreads)
    check(library().nt_copy(pd, ps, nbytes, nthreads), "copy")
    return dst


# ---- for callers that checked their arguments already ----
#
# The host backend's stream operations reach the kernels with arguments the ``Stream``
# methods checked once (numpy arrays, C-contiguous, one dtype, equal sizes, no partial
# overlap; the C library checks sizes and overlap again). These skip the Python checks,
# which cost more than the kernel itself below about 64 KiB.

_from_buffer = ctypes.c_char.from_buffer
_addressof = ctypes.addressof


def _fast_addr(x: np.ndarray) -> int:
    """The address of a contiguous array's first byte: through the buffer protocol for a
    writeable array (a fraction of ``__array_interface__``'s cost), else numpy's."""
    try:
        return _addressof(_from_buffer(x.data))
    except (TypeError, ValueError):  # read-only, or empty
        return int(x.ctypes.data)


def reduce_n_checked(
    dst: np.ndarray, srcs: Sequence[np.ndarray], op: str, nthreads: int, alpha: float = 1.0
) -> None:
    """:func:`reduce_n` for arguments already checked (see above)."""
    k = len(srcs)
    ptrs = (ctypes.c_void_p * k)(*[_fast_addr(s) for s in srcs])
    lib, code, dtype = library(), OPS[op], DTYPES[dst.dtype]
    if alpha != 1.0:
        status = lib.nt_reduce_n_scaled(
            code, dtype, _fast_addr(dst), ptrs, k, dst.size, alpha, nthreads
        )
    else:
        status = lib.nt_reduce_n(code, dtype, _fast_addr(dst), ptrs, k, dst.size, nthreads)
    if status:
        check(status, "reduce_n")


def copy_checked(dst: np.ndarray, src: np.ndarray, nthreads: int) -> None:
    """:func:`copy` for arguments already checked (see above)."""
    status = library().nt_copy(_fast_addr(dst), _fast_addr(src), dst.nbytes, nthreads)
    if status:
        check(status, "copy")


class Step(ctypes.Structure):
    """One step of a plan performed by :func:`run_steps` (``nt_step`` in csrc/nccltree.h):
    buffers are slots whose addresses each call passes, offsets count elements."""

    _fields_ = [
        ("kind", ctypes.c_int32),
        ("op", ctypes.c_int32),
        ("k", ctypes.c_int32),
        ("rank", ctypes.c_int32),
        ("count", ctypes.c_int64),
        ("alpha", ctypes.c_double),
        ("dst", ctypes.c_int32),
        ("src", ctypes.c_int32 * MAX_SOURCES),
        ("dst_off", ctypes.c_int64),
        ("src_off", ctypes.c_int64 * MAX_SOURCES),
        ("m", ctypes.c_int32),
        ("mdst", ctypes.c_int32 * (MAX_SOURCES - 1)),
        ("mdst_off", ctypes.c_int64 * (MAX_SOURCES - 1)),
    ]


STEP_COPY, STEP_REDUCE, STEP_SCALE, STEP_REDUCE_MANY = 0, 1, 2, 3


def run_steps(
    dtype: int,
    steps: ctypes.Array[Step],
    bases: ctypes.Array[ctypes.c_void_p],
    threads: ctypes.Array[ctypes.c_int],
    failed: ctypes.c_int,
) -> None:
    """Perform ``steps`` in order in one native call: a plan run inline (the engine checked
    every range against its buffer once, and the arguments of the call; the library checks
    each kernel's overlap rules again). ``dtype`` is the C dtype code (:data:`DTYPES`),
    ``bases[slot]`` each buffer's address, ``threads[rank]`` each rank's kernel threads;
    the arrays are the caller's, reused from call to call, and ``failed`` receives the
    index of a step that fails (named in the exception)."""
    status = library().nt_run_steps(dtype, steps, len(steps), bases, threads, ctypes.byref(failed))
    if status:
        check(status, f"step {failed.value} of the plan")


class _PyBuffer(ctypes.Structure):
    """CPython's ``Py_buffer`` (part of the stable ABI since 3.11)."""

    _fields_ = [
        ("buf", ctypes.c_void_p),
        ("obj", ctypes.c_void_p),
        ("len", ctypes.c_ssize_t),
        ("itemsize", ctypes.c_ssize_t),
        ("readonly", ctypes.c_int),
        ("ndim", ctypes.c_int),
        ("format", ctypes.c_char_p),
        ("shape", ctypes.c_void_p),
        ("strides", ctypes.c_void_p),
        ("suboffsets", ctypes.c_void_p),
        ("internal", ctypes.c_void_p),
    ]


def _buffer_api() -> tuple[Callable[[object, int, int], int], Callable[[int], None]]:
    # The buffer protocol straight from the interpreter: the address of a read-only buffer
    # (an LMDB value) costs about 0.7 us this way against about 1.5 us through a numpy view,
    # and ctypes' own from_buffer refuses read-only memory.
    api = ctypes.pythonapi
    get, rel = api.PyObject_GetBuffer, api.PyBuffer_Release
    get.argtypes = [ctypes.py_object, ctypes.c_void_p, ctypes.c_int]
    get.restype = ctypes.c_int
    rel.argtypes = [ctypes.c_void_p]
    rel.restype = None
    return get, rel


_get_buffer, _release_buffer = _buffer_api()
_BUF_LEN = _PyBuffer.len.offset


def gather(dst: np.ndarray, views: Sequence[object], nthreads: int = 1) -> np.ndarray:
    """Copy the bytes of ``views`` back to back into ``dst``; returns ``dst``.

    ``views`` is a list or tuple of C-contiguous buffer objects (memoryviews, bytes, numpy
    arrays; read-only is fine) whose sizes add up to ``dst.nbytes``; none may overlap
    ``dst``.  The copy is split over ``nthreads`` threads, and large totals are written
    with streaming stores.
    """
    dst = check_host_array(dst, "dst", writable=True)
    if not isinstance(views, (list, tuple)):
        raise TypeError(
            f"views must be a list or tuple of buffer objects, got {type(views).__name__}"
        )
    nthreads = _threads(nthreads)
    k = len(views)
    bufs = (_PyBuffer * k)()
    base = ctypes.addressof(bufs)
    step = ctypes.sizeof(_PyBuffer)
    held = 0
    try:
        for j, v in enumerate(views):
            at = base + j * step
            try:
                _get_buffer(v, at, 0)  # flags 0: a simple, C-contiguous buffer
            except (TypeError, BufferError, ValueError) as exc:
                raise TypeError(
                    f"views[{j}] must be a C-contiguous buffer object (bytes, memoryview, "
                    f"numpy array); got {type(v).__name__}: {exc}"
                ) from None
            held += 1
        # every address and size in two vectorised reads instead of 2k ctypes look-ups
        fields = np.frombuffer(memoryview(bufs).cast("B"), np.uint8).reshape(k, step)
        ptrs = np.ascontiguousarray(fields[:, :8]).view(np.uint64).reshape(k)
        sizes = np.ascontiguousarray(fields[:, _BUF_LEN : _BUF_LEN + 8]).view(np.int64).reshape(k)
        total = int(sizes.sum())
        if total != dst.nbytes:
            raise ValueError(f"views hold {total} bytes but dst has {dst.nbytes}; they must match")
        status = library().nt_gather(_addr(dst), _addr(ptrs), _addr(sizes), k, nthreads)
        check(status, "gather")
    finally:
        for j in range(held):
            _release_buffer(base + j * step)
    return dst


# ---- the wait primitive ----

_COUNTER_SHARED = 1  # NT_COUNTER_SHARED
_COUNTER_MASK = 0xFFFFFFFF
_MAX_WAIT_S = 1e9  # about 31 years: longer timeouts (inf) are clamped to it
_gil_add: Callable[..., int] | None = None


def _gil_holding_add() -> Callable[..., int]:
    """``nt_counter_add_wake`` called *without* releasing the GIL (through ``PyDLL``): it
    never blocks (one atomic add, a futex wake only when someone sleeps), and releasing
    the GIL there would hand it to a woken thread in the middle of the caller's work."""
    global _gil_add
    if _gil_add is None:
        with _lock:
            if _gil_add is None:
                library()  # loads and checks it first
                fn = ctypes.PyDLL(os.fspath(library_path())).nt_counter_add_wake
                fn.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_void_p]
                fn.restype = ctypes.c_int
                _gil_add = fn
    return _gil_add


class Counter:
    """A 32-bit sequence counter that threads, or processes sharing memory, wait on.

    Two adjacent ``uint32`` words (8-byte aligned): the value, which wraps at 2**32, and
    the number of threads sleeping on it. ``Counter()`` allocates them; ``Counter(buf,
    offset, shared=True)`` uses 8 zeroed bytes of a writable buffer, e.g. an ``mmap``
    shared with another process (every process must pass the same ``shared``).

    :meth:`wait` blocks until the value reaches a target (wrap-safe: "reached" means at
    most 2**31 - 1 ahead), spinning briefly when a core looks free, then sleeping on a
    futex with the GIL released; it always returns within its timeout. :meth:`add` adds
    and wakes every sleeper (no system call when none sleeps). Linux uses futex; other
    POSIX systems a process-wide condition variable (``shared=True`` is refused there).
    """

    __slots__ = ("_buf", "_wait", "_add", "addr", "flags", "_words")

    def __init__(
        self, buffer: WriteableBuffer | None = None, offset: int = 0, *, shared: bool = False
    ) -> None:
        offset = check_int(offset, "offset", min=0)
        if buffer is None:
            words = np.zeros(2, np.uint32)  # numpy data is at least 16-byte aligned
            self._buf: object = words
            self.addr = _addr(words)
        else:
            try:
                raw = (ctypes.c_char * 8).from_buffer(buffer, offset)
            except (TypeError, ValueError) as exc:
                raise ValueError(
                    f"a Counter needs 8 writable bytes at offset {offset} of the buffer: {exc}"
                ) from None
            self._buf = raw
            self.addr = ctypes.addressof(raw)
        if self.addr % 8:
            raise ValueError(f"a Counter must be 8-byte aligned; address {self.addr:#x} is not")
        self._words = (ctypes.c_uint32 * 2).from_address(self.addr)
        self.flags = _COUNTER_SHARED if shared else 0
        lib = library()
        self._wait = lib.nt_counter_wait
        self._add = _gil_holding_add()

    @property
    def value(self) -> int:
        """The value now (0 .. 2**32 - 1)."""
        return int(self._words[0])

    @property
    def sleepers(self) -> int:
        """Threads sleeping on the counter now."""
        return int(self._words[1])

    def wait(self, target: int, timeout: float, spin: float | None = None) -> bool:
        """Block until the value reaches ``target`` (mod 2**32): True, or False once
        ``timeout`` seconds passed. ``spin``: seconds to spin before sleeping (0: sleep at
        once; None: the adaptive default, a short spin only while a core looks free)."""
        if not timeout >= 0:  # also NaN
            raise ValueError(f"timeout must be >= 0 seconds, got {timeout!r}")
        spin_ns = -1 if spin is None else max(0, int(min(spin, _MAX_WAIT_S) * 1e9))
        timeout_ns = int(min(timeout, _MAX_WAIT_S) * 1e9)  # inf: a wait of years
        status = self._wait(self.addr, target & _COUNTER_MASK, timeout_ns, spin_ns, self.flags)
        if status == TIMEOUT:
            return False
        check(status, "Counter.wait")
        return True

    def add(self, delta: int = 1) -> None:
        """Add ``delta`` (mod 2**32) and wake every thread sleeping on the counter."""
        status = self._add(self.addr, delta & _COUNTER_MASK, self.flags, None)
        if status:
            check(status, "Counter.add")

    def add_fetch(self, delta: int = 1) -> int:
        """:meth:`add`, returning the value it made (one atomic add: of threads or
        processes adding at once, each gets a value of its own)."""
        made = ctypes.c_uint32()
        status = self._add(self.addr, delta & _COUNTER_MASK, self.flags, ctypes.byref(made))
        if status:
            check(status, "Counter.add_fetch")
        return int(made.value)


def futex_pingpong(
    rounds: int = 10000, spin: float | None = 0.0, cpus: tuple[int, int] | None = None
) -> float:
    """Two new C threads pass a :class:`Counter` back and forth ``rounds`` times: seconds
    per round trip. ``spin``: as in :meth:`Counter.wait` (None: adaptive); with 0 it is
    the floor of any hand-off between two sleeping threads. ``cpus=(a, b)`` pins the two
    threads (Linux): the same CPU twice gives the cost of a switch on one CPU, two CPUs
    the cost of waking a thread on another one; None lets the scheduler place them."""
    rounds = check_int(rounds, "rounds", min=1)
    spin_ns = -1 if spin is None else max(0, int(spin * 1e9))
    if cpus is None:
        cpu_a = cpu_b = -1
    else:
        cpu_a, cpu_b = (check_int(c, "cpus[i]", min=0) for c in cpus)
    ns = int(library().nt_futex_pingpong(rounds, spin_ns, cpu_a, cpu_b))
    if ns < 0:
        check(-ns, "futex_pingpong")
    return ns * 1e-9


def spin_default() -> float:
    """Seconds :meth:`Counter.wait` spins by default when a core looks free."""
    return int(library().nt_spin_default_ns()) * 1e-9


class CounterLike(Protocol):
    """What :func:`new_counter` returns: :class:`Counter` or its portable stand-in."""

    @property
    def value(self) -> int: ...

    def wait(self, target: int, timeout: float, spin: float | None = None) -> bool: ...

    def add(self, delta: int = 1) -> None: ...


class _ConditionCounter:
    """:class:`Counter`'s behaviour for threads of one process, on a condition variable:
    the stand-in where the native wait primitive is missing (no library, or a platform
    without futex or POSIX threads)."""

    __slots__ = ("_value", "_cond")

    def __init__(self) -> None:
        self._value = 0
        self._cond = threading.Condition(threading.Lock())

    @property
    def value(self) -> int:
        return self._value

    def wait(self, target: int, timeout: float, spin: float | None = None) -> bool:
        if not timeout >= 0:  # also NaN
            raise ValueError(f"timeout must be >= 0 seconds, got {timeout!r}")
        target &= _COUNTER_MASK
        timeout = min(timeout, _MAX_WAIT_S)

        def reached() -> bool:
            return ((self._value - target) & _COUNTER_MASK) < (1 << 31)

        with self._cond:
            return self._cond.wait_for(reached, timeout)

    def add(self, delta: int = 1) -> None:
        with self._cond:
            self._value = (self._value + delta) & _COUNTER_MASK
            self._cond.notify_all()


_native_wait: bool | None = None


def new_counter() -> CounterLike:
    """A process-private :class:`Counter`, or where the native wait primitive is not
    available, a condition-variable stand-in with the same methods."""
    global _native_wait
    if _native_wait is None:
        try:
            probe = Counter()
            status = probe._wait(probe.addr, 1, 0, 0, 0)
            _native_wait = status == TIMEOUT
        except BackendUnavailable:
            _native_wait = False
    return Counter() if _native_wait else _ConditionCounter()
