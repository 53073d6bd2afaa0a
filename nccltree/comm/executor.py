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
from typing import Any

from .plan import IN, OUT, STAGE, TMP, Buf, Plan, Step


class Buffers:
    """The memory behind a plan's symbolic buffers for one call: flat views per rank."""

    __slots__ = ("arrays",)

    def __init__(
        self,
        ins: Sequence[Any],
        outs: Sequence[Any],
        tmps: Sequence[Any | None],
        stages: Sequence[Any | None] | None = None,
    ):
        stages = stages if stages is not None else [None] * len(ins)
        self.arrays = [
            {IN: i, OUT: o, TMP: t, STAGE: g} for i, o, t, g in zip(ins, outs, tmps, stages)
        ]

    def view(self, b: Buf) -> Any:
        arr = self.arrays[b.rank][b.role]
        return arr[b.offset : b.offset + b.count]

    def same(self, a: Buf, b: Buf) -> bool:
        """Whether two ranges are one memory (an in-place rank's "in" and "out")."""
        return (
            a.offset == b.offset
            and a.count == b.count
            and self.arrays[a.rank][a.role] is self.arrays[b.rank][b.role]
        )


def _device_of(b: Buf, devices: Sequence[Any]) -> Any:
    # staging memory is pinned host memory: no device holds it
    return None if b.role == STAGE else devices[b.rank]


def enqueue(
    plan: Plan,
    bufs: Buffers,
    streams: Sequence[Any],
    devices: Sequence[Any],
    events: Sequence[Any] | None,
    steps: Sequence[Step] | None = None,
) -> None:
    """Issue every step of ``plan`` (or ``steps``) on ``streams[step.rank]``."""
    view = bufs.view
    for s in plan.steps if steps is None else steps:
        st = streams[s.rank]
        kind = s.kind
        if kind == "record":
            st.record(events[s.event])
        elif kind == "wait":
            st.wait_event(events[s.event])
        elif kind == "copy":
            if not bufs.same(s.dst, s.srcs[0]):
                st.copy(
                    view(s.dst),
                    view(s.srcs[0]),
                    src_device=_device_of(s.srcs[0], devices),
                    dst_device=_device_of(s.dst, devices),
                )
        elif kind == "reduce":
            st.reduce(
                view(s.dst),
                [view(b) for b in s.srcs],
                s.op,
                src_devices=[_device_of(b, devices) for b in s.srcs],
                dst_device=devices[s.dst.rank],
                alpha=s.alpha,
            )
        elif kind == "scale":
            st.scale(view(s.dst), s.alpha)
        else:  # pragma: no cover - plans are built by this package
            raise AssertionError(f"unknown step kind {kind!r}")


class _Now:
    """A stand-in stream that performs each operation at once, in the calling thread."""

    __slots__ = ("copy", "reduce", "scale")

    def __init__(self, device: Any) -> None:
        self.copy, self.reduce, self.scale = device.copy_now, device.reduce_now, device.scale


def run_inline(plan: Plan, bufs: Buffers, devices: Sequence[Any]) -> None:
    """Perform ``plan`` now, in the calling thread (host backend only): its data steps in
    list order, which is a valid schedule, so the events are not needed."""
    enqueue(plan, bufs, [_Now(d) for d in devices], devices, None, plan.data_steps())
