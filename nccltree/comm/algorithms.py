"""Algorithms: each turns a collective into a :class:`~nccltree.comm.plan.Plan`.

Conventions shared by every builder:

* ``count`` is the element count of each rank's *input* for all_reduce, reduce and
  broadcast; of each rank's input *block* for all_gather (output: ``size * count``); and of
  each rank's *output* block for reduce_scatter (input: ``size * count``).
* ``res(r)`` is where rank ``r``'s result goes: its output buffer, or its input buffer
  when the call is in place.
* Summation order is fixed by the plan (tree shape, ring position, rank order), never by
  arrival, so every run gives bitwise the same result.

tree   — reduce up a topology-aware tree (a parent sums itself and all its children in one
         fused pass, reading the children's buffers directly), then send the result down
         it, the most distant subtree first; cut into chunks so that levels and the two
         directions work concurrently (with several chunks, each child with peer access
         copies from its parent on its own stream, so the parent's stream goes on to its
         next chunk; links without peer access go through pinned staging).
ring   — reduce-scatter then all-gather around the ring, chunked; bandwidth-optimal on
         links that can't all be used at once.
direct — every rank reduces its 1/N slice reading all peers, then writes it to every peer:
         about 2N buffer passes in total, the least traffic in shared memory (one host,
         NVSwitch). Needs every pair of devices to reach each other.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from ..backends.base import MAX_FUSED
from .plan import IN, OUT, Buf, Plan, PlanBuilder, align_elements, aligned_chunk, chunked, split

if TYPE_CHECKING:
    from ..tree import Tree

MAX_FAN_IN = MAX_FUSED  # sources one native reduce pass takes


def _res_role(in_place: bool) -> str:
    return IN if in_place else OUT


def _reduce_many(b: PlanBuilder, rank: int, dst: Buf, srcs: list[Buf], op: str) -> None:
    """dst = op(srcs) in passes of at most MAX_FAN_IN sources, in a fixed order."""
    if dst in srcs[MAX_FAN_IN:]:
        # The accumulator must not be overwritten before it is read.
        srcs = [dst] + [s for s in srcs if s != dst]
    b.reduce(rank, dst, srcs[:MAX_FAN_IN], op)
    rest = srcs[MAX_FAN_IN:]
    while rest:
        b.reduce(rank, dst, [dst, *rest[: MAX_FAN_IN - 1]], op)
        rest = rest[MAX_FAN_IN - 1 :]


def _finish_mean(b: PlanBuilder, rank: int, buf: Buf, op: str, size: int) -> None:
    # the 1/size goes into the sum that has just produced buf when it can, which saves a
    # pass over buf (and rounds float16 once); otherwise, e.g. after a copy, a scale step
    if op == "mean" and size > 1 and not b.fold_scale(rank, buf, 1.0 / size):
        b.scale(rank, buf, 1.0 / size)


def _kernel_op(op: str) -> str:
    return "sum" if op == "mean" else op


# -- tree ---------------------------------------------------------------------------------


def _tree_orders(tree: Tree) -> tuple[list[int], list[int]]:
    """(children-before-parents order, parents-before-children order) of the tree's ranks."""
    pre: list[int] = []
    frontier = [tree.root]
    while frontier:
        r = frontier.pop(0)
        pre.append(r)
        frontier.extend(tree.children(r))
    height: dict[int, int] = {}
    for r in reversed(pre):
        height[r] = 1 + max((height[k] for k in tree.children(r)), default=-1)
    post = sorted(pre, key=lambda r: (height[r], pre.index(r)))
    return post, pre


def _subtree(tree: Tree, r: int) -> list[int]:
    out, stack = [], [r]
    while stack:
        x = stack.pop()
        out.append(x)
        stack.extend(tree.children(x))
    return sorted(out)


def _ranges(blocks: list[int], count: int) -> list[tuple[int, int]]:
    """Merge sorted block indices into (offset, count) element ranges."""
    out: list[tuple[int, int]] = []
    for blk in blocks:
        off = blk * count
        if out and out[-1][0] + out[-1][1] == off:
            out[-1] = (out[-1][0], out[-1][1] + count)
        else:
            out.append((off, count))
    return out


