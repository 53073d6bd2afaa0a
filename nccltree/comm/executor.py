"""Executors: put a :class:`Plan` to work on a backend.

A plan is resolved once into a :class:`Program` when the World caches it: every step's
kind, rank, devices, op and alpha; the memory ranges it touches, numbered so that each
distinct range is sliced once per call however many steps use it; the events, created
once and reused by every call of the plan; and a check, made once, that every range lies
inside the buffer it names. A call then only slices its buffers into those ranges and
issues the steps.

``Program.enqueue`` issues every step on its rank's stream, in the plan's global order;
the ranks' devices then work in parallel and the plan's events order them.
``Program.run_inline`` performs the steps one after another in the calling thread, with
no streams at all; it is what a synchronous call on the host backend uses (at every size
by default): the steps are in a valid topological order, so running them in sequence is
one legal schedule of the same plan. On the host the data steps are lowered once into
the kernel library's step list, and a call runs them all in one native call
(``nt_run_steps``); calls whose transfers are being recorded issue them one by one on the
inline streams, which log each transfer.

Reusing a plan's events across calls is safe on every backend: a wait takes the event's
state when it is enqueued (CUDA's ``cudaStreamWaitEvent``; the host backend's wait keeps
the stream and sequence number it saw), so recording the event again for the next call
does not change what an earlier wait waits for. The end events of an asynchronous call
are the exception: a ``Work`` holds them after the call returns, so such a call gets
fresh ones.
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from .. import _native
from .._errors import NcclTreeError
from ..backends.base import CopyArgs, ReduceArgs
from ..backends.host import recording_transfers
from ._args import Array
from .plan import IN, OUT, STAGE, TMP, Buf, Plan

if TYPE_CHECKING:
    from ..backends.base import Device, Event, Stream
    from ..backends.host import HostDevice


class _Sync(NamedTuple):
    """A record (``wait`` False) or a wait of event ``event`` on ``rank``'s stream."""

    rank: int
    wait: bool
    event: int


class _Copy(NamedTuple):
    """Range ``dst`` <- range ``src`` (range ids); ``same``: (rank, role, rank, role) of
    the two buffers when the ranges have one offset and length (an in-place rank's "in"
    and "out"): the copy is skipped when the two are one array."""

    rank: int
    dst: int
    src: int
    src_dev: Device | None
    dst_dev: Device
    same: tuple[int, str, int, str] | None


class _Reduce(NamedTuple):
    rank: int
    dst: int
    srcs: tuple[int, ...]
    op: str
    src_devs: list[Device]
    dst_dev: Device
    alpha: float


class _Scale(NamedTuple):
    rank: int
    dst: int
    alpha: float


_Data = _Copy | _Reduce | _Scale
Range = tuple[int, str, int, int]  # (rank, role, offset, count)


class Buffers:
    """The memory behind a plan's symbolic buffers for one call: flat arrays per rank."""

    __slots__ = ("arrays",)

    def __init__(
        self,
        ins: Sequence[Array],
        outs: Sequence[Array],
        tmps: Sequence[Array | None],
        stages: Sequence[Array | None] | None = None,
    ) -> None:
        stages = stages if stages is not None else [None] * len(ins)
        self.arrays = [
            {IN: i, OUT: o, TMP: t, STAGE: g} for i, o, t, g in zip(ins, outs, tmps, stages)
        ]

    def view(self, b: Buf) -> Array:
        arr = self.arrays[b.rank][b.role]
        return arr[b.offset : b.offset + b.count]

    def same(self, a: Buf, b: Buf) -> bool:
        """Whether two ranges are one memory (an in-place rank's "in" and "out")."""
        return (
            a.offset == b.offset
            and a.count == b.count
            and self.arrays[a.rank][a.role] is self.arrays[b.rank][b.role]
        )


