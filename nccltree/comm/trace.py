"""Tracing: one call performed step by step with every step timed, and the Chrome trace
format (``chrome://tracing``, Perfetto) that shows it, one lane per rank's stream.

``World.trace`` and ``nccltree-bench collectives --trace FILE`` use it. On the host
backend the steps run one after another in the calling thread, in the plan's order (a
valid schedule of the plan, so the lanes show the order and the cost of each step, not
overlap between ranks); on GPUs each step is issued on its rank's stream between two
timing events, so the lanes show what overlapped.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple, cast

from .executor import Buffers, Program, _Copy, _Data, _issue, _Reduce, _Scale, _Sync, _sync

if TYPE_CHECKING:
    from ..backends.base import Stream
    from ..backends.host import HostDevice


class Span(NamedTuple):
    """One step of a traced call: ``kind`` (``copy``, ``reduce``, ``scale``; ``record`` and
    ``wait`` are instants, ``duration`` 0), the rank whose stream performs it, when it
    started and how long it took (seconds, from the start of the call), the elements it
    writes, and a description of its ranges."""

    rank: int
    kind: str
    start: float
    duration: float
    elements: int
    detail: str


def trace_program(
    program: Program,
    bufs: Buffers,
    streams: Sequence[Stream] | None = None,
) -> list[Span]:
    """Perform ``program`` once, timing every step. Host devices (``streams`` None): the
    steps one after another in the calling thread, in plan order (a valid schedule), each
    timed by the host clock. CUDA (``streams``: each rank's): every step issued on its
    rank's stream between two timing events, the plan's events ordering them as in a
    normal call; the times come from the events once the streams are done, relative to
    an event recorded first on each rank's stream (one GPU's clock per GPU)."""
    views = program.views(bufs)
    arrays = bufs.arrays
    ranges = program.ranges

    def describe(op: _Data) -> tuple[str, int]:
        def name(i: int) -> str:
            r, role, off, cnt = ranges[i]
            return f"{role}[{r}][{off}:{off + cnt}]"

        count = ranges[op.dst][3]
        if isinstance(op, _Reduce):
            return f"{name(op.dst)} = {op.op}({', '.join(name(i) for i in op.srcs)})", count
        if isinstance(op, _Copy):
            return f"{name(op.dst)} <- {name(op.src)}", count
        return f"{name(op.dst)} *= {op.alpha:g}", count

    def kind(op: _Sync | _Data) -> str:
        if isinstance(op, _Sync):
            return "wait" if op.wait else "record"
        return {_Copy: "copy", _Reduce: "reduce", _Scale: "scale"}[type(op)]

    spans: list[Span] = []
    if streams is None:
        devices = program.devices
        now = [d.inline_stream for d in cast("list[HostDevice]", devices)]
        t_start = time.perf_counter()
        for op in program.ops:
            t0 = time.perf_counter() - t_start
            if isinstance(op, _Sync):
                spans.append(Span(op.rank, kind(op), t0, 0.0, 0, f"event {op.event}"))
                continue
            _issue(op, now[op.rank], views, arrays, program.dtype)
            detail, count = describe(op)
            spans.append(Span(op.rank, kind(op), t0, time.perf_counter() - t_start - t0,
                              count, detail))  # fmt: skip
        return spans
    from ..backends.cuda import CudaStream, _cupy

    cp = _cupy()
    cuda = cast("list[CudaStream]", list(streams))
    events = program.call_events(fresh_ends=True)
    marks: list[tuple[Span, object, object]] = []
    starts = []
    for st in cuda:
        with cp.cuda.Device(st.device.physical_id):
            ev = cp.cuda.Event()
            ev.record(st.cupy_stream)
            starts.append(ev)
    for op in program.ops:
        st = cuda[op.rank]
        if isinstance(op, _Sync):
            _sync(op, st, events)
            marks.append((Span(op.rank, kind(op), 0.0, 0.0, 0, f"event {op.event}"), None, None))
            continue
        with cp.cuda.Device(st.device.physical_id):
            a, b = cp.cuda.Event(), cp.cuda.Event()
            a.record(st.cupy_stream)
            _issue(op, st, views, arrays, program.dtype)
            b.record(st.cupy_stream)
        detail, count = describe(op)
        marks.append((Span(op.rank, kind(op), 0.0, 0.0, count, detail), a, b))
    for st in cuda:
        st.synchronize()
    last = [0.0] * len(cuda)  # an instant sits where its stream had got to
    for span, a, b in marks:
        if a is None:
            spans.append(span._replace(start=last[span.rank]))
            continue
        base = starts[span.rank]
        t0 = cp.cuda.get_elapsed_time(base, a) / 1e3
        t1 = cp.cuda.get_elapsed_time(base, b) / 1e3
        last[span.rank] = t1
        spans.append(span._replace(start=t0, duration=t1 - t0))
    return spans


def chrome_trace(runs: Sequence[tuple[str, Sequence[str], Sequence[Span]]]) -> dict[str, object]:
    """The Chrome trace of ``runs``: each ``(title, rank names, spans)`` a process of its
    own (one per algorithm, say), each rank a thread; steps are complete events (``X``,
    microseconds), records and waits instants (``i``)."""
    events: list[dict[str, object]] = []
    for pid, (title, names, spans) in enumerate(runs):
        events.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0,
                       "args": {"name": title}})  # fmt: skip
        for r, name in enumerate(names):
            events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": r,
                           "args": {"name": f"rank {r} ({name})"}})  # fmt: skip
        for s in spans:
            ev: dict[str, object] = {
                "name": s.kind,
                "cat": s.kind,
                "pid": pid,
                "tid": s.rank,
                "ts": round(s.start * 1e6, 3),
                "args": {"step": s.detail, "elements": s.elements},
            }
            if s.kind in ("record", "wait"):
                ev.update(ph="i", s="t")
            else:
                ev.update(ph="X", dur=round(max(s.duration, 1e-9) * 1e6, 3))
            events.append(ev)
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(
    path: str, runs: Sequence[tuple[str, Sequence[str], Sequence[Span]]]
) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(chrome_trace(runs), f)
