"""The kernels of ``csrc/nccltree_kernels.cu`` executed with numpy, and fake module images.

Each kernel follows the .cu exactly, element by element: the same argument list (pointers,
the ``nt_srcs`` struct of 8 pointers passed by value, ``int k``, ``long long n``, scalars
of type S), float16 and bfloat16 loaded into float32, combined in source order and
rounded once when stored (bfloat16 through ml_dtypes, whose rounding the .cu's integer
arithmetic reproduces), int8/uint8 computed in int32 and truncated when stored, integer
sum/prod wrapping, NaN-propagating max/min as ``(a > b || a != a) ? a : b``. A bfloat16
pointer is a ``uint16`` array, as CuPy, which has no bfloat16 dtype, passes it.
A module compiled with ``-ftz=true`` flushes float32 subnormal inputs and results to zero,
as the PTX ``.ftz`` instructions do. The vector/scalar split of the .cu never changes an
element's value, so it is not modelled.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from nccltree.backends.base import BFLOAT16, MAX_FUSED

from . import _core

MAGIC = b"\x7fFAKECUDA\n"
NT_MAX_SOURCES = MAX_FUSED  # the one limit; the fake reads the same pointer struct

_TYPES: dict[str, np.dtype[Any]] = {
    "f16": np.dtype(np.float16),
    "f32": np.dtype(np.float32),
    "f64": np.dtype(np.float64),
    "i32": np.dtype(np.int32),
    "i64": np.dtype(np.int64),
    "bf16": BFLOAT16,
    "i8": np.dtype(np.int8),
    "u8": np.dtype(np.uint8),
}
_SCALAR: dict[str, np.dtype[Any]] = {
    "f16": np.dtype(np.float32),
    "f32": np.dtype(np.float32),
    "f64": np.dtype(np.float64),
    "bf16": np.dtype(np.float32),
}
# the compute type of each storage type (nt_io<T>::acc in the .cu)
_ACC: dict[str, np.dtype[Any]] = {
    "f16": np.dtype(np.float32),
    "bf16": np.dtype(np.float32),
    "i8": np.dtype(np.int32),
    "u8": np.dtype(np.int32),
}
# the CuPy array dtype of a kernel's pointers, where it is not the storage type
_POINTER = {"bf16": np.dtype(np.uint16)}
_I32, _I64 = np.dtype(np.int32), np.dtype(np.int64)


@dataclass(frozen=True)
class Param:
    kind: str  # "ptr" (T*), "srcs" (nt_srcs by value) or "scalar"
    dtype: np.dtype[Any] | None


def _signatures() -> dict[str, tuple[Param, ...]]:
    sig: dict[str, tuple[Param, ...]] = {}
    for sfx, t in _TYPES.items():
        ptr = Param("ptr", _POINTER.get(sfx, t))
        for op in ("sum", "prod", "max", "min"):
            sig[f"nt_reduce_n_{op}_{sfx}"] = (
                ptr, Param("srcs", None), Param("scalar", _I32), Param("scalar", _I64)
            )  # fmt: skip
        sig[f"nt_sum_into_{sfx}"] = (ptr, ptr, Param("scalar", _I64))
        if sfx in _SCALAR:
            s = Param("scalar", _SCALAR[sfx])
            sig[f"nt_reduce_n_scaled_sum_{sfx}"] = (
                ptr, Param("srcs", None), Param("scalar", _I32), Param("scalar", _I64), s
            )  # fmt: skip
            sig[f"nt_scale_{sfx}"] = (ptr, s, Param("scalar", _I64))
            sig[f"nt_sgd_update_{sfx}"] = (ptr, ptr, ptr, s, s, s, Param("scalar", _I64))
    return sig


SIGNATURES = _signatures()


def kernel_names(source: str) -> list[str]:
    """The extern "C" kernels a source defines: plain definitions, and the instances of the
    .cu's ``NT_ALL_OPS(NAME, T)`` / ``NT_FLOAT_ONLY(NAME, T, S)`` macros."""
    names = []
    body = "\n".join(line for line in source.splitlines() if not line.lstrip().startswith("#"))
    body = re.sub(r"\\\n", " ", body)
    for m in re.finditer(r'extern\s+"C"\s+__global__\s+void\s+(\w+)\s*\(', body):
        if "##" not in m.group(1):
            names.append(m.group(1))
    for m in re.finditer(r"^\s*NT_ALL_OPS\(\s*(\w+)\s*,", body, re.M):
        n = m.group(1)
        names += [f"nt_reduce_n_{op}_{n}" for op in ("sum", "prod", "max", "min")]
        names.append(f"nt_sum_into_{n}")
    for m in re.finditer(r"^\s*NT_FLOAT_ONLY\(\s*(\w+)\s*,", body, re.M):
        n = m.group(1)
        names += [f"nt_reduce_n_scaled_sum_{n}", f"nt_scale_{n}", f"nt_sgd_update_{n}"]
    return names


