"""Executors: put a :class:`Plan` to work on a backend.

``enqueue`` issues every step on its rank's stream, in the plan's global order; the
ranks' devices then work in parallel and the plan's events order them. ``run_inline``
performs the steps one after another in the calling thread, with no streams at all; it is
what a synchronous call on the host backend uses for small messages, where handing work
to N worker threads costs more than the work (the steps are in a valid topological order,
so running them in sequence is one legal schedule of the same plan).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..backends.base import CopyArgs, ReduceArgs
from ._args import Array
from .plan import IN, OUT, STAGE, TMP, Buf, Plan, Step

if TYPE_CHECKING:
    from ..backends.base import Device, Event, Stream
    from ..backends.host import HostDevice


class Buffers:
    """The memory behind a plan's symbolic buffers for one call: flat views per rank."""

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


def _device_of(b: Buf, devices: Sequence[Device]) -> Device | None:
    # staging memory is pinned host memory: no device holds it
    return None if b.role == STAGE else devices[b.rank]


def _issue(s: Step, st: Stream, bufs: Buffers, devices: Sequence[Device]) -> None:
    """Issue one data step (copy, reduce, scale) on ``st``.

    The arguments are not checked again: every rank's buffers were checked for the whole
    collective by ``prepare`` (the scratch and staging buffers are the engine's own), and
    the plan's ranges lie inside them, so the steps are issued as checked arguments."""
    view = bufs.view
    dst = s.dst
    assert dst is not None, s  # every data step writes a range
    if s.kind == "copy":
        src = s.srcs[0]
        if not bufs.same(dst, src):
            dst_dev = _device_of(dst, devices) or st.device
            st.copy_checked(CopyArgs(view(dst), view(src), _device_of(src, devices), dst_dev))
    elif s.kind == "reduce":
        dst_dev = devices[dst.rank]
        st.reduce_checked(
            ReduceArgs(
                view(dst),
                [view(b) for b in s.srcs],
                s.op,
                [_device_of(b, devices) or dst_dev for b in s.srcs],
                dst_dev,
                float(s.alpha),
            )
        )
    elif s.kind == "scale":
        st.scale_checked(view(dst), float(s.alpha))
    else:  # pragma: no cover - plans are built by this package
        raise AssertionError(f"unknown step kind {s.kind!r}")


def enqueue(
    plan: Plan,
    bufs: Buffers,
    streams: Sequence[Stream],
    devices: Sequence[Device],
    events: Sequence[Event],
) -> None:
    """Issue every step of ``plan`` on ``streams[step.rank]``."""
    for s in plan.steps:
        st = streams[s.rank]
        if s.kind == "record":
            st.record(events[s.event])
        elif s.kind == "wait":
            st.wait_event(events[s.event])
        else:
            _issue(s, st, bufs, devices)


def run_inline(
    plan: Plan, bufs: Buffers, devices: Sequence[HostDevice], threads: int | None = None
) -> None:
    """Perform ``plan`` now, in the calling thread (host backend only): its data steps in
    list order, which is a valid schedule, so the events are not needed. ``threads``: the
    threads every kernel uses (None: its device's)."""
    # streams that perform each op at once
    now = [d.inline_stream if threads is None else d.inline_stream_with(threads) for d in devices]
    for s in plan.data_steps():
        _issue(s, now[s.rank], bufs, devices)