class _Stager:
    """Moves data across tree edges whose devices have no peer access, through pinned host
    memory: the sender copies a chunk into one of two staging slots of its own, the
    receiver copies it out. Double buffering with "slot free" events bounds the staging
    memory to two chunks per rank while sender and receiver overlap."""

    SLOTS = 2

    def __init__(self, b: PlanBuilder, tree: Tree, chunk: int) -> None:
        self.b, self.chunk = b, chunk
        self.p2p = lambda i, j: tree.topology.link(i, j).p2p
        self.areas: dict[int, Buf] = {}
        self.turn: dict[int, int] = {}
        self.free: dict[tuple[int, int], int] = {}

    def direct(self, i: int, j: int) -> bool:
        return self.p2p(i, j)

    def send(self, sender: int, receiver: int, dst: Buf, src: Buf) -> None:
        """dst (on receiver) <- src (on sender), in chunks through the sender's slots; the
        copy out of the last slot is on the receiver's stream, so later work of the
        receiver is ordered after it."""
        b = self.b
        if sender not in self.areas:
            self.areas[sender] = b.alloc_stage(sender, self.SLOTS * self.chunk)
            self.turn[sender] = 0
        for off, c in chunked(src.count, self.chunk):
            if not c:
                continue
            slot = self.turn[sender]
            self.turn[sender] = (slot + 1) % self.SLOTS
            area = self.areas[sender].sub(slot * self.chunk, c)
            if (sender, slot) in self.free:
                b.wait(sender, self.free[(sender, slot)])
            b.copy(sender, area, src.sub(off, c))
            b.wait(receiver, b.signal(sender))
            b.copy(receiver, dst.sub(off, c), area)
            self.free[(sender, slot)] = b.signal(receiver)


def _tree_reduce_phase(
    b: PlanBuilder,
    tree: Tree,
    post: list[int],
    part: Callable[[int], Buf],
    own: Callable[[int], Buf],
    off: int,
    c: int,
    op: str,
    ready: dict[tuple[int, int], int],
    key: int,
    stager: _Stager,
    landing: dict[tuple[int, int], Buf],
) -> None:
    """One chunk of the reduction up the tree: part(r) <- own(r) + sum(part(children)).

    A child behind a link without peer access sends its chunk through the stager into a
    landing area in the parent's scratch memory, which the fused pass then reads."""
    for r in post:
        kids = tree.children(r)
        if not kids:
            continue
        srcs = [own(r).sub(off, c)]
        for k in kids:
            if stager.direct(r, k):
                if (k, key) in ready:
                    b.wait(r, ready[(k, key)])
                srcs.append(part(k).sub(off, c))
            else:
                if (r, k) not in landing:
                    landing[(r, k)] = b.alloc_scratch(r, stager.chunk)
                land = landing[(r, k)].sub(0, c)
                stager.send(k, r, land, part(k).sub(off, c))
                srcs.append(land)
        _reduce_many(b, r, part(r).sub(off, c), srcs, _kernel_op(op))
        if r != tree.root:
            ready[(r, key)] = b.signal(r)


def _tree_down_phase(
    b: PlanBuilder,
    tree: Tree,
    pre: list[int],
    src: Callable[[int], Buf],
    dst: Callable[[int], Buf],
    ranges: Callable[[int], list[tuple[int, int]]],
    stager: _Stager,
    pull: bool,
) -> None:
    """Down the tree, parents before children, the most distant child first.

    ``pull``: a child with peer access copies the data on its own stream once its parent
    has it, so the parent's stream goes on to its next chunk while its children copy
    this one; the builders ask for it when a message has more than one chunk. Otherwise
    the parent writes the data into its children's buffers on its own stream, from its
    cache, and each child waits for that. A child without peer access always gets the
    data through the parent's staging slots."""
    for r in pre:
        kids = tree.children(r)
        has = b.signal(r) if pull and any(stager.direct(r, k) for k in kids) else None
        for k in kids:
            if not stager.direct(r, k):
                for off, c in ranges(k):
                    stager.send(r, k, dst(k).sub(off, c), src(r).sub(off, c))
            elif pull:
                assert has is not None  # signalled above: k has peer access
                b.wait(k, has)
                for off, c in ranges(k):
                    b.copy(k, dst(k).sub(off, c), src(r).sub(off, c))
            else:
                for off, c in ranges(k):
                    b.copy(r, dst(k).sub(off, c), src(r).sub(off, c))
                b.wait(k, b.signal(r))