def missing_includes(source: str, include_names: Sequence[str]) -> list[str]:
    """``#include`` files neither given to NVRTC as headers nor built in."""
    out = []
    for m in re.finditer(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]', source, re.M):
        if m.group(1) not in include_names:
            out.append(m.group(1))
    return out


# -- images ------------------------------------------------------------------------------


def make_image(kind: str, archs: Iterable[str], kernels: Iterable[str], ftz: bool) -> bytes:
    """A fake cubin/PTX/fatbin: ``archs`` like ``"sm_90"`` (binary for exactly that major
    version, minor >= its minor) or ``"compute_80"`` (PTX the driver compiles for any GPU of
    that capability or newer)."""
    doc = {"kind": kind, "archs": list(archs), "kernels": sorted(set(kernels)), "ftz": ftz}
    return MAGIC + json.dumps(doc).encode()


def parse_image(data: bytes) -> dict[str, Any] | None:
    if not data.startswith(MAGIC):
        return None
    try:
        doc = json.loads(data[len(MAGIC) :])
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None


def image_fits(archs: Iterable[str], capability: str) -> bool:
    cc = int(capability)
    for a in archs:
        kind, _, num = a.partition("_")
        v = int(num)
        if kind == "sm" and v // 10 == cc // 10 and v <= cc:
            return True
        if kind == "compute" and v <= cc:
            return True
    return False


# -- launches ----------------------------------------------------------------------------


def _as_scalar(fake: _core.FakeCuda, name: str, i: int, arg: Any, want: np.dtype[Any]) -> Any:
    if isinstance(arg, np.ndarray) and arg.size == 1 and arg.dtype == want:
        return arg.reshape(()).item() if want.kind != "f" else want.type(arg.reshape(())[()])
    if isinstance(arg, np.generic) and arg.dtype == want:
        return arg
    if type(arg) is int and want == _I64:
        return np.int64(arg)
    if type(arg) is float and want == np.dtype(np.float64):
        return np.float64(arg)
    got = arg.dtype if isinstance(arg, (np.ndarray, np.generic)) else type(arg).__name__
    raise fake.misuse_error(
        f"{name}: argument {i} is a {want} passed by value, got {got} (CUDA would read "
        "the wrong bytes)"
    )


def _as_pointer(fake: _core.FakeCuda, name: str, i: int, arg: Any, want: np.dtype[Any]) -> int:
    from .cupy import ndarray
    from .cupy.cuda import MemoryPointer

    if isinstance(arg, ndarray):
        if arg.dtype != want:
            raise fake.misuse_error(
                f"{name}: argument {i} is a {want} pointer, got a {arg.dtype} array"
            )
        return int(arg.data.ptr)
    if isinstance(arg, MemoryPointer):
        return int(arg.ptr)
    if arg is None:
        return 0
    if type(arg) is int:
        return arg  # CuPy passes an int as a 64-bit value: a raw pointer
    raise fake.misuse_error(f"{name}: argument {i} is a pointer, got {type(arg).__name__}")


def _as_srcs(fake: _core.FakeCuda, name: str, i: int, arg: Any) -> tuple[int, ...]:
    if isinstance(arg, np.ndarray) and arg.size == 1 and arg.dtype.itemsize == 8 * NT_MAX_SOURCES:
        return tuple(int(p) for p in np.frombuffer(arg.tobytes(), "<u8"))
    raise fake.misuse_error(
        f"{name}: argument {i} is the nt_srcs struct (8 device pointers, 64 bytes, by "
        f"value), got {type(arg).__name__}"
    )


