"""Reduction ops and dtypes, looked up in one table."""

from __future__ import annotations

import numpy as np

# name -> the elementwise op the kernels apply between contributions; "mean" is a sum
# followed by a scale of 1/size on the rank that holds the final value.
OPS = {"sum": "sum", "mean": "sum", "max": "max", "min": "min", "prod": "prod"}

DTYPES = tuple(np.dtype(t) for t in ("float16", "float32", "float64", "int32", "int64"))

COLLECTIVES = ("all_reduce", "reduce", "broadcast", "all_gather", "reduce_scatter")

# Spellings accepted from users (nccl-tests and MPI write them without underscores).
ALIASES = {
    "allreduce": "all_reduce",
    "all_reduce": "all_reduce",
    "reduce": "reduce",
    "broadcast": "broadcast",
    "bcast": "broadcast",
    "allgather": "all_gather",
    "all_gather": "all_gather",
    "reducescatter": "reduce_scatter",
    "reduce_scatter": "reduce_scatter",
}


def check_op(op: str, dtype: np.dtype) -> str:
    """The kernel op for ``op`` on ``dtype``; ValueError/TypeError for bad combinations."""
    if not isinstance(op, str) or op not in OPS:
        raise ValueError(f"unknown reduction op {op!r}; accepted: {', '.join(OPS)}")
    if op == "mean" and dtype.kind != "f":
        raise TypeError(f"op 'mean' needs a floating-point dtype, got {dtype}")
    return OPS[op]


def check_dtype(dtype: np.dtype) -> np.dtype:
    dtype = np.dtype(dtype)
    if dtype not in DTYPES:
        raise TypeError(f"unsupported dtype {dtype}; accepted: {', '.join(str(d) for d in DTYPES)}")
    return dtype


def collective_name(name: str) -> str:
    key = name.strip().lower().replace("-", "_")
    if key not in ALIASES:
        raise ValueError(
            f"unknown collective {name!r}; accepted: {', '.join(COLLECTIVES)} "
            "(also allreduce, allgather, reducescatter)"
        )
    return ALIASES[key]


def numpy_reduce(op: str, arrays: list[np.ndarray]) -> np.ndarray:
    """Reference result in float64 (or int64), as tests and the benchmark check it."""
    wide = [a.astype(np.float64 if a.dtype.kind == "f" else np.int64) for a in arrays]
    if op in ("sum", "mean"):
        out = np.sum(wide, axis=0)
        return out / len(arrays) if op == "mean" else out
    if op == "prod":
        return np.prod(wide, axis=0)
    if op == "max":
        return np.max(wide, axis=0)
    return np.min(wide, axis=0)
