"""Plans: a collective as data.

An algorithm turns a collective into a :class:`Plan` — copies and reductions placed on the
ranks' streams, ordered by events. A plan names memory symbolically (:class:`Buf`: whose
buffer, which role, which element range), so one plan serves every call with the same
shape, can be inspected by tests (which copies, between whom) and executed by any
backend.

:class:`PlanBuilder` adds the fences every plan needs, so algorithms state only their own
data flow:

* before a rank first touches another rank's buffer it waits for that rank's *start*
  event (the owner's caller has finished producing the data);
* after a rank last touches another rank's buffer it records an event that the owner
  waits on before its *end*, so when a rank's part of the collective is complete nobody
  reads or writes its buffers any more (the caller may reuse them).

:func:`check_races` replays a plan with vector clocks and reports any two accesses to
overlapping memory, at least one a write, on different streams without a happens-before
edge: the static twin of the host backend's jitter mode.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from math import lcm

from .._validate import check_int

# Buffer roles: the caller's input, the caller's output (same memory as "in" when the call
# is in place), scratch memory the engine owns on the rank's device, and pinned host
# memory the engine owns for the rank (staging between devices without peer access).
IN, OUT, TMP, STAGE = "in", "out", "tmp", "stage"

#: The offsets a plan chooses itself (slices, chunks, scratch and staging regions) are
#: multiples of this many bytes when the builder knows the itemsize: the CUDA kernels use
#: 16-byte vectors only where every pointer shares its offset within 16 bytes, and 256
#: bytes also starts every piece on a cache line and on the allocators' granularity.
ALIGN_BYTES = 256


def align_elements(itemsize: int | None) -> int:
    """The plan's alignment in elements of ``itemsize`` bytes: the smallest element count
    that is a multiple of :data:`ALIGN_BYTES` bytes (1, element granularity, for None)."""
    if itemsize is None:
        return 1
    itemsize = check_int(itemsize, "itemsize", min=1)
    return lcm(ALIGN_BYTES, itemsize) // itemsize


def align_bytes(nbytes: int) -> int:
    """``nbytes`` rounded up to a multiple of :data:`ALIGN_BYTES`: where a region of
    ``nbytes`` bytes laid out after another must end so the next one starts aligned."""
    return -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES


# -- the chunk policy ---------------------------------------------------------------------------
#
# Plans cut a message into chunks and pipeline them. One fixed chunk of CHUNK_BYTES serves
# the host backend (docs/performance.md#chunk-size-on-the-host-backend), the process
# groups' plans and the simulator's default; GPU Worlds cut each message into about
# GPU_CHUNKS chunks of GPU_CHUNK_MIN to GPU_CHUNK_MAX bytes (gpu_chunk_bytes).

#: the fixed chunk (bytes): host Worlds, process groups, the simulator's default
CHUNK_BYTES = 16 << 20
#: the GPU policy: about this many chunks a message ...
GPU_CHUNKS = 16
#: ... each of at least this many bytes ...
GPU_CHUNK_MIN = 256 << 10
#: ... and at most this many
GPU_CHUNK_MAX = CHUNK_BYTES


def gpu_chunk_bytes(nbytes: int) -> int:
    """The chunk of a message of ``nbytes`` bytes per rank under the GPU policy:
    ``nbytes / GPU_CHUNKS`` rounded up to :data:`ALIGN_BYTES`, within ``[GPU_CHUNK_MIN,
    GPU_CHUNK_MAX]``. So a message of up to ``GPU_CHUNKS * GPU_CHUNK_MAX`` (256 MiB) bytes
    has at most ``GPU_CHUNKS`` chunks, a larger one chunks of ``GPU_CHUNK_MAX``, and one of
    at most ``GPU_CHUNK_MIN`` a single chunk."""
    per = align_bytes(-(-nbytes // GPU_CHUNKS))
    return min(GPU_CHUNK_MAX, max(GPU_CHUNK_MIN, per))


def chunk_elements(chunk_bytes: int, itemsize: int) -> int:
    """A chunk of ``chunk_bytes`` bytes in elements of ``itemsize`` bytes (at least one)."""
    return max(1, chunk_bytes // itemsize)


@dataclass(frozen=True)
class Buf:
    """``count`` elements of rank ``rank``'s ``role`` buffer starting at ``offset``."""

    rank: int
    role: str
    offset: int
    count: int

    def sub(self, offset: int, count: int) -> Buf:
        """The sub-range ``[offset, offset + count)`` of this range (relative)."""
        return Buf(self.rank, self.role, self.offset + offset, count)