def _same_for_all(pieces: list[tuple[int, int]]) -> Callable[[int], list[tuple[int, int]]]:
    """``ranges`` for :func:`_tree_down_phase` that gives every child the same pieces."""
    return lambda _k: pieces


def _interleave(
    n_chunks: int, lag: int, up: Callable[[int], None], down: Callable[[int], None]
) -> None:
    """Issue chunk t's upward work, then chunk t-lag's downward work, so both phases
    progress together on every stream instead of one strictly after the other."""
    for t in range(n_chunks + lag):
        if t < n_chunks:
            up(t)
        if t - lag >= 0:
            down(t - lag)


def tree_all_reduce(
    tree: Tree, count: int, op: str, in_place: bool, chunk: int, align: int = 1
) -> Plan:
    n = tree.n
    b = PlanBuilder(n, f"tree all_reduce {op} count={count}", same_buffer=in_place, align=align)
    post, pre = _tree_orders(tree)
    role = _res_role(in_place)

    def own(r: int) -> Buf:
        return Buf(r, IN, 0, count)

    def part(r: int) -> Buf:
        # A leaf's contribution is its input, read in place; inner nodes accumulate in
        # their result buffer (overwritten by the final value later anyway).
        return own(r) if not tree.children(r) else Buf(r, role, 0, count)

    res = lambda r: Buf(r, role, 0, count)  # noqa: E731
    pieces = list(chunked(count, chunk))
    ready: dict[tuple[int, int], int] = {}
    stager = _Stager(b, tree, chunk)
    landing: dict[tuple[int, int], Buf] = {}

    def up(i: int) -> None:
        off, c = pieces[i]
        _tree_reduce_phase(b, tree, post, part, own, off, c, op, ready, i, stager, landing)
        if n == 1 and not in_place:
            b.copy(0, res(0).sub(off, c), own(0).sub(off, c))
        _finish_mean(b, tree.root, res(tree.root).sub(off, c), op, n)

    def down(i: int) -> None:
        off, c = pieces[i]
        _tree_down_phase(b, tree, pre, res, res, lambda k: [(off, c)], stager, len(pieces) > 1)

    _interleave(len(pieces), max(1, tree.depth), up, down)
    return b.build()


def tree_reduce(
    tree: Tree, count: int, op: str, in_place: bool, chunk: int, align: int = 1
) -> Plan:
    """Reduce to ``tree.root``; inputs of other ranks stay unchanged (inner partial sums go
    to scratch memory)."""
    n, root = tree.n, tree.root
    b = PlanBuilder(
        n, f"tree reduce {op} root={root} count={count}", same_buffer=in_place, align=align
    )
    post, _ = _tree_orders(tree)
    role = _res_role(in_place)
    own = lambda r: Buf(r, IN, 0, count)  # noqa: E731
    partials = {r: b.alloc_scratch(r, count) for r in range(n) if r != root and tree.children(r)}

    def part(r: int) -> Buf:
        if r == root:
            return Buf(r, role, 0, count)
        return partials.get(r, own(r))

    ready: dict[tuple[int, int], int] = {}
    stager = _Stager(b, tree, chunk)
    landing: dict[tuple[int, int], Buf] = {}
    for i, (off, c) in enumerate(chunked(count, chunk)):
        _tree_reduce_phase(b, tree, post, part, own, off, c, op, ready, i, stager, landing)
        if n == 1 and not in_place:
            b.copy(root, part(root).sub(off, c), own(root).sub(off, c))
        _finish_mean(b, root, part(root).sub(off, c), op, n)
    return b.build()


def tree_broadcast(tree: Tree, count: int, in_place: bool, chunk: int, align: int = 1) -> Plan:
    n, root = tree.n, tree.root
    b = PlanBuilder(
        n, f"tree broadcast root={root} count={count}", same_buffer=in_place, align=align
    )
    _, pre = _tree_orders(tree)
    role = _res_role(in_place)

    def src(r: int) -> Buf:
        return Buf(r, IN if r == root else role, 0, count)

    stager = _Stager(b, tree, chunk)
    pieces = list(chunked(count, chunk))
    for off, c in pieces:
        if not in_place:
            b.copy(root, Buf(root, OUT, off, c), Buf(root, IN, off, c))
        _tree_down_phase(
            b,
            tree,
            pre,
            src,
            lambda k: Buf(k, role, 0, count),
            _same_for_all([(off, c)]),
            stager,
            len(pieces) > 1,
        )
    return b.build()


