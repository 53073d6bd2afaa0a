"""tree: reduce up a topology-aware tree, then send the result down it.

A parent sums itself and all its children in one fused pass, reading the children's
buffers directly; the result goes down the tree, the most distant subtree first. Messages
are cut into chunks so that levels and the two directions work concurrently (with several
chunks, each child with peer access copies from its parent on its own stream, so the
parent's stream goes on to its next chunk); links without peer access go through pinned
staging.

Ranks that share one memory (``SAME_DEVICE`` links: virtual host devices, or ranks on one
GPU) help their parent with its fused pass: the parent's sum of a large chunk is cut into
contiguous pieces, one per member of the team (the parent and such children), each
member summing its piece from the same sources in the same order into the parent's
buffer. Every element is still summed by one pass over the same sources in the same
order, so results are bitwise those of the parent summing alone; only who does the
arithmetic changes. The pieces are sized so that every rank moves about as many bytes in
all (water-filling each team's work over its members' loads), which a parent summing
alone does not: at 2 ranks it reads and writes 3 bytes per byte of message, its child 2.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from ...topology import LinkKind
from ..plan import IN, OUT, Buf, PlanBuilder, chunked
from ._base import BufOf, PlanRequest, builds, finish_mean, reduce_many

if TYPE_CHECKING:
    from ...tree import Tree

Ranges = Callable[[int], list[tuple[int, int]]]  # rank -> the (offset, count) pieces it gets


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


def _ranges(blocks: tuple[int, ...] | list[int], count: int) -> list[tuple[int, int]]:
    """Merge sorted block indices into (offset, count) element ranges."""
    out: list[tuple[int, int]] = []
    for blk in blocks:
        off = blk * count
        if out and out[-1][0] + out[-1][1] == off:
            out[-1] = (out[-1][0], out[-1][1] + count)
        else:
            out.append((off, count))
    return out


# A team shares a chunk's sum only when the chunk has at least this many bytes (below it
# the extra cross-stream hand-offs cost more than the arithmetic they spread), and gives a
# member a piece only if it gets at least MIN_PIECE_BYTES.
SHARE_MIN_BYTES = 1 << 20
MIN_PIECE_BYTES = 64 << 10


def _shares(tree: Tree, base: Callable[[int], float]) -> dict[int, list[tuple[int, float]]]:
    """For each parent whose children share its memory: its team as (member, fraction of
    the parent's sum), the parent first.

    ``base(r)`` is what rank r moves per element besides the sums (e.g. the copy down the
    tree). A parent's sum costs each element's sources read and its result written; each
    team's work is poured over its members' loads so far (lowest loads first), parents in
    children-before-parents order, so the total per rank comes out about even."""
    post, _ = _tree_orders(tree)
    topo = tree.topology
    load = {r: base(r) for r in range(tree.n)}
    teams: dict[int, list[tuple[int, float]]] = {}
    for r in post:
        kids = tree.children(r)
        if not kids:
            continue
        work = float(len(kids) + 2)  # own + children read, the result written
        helpers = [k for k in kids if topo.link(r, k).kind == LinkKind.SAME_DEVICE]
        # a helper reads every source: it must share memory with the parent's other
        # children too
        helpers = [
            k
            for k in helpers
            if all(topo.link(k, j).kind in (LinkKind.SELF, LinkKind.SAME_DEVICE) for j in kids)
        ]
        if not helpers:
            load[r] += work
            continue
        members = [r, *helpers]
        # water-filling: the level h with sum(max(0, h - load)) == work
        levels = sorted(load[m] for m in members)
        left, h = work, levels[0]
        for i in range(len(levels)):
            nxt = levels[i + 1] if i + 1 < len(levels) else float("inf")
            need = (nxt - levels[i]) * (i + 1)
            if need >= left:
                h = levels[i] + left / (i + 1)
                break
            left -= need
        parts = [(m, max(0.0, h - load[m]) / work) for m in members]
        for m, f in parts:
            load[m] += f * work
        teams[r] = parts
    return teams


def _pieces(
    team: list[tuple[int, float]], c: int, align: int, itemsize: int
) -> list[tuple[int, int, int]]:
    """(member, offset, count) pieces of a chunk of ``c`` elements by the team's fractions,
    in team order: offsets multiples of ``align``; a member whose piece would be smaller
    than ``MIN_PIECE_BYTES`` gets none (the parent, first, takes what the others leave)."""
    units = c // align
    min_units = max(1, MIN_PIECE_BYTES // (itemsize * align))
    sizes = [int(f * units) for _, f in team]
    sizes = [0] + [u if u >= min_units else 0 for u in sizes[1:]]
    sizes[0] = units - sum(sizes)
    counts = [u * align for u in sizes]
    # the elements past the last whole unit go to the last piece, so offsets stay aligned
    last = max(i for i, x in enumerate(counts) if x) if any(counts) else 0
    counts[last] += c - units * align
    out, off = [], 0
    for (m, _), cnt in zip(team, counts, strict=True):
        if cnt:
            out.append((m, off, cnt))
        off += cnt
    return out


def _same_for_all(pieces: list[tuple[int, int]]) -> Ranges:
    """``ranges`` for :meth:`_TreePlan.send_down` that gives every child the same pieces."""
    return lambda _k: pieces


class _Stager:
    """Moves data across tree edges whose devices have no peer access, through pinned host
    memory: the sender copies a chunk into one of two staging slots of its own, the
    receiver copies it out. Double buffering with "slot free" events bounds the staging
    memory to two chunks per rank while sender and receiver overlap."""

    SLOTS = 2

    def __init__(self, b: PlanBuilder, tree: Tree, chunk: int) -> None:
        self.b, self.tree, self.chunk = b, tree, chunk
        self.areas: dict[int, Buf] = {}
        self.turn: dict[int, int] = {}
        self.free: dict[tuple[int, int], int] = {}

    def direct(self, i: int, j: int) -> bool:
        """Whether ranks i and j reach each other's memory (else the stager carries)."""
        return self.tree.topology.link(i, j).p2p

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


class _TreePlan:
    """One tree plan in the making: the builder, the tree and its two visiting orders, the
    stager, the events that say a rank's partial sum of a chunk is ready (by (rank, chunk
    key)) and the landing areas in parents' scratch for children behind links without
    peer access (by (parent, child)). The phases below add to it chunk by chunk."""

    def __init__(
        self,
        b: PlanBuilder,
        tree: Tree,
        req: PlanRequest,
        base: Callable[[int], float] | None = None,
    ) -> None:
        """``base``: what each rank moves per element besides the sums up the tree (for
        sizing shared sums, see :func:`_shares`); None: no team shares a sum."""
        self.b, self.tree, self.req = b, tree, req
        self.post, self.pre = _tree_orders(tree)
        self.stager = _Stager(b, tree, req.chunk)
        self.ready: dict[tuple[int, int], int] = {}
        self.landing: dict[tuple[int, int], Buf] = {}
        self.itemsize = req.itemsize or 1
        self.teams = _shares(tree, base) if base is not None else {}
        # ranks that reach the root over shared memory all the way down: pulling a chunk
        # from the root costs them what pulling it from their parent costs, without
        # waiting for the levels in between
        topo, root = tree.topology, tree.root
        self.from_root: set[int] = set()
        for k in self.pre[1:]:
            parent = tree.parent(k)
            assert parent is not None
            if (parent == root or parent in self.from_root) and all(
                topo.link(a, k).kind == LinkKind.SAME_DEVICE for a in (parent, root)
            ):
                self.from_root.add(k)

    def reduce_up(
        self,
        part: BufOf,
        own: BufOf,
        key: int,
        off: int,
        c: int,
        total: Buf,
        signal_root: bool = False,
    ) -> int | None:
        """One chunk of the reduction up the tree: part(r) <- own(r) + sum(part(children)),
        finished in the root's ``total`` (a mean scaled there). On a tree of one rank the
        root's input is copied to ``total`` unless it is that buffer. ``signal_root``: the
        root records an event once the chunk is finished, returned (else None), so the
        chunk can go down the tree before the root's later work.

        A child behind a link without peer access sends its chunk through the stager into
        a landing area in the parent's scratch memory, which the fused pass then reads. A
        parent with a team (children sharing its memory) shares a large chunk's sum with
        them: each member sums its piece into the parent's buffer, and the parent waits
        for all of them before the chunk counts as summed."""
        b, tree, stager = self.b, self.tree, self.stager
        for r in self.post:
            kids = tree.children(r)
            if not kids:
                continue
            srcs = [own(r).sub(off, c)]
            waits: list[tuple[int, int]] = []  # (child, its "partial sum ready" event)
            for k in kids:
                if stager.direct(r, k):
                    if (k, key) in self.ready:
                        waits.append((k, self.ready[(k, key)]))
                    srcs.append(part(k).sub(off, c))
                else:
                    if (r, k) not in self.landing:
                        self.landing[(r, k)] = b.alloc_scratch(r, stager.chunk)
                    land = self.landing[(r, k)].sub(0, c)
                    stager.send(k, r, land, part(k).sub(off, c))
                    srcs.append(land)
            team = self.teams.get(r)
            if team is None or c * self.itemsize < SHARE_MIN_BYTES:
                for _, e in waits:
                    b.wait(r, e)
                reduce_many(b, r, part(r).sub(off, c), srcs, self.req.kernel_op)
            else:
                helped: list[int] = []
                for m, o, cnt in _pieces(team, c, self.req.align, self.itemsize):
                    for k, e in waits:
                        if k != m:  # a member's own partial sum is ordered on its stream
                            b.wait(m, e)
                    piece = [s.sub(o, cnt) for s in srcs]
                    reduce_many(b, m, part(r).sub(off + o, cnt), piece, self.req.kernel_op)
                    if m != r:
                        helped.append(b.signal(m))
                for e in helped:
                    b.wait(r, e)
            if r != tree.root:
                self.ready[(r, key)] = b.signal(r)
        root = tree.root
        dst, mine = total.sub(off, c), own(root).sub(off, c)
        if tree.n == 1 and dst != mine:
            b.copy(root, dst, mine)
        finish_mean(b, root, dst, self.req.op, tree.n)
        return b.signal(root) if signal_root else None

    def send_down(
        self,
        src: BufOf,
        dst: BufOf,
        ranges: Ranges,
        pull: bool,
        root_has: int | None = None,
    ) -> None:
        """Down the tree, parents before children, the most distant child first: child k
        gets the pieces ``ranges(k)`` of its parent's ``src`` in its ``dst``.

        ``pull``: a child with peer access copies the data on its own stream once its
        parent has it, so the parent's stream goes on to its next chunk while its children
        copy this one; the builders ask for it when a message has more than one chunk. A
        rank that reaches the root over shared memory all the way down pulls from the root
        itself as soon as the root has the data (the same bytes, no wait for the levels
        in between). Otherwise the parent writes the data into its children's buffers on
        its own stream, from its cache, and each child waits for that. A child without
        peer access always gets the data through the parent's staging slots.
        ``root_has``: an event the root recorded when it had the data (else it records one
        now)."""
        b, stager, root = self.b, self.stager, self.tree.root
        from_root = self.from_root if pull else set()
        root_event: int | None = None
        for r in self.pre:
            kids = self.tree.children(r)
            has = None
            pulls_from_r = [k for k in kids if stager.direct(r, k) and k not in from_root]
            if pull and (pulls_from_r or (r == root and from_root)):
                has = root_has if r == root and root_has is not None else b.signal(r)
            if r == root:
                root_event = has
            for k in kids:
                if not stager.direct(r, k):
                    for off, c in ranges(k):
                        stager.send(r, k, dst(k).sub(off, c), src(r).sub(off, c))
                elif pull:
                    giver, event = (root, root_event) if k in from_root else (r, has)
                    assert event is not None  # signalled above: k has peer access
                    b.wait(k, event)
                    for off, c in ranges(k):
                        b.copy(k, dst(k).sub(off, c), src(giver).sub(off, c))
                else:
                    for off, c in ranges(k):
                        b.copy(r, dst(k).sub(off, c), src(r).sub(off, c))
                    b.wait(k, b.signal(r))


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


@builds("tree", "all_reduce")
def tree_all_reduce(req: PlanRequest, b: PlanBuilder) -> None:
    """Reduce up the tree rooted at rank 0, send the result down; the chunks interleaved."""
    tree = req.tree()
    count, role = req.count, req.res_role
    # besides the sums, every rank but the root copies the result down (a read, a write)
    tp = _TreePlan(b, tree, req, base=lambda r: 0.0 if r == tree.root else 2.0)

    def own(r: int) -> Buf:
        return Buf(r, IN, 0, count)

    def res(r: int) -> Buf:
        return Buf(r, role, 0, count)

    def part(r: int) -> Buf:
        # A leaf's contribution is its input, read in place; inner nodes accumulate in
        # their result buffer (overwritten by the final value later anyway).
        return own(r) if not tree.children(r) else res(r)

    pieces = list(chunked(count, req.chunk))
    pull = len(pieces) > 1
    summed: dict[int, int | None] = {}  # chunk -> the root's "summed" event

    def up(i: int) -> None:
        off, c = pieces[i]
        summed[i] = tp.reduce_up(part, own, i, off, c, res(tree.root), signal_root=pull)

    def down(i: int) -> None:
        # children pull a chunk as soon as the root has summed it, not after the root's
        # sums of the chunks issued in between
        tp.send_down(res, res, _same_for_all([pieces[i]]), pull, root_has=summed.pop(i))

    _interleave(len(pieces), max(1, tree.depth), up, down)


@builds("tree", "reduce")
def tree_reduce(req: PlanRequest, b: PlanBuilder) -> None:
    """Reduce to the root; inputs of other ranks stay unchanged (inner partial sums go to
    scratch memory)."""
    tree = req.tree(req.root)
    n, root, count = tree.n, tree.root, req.count
    tp = _TreePlan(b, tree, req, base=lambda r: 0.0)

    def own(r: int) -> Buf:
        return Buf(r, IN, 0, count)

    partials = {r: b.alloc_scratch(r, count) for r in range(n) if r != root and tree.children(r)}

    def part(r: int) -> Buf:
        if r == root:
            return Buf(r, req.res_role, 0, count)
        return partials.get(r, own(r))

    for i, (off, c) in enumerate(chunked(count, req.chunk)):
        tp.reduce_up(part, own, i, off, c, part(root))


@builds("tree", "broadcast")
def tree_broadcast(req: PlanRequest, b: PlanBuilder) -> None:
    tree = req.tree(req.root)
    root, count, role = tree.root, req.count, req.res_role
    tp = _TreePlan(b, tree, req)

    def src(r: int) -> Buf:
        return Buf(r, IN if r == root else role, 0, count)

    def dst(k: int) -> Buf:
        return Buf(k, role, 0, count)

    pieces = list(chunked(count, req.chunk))
    for off, c in pieces:
        if not req.in_place:
            b.copy(root, Buf(root, OUT, off, c), Buf(root, IN, off, c))
        tp.send_down(src, dst, _same_for_all([(off, c)]), len(pieces) > 1)


@builds("tree", "all_gather")
def tree_all_gather(req: PlanRequest, b: PlanBuilder) -> None:
    """Gather every rank's block up the tree into the root's output, then send the blocks
    each subtree lacks down the tree."""
    tree = req.tree()
    n, count = tree.n, req.count
    tp = _TreePlan(b, tree, req)
    stager = tp.stager

    def out(r: int) -> Buf:
        return Buf(r, OUT, 0, n * count)

    for r in tp.post:
        if not req.in_place:
            b.copy(r, out(r).sub(r * count, count), req.gather_input(r))
        for k in tree.children(r):
            for off, c in _ranges(tree.subtree(k), count):
                if stager.direct(r, k):
                    if (k, 0) in tp.ready:
                        b.wait(r, tp.ready.pop((k, 0)))
                    b.copy(r, out(r).sub(off, c), out(k).sub(off, c))
                else:
                    stager.send(k, r, out(r).sub(off, c), out(k).sub(off, c))
        if r != tree.root:
            tp.ready[(r, 0)] = b.signal(r)

    def missing(k: int) -> list[tuple[int, int]]:
        have = set(tree.subtree(k))
        pieces: list[tuple[int, int]] = []
        for off, c in _ranges([x for x in range(n) if x not in have], count):
            pieces.extend((off + o, cc) for o, cc in chunked(c, req.chunk))
        return pieces

    pull = any(len(missing(k)) > 1 for k in range(n) if k != tree.root)
    tp.send_down(out, out, missing, pull)


@builds("tree", "reduce_scatter")
def tree_reduce_scatter(req: PlanRequest, b: PlanBuilder) -> None:
    """Reduce the whole input to the root's scratch memory, then every rank copies its
    block from there."""
    tree = req.tree()
    n, root, count = tree.n, tree.root, req.count
    total = n * count
    # besides the sums, every rank copies its block of the result (a read, a write)
    tp = _TreePlan(b, tree, req, base=lambda r: 2.0 / n)

    def own(r: int) -> Buf:
        return Buf(r, IN, 0, total)

    partials = {r: b.alloc_scratch(r, total) for r in range(n) if r == root or tree.children(r)}

    def part(r: int) -> Buf:
        return partials.get(r, own(r))

    for i, (off, c) in enumerate(chunked(total, req.chunk)):
        tp.reduce_up(part, own, i, off, c, part(root))
    done = b.signal(root)
    for r in range(n):
        dst = req.scatter_output(r)
        block = part(root).sub(r * count, count)
        if r == root or tp.stager.direct(root, r):
            if r != root:
                b.wait(r, done)
            b.copy(r, dst, block)
        else:
            tp.stager.send(root, r, dst, block)
