"""Which parts of a process's user buffers go through its shared mirrors, and when.

A user buffer that another process of the node reads or writes is mirrored in shared
memory. Copying the whole buffer in before the call and out after it costs two passes
over it; most of that is avoidable, element range by element range:

* a range no other process touches stays in the user's buffer: no copy;
* a range another process touches lives in the mirror until the last such access; its
  initial value is copied in only if the first access reads it;
* after the last access by another process, the owner's first write to the range goes
  to the user's buffer (and every later access follows it there), so the range is not
  copied back; a range whose last value is still in the mirror (written by another
  process, or read by one after the owner's last write) is copied back.

The owner's steps are rewritten accordingly: a buffer range is named by its role
(``in``/``out``: the user's buffer) or its mirror role (``m:in``/``m:out``), and a step
whose ranges fall partly in each is split (copies and reduces are elementwise, so a
step over a range is the same as its steps over the pieces). Sends to other nodes read
one range; where that range is split, :func:`plan` gives up (``None``) and the call
mirrors whole buffers, as before.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

from ..plan import IN, OUT, Buf, Step
from .schedule import Item

MIRROR = {IN: "m:in", OUT: "m:out"}


@dataclass
class Staging:
    """The rewritten steps of this process (by the plan's data-step index; a step absent
    is unchanged), the rewritten source of each send (by position in the items), and the
    ranges to copy: (rank, buffer id, offset, count) (see :func:`plan`)."""

    steps: dict[int, list[Step]] = field(default_factory=dict)
    sends: dict[int, Buf] = field(default_factory=dict)
    copy_in: list[tuple[int, int, int, int]] = field(default_factory=list)
    copy_out: list[tuple[int, int, int, int]] = field(default_factory=list)


@dataclass
class _Access:
    index: int  # data-step index (global order)
    mine: bool  # performed by this process (its steps, and its sends to other nodes)
    write: bool
    buf: Buf
    lo: int  # the range in the buffer's coordinates (the one buffer, in place)
    hi: int


def plan(
    data_steps: Sequence[Step],
    exec_proc: Sequence[int],
    items: Sequence[Item],
    me: int,
    node_procs: Collection[int],
    mirrored: Mapping[tuple[int, str], int],
    one_buffer: Collection[int],
) -> Staging | None:
    """``data_steps``: the plan's data steps; ``exec_proc[i]``: the process performing
    step ``i``; ``items``: this process's schedule; ``node_procs``: the processes sharing
    memory with this one; ``mirrored``: this process's mirrored (rank, role), each with
    the role's offset in its buffer's coordinates; ``one_buffer``: the ranks whose input
    and output are one buffer (in place: one mirror, buffer id 0). Copy ranges are in
    buffer coordinates: (rank, buffer id, offset, count), id 0 the input (or the one
    buffer), 1 the output."""
    if not mirrored:
        return Staging()

    def key(b: Buf) -> tuple[int, int]:
        return (b.rank, 0 if b.rank in one_buffer or b.role == IN else 1)

    acc: dict[tuple[int, int], list[_Access]] = {}
    for i, s in enumerate(data_steps):
        for j, b in enumerate(s.touches):
            if (b.rank, b.role) not in mirrored:
                continue
            write = j == 0 and s.dst is not None
            # another node's step reading this process's buffer: this process's send
            mine = exec_proc[i] == me or exec_proc[i] not in node_procs
            base = mirrored[(b.rank, b.role)] + b.offset
            acc.setdefault(key(b), []).append(_Access(i, mine, write, b, base, base + b.count))
    # per access (step, range object, write) its pieces: (lo, hi, in the mirror)
    where: dict[tuple[int, int, bool], list[tuple[int, int, bool]]] = {}
    out = Staging()
    for k, accesses in acc.items():
        accesses.sort(key=lambda a: (a.index, a.write))  # a step reads, then writes
        cuts = sorted({a.lo for a in accesses} | {a.hi for a in accesses})
        for lo, hi in zip(cuts, cuts[1:], strict=False):
            on = [a for a in accesses if a.lo <= lo and hi <= a.hi]
            if not on:
                continue
            others = [a.index for a in on if not a.mine]
            if not others:
                for a in on:
                    where.setdefault((a.index, id(a.buf), a.write), []).append((lo, hi, False))
                continue
            last_other = max(others)
            if not on[0].write:  # the initial value is read: it must be in the mirror
                out.copy_in.append((k[0], k[1], lo, hi - lo))
            cur = True  # where the value is now: the mirror
            written = False
            for a in on:
                if a.index <= last_other:
                    m = True
                elif a.write and cur:
                    cur = m = False  # the owner's first write after the others: the user's
                else:
                    m = cur
                written = written or a.write
                where.setdefault((a.index, id(a.buf), a.write), []).append((lo, hi, m))
            if cur and written:
                out.copy_out.append((k[0], k[1], lo, hi - lo))
    # sends: one range, one memory, or give up
    for n, it in enumerate(items):
        if it.kind != "send" or it.src is None or (it.src.rank, it.src.role) not in mirrored:
            continue
        kinds = {m for _, _, m in where.get((it.index, id(it.src), False), [])}
        if len(kinds) != 1:
            return None
        out.sends[n] = _named(it.src, kinds.pop())
    # this process's steps (as its schedule has them: sources from other nodes already
    # read from the receive arena)
    for it in items:
        if it.kind == "step" and it.step is not None:
            new = _rewrite(it.step, where, mirrored, it.index)
            if new is not None:
                out.steps[it.index] = new
    out.copy_in = _merge(out.copy_in)
    out.copy_out = _merge(out.copy_out)
    return out


def _rewrite(
    s: Step,
    where: Mapping[tuple[int, int, bool], list[tuple[int, int, bool]]],
    mirrored: Mapping[tuple[int, str], int],
    i: int,
) -> list[Step] | None:
    """Step ``s`` (data step ``i``) with each range named by where it lives, split where
    its ranges change memory; None where it touches no mirrored buffer."""
    touches = s.touches
    pieces_of = [where.get((i, id(b), j == 0 and s.dst is not None)) for j, b in enumerate(touches)]
    if all(p is None for p in pieces_of):
        return None
    count = touches[0].count
    rel = {0, count}
    for b, p in zip(touches, pieces_of, strict=True):
        if p is not None:
            base = mirrored[(b.rank, b.role)] + b.offset
            rel |= {lo - base for lo, _, _ in p} | {hi - base for _, hi, _ in p}
    cuts = sorted(x for x in rel if 0 <= x <= count)
    new: list[Step] = []
    for lo, hi in zip(cuts, cuts[1:], strict=False):
        parts = []
        for b, p in zip(touches, pieces_of, strict=True):
            sub = b.sub(lo, hi - lo)
            if p is not None:
                base = mirrored[(b.rank, b.role)] + b.offset
                m = next(m for plo, phi, m in p if plo <= base + lo and base + hi <= phi)
                sub = _named(sub, m)
            parts.append(sub)
        if s.dst is not None:
            dst, srcs = parts[0], tuple(parts[1:])
        else:
            dst, srcs = None, tuple(parts)
        new.append(Step(s.rank, s.kind, dst, srcs, s.op, s.alpha, s.event))
    return new


def _named(b: Buf, mirror: bool) -> Buf:
    return Buf(b.rank, MIRROR[b.role], b.offset, b.count) if mirror else b


def _merge(ranges: list[tuple[int, int, int, int]]) -> list[tuple[int, int, int, int]]:
    """Adjacent ranges of one buffer joined (fewer, longer copies)."""
    out: list[tuple[int, int, int, int]] = []
    for r, k, lo, n in sorted(ranges):
        if out and out[-1][0] == r and out[-1][1] == k and out[-1][2] + out[-1][3] == lo:
            out[-1] = (r, k, out[-1][2], out[-1][3] + n)
        else:
            out.append((r, k, lo, n))
    return out