def tree_all_gather(tree: Tree, count: int, in_place: bool, chunk: int, align: int = 1) -> Plan:
    """Gather every rank's block up the tree into the root's output, then send the blocks
    each subtree lacks down the tree."""
    n = tree.n
    b = PlanBuilder(n, f"tree all_gather count={count}", align=align)
    post, pre = _tree_orders(tree)
    out = lambda r: Buf(r, OUT, 0, n * count)  # noqa: E731
    mine = lambda r: Buf(r, OUT, r * count, count) if in_place else Buf(r, IN, 0, count)  # noqa: E731
    ready: dict[int, int] = {}
    stager = _Stager(b, tree, chunk)
    for r in post:
        if not in_place:
            b.copy(r, out(r).sub(r * count, count), mine(r))
        for k in tree.children(r):
            for off, c in _ranges(_subtree(tree, k), count):
                if stager.direct(r, k):
                    if k in ready:
                        b.wait(r, ready.pop(k))
                    b.copy(r, out(r).sub(off, c), out(k).sub(off, c))
                else:
                    stager.send(k, r, out(r).sub(off, c), out(k).sub(off, c))
        if r != tree.root:
            ready[r] = b.signal(r)

    def missing(k: int) -> list[tuple[int, int]]:
        have = set(_subtree(tree, k))
        pieces: list[tuple[int, int]] = []
        for off, c in _ranges([x for x in range(n) if x not in have], count):
            pieces.extend((off + o, cc) for o, cc in chunked(c, chunk))
        return pieces

    _tree_down_phase(
        b,
        tree,
        pre,
        out,
        out,
        missing,
        stager,
        any(len(missing(k)) > 1 for k in range(n) if k != tree.root),
    )
    return b.build()


def tree_reduce_scatter(
    tree: Tree, count: int, op: str, in_place: bool, chunk: int, align: int = 1
) -> Plan:
    """Reduce the whole input to the root's scratch memory, then every rank copies its
    block from there."""
    n, root = tree.n, tree.root
    total = n * count
    b = PlanBuilder(n, f"tree reduce_scatter {op} count={count}", align=align)
    post, _ = _tree_orders(tree)
    own = lambda r: Buf(r, IN, 0, total)  # noqa: E731
    partials = {r: b.alloc_scratch(r, total) for r in range(n) if r == root or tree.children(r)}

    def part(r: int) -> Buf:
        return partials.get(r, own(r))

    ready: dict[tuple[int, int], int] = {}
    stager = _Stager(b, tree, chunk)
    landing: dict[tuple[int, int], Buf] = {}
    for i, (off, c) in enumerate(chunked(total, chunk)):
        _tree_reduce_phase(b, tree, post, part, own, off, c, op, ready, i, stager, landing)
        if n == 1:
            b.copy(root, part(root).sub(off, c), own(root).sub(off, c))
        _finish_mean(b, root, part(root).sub(off, c), op, n)
    done = b.signal(root)
    for r in range(n):
        dst = Buf(r, IN, r * count, count) if in_place else Buf(r, OUT, 0, count)
        block = part(root).sub(r * count, count)
        if r == root or stager.direct(root, r):
            if r != root:
                b.wait(r, done)
            b.copy(r, dst, block)
        else:
            stager.send(root, r, dst, block)
    return b.build()


# -- ring ---------------------------------------------------------------------------------