class Program:
    """A plan resolved for one World's devices (see the module docstring).

    ``extents[role][rank]`` is the element count of each buffer a call passes (``in``,
    ``out``) or the engine allocates (``tmp``, ``stage``); every range of the plan is
    checked against it here, once, which is what lets every call issue its steps as
    checked arguments (``Stream.copy_checked`` and the like).

    ``dtype``: the dtype the calls' arrays carry, named to every reduction and scale
    (bfloat16 in ``uint16`` CuPy arrays); None: the arrays' own."""

    __slots__ = (
        "plan",
        "ranges",
        "ops",
        "data_ops",
        "owners",
        "events",
        "devices",
        "memory",
        "dtype",
        "_native",
    )

    def __init__(
        self,
        plan: Plan,
        devices: Sequence[Device],
        extents: Mapping[str, Sequence[int]],
        dtype: np.dtype | None = None,
    ) -> None:
        self.plan = plan
        self.devices = list(devices)
        self.dtype = dtype
        index: dict[Range, int] = {}
        self.ranges: list[Range] = []

        def rid(b: Buf) -> int:
            key = (b.rank, b.role, b.offset, b.count)
            i = index.get(key)
            if i is None:
                size = extents[b.role][b.rank]
                if b.offset < 0 or b.count < 0 or b.offset + b.count > size:
                    raise AssertionError(
                        f"plan range {b} lies outside rank {b.rank}'s {b.role} buffer of {size}"
                    )
                i = index[key] = len(self.ranges)
                self.ranges.append(key)
            return i

        def dev(b: Buf) -> Device | None:
            # staging memory is pinned host memory: no device holds it
            return None if b.role == STAGE else devices[b.rank]

        ops: list[_Sync | _Data] = []
        for s in plan.steps:
            k, r = s.kind, s.rank
            if k == "record" or k == "wait":
                ops.append(_Sync(r, k == "wait", s.event))
            elif k == "copy":
                dst, src = s.dst, s.srcs[0]
                assert dst is not None, s
                if dst == src:
                    continue  # a copy onto itself moves nothing
                same = (
                    (dst.rank, dst.role, src.rank, src.role)
                    if (dst.offset, dst.count) == (src.offset, src.count)
                    else None
                )
                ops.append(_Copy(r, rid(dst), rid(src), dev(src), dev(dst) or devices[r], same))
            elif k == "reduce":
                dst = s.dst
                assert dst is not None, s
                dst_dev = devices[dst.rank]
                ops.append(
                    _Reduce(
                        r,
                        rid(dst),
                        tuple(rid(b) for b in s.srcs),
                        s.op,
                        [dev(b) or dst_dev for b in s.srcs],
                        dst_dev,
                        float(s.alpha),
                    )
                )
            elif k == "scale":
                assert s.dst is not None, s
                ops.append(_Scale(r, rid(s.dst), float(s.alpha)))
            else:  # pragma: no cover - plans are built by this package
                raise AssertionError(f"unknown step kind {k!r}")
        self.ops = ops
        self.data_ops: list[_Data] = [op for op in ops if not isinstance(op, _Sync)]
        self.owners = plan.event_owners()
        # created on first use: an inline call needs none
        self.events: list[Event] | None = None
        #: the World's scratch and staging buffers for this plan, with the dtype (``str``)
        #: they were looked up for; kept by the World, which forgets them (None) whenever
        #: it replaces a scratch buffer
        self.memory: tuple[str, list[Array | None], list[Array | None]] | None = None
        #: the data steps lowered for the host library's ``nt_run_steps`` (built on first
        #: inline use; False: they cannot be)
        self._native: _Lowered | bool | None = None

    def views(self, bufs: Buffers) -> list[Array]:
        """Every range of the plan as a view of this call's buffers, by range id."""
        arrays = bufs.arrays
        return [arrays[r][role][o : o + c] for r, role, o, c in self.ranges]

    def call_events(self, fresh_ends: bool) -> list[Event]:
        """The events of one call: the plan's own, reused, with new end events when
        ``fresh_ends`` (an asynchronous call, whose ``Work`` keeps them)."""
        events = self.events
        if events is None:
            events = self.events = [self.devices[r].new_event() for r in self.owners]
        if fresh_ends:
            events = list(events)
            for r, e in self.plan.end_events.items():
                events[e] = self.devices[r].new_event()
        return events

    def enqueue(self, bufs: Buffers, streams: Sequence[Stream], events: Sequence[Event]) -> None:
        """Issue every step on ``streams[step.rank]``, ordered by ``events``."""
        views = self.views(bufs)
        arrays = bufs.arrays
        dtype = self.dtype
        for op in self.ops:
            st = streams[op.rank]
            if isinstance(op, _Sync):
                _sync(op, st, events)
            else:
                _issue(op, st, views, arrays, dtype)

    def run_inline(
        self, bufs: Buffers, devices: Sequence[HostDevice], threads: int | None = None
    ) -> None:
        """Perform the plan now, in the calling thread (host backend only): its data steps
        in list order, which is a valid schedule, so the events are not needed.
        ``threads``: the threads every kernel uses (None: its device's)."""
        arrays = bufs.arrays
        native = self._native if self._native is not None else self._lower()
        if isinstance(native, _Lowered) and self.dtype is None and not recording_transfers():
            # every step in one native call: no Python between the kernels
            code = _native.DTYPES.get(arrays[0][IN].dtype)
            if code is not None:
                bases, nthreads, failed = native.bases, native.threads, native.failed
                for i, (r, role) in enumerate(native.slots):
                    bases[i] = _native._fast_addr(arrays[r][role])
                for r, d in enumerate(devices):
                    nthreads[r] = threads or d.threads
                _native.run_steps(code, native.steps, bases, nthreads, failed)
                return
        views = self.views(bufs)
        # streams that perform each op at once (they record transfers, when asked)
        now = [
            d.inline_stream if threads is None else d.inline_stream_with(threads) for d in devices
        ]
        for op in self.data_ops:
            _issue(op, now[op.rank], views, arrays, self.dtype)

    def _lower(self) -> _Lowered | bool:
        """The data steps lowered for the host library's ``nt_run_steps``, built once;
        False when a step does not fit (more sources than one kernel takes) or the library
        is missing."""
        self._native = False
        try:
            _native.library()
        except NcclTreeError:
            return False
        slot: dict[tuple[int, str], int] = {}

        def place(i: int) -> tuple[int, int]:
            r, role, off, _ = self.ranges[i]
            return slot.setdefault((r, role), len(slot)), off

        groups = _fused(self.data_ops, self.ranges) if FUSE_REDUCE_COPIES else None
        if groups is None:
            groups = [[op] for op in self.data_ops]
        steps = (_native.Step * len(groups))()
        for st, group in zip(steps, groups, strict=True):
            op = group[0]
            st.rank = op.rank
            st.dst, st.dst_off = place(op.dst)
            st.count = self.ranges[op.dst][3]
            st.alpha = 1.0
            if isinstance(op, _Copy):
                st.kind, st.k = _native.STEP_COPY, 1
                st.src[0], st.src_off[0] = place(op.src)
            elif isinstance(op, _Reduce):
                if len(op.srcs) > _native.MAX_SOURCES:
                    return False
                st.kind, st.k, st.op = _native.STEP_REDUCE, len(op.srcs), _native.OPS[op.op]
                st.alpha = op.alpha
                for j, i in enumerate(op.srcs):
                    st.src[j], st.src_off[j] = place(i)
                if len(group) > 1:
                    st.kind, st.m = _native.STEP_REDUCE_MANY, len(group)
                    for j, cp in enumerate(group[1:]):
                        st.mdst[j], st.mdst_off[j] = place(cp.dst)
            else:
                st.kind, st.alpha = _native.STEP_SCALE, op.alpha
        lowered = _Lowered(
            steps,
            sorted(slot, key=slot.__getitem__),
            (ctypes.c_void_p * max(1, len(slot)))(),
            (ctypes.c_int * len(self.devices))(),
            ctypes.c_int(-1),
        )
        self._native = lowered
        return lowered