@dataclass(frozen=True)
class Step:
    """One operation on ``rank``'s stream, of ``kind``.

    kinds: ``copy`` (``dst <- srcs[0]``), ``reduce`` (``dst <- op(*srcs)``, times
    ``alpha`` when that is not 1: a mean folded into its sum), ``scale``
    (``dst <- dst * alpha``), ``record`` (event ``event`` marks this point), ``wait`` (later
    work waits for event ``event``).
    """

    rank: int
    kind: str
    dst: Buf | None = None
    srcs: tuple[Buf, ...] = ()
    op: str = "sum"
    alpha: float = 1.0
    event: int = -1

    @property
    def touches(self) -> tuple[Buf, ...]:
        """The buffers the step writes and reads (``dst`` first, then ``srcs``)."""
        return (self.dst, *self.srcs) if self.dst is not None else self.srcs


@dataclass
class Plan:
    """Steps in a valid global issue order, for ``size`` ranks.

    ``same_buffer`` says that ``in`` and ``out`` are one buffer (an in-place call), so the
    race checker treats them as the same memory. ``scratch[r]`` is the number of elements
    of scratch memory rank ``r`` needs, ``stage[r]`` of pinned host staging memory.
    ``steps`` are the operations in issue order, using events ``0 .. n_events - 1``;
    ``start_events[r]`` and ``end_events[r]`` are the events that mark where rank ``r``'s
    part begins and ends (a caller's stream waits on the end ones). ``description`` says
    what the plan does, for reports.
    """

    size: int
    steps: list[Step]
    n_events: int
    scratch: dict[int, int] = field(default_factory=dict)
    stage: dict[int, int] = field(default_factory=dict)
    same_buffer: bool = False
    start_events: dict[int, int] = field(default_factory=dict)
    end_events: dict[int, int] = field(default_factory=dict)
    description: str = ""

    def data_steps(self) -> list[Step]:
        """The steps that move or combine data, in order (what an inline run performs)."""
        cached = self.__dict__.get("_data_steps")
        if cached is None:
            cached = self.__dict__["_data_steps"] = [
                s for s in self.steps if s.kind not in ("record", "wait")
            ]
        return cached

    def event_owners(self) -> list[int]:
        """The rank whose stream records each event (events are created on its device)."""
        owners = [0] * self.n_events
        for s in self.steps:
            if s.kind == "record":
                owners[s.event] = s.rank
        return owners

    def steps_of(self, rank: int) -> list[Step]:
        """The steps on ``rank``'s stream, in order."""
        return [s for s in self.steps if s.rank == rank]

    def transfers(self) -> list[tuple[int, int, int]]:
        """(source rank, destination rank, elements) of every cross-rank data movement the
        plan implies: copies from another rank's buffer and peer reads by reductions."""
        out = []
        for s in self.steps:
            if s.kind in ("copy", "reduce") and s.dst is not None:
                for src in s.srcs:
                    if src.rank != s.dst.rank:
                        out.append((src.rank, s.dst.rank, src.count))
        return out

    def bytes_moved(self, itemsize: int) -> int:
        """Bytes the plan's data steps read and write, for elements of ``itemsize`` bytes:
        a copy reads and writes its elements once, a reduce reads every source and writes
        the destination, a scale reads and writes its buffer. A copy onto the same memory
        (which the executor skips) moves nothing. Over a memory bandwidth (bytes read +
        written per second), this is the least time the plan can take on one host."""
        itemsize = check_int(itemsize, "itemsize", min=1)

        def where(b: Buf) -> tuple[tuple[int, str], int, int]:
            return _region(b, self.same_buffer), b.offset, b.count

        total = 0
        for s in self.data_steps():
            assert s.dst is not None, f"a {s.kind} step without a destination"
            if s.kind == "copy" and where(s.dst) == where(s.srcs[0]):
                continue
            total += (len(s.srcs) + 1) * s.dst.count * itemsize
        return total

    def __str__(self) -> str:
        lines = [f"plan: {self.description} ({self.size} ranks, {len(self.steps)} steps)"]
        for s in self.steps:
            if s.kind in ("record", "wait"):
                lines.append(f"  r{s.rank}: {s.kind} e{s.event}")
            else:
                srcs = ", ".join(_fmt(b) for b in s.srcs)
                times = f" * {s.alpha:g}" if s.alpha != 1.0 else ""
                lines.append(f"  r{s.rank}: {s.kind}({s.op}) {_fmt(s.dst)} <- {srcs}{times}")
        return "\n".join(lines)


def _fmt(b: Buf | None) -> str:
    return "-" if b is None else f"{b.role}{b.rank}[{b.offset}:{b.offset + b.count}]"