def _ring_reduce_scatter(
    b: PlanBuilder,
    n: int,
    segs: list[tuple[int, int]],
    op: str,
    chunk: int,
    src: Callable[[int], Buf],
    acc: Callable[[int], Buf],
    shift: int,
    final: Callable[[int], Buf],
) -> dict[tuple[int, int, int], int]:
    """Ring reduce-scatter. At step s rank r adds its own part of segment (r + shift - s)
    to the partial sum rank r-1 holds; after n-1 steps rank r has segment (r + shift + 2 -
    n) complete, written to final(r). Returns the events that mark each (rank, step, chunk)
    done."""
    ev: dict[tuple[int, int, int], int] = {}
    for s in range(n - 1):
        for r in range(n):
            p = (r - 1) % n
            seg = (r + shift - s) % n
            off, cnt = segs[seg]
            last = s == n - 2
            for i, (o, c) in enumerate(chunked(cnt, chunk)):
                if (p, s - 1, i) in ev:
                    b.wait(r, ev[(p, s - 1, i)])
                prev = src(p) if s == 0 else acc(p)
                dst = final(r) if last else acc(r)
                b.reduce(
                    r,
                    dst.sub(off + o, c),
                    [prev.sub(off + o, c), src(r).sub(off + o, c)],
                    _kernel_op(op),
                )
                if last:
                    _finish_mean(b, r, dst.sub(off + o, c), op, n)
                ev[(r, s, i)] = b.signal(r)
    return ev


def ring_all_reduce(
    n: int, count: int, op: str, in_place: bool, chunk: int, align: int = 1
) -> Plan:
    b = PlanBuilder(n, f"ring all_reduce {op} count={count}", same_buffer=in_place, align=align)
    role = _res_role(in_place)
    own = lambda r: Buf(r, IN, 0, count)  # noqa: E731
    acc = lambda r: Buf(r, role, 0, count)  # noqa: E731
    if n == 1:
        if not in_place:
            b.copy(0, acc(0), own(0))
        return b.build()
    segs = split(count, n, align)
    ev = _ring_reduce_scatter(b, n, segs, op, chunk, own, acc, shift=-1, final=acc)
    # all-gather: at step t rank r pulls segment (r - t) from rank r-1, which completed it
    # in the reduce-scatter (t = 0) or received it at step t-1.
    for t in range(n - 1):
        for r in range(n):
            p = (r - 1) % n
            off, cnt = segs[(r - t) % n]
            for i, (o, c) in enumerate(chunked(cnt, chunk)):
                key = (p, n - 2, i) if t == 0 else (p, n - 1 + t - 1, i)
                b.wait(r, ev[key])
                b.copy(r, acc(r).sub(off + o, c), acc(p).sub(off + o, c))
                ev[(r, n - 1 + t, i)] = b.signal(r)
    return b.build()


def ring_reduce(
    n: int, root: int, count: int, op: str, in_place: bool, chunk: int, align: int = 1
) -> Plan:
    """Ring reduce-scatter into scratch, then every segment owner sends its piece to root."""
    b = PlanBuilder(
        n, f"ring reduce {op} root={root} count={count}", same_buffer=in_place, align=align
    )
    role = _res_role(in_place)
    own = lambda r: Buf(r, IN, 0, count)  # noqa: E731
    if n == 1:
        if not in_place:
            b.copy(0, Buf(0, OUT, 0, count), own(0))
        return b.build()
    segs = split(count, n, align)
    tmps = {r: b.alloc_scratch(r, count) for r in range(n)}
    tmp = tmps.__getitem__
    dst = Buf(root, role, 0, count)
    _ring_reduce_scatter(b, n, segs, op, chunk, own, tmp, shift=-1, final=tmp)
    for r in range(n):
        off, cnt = segs[(r + 1) % n]
        b.copy(r, dst.sub(off, cnt), tmp(r).sub(off, cnt))
    return b.build()


def ring_broadcast(
    n: int, root: int, count: int, in_place: bool, chunk: int, align: int = 1
) -> Plan:
    """A chunked pipeline along the ring starting at root."""
    b = PlanBuilder(
        n, f"ring broadcast root={root} count={count}", same_buffer=in_place, align=align
    )
    role = _res_role(in_place)
    res = lambda r: Buf(r, role, 0, count)  # noqa: E731
    order = [(root + i) % n for i in range(n)]
    for off, c in chunked(count, chunk):
        if not in_place:
            b.copy(root, res(root).sub(off, c), Buf(root, IN, off, c))
        for prev, r in zip(order, order[1:]):
            src = Buf(prev, IN, off, c) if prev == root else res(prev).sub(off, c)
            b.copy(r, res(r).sub(off, c), src)
            if r != order[-1]:
                b.wait(order[order.index(r) + 1], b.signal(r))
    return b.build()


