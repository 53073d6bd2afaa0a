"""A plan cut into one schedule per process: which steps each process performs, what it
waits for before each, and which messages cross between nodes.

Every process builds the same plan and the same schedules from it (both are
deterministic data), then performs its own schedule. A step runs in the process that
owns its stream's rank, except when its destination lives on another node: then the
destination's process performs it and pulls the sources it lacks (the writes to a
node's memory all happen on that node).

Ordering comes from vector clocks. Walking the plan in its global order, each stream
carries the set of steps that happened before its current point (as "process q has
completed k of its steps", one number per process, since each process performs its
steps in global order); a ``record`` copies the stream's clock into the event, a
``wait`` merges the event's clock into the stream's. A step then needs, from every
other process q, its first ``need[q]`` steps:

* q on the same node: wait on q's progress counter in shared memory;
* q on another node: a message from q. A source that lives on another node arrives as
  a **data** message, sent by its owner at the same point of the global order once the
  owner's node has produced it; knowledge that q progressed travels with data, and
  where it did not, q sends a small **notify** message right after the step needed.

Each process performs its items (steps, sends, notifies) in the global order of the
steps they belong to, so the earliest unfinished item of the whole group can always
proceed: schedules cannot deadlock.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from ..plan import Buf, Plan, Step

#: the role of a range of the receive arena (where data from other nodes lands)
RECV = "recv"


@dataclass(frozen=True)
class Item:
    """One thing a process does, in order.

    ``kind``: ``end`` (the process's last waits: its buffers are free), ``step`` (perform ``step``, the plan's data step number ``index``, with
    sources from other nodes replaced by receive-arena ranges), ``send`` (send ``src`` to
    process ``peer`` as message ``tag``) or ``notify`` (send an empty message ``tag`` to
    ``peer``). ``waits``: (process, steps) on this node to wait for first; ``recvs``:
    (process, tag) messages to have received first (a step's data and notifications).
    """

    kind: str
    index: int = -1
    step: Step | None = None
    peer: int = -1
    tag: int = -1
    src: Buf | None = None
    waits: tuple[tuple[int, int], ...] = ()
    recvs: tuple[tuple[int, int], ...] = ()
    #: where the item sits in the group's global order (every process sorts its items by
    #: it): the plan position of its step, then sends (0), the step (1), notifies (2)
    key: tuple[int, int, int] = (0, 0, 0)


@dataclass
class Schedule:
    """One process's part of a plan (see the module docstring)."""

    proc: int
    items: list[Item] = field(default_factory=list)
    #: steps this process performs (its progress counter counts them)
    n_steps: int = 0
    #: messages this process receives: (sender, tag, elements, arena offset), in order
    recvs: list[tuple[int, int, int, int]] = field(default_factory=list)
    #: elements of the receive arena
    arena: int = 0
    #: the (rank, role) buffers that processes of this node other than the owner touch
    exposed: set[tuple[int, str]] = field(default_factory=set)


def split(plan: Plan, proc_of_rank: Sequence[int], node_of_proc: Sequence[int]) -> list[Schedule]:
    """Every process's schedule for ``plan``; ranks are mapped to processes by
    ``proc_of_rank`` and processes to nodes by ``node_of_proc``."""
    nproc = len(node_of_proc)
    scheds = [Schedule(p) for p in range(nproc)]
    keyed: list[list[tuple[tuple[int, int, int], Item]]] = [[] for _ in range(nproc)]
    counts = [0] * nproc
    stream_vc: dict[int, dict[int, int]] = {}
    event_vc: dict[int, dict[int, int]] = {}
    known = [[0] * nproc for _ in range(nproc)]  # known[x][q]: q's progress x has heard of
    tags: dict[tuple[int, int], int] = {}  # (sender, receiver) -> next tag
    pos_of = [[0] * 1 for _ in range(nproc)]  # pos_of[q][k]: global position of q's k-th step
    node = list(node_of_proc)

    def proc(rank: int) -> int:
        return proc_of_rank[rank]

    def next_tag(a: int, b: int) -> int:
        t = tags.get((a, b), 0)
        tags[(a, b)] = t + 1
        return t

    def order(x: int, need: dict[int, int], recvs: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """What ``x`` must see before going on: the node's processes' progress (returned:
        (process, steps) to wait for), and from other nodes a notify where nothing x has
        received already implies it (appended to ``recvs``)."""
        waits = []
        for q, k in sorted(need.items()):
            if q == x or not k:
                continue
            if node[q] == node[x]:
                waits.append((q, k))
            elif known[x][q] < k:
                # q tells x once it has performed its k-th step
                tag = next_tag(q, x)
                keyed[q].append(((pos_of[q][k], 2, len(keyed[q])), Item("notify", peer=x, tag=tag)))
                recvs.append((q, tag))
                scheds[x].recvs.append((q, tag, 0, -1))
                known[x][q] = k
        return waits

    index = -1
    for gpos, s in enumerate(plan.steps):
        if s.kind == "record":
            event_vc[s.event] = dict(stream_vc.get(s.rank, {}))
            continue
        if s.kind == "wait":
            vc = stream_vc.setdefault(s.rank, {})
            for q, k in event_vc.get(s.event, {}).items():
                if vc.get(q, 0) < k:
                    vc[q] = k
            continue
        index += 1
        x = proc(s.rank)
        if s.dst is not None and node[proc(s.dst.rank)] != node[x]:
            x = proc(s.dst.rank)  # the destination's node performs it
        need = dict(stream_vc.get(s.rank, {}))
        # sources from other nodes: data messages, sent by the source's owner at this
        # point of the global order, once the owner's node has produced them
        srcs = list(s.srcs)
        recvs: list[tuple[int, int]] = []
        for j, b in enumerate(s.srcs):
            o = proc(b.rank)
            if node[o] == node[x]:
                continue
            tag = next_tag(o, x)
            sw = tuple(
                (q, k) for q, k in sorted(need.items()) if q != o and node[q] == node[o] and k
            )
            keyed[o].append(
                ((gpos, 0, len(keyed[o])), Item("send", index, peer=x, tag=tag, src=b, waits=sw))
            )
            off = scheds[x].arena
            scheds[x].recvs.append((o, tag, b.count, off))
            scheds[x].arena += b.count
            srcs[j] = Buf(s.dst.rank if s.dst is not None else s.rank, RECV, off, b.count)
            recvs.append((o, tag))
            # the owner waited for its node's part of ``need`` before sending
            for q, k in need.items():
                if node[q] == node[o] and known[x][q] < k:
                    known[x][q] = k
            if known[x][o] < need.get(o, 0):
                known[x][o] = need.get(o, 0)
        waits = order(x, need, recvs)
        for b in s.touches:
            o = proc(b.rank)
            if o != x and node[o] == node[x]:
                scheds[o].exposed.add((b.rank, b.role))
        step = Step(s.rank, s.kind, s.dst, tuple(srcs), s.op, s.alpha, s.event)
        keyed[x].append(
            (
                (gpos, 1, 0),
                Item("step", index=index, step=step, waits=tuple(waits), recvs=tuple(recvs)),
            )
        )
        counts[x] += 1
        pos_of[x].append(gpos)
        vc = stream_vc.setdefault(s.rank, {})
        vc[x] = counts[x]
    # the end: a process is done when its ranks' streams are (the plan's end fences: every
    # access by others to its buffers happened), so the caller may reuse them
    end = len(plan.steps)
    for x in range(nproc):
        last: dict[int, int] = {}
        for r, vc in stream_vc.items():
            if proc(r) == x:
                for q, k in vc.items():
                    if last.get(q, 0) < k:
                        last[q] = k
        recvs = []
        waits = order(x, last, recvs)
        if waits or recvs:
            keyed[x].append(((end, 1, 0), Item("end", waits=tuple(waits), recvs=tuple(recvs))))
    for p in range(nproc):
        keyed[p].sort(key=lambda kv: kv[0])
        scheds[p].items = [replace(it, key=k) for k, it in keyed[p]]
        scheds[p].n_steps = counts[p]
    return scheds
