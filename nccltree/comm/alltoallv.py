"""all_to_all_v on a World: the counts checked, the buffers checked, its own plan.

A World's ``all_to_all_v`` moves uneven blocks (``counts[r][q]`` elements from rank r to
rank q) with one copy per block, by a plan made for the counts (whatever the World's
algorithm); :func:`prepare_all_to_all_v` checks a call and says what the World caches its
program under and how to build it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .._native import ranges_overlap
from .._validate import check_int
from ..backends.base import data_ptr
from ._args import Array, Prepared
from .plan import IN, OUT, STAGE, TMP, Plan

if TYPE_CHECKING:
    from ..backends.base import Device


@dataclass(frozen=True)
class AllToAllV:
    """A checked all_to_all_v call: its buffers (``prep``), the key of its program, the
    elements it moves in all, and ``make()``: its plan and the plan's buffer extents."""

    prep: Prepared
    key: tuple[object, ...]
    total: int
    make: Callable[[], tuple[Plan, Mapping[str, Sequence[int]]]]


def prepare_all_to_all_v(
    devices: Sequence[Device],
    xs: Sequence[Array],
    outs: Sequence[Array],
    counts: Sequence[Sequence[int]],
    dtype: object = None,
) -> AllToAllV:
    """The call checked (``ValueError``/``TypeError`` before anything is written)."""
    n = len(devices)
    matrix = _count_matrix(counts, n)
    prep = _prepare_v(devices, xs, outs, matrix, dtype)

    def make() -> tuple[Plan, Mapping[str, Sequence[int]]]:
        extents = {IN: [sum(row) for row in matrix],
                   OUT: [sum(row[q] for row in matrix) for q in range(n)],
                   TMP: [0] * n, STAGE: [0] * n}  # fmt: skip
        return _all_to_all_v_plan(matrix), extents

    key = ("all_to_all_v", matrix, prep.dtype.itemsize)
    return AllToAllV(prep, key, sum(map(sum, matrix)), make)


def _count_matrix(counts: Sequence[Sequence[int]], n: int) -> tuple[tuple[int, ...], ...]:
    """all_to_all_v's counts, checked: n rows of n element counts, none negative."""
    if isinstance(counts, (str, bytes)) or len(counts) != n:
        raise ValueError(f"counts must have a row per rank ({n}), got {len(counts)}")
    rows = []
    for r, row in enumerate(counts):
        if isinstance(row, (str, bytes)) or len(row) != n:
            raise ValueError(f"counts[{r}] must have a count per rank ({n})")
        rows.append(tuple(check_int(c, f"counts[{r}][{q}]", min=0) for q, c in enumerate(row)))
    return tuple(rows)


def _prepare_v(
    devices: Sequence[Device], xs: Sequence[Array], outs: Sequence[Array],
    matrix: tuple[tuple[int, ...], ...], dtype: object = None,
) -> Prepared:  # fmt: skip
    """all_to_all_v's buffers, checked as a collective's are (one dtype, C-contiguous,
    the sizes the counts give, no output overlapping an input, ``dtype=`` as for every
    collective)."""
    from ._args import _as_list, _device_array, check_call_dtype, resolve_dtype

    n = len(devices)
    ins = [_device_array(d, x, f"rank {r}: input")
           for r, (d, x) in enumerate(zip(devices, _as_list(xs, "inputs", n), strict=True))]  # fmt: skip
    res = [_device_array(d, o, f"rank {r}: output")
           for r, (d, o) in enumerate(zip(devices, _as_list(outs, "outputs", n), strict=True))]  # fmt: skip
    stored = ins[0].dtype
    for r in range(n):
        if ins[r].dtype != stored or res[r].dtype != stored:
            raise TypeError(f"rank {r}: dtype differs from rank 0's {stored}")
        want_in, want_out = sum(matrix[r]), sum(row[r] for row in matrix)
        if ins[r].size != want_in:
            raise ValueError(f"rank {r}: the input needs {want_in} elements (its row of "
                             f"counts), got {ins[r].size}")  # fmt: skip
        if res[r].size != want_out:
            raise ValueError(f"rank {r}: the output needs {want_out} elements (its column "
                             f"of counts), got {res[r].size}")  # fmt: skip
    for r in range(n):
        for q in range(n):
            if (
                ins[r].nbytes
                and res[q].nbytes
                and ranges_overlap(data_ptr(ins[r]), ins[r].nbytes, data_ptr(res[q]), res[q].nbytes)
            ):
                raise ValueError(f"all_to_all_v cannot run in place: rank {q}'s output "
                                 f"overlaps rank {r}'s input")  # fmt: skip
    logical = check_call_dtype(dtype)
    ins, viewed, dt, storage = resolve_dtype(ins, list(res), logical, "rank 0: input")
    flat_in = [x.reshape(-1) for x in ins]
    flat_out = [o.reshape(-1) for o in viewed if o is not None]
    return Prepared("all_to_all_v", flat_in, flat_out, list(outs), dt, 0, False, "sum", 0, storage)


def _all_to_all_v_plan(matrix: tuple[tuple[int, ...], ...]) -> Plan:
    """One copy per nonzero block: rank r pushes its block for q into q's output, at the
    place of rank r's block there; ranks start at different destinations."""
    from .plan import Buf, PlanBuilder

    n = len(matrix)
    b = PlanBuilder(n, f"direct all_to_all_v of {sum(map(sum, matrix))} elements")
    for r in range(n):
        src_off = [sum(matrix[r][:q]) for q in range(n)]
        for i in range(n):
            q = (r + i) % n
            c = matrix[r][q]
            if c:
                dst_off = sum(matrix[p][q] for p in range(r))
                b.copy(r, Buf(q, OUT, dst_off, c), Buf(r, IN, src_off[q], c))
    return b.build()