#: the host's inline runs fuse a reduction and the copies of its result that follow it
#: into one pass (``nt_reduce_many``); False lowers every step alone (for comparing the two)
FUSE_REDUCE_COPIES = True


def _fused(ops: Sequence[_Data], ranges: Sequence[Range]) -> list[list[_Data]]:
    """The data steps in groups: a reduction with the copies of its whole result that
    follow it at once (a one-pass reduce with several outputs), every other step alone.
    A copy joins only where nothing can alias in a way the fused kernel would refuse: its
    destination is one of the reduction's sources exactly (the same range), or lies on a
    rank none of the others touch, and no two destinations share a rank."""
    groups: list[list[_Data]] = []
    i = 0
    while i < len(ops):
        op = ops[i]
        group: list[_Data] = [op]
        i += 1
        if isinstance(op, _Reduce) and len(op.srcs) <= _native.MAX_SOURCES:
            src_ranges = {ranges[j] for j in op.srcs}
            touched = {ranges[j][0] for j in op.srcs}
            dst_ranks = {ranges[op.dst][0]}
            while i < len(ops) and len(group) < _native.MAX_SOURCES:
                cp = ops[i]
                # (a copy between one array's ranges, ``same``, moves nothing: the
                # kernel skips a destination that is an earlier one, or the result)
                if not (isinstance(cp, _Copy) and cp.src == op.dst and cp.rank == op.rank):
                    break
                d = ranges[cp.dst]
                if d[3] != ranges[op.dst][3] or d[0] in dst_ranks:
                    break
                if d not in src_ranges and d[0] in touched:
                    break
                dst_ranks.add(d[0])
                group.append(cp)
                i += 1
        groups.append(group)
    return groups