class PlanBuilder:
    """Collects an algorithm's steps, then adds start/end fences (see module docstring)."""

    def __init__(
        self, size: int, description: str = "", same_buffer: bool = False, align: int = 1
    ) -> None:
        self.size = size
        self.description = description
        self.same_buffer = same_buffer
        self.align = align  # elements; scratch and staging regions start at multiples
        self._steps: list[Step] = []
        self._n_events = 0
        self.scratch: dict[int, int] = {}
        self.stage: dict[int, int] = {}

    # -- algorithm-facing API -------------------------------------------------------------
    def copy(self, rank: int, dst: Buf, src: Buf) -> None:
        if dst.count != src.count:
            raise AssertionError(f"copy of {src.count} elements into {dst.count}")
        if dst.count:
            self._steps.append(Step(rank, "copy", dst, (src,)))

    def reduce(self, rank: int, dst: Buf, srcs: Sequence[Buf], op: str, alpha: float = 1.0) -> None:
        """dst <- op(*srcs), times ``alpha`` when it is not 1 (a sum only)."""
        if any(s.count != dst.count for s in srcs):
            raise AssertionError("reduce sources and destination differ in size")
        if alpha != 1.0 and op != "sum":
            raise AssertionError(f"a scaled reduce must be a sum, not {op!r}")
        if dst.count:
            if len(srcs) == 1 and alpha == 1.0:
                if srcs[0] != dst:
                    self._steps.append(Step(rank, "copy", dst, (srcs[0],)))
            else:
                self._steps.append(Step(rank, "reduce", dst, tuple(srcs), op=op, alpha=alpha))

    def fold_scale(self, rank: int, buf: Buf, alpha: float) -> bool:
        """Fold ``scale(rank, buf, alpha)`` into the step just added, if that step is an
        unscaled sum on ``rank`` writing exactly ``buf`` (then nothing can have seen the
        unscaled value); returns whether it did. Saves a pass over ``buf``."""
        last = self._steps[-1] if self._steps else None
        if (
            last is None
            or last.kind != "reduce"
            or last.rank != rank
            or last.dst != buf
            or last.op != "sum"
            or last.alpha != 1.0
        ):
            return False
        self._steps[-1] = replace(last, alpha=alpha)
        return True

    def scale(self, rank: int, buf: Buf, alpha: float) -> None:
        if buf.count:
            self._steps.append(Step(rank, "scale", buf, (buf,), alpha=alpha))

    def signal(self, rank: int) -> int:
        """Record a new event on ``rank``'s stream; returns its id."""
        ev = self._n_events
        self._n_events += 1
        self._steps.append(Step(rank, "record", event=ev))
        return ev

    def wait(self, rank: int, event: int) -> None:
        self._steps.append(Step(rank, "wait", event=event))

    def alloc_scratch(self, rank: int, count: int) -> Buf:
        """A fresh region of ``count`` elements of ``rank``'s scratch, after all others."""
        off = _round_up(self.scratch.get(rank, 0), self.align)
        self.scratch[rank] = off + count
        return Buf(rank, TMP, off, count)

    def alloc_stage(self, rank: int, count: int) -> Buf:
        """A fresh region of ``count`` elements of ``rank``'s pinned host staging memory."""
        off = _round_up(self.stage.get(rank, 0), self.align)
        self.stage[rank] = off + count
        return Buf(rank, STAGE, off, count)

    # -- fences ---------------------------------------------------------------------------
    def build(self) -> Plan:
        n = self.size
        starts = {r: r for r in range(n)}  # event ids 0..n-1 are the start events
        offset = n
        body = [
            Step(s.rank, s.kind, s.dst, s.srcs, s.op, s.alpha, s.event + offset)
            if s.kind in ("record", "wait")
            else s
            for s in self._steps
        ]
        n_events = self._n_events + offset
        out: list[Step] = [Step(r, "record", event=starts[r]) for r in range(n)]

        # Which event ids each rank recorded, so a wait on any of them implies the
        # recorder's start is behind us.
        recorder = {s.event: s.rank for s in body if s.kind == "record"}
        recorder.update({starts[r]: r for r in range(n)})

        # Start fences: before rank q first touches rank r's buffer, q must have waited on
        # an event recorded by r.
        synced: dict[int, set[int]] = {q: {q} for q in range(n)}
        # last step index (in `out`) where q touched r's buffers
        last_touch: dict[tuple[int, int], int] = {}
        for s in body:
            q = s.rank
            if s.kind == "wait":
                synced[q].add(recorder[s.event])
            for b in s.touches:
                r = b.rank
                if r not in synced[q]:
                    out.append(Step(q, "wait", event=starts[r]))
                    synced[q].add(r)
            out.append(s)
            for b in s.touches:
                if b.rank != q:
                    last_touch[(q, b.rank)] = len(out) - 1

        # End fences: after q's last touch of r's buffer, q records an event r waits on.
        # Insert the records from the back so earlier indices stay valid.
        waits: dict[int, list[int]] = {r: [] for r in range(n)}
        inserts: list[tuple[int, Step]] = []
        for (q, r), idx in last_touch.items():
            ev = n_events
            n_events += 1
            inserts.append((idx + 1, Step(q, "record", event=ev)))
            waits[r].append(ev)
        for idx, st in sorted(inserts, key=lambda t: t[0], reverse=True):
            out.insert(idx, st)
        ends: dict[int, int] = {}
        for r in range(n):
            for ev in sorted(waits[r]):
                out.append(Step(r, "wait", event=ev))
            ends[r] = n_events
            out.append(Step(r, "record", event=n_events))
            n_events += 1
        return Plan(
            size=n,
            steps=out,
            n_events=n_events,
            scratch=dict(self.scratch),
            stage=dict(self.stage),
            same_buffer=self.same_buffer,
            start_events=starts,
            end_events=ends,
            description=self.description,
        )


