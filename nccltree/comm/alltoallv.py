"""The v-collectives on a World: the counts checked, the buffers checked, their own plans.

A World's ``all_to_all_v`` moves uneven blocks (``counts[r][q]`` elements from rank r to
rank q) with one copy per block, by a plan made for the counts (whatever the World's
algorithm); :func:`prepare_all_to_all_v` checks a call and says what the World caches its
program under and how to build it. ``all_gather_v`` (rank r contributes ``counts[r]``
elements; every rank gets them all, rank after rank) and ``reduce_scatter_v`` (rank q
gets block q, of ``counts[q]`` elements, of the op over every rank's input) are built the
same way (:func:`prepare_all_gather_v`, :func:`prepare_reduce_scatter_v`): direct plans,
one copy per block and destination, or one reduce per block at its destination, summing
the ranks in rank order (deterministic, as every plan is).
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
    want_in = [sum(row) for row in matrix]
    want_out = [sum(row[q] for row in matrix) for q in range(n)]
    prep = _prepare_v(devices, xs, outs, want_in, want_out, "all_to_all_v", dtype)

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


def prepare_all_gather_v(
    devices: Sequence[Device],
    xs: Sequence[Array],
    outs: Sequence[Array],
    counts: Sequence[int],
    dtype: object = None,
) -> AllToAllV:
    """all_gather_v checked: rank r's input holds ``counts[r]`` elements, every output
    ``sum(counts)`` (rank r's block at ``sum(counts[:r])``)."""
    n = len(devices)
    cs = _count_row(counts, n)
    total = sum(cs)
    prep = _prepare_v(devices, xs, outs, list(cs), [total] * n, "all_gather_v", dtype)

    def make() -> tuple[Plan, Mapping[str, Sequence[int]]]:
        from .plan import Buf, PlanBuilder

        b = PlanBuilder(n, f"direct all_gather_v of {total} elements")
        for r in range(n):
            off = sum(cs[:r])
            for i in range(n):
                q = (r + i) % n  # its own output first, then around the ring
                b.copy(r, Buf(q, OUT, off, cs[r]), Buf(r, IN, 0, cs[r]))
        extents = {IN: list(cs), OUT: [total] * n, TMP: [0] * n, STAGE: [0] * n}
        return b.build(), extents

    key = ("all_gather_v", cs, prep.dtype.itemsize)
    return AllToAllV(prep, key, total * n, make)


def prepare_reduce_scatter_v(
    devices: Sequence[Device],
    xs: Sequence[Array],
    outs: Sequence[Array],
    counts: Sequence[int],
    op: str = "sum",
    dtype: object = None,
) -> AllToAllV:
    """reduce_scatter_v checked: every input holds ``sum(counts)`` elements, rank q's
    output ``counts[q]``: the op over every rank's block q (at ``sum(counts[:q])``)."""
    from . import _ops

    n = len(devices)
    cs = _count_row(counts, n)
    total = sum(cs)
    prep = _prepare_v(devices, xs, outs, [total] * n, list(cs), "reduce_scatter_v", dtype)
    kernel_op = _ops.check_op(op, prep.dtype)
    prep.op = op

    def make() -> tuple[Plan, Mapping[str, Sequence[int]]]:
        from .builders._base import finish_mean, reduce_many
        from .plan import Buf, PlanBuilder

        b = PlanBuilder(n, f"direct reduce_scatter_v {op} of {total} elements")
        for q in range(n):
            off = sum(cs[:q])
            dst = Buf(q, OUT, 0, cs[q])
            if cs[q]:
                reduce_many(b, q, dst, [Buf(r, IN, off, cs[q]) for r in range(n)], kernel_op)
                finish_mean(b, q, dst, op, n)
        extents = {IN: [total] * n, OUT: list(cs), TMP: [0] * n, STAGE: [0] * n}
        return b.build(), extents

    key = ("reduce_scatter_v", cs, op, prep.dtype.itemsize)
    return AllToAllV(prep, key, total, make)


def _count_row(counts: Sequence[int], n: int) -> tuple[int, ...]:
    """A count per rank, none negative."""
    if isinstance(counts, (str, bytes)) or len(counts) != n:
        raise ValueError(f"counts must have a count per rank ({n}), got {len(counts)}")
    return tuple(check_int(c, f"counts[{r}]", min=0) for r, c in enumerate(counts))


def _prepare_v(
    devices: Sequence[Device], xs: Sequence[Array], outs: Sequence[Array],
    want_ins: Sequence[int], want_outs: Sequence[int], name: str, dtype: object = None,
) -> Prepared:  # fmt: skip
    """A v-collective's buffers, checked as a collective's are (one dtype, C-contiguous,
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
        want_in, want_out = want_ins[r], want_outs[r]
        if ins[r].size != want_in:
            raise ValueError(f"rank {r}: the input needs {want_in} elements (the "
                             f"counts of {name}), got {ins[r].size}")  # fmt: skip
        if res[r].size != want_out:
            raise ValueError(f"rank {r}: the output needs {want_out} elements (the "
                             f"counts of {name}), got {res[r].size}")  # fmt: skip
    for r in range(n):
        for q in range(n):
            if (
                ins[r].nbytes
                and res[q].nbytes
                and ranges_overlap(data_ptr(ins[r]), ins[r].nbytes, data_ptr(res[q]), res[q].nbytes)
            ):
                raise ValueError(f"{name} cannot run in place: rank {q}'s output "
                                 f"overlaps rank {r}'s input")  # fmt: skip
    logical = check_call_dtype(dtype)
    ins, viewed, dt, storage = resolve_dtype(ins, list(res), logical, "rank 0: input")
    flat_in = [x.reshape(-1) for x in ins]
    flat_out = [o.reshape(-1) for o in viewed if o is not None]
    return Prepared(name, flat_in, flat_out, list(outs), dt, 0, False, "sum", 0, storage)


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