def ring_all_gather(n: int, count: int, in_place: bool, chunk: int, align: int = 1) -> Plan:
    b = PlanBuilder(n, f"ring all_gather count={count}", align=align)
    out = lambda r: Buf(r, OUT, 0, n * count)  # noqa: E731
    ev: dict[tuple[int, int], int] = {}
    for r in range(n):
        if not in_place:
            b.copy(r, out(r).sub(r * count, count), Buf(r, IN, 0, count))
        ev[(r, -1)] = b.signal(r)
    for t in range(n - 1):
        for r in range(n):
            p = (r - 1) % n
            blk = (p - t) % n
            b.wait(r, ev[(p, t - 1)])
            for o, c in chunked(count, chunk):
                b.copy(r, out(r).sub(blk * count + o, c), out(p).sub(blk * count + o, c))
            ev[(r, t)] = b.signal(r)
    return b.build()


def ring_reduce_scatter(
    n: int, count: int, op: str, in_place: bool, chunk: int, align: int = 1
) -> Plan:
    b = PlanBuilder(n, f"ring reduce_scatter {op} count={count}", align=align)
    total = n * count
    own = lambda r: Buf(r, IN, 0, total)  # noqa: E731

    def final(r: int) -> Buf:
        # rank r finishes block r; address it in whole-input coordinates
        return Buf(r, IN, 0, total) if in_place else Buf(r, OUT, -r * count, total)

    if n == 1:
        if not in_place:
            b.copy(0, Buf(0, OUT, 0, count), Buf(0, IN, 0, count))
        return b.build()
    tmps = {r: b.alloc_scratch(r, total) for r in range(n)}
    tmp = tmps.__getitem__
    segs = [(i * count, count) for i in range(n)]
    _ring_reduce_scatter(b, n, segs, op, chunk, own, tmp, shift=-2, final=final)
    return b.build()


# -- direct -------------------------------------------------------------------------------


def direct_all_reduce(
    n: int, count: int, op: str, in_place: bool, chunk: int, align: int = 1
) -> Plan:
    b = PlanBuilder(n, f"direct all_reduce {op} count={count}", same_buffer=in_place, align=align)
    role = _res_role(in_place)
    for r, (off, cnt) in enumerate(split(count, n, align)):
        for o, c in chunked(cnt, chunk):
            mine = Buf(r, role, off + o, c)
            _reduce_many(b, r, mine, [Buf(q, IN, off + o, c) for q in range(n)], _kernel_op(op))
            _finish_mean(b, r, mine, op, n)
            # Write the chunk to every peer right away (staggered so the ranks do not all
            # hit the same destination at once).
            for i in range(1, n):
                q = (r + i) % n
                b.copy(r, Buf(q, role, off + o, c), mine)
    return b.build()


def direct_reduce(
    n: int, root: int, count: int, op: str, in_place: bool, chunk: int, align: int = 1
) -> Plan:
    """Rank r reduces slice r of every input straight into the root's result."""
    b = PlanBuilder(
        n, f"direct reduce {op} root={root} count={count}", same_buffer=in_place, align=align
    )
    role = _res_role(in_place)
    for r, (off, cnt) in enumerate(split(count, n, align)):
        for o, c in chunked(cnt, chunk):
            dst = Buf(root, role, off + o, c)
            _reduce_many(b, r, dst, [Buf(q, IN, off + o, c) for q in range(n)], _kernel_op(op))
            _finish_mean(b, r, dst, op, n)
    return b.build()


def direct_broadcast(
    n: int, root: int, count: int, in_place: bool, chunk: int, align: int = 1
) -> Plan:
    """Every rank reads the root's buffer itself."""
    b = PlanBuilder(
        n, f"direct broadcast root={root} count={count}", same_buffer=in_place, align=align
    )
    role = _res_role(in_place)
    for r in range(n):
        if r == root and in_place:
            continue
        b.copy(r, Buf(r, role, 0, count), Buf(root, IN, 0, count))
    return b.build()


def direct_all_gather(n: int, count: int, in_place: bool, chunk: int, align: int = 1) -> Plan:
    b = PlanBuilder(n, f"direct all_gather count={count}", align=align)
    for r in range(n):
        src = Buf(r, OUT, r * count, count) if in_place else Buf(r, IN, 0, count)
        for i in range(n):
            q = (r + i) % n
            if q == r and in_place:
                continue
            b.copy(r, Buf(q, OUT, r * count, count), src)
    return b.build()