# -- static race check --------------------------------------------------------------------


def _region(b: Buf, same_buffer: bool) -> tuple[int, str]:
    role = IN if (same_buffer and b.role == OUT) else b.role
    return b.rank, role


def check_races(plan: Plan) -> list[str]:
    """Report conflicting accesses not ordered by the plan's events (empty list: none).

    Each stream is a sequence of steps; ``record``/``wait`` pairs add happens-before edges.
    Every access is stamped with a vector clock; two accesses to overlapping ranges of the
    same buffer, at least one a write, on different streams, must be ordered.
    """
    n = plan.size
    clocks = [[0] * n for _ in range(n)]
    event_clock: dict[int, list[int]] = {}
    accesses: dict[tuple[int, str], list[tuple[int, int, bool, int, list[int], str]]] = {}
    problems: list[str] = []
    for i, s in enumerate(plan.steps):
        q = s.rank
        clocks[q][q] += 1
        if s.kind == "record":
            event_clock[s.event] = list(clocks[q])
            continue
        if s.kind == "wait":
            ec = event_clock.get(s.event)
            if ec is None:
                problems.append(f"step {i}: r{q} waits on e{s.event} before it is recorded")
                continue
            clocks[q] = [max(a, b) for a, b in zip(clocks[q], ec)]
            continue
        stamp = list(clocks[q])
        assert s.dst is not None, f"step {i}: a {s.kind} step without a destination"
        touched = [(s.dst, True)] + [(b, False) for b in s.srcs]
        for b, write in touched:
            key = _region(b, plan.same_buffer)
            lo, hi = b.offset, b.offset + b.count
            for plo, phi, pwrite, pq, pstamp, pdesc in accesses.get(key, ()):
                if pq == q or not (write or pwrite) or phi <= lo or hi <= plo:
                    continue
                # ordered iff the earlier access's own clock entry is covered by ours
                if pstamp[pq] > stamp[pq]:
                    problems.append(
                        f"step {i} r{q} {'writes' if write else 'reads'} {_fmt(b)} "
                        f"unordered with {pdesc}"
                    )
            accesses.setdefault(key, []).append(
                (lo, hi, write, q, stamp, f"step {i} r{q} {s.kind} {_fmt(b)}")
            )
    return problems


def _round_up(x: int, align: int) -> int:
    return -(-x // align) * align


def split(count: int, parts: int, align: int = 1) -> list[tuple[int, int]]:
    """``count`` elements in ``parts`` contiguous pieces, as (offset, count): every offset a
    multiple of ``align``, the sizes within ``align`` of each other (whole ``align`` units
    dealt out as evenly as possible, the last piece also taking the ``count % align``
    elements left over). ``align=1`` is an even split to the element."""
    units, rest = divmod(count, align)
    base, extra = divmod(units, parts)
    out, off = [], 0
    for i in range(parts):
        c = (base + (1 if i < extra else 0)) * align + (rest if i == parts - 1 else 0)
        out.append((off, c))
        off += c
    return out


def aligned_chunk(chunk: int, align: int) -> int:
    """``chunk`` elements rounded down to a multiple of ``align`` (at least ``align``), so
    that pieces cut from an aligned offset stay aligned."""
    return max(align, chunk // align * align)


def chunked(total: int, chunk: int) -> Iterable[tuple[int, int]]:
    """(offset, count) pieces of at most ``chunk`` elements covering ``total`` (>= 1 piece)."""
    if total <= 0:
        yield 0, 0
        return
    for off in range(0, total, chunk):
        yield off, min(chunk, total - off)
