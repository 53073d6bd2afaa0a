"""Argument checks of a collective, for every rank at once, and the shapes they yield."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import _ops


@dataclass
class Prepared:
    collective: str
    ins: list[Any]  # flat views
    outs: list[Any]  # flat views (== ins where in place)
    results: list[Any]  # what each rank gets back, in the caller's shapes
    dtype: np.dtype
    count: int
    in_place: bool
    op: str
    root: int

    @property
    def nbytes(self) -> int:
        """Bytes of the collective's message per rank (nccl-tests' S for all_reduce)."""
        return self.count * self.dtype.itemsize


@dataclass
class Launched:
    results: list[Any]
    events: list[Any] | None
    caller_streams: list[Any]
    keepalive: Any


def prepare(
    devices: Sequence[Any], collective: str, xs: Any, outs: Any, op: str, root: int
) -> Prepared:
    """Check every rank's arguments together (ValueError/TypeError naming the rank) and
    return flat views and the call's shape; nothing is written."""
    n = len(devices)
    xs = _as_list(xs, "inputs", n)
    outs = [None] * n if outs is None else _as_list(outs, "outputs", n)
    if collective in ("reduce", "broadcast"):
        if isinstance(root, bool) or not isinstance(root, (int, np.integer)) or not (0 <= root < n):
            raise ValueError(f"root must be a rank in [0, {n}), got {root!r}")
    root = int(root)
    ins, outs_arr = [], []
    for r in range(n):
        dev = devices[r]
        ins.append(_device_array(dev, xs[r], f"rank {r}: input"))
        outs_arr.append(
            None if outs[r] is None else _device_array(dev, outs[r], f"rank {r}: output")
        )
    dtype = ins[0].dtype
    for r, x in enumerate(ins):
        if x.dtype != dtype:
            raise TypeError(f"dtype mismatch: rank 0 has {dtype}, rank {r} has {x.dtype}")
        o = outs_arr[r]
        if o is not None and o.dtype != dtype:
            raise TypeError(f"rank {r}: output dtype {o.dtype} differs from input {dtype}")
    dtype = _ops.check_dtype(dtype)
    if collective in ("all_reduce", "reduce", "reduce_scatter"):
        _ops.check_op(op, dtype)
    count = ins[0].size
    for r, x in enumerate(ins):
        if x.size != count:
            raise ValueError(
                f"size mismatch: rank 0 passes {count} elements, rank {r} passes {x.size}"
            )
    if collective == "all_gather" and any(o is None for o in outs_arr):
        raise ValueError("all_gather needs an output array on every rank")
    if collective == "reduce_scatter":
        if any(o is None for o in outs_arr):
            raise ValueError("reduce_scatter needs an output array on every rank")
        if count % n:
            raise ValueError(
                f"reduce_scatter input of {count} elements does not split into {n} blocks"
            )
    want = {"all_gather": count * n, "reduce_scatter": count // n}.get(collective, count)
    flat_in, flat_out, results, in_place = [], [], [], []
    for r in range(n):
        x, o = ins[r], outs_arr[r]
        fx = x.reshape(-1)
        if o is None:
            flat_in.append(fx)
            flat_out.append(fx)
            results.append(xs[r])
            in_place.append(True)
            continue
        if o.size != want:
            raise ValueError(f"rank {r}: {collective} output needs {want} elements, got {o.size}")
        fo = o.reshape(-1)
        same = _in_place(collective, fx, fo, r, count, want)
        flat_in.append(fx)
        # one object for one memory, so the executor can tell copies onto themselves
        flat_out.append(fx if same and fo.size == fx.size else fo)
        results.append(outs[r])
        in_place.append(same)
    all_in_place = all(in_place)
    if collective in ("all_gather", "reduce_scatter") and any(in_place) != all_in_place:
        raise ValueError(
            f"{collective}: either every rank or no rank may call in place "
            f"(in place: ranks {[r for r in range(n) if in_place[r]]})"
        )
    if collective == "reduce_scatter":
        count = want
    if collective in ("reduce", "broadcast"):
        # only the root's output matters for reduce; broadcast writes every rank's
        all_in_place = in_place[root] if collective == "reduce" else all_in_place
    return Prepared(collective, flat_in, flat_out, results, dtype, count, all_in_place, op, root)


def _as_list(xs: Any, what: str, n: int) -> list[Any]:
    if not isinstance(xs, (list, tuple)):
        raise TypeError(f"{what} must be a list with one array per rank, got {type(xs).__name__}")
    if len(xs) != n:
        raise ValueError(f"{what}: {len(xs)} arrays for {n} ranks")
    return list(xs)


def _device_array(dev: Any, obj: Any, what: str) -> Any:
    try:
        arr = dev.asarray(obj)
        dev.check_array(arr)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{what}: {exc}") from None
    if not arr.flags.c_contiguous:
        raise ValueError(f"{what}: the array must be C-contiguous")
    return arr


def _ptr(a: Any) -> int:
    iface = getattr(a, "__array_interface__", None)
    return iface["data"][0] if iface is not None else a.data.ptr


def _in_place(collective: str, x: Any, out: Any, rank: int, count: int, want: int) -> bool:
    """Whether ``out`` is the in-place buffer for ``x`` (NCCL's rules); ValueError when
    the two overlap in any other way."""
    px, po = _ptr(x), _ptr(out)
    item = x.dtype.itemsize
    if collective == "all_gather":
        exact = px == po + rank * count * item and x.size == count
    elif collective == "reduce_scatter":
        exact = po == px + rank * want * item
    else:
        exact = px == po
    if exact:
        return True
    if px < po + out.nbytes and po < px + x.nbytes and x.nbytes and out.nbytes:
        raise ValueError(
            f"rank {rank}: input and output overlap but are not the in-place layout of {collective}"
        )
    return False