def direct_reduce_scatter(
    n: int, count: int, op: str, in_place: bool, chunk: int, align: int = 1
) -> Plan:
    b = PlanBuilder(n, f"direct reduce_scatter {op} count={count}", align=align)
    for r in range(n):
        dst = Buf(r, IN, r * count, count) if in_place else Buf(r, OUT, 0, count)
        for o, c in chunked(count, chunk):
            srcs = [Buf(q, IN, r * count + o, c) for q in range(n)]
            _reduce_many(b, r, dst.sub(o, c), srcs, _kernel_op(op))
            _finish_mean(b, r, dst.sub(o, c), op, n)
    return b.build()


# -- dispatch -----------------------------------------------------------------------------

ALGORITHMS = ("tree", "ring", "direct")


def build_plan(
    algorithm: str,
    collective: str,
    *,
    size: int,
    count: int,
    op: str = "sum",
    root: int = 0,
    in_place: bool = False,
    chunk: int = 1 << 18,
    tree_for: Callable[[int], Tree] | None = None,
    itemsize: int | None = None,
) -> Plan:
    """The plan of ``collective`` by ``algorithm``. ``tree_for(root)`` gives the tree (only
    the tree algorithm needs it); ``chunk`` is in elements.

    ``itemsize`` (bytes per element) makes every offset the plan chooses itself a multiple
    of :data:`~nccltree.comm.plan.ALIGN_BYTES`: the slices of ring and direct, the chunks
    (``chunk`` is rounded down to a multiple, at least one), scratch and staging regions.
    Offsets the call fixes (the blocks of all_gather and reduce_scatter) stay where they
    are. Without it the plan works to the element (the data flow is the same)."""
    align = align_elements(itemsize)
    chunk = aligned_chunk(max(1, int(chunk)), align)
    build = _BUILDERS.get((algorithm, collective))
    if build is None:
        raise ValueError(f"no plan for {algorithm!r} {collective!r}")
    if algorithm == "tree":
        if tree_for is None:
            raise ValueError("the tree algorithm needs a tree")
        # rooted collectives need the tree rooted there; the others use rank 0's
        topo: Tree | int = tree_for(root if collective in ("reduce", "broadcast") else 0)
    else:
        topo = size
    return build(topo, root=root, count=count, op=op, in_place=in_place, chunk=chunk, align=align)


def _table() -> dict[tuple[str, str], Callable[..., Plan]]:
    """(algorithm, collective) -> builder(tree or size, *, root, count, op, in_place, chunk,
    align)."""

    def rooted(fn):  # builders that take (size, root, ...)
        return lambda t, *, root, count, op, in_place, chunk, align: fn(
            t, root, count, op, in_place, chunk, align
        )

    def rooted_nop(fn):  # ... without an op
        return lambda t, *, root, count, op, in_place, chunk, align: fn(
            t, root, count, in_place, chunk, align
        )

    def plain(fn):
        return lambda t, *, root, count, op, in_place, chunk, align: fn(
            t, count, op, in_place, chunk, align
        )

    def plain_nop(fn):
        return lambda t, *, root, count, op, in_place, chunk, align: fn(
            t, count, in_place, chunk, align
        )

    return {
        ("tree", "all_reduce"): plain(tree_all_reduce),
        ("tree", "reduce"): plain(tree_reduce),  # the tree is rooted at root already
        ("tree", "broadcast"): plain_nop(tree_broadcast),
        ("tree", "all_gather"): plain_nop(tree_all_gather),
        ("tree", "reduce_scatter"): plain(tree_reduce_scatter),
        ("ring", "all_reduce"): plain(ring_all_reduce),
        ("ring", "reduce"): rooted(ring_reduce),
        ("ring", "broadcast"): rooted_nop(ring_broadcast),
        ("ring", "all_gather"): plain_nop(ring_all_gather),
        ("ring", "reduce_scatter"): plain(ring_reduce_scatter),
        ("direct", "all_reduce"): plain(direct_all_reduce),
        ("direct", "reduce"): rooted(direct_reduce),
        ("direct", "broadcast"): rooted_nop(direct_broadcast),
        ("direct", "all_gather"): plain_nop(direct_all_gather),
        ("direct", "reduce_scatter"): plain(direct_reduce_scatter),
    }


_BUILDERS = _table()
