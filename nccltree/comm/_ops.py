"""Reduction ops and dtypes, looked up in one table; the numpy reference of the ops."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np

from .._validate import check_choice
from ..backends import base

# name -> the elementwise op the kernels apply between contributions; "mean" is a sum
# followed by a scale of 1/size on the rank that holds the final value.
OPS = {"sum": "sum", "mean": "sum", "max": "max", "min": "min", "prod": "prod"}

# the kernels' dtypes: the backends' one list
DTYPES = base.DTYPES


def check_op(op: str, dtype: np.dtype) -> str:
    """The kernel op for ``op`` on ``dtype``; ValueError/TypeError for bad combinations."""
    check_choice(op, "reduction op", OPS)
    if op == "mean" and dtype not in base.FLOAT_DTYPES:
        raise TypeError(f"op 'mean' needs a floating-point dtype, got {dtype}")
    return OPS[op]


def check_dtype(dtype: np.dtype) -> np.dtype:
    dtype = np.dtype(dtype)
    if dtype not in DTYPES:
        raise TypeError(f"unsupported dtype {dtype}; accepted: {', '.join(str(d) for d in DTYPES)}")
    return dtype


# the numpy ufunc of each op, for the reference
_NP_OPS = {"sum": np.add, "mean": np.add, "prod": np.multiply, "max": np.maximum, "min": np.minimum}


def widen(a: np.ndarray) -> np.ndarray:
    """``a`` in float64 (int64 for integers): what a reference compares in."""
    return a.astype(np.float64 if a.dtype in base.FLOAT_DTYPES else np.int64)


def reference(
    op: str,
    arrays: Sequence[np.ndarray],
    *,
    rounding: Literal["wide", "kernel"] = "wide",
    alpha: float = 1.0,
) -> np.ndarray:
    """``op`` over ``arrays``, left to right, one array at a time (so that 64 MiB per rank
    needs no N-high stack in memory), then times ``alpha``; the one numpy reference of the
    reduction ops.

    ``rounding="wide"``: in float64 (int64 for integers) and returned so, ``mean`` divided
    by the number of arrays: the value a collective's result is compared with, within a
    tolerance (the benchmark's ``#wrong``, the collective tests).

    ``rounding="kernel"``: as one fused kernel pass computes it, to compare bitwise: in the
    arrays' dtype (integers wrap), float16 and bfloat16 accumulated in float32; ``mean`` is the sum
    times ``1/len(arrays)``, ``alpha`` is rounded to that compute type and multiplies the
    finished sum; the result is rounded to the arrays' dtype once, at the end.
    """
    check_choice(op, "reduction op", OPS)
    ufunc = _NP_OPS[op]
    dtype = arrays[0].dtype
    if rounding == "wide":
        acc = widen(arrays[0])
        for a in arrays[1:]:
            ufunc(acc, a, out=acc, casting="unsafe")
        if op == "mean":
            acc = acc / len(arrays)
        return acc if alpha == 1.0 else acc * alpha
    if rounding != "kernel":
        raise ValueError(f"unknown rounding {rounding!r}; accepted: wide, kernel")
    wide = np.dtype(np.float32) if dtype in base.HALF_DTYPES else dtype
    if op == "mean":
        alpha = alpha / len(arrays)
    with np.errstate(over="ignore", invalid="ignore"):
        acc = arrays[0].astype(wide)
        for a in arrays[1:]:
            acc = ufunc(acc, a.astype(wide))
        if alpha != 1.0:
            acc = acc * wide.type(alpha)
        return acc.astype(dtype)