class _Lowered(NamedTuple):
    """A program's data steps for the host library's ``nt_run_steps`` (see
    :meth:`Program.run_inline`): the steps, the (rank, role) of each buffer slot they
    name, and the argument arrays each call fills (a World runs one call at a time)."""

    steps: ctypes.Array[_native.Step]
    slots: list[tuple[int, str]]
    bases: ctypes.Array[ctypes.c_void_p]
    threads: ctypes.Array[ctypes.c_int]
    failed: ctypes.c_int


def _sync(op: _Sync, st: Stream, events: Sequence[Event]) -> None:
    """A record or a wait of one of a call's events on ``st``."""
    if op.wait:
        st.wait_event(events[op.event])
    else:
        events[op.event].record(st)


def _issue(
    op: _Data,
    st: Stream,
    views: list[Array],
    arrays: list[dict[str, Array]],
    dtype: np.dtype | None = None,
) -> None:
    """Issue one data step (copy, reduce, scale) on ``st``; ``dtype``: the dtype the
    arrays carry (see :class:`Program`), named to reductions and scales.

    The arguments are not checked again: every rank's buffers were checked for the whole
    collective by ``prepare``, the scratch and staging buffers are the engine's own, and
    the program checked once that the plan's ranges lie inside them."""
    if isinstance(op, _Reduce):
        st.reduce_checked(
            ReduceArgs(
                views[op.dst],
                [views[i] for i in op.srcs],
                op.op,
                op.src_devs,
                op.dst_dev,
                op.alpha,
                dtype,
            )
        )
    elif isinstance(op, _Copy):
        same = op.same
        if same is not None and arrays[same[0]][same[1]] is arrays[same[2]][same[3]]:
            return
        st.copy_checked(CopyArgs(views[op.dst], views[op.src], op.src_dev, op.dst_dev))
    else:
        st.scale_checked(views[op.dst], op.alpha, dtype)