def convert_args(fake: _core.FakeCuda, name: str, args: Sequence[Any]) -> tuple[Any, ...]:
    sig = SIGNATURES.get(name)
    if sig is None:
        raise fake.misuse_error(f"the fake has no model of kernel {name!r}")
    if len(args) != len(sig):
        raise fake.misuse_error(f"{name} takes {len(sig)} arguments, got {len(args)}")
    out: list[Any] = []
    for i, (p, a) in enumerate(zip(sig, args, strict=True)):
        if p.kind == "ptr":
            assert p.dtype is not None
            out.append(_as_pointer(fake, name, i, a, p.dtype))
        elif p.kind == "srcs":
            out.append(_as_srcs(fake, name, i, a))
        else:
            assert p.dtype is not None
            out.append(_as_scalar(fake, name, i, a, p.dtype))
    return tuple(out)


def accesses(name: str, args: tuple[Any, ...]) -> list[tuple[int, int]]:
    """(pointer, bytes) of every buffer the kernel touches, as the .cu reads and writes."""
    sfx = name.rsplit("_", 1)[1]
    item = _TYPES[sfx].itemsize
    n = int(args[3]) if name.startswith("nt_reduce_n_") else int(args[-1])
    if n <= 0:
        return []
    nb = n * item
    if name.startswith("nt_reduce_n_"):
        k = int(args[2])
        used = max(1, min(k, NT_MAX_SOURCES))  # srcs.p[0] is read whatever k is
        return [(args[0], nb)] + [(p, nb) for p in args[1][:used]]
    if name.startswith("nt_sum_into_"):
        return [(args[0], nb), (args[1], nb)]
    if name.startswith("nt_scale_"):
        return [(args[0], nb)]
    return [(args[0], nb), (args[1], nb), (args[2], nb)]  # sgd_update


_F32_TINY = np.float32(np.finfo(np.float32).tiny)


def _ftz(x: np.ndarray) -> np.ndarray:
    if x.dtype != np.float32:
        return x
    return np.where(np.abs(x) < _F32_TINY, np.copysign(np.float32(0), x), x).astype(np.float32)


def execute(fake: _core.FakeCuda, name: str, args: tuple[Any, ...], ftz: bool) -> None:
    """Run a (checked) kernel on the fake's memory."""
    sfx = name.rsplit("_", 1)[1]
    t = _TYPES[sfx]
    acc_t = _ACC.get(sfx, t)
    fl = (lambda a: _ftz(a)) if ftz else (lambda a: a)

    def arr(ptr: int, n: int) -> np.ndarray:
        return fake.bytes_at(ptr, n * t.itemsize).view(t)

    def load(ptr: int, n: int) -> np.ndarray:
        return fl(arr(ptr, n).astype(acc_t))

    with np.errstate(all="ignore"):
        if name.startswith("nt_reduce_n_") or name.startswith("nt_sum_into_"):
            if name.startswith("nt_sum_into_"):
                dst, n, k = args[0], int(args[2]), 2
                srcs: tuple[int, ...] = (args[0], args[1])
                op, alpha = "sum", None
            else:
                dst, srcs, k, n = args[0], args[1], int(args[2]), int(args[3])
                op = name[len("nt_reduce_n_") : -len(sfx) - 1]
                alpha = args[4] if op == "scaled_sum" else None
                op = "sum" if op == "scaled_sum" else op
            if n <= 0:
                return
            acc = load(srcs[0], n)
            for j in range(1, NT_MAX_SOURCES):
                if j < k:
                    b = load(srcs[j], n)
                    if op == "sum":
                        acc = acc + b
                    elif op == "prod":
                        acc = acc * b
                    elif op == "max":
                        acc = np.where((acc > b) | (acc != acc), acc, b)
                    else:
                        acc = np.where((acc < b) | (acc != acc), acc, b)
                    acc = fl(acc)
            if alpha is not None:
                acc = fl(acc * acc_t.type(alpha))
            arr(dst, n)[...] = acc.astype(t)
        elif name.startswith("nt_scale_"):
            x, alpha, n = args[0], args[1], int(args[2])
            if n > 0:
                arr(x, n)[...] = fl(load(x, n) * acc_t.type(alpha)).astype(t)
        else:  # nt_sgd_update
            w, g, v = args[0], args[1], args[2]
            lr, mom, wd = (acc_t.type(a) for a in args[3:6])
            n = int(args[6])
            if n <= 0:
                return
            wi, gi, vi = load(w, n), load(g, n), load(v, n)
            gi = fl(gi + fl(wd * wi))
            vi = fl(fl(mom * vi) + fl(lr * gi))
            wi = fl(wi - vi)
            arr(w, n)[...] = wi.astype(t)
            arr(g, n)[...] = gi.astype(t)
            arr(v, n)[...] = vi.astype(t)
