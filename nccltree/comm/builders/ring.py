"""ring: reduce-scatter then all-gather around the ring, chunked; bandwidth-optimal on
links that can't all be used at once."""

from __future__ import annotations

from ..plan import IN, OUT, Buf, PlanBuilder, chunked, split
from ._base import BufOf, PlanRequest, builds, reduce_final


def _ring_reduce_scatter(
    b: PlanBuilder,
    req: PlanRequest,
    segs: list[tuple[int, int]],
    src: BufOf,
    acc: BufOf,
    shift: int,
    final: BufOf,
) -> dict[tuple[int, int, int], int]:
    """Ring reduce-scatter. At step s rank r adds its own part of segment (r + shift - s)
    to the partial sum rank r-1 holds; after n-1 steps rank r has segment (r + shift + 2 -
    n) complete, written to final(r). Returns the events that mark each (rank, step, chunk)
    done."""
    n = req.size
    ev: dict[tuple[int, int, int], int] = {}
    for s in range(n - 1):
        for r in range(n):
            p = (r - 1) % n
            seg = (r + shift - s) % n
            off, cnt = segs[seg]
            last = s == n - 2
            for i, (o, c) in enumerate(chunked(cnt, req.chunk)):
                if (p, s - 1, i) in ev:
                    b.wait(r, ev[(p, s - 1, i)])
                prev = src(p) if s == 0 else acc(p)
                srcs = [prev.sub(off + o, c), src(r).sub(off + o, c)]
                if last:
                    reduce_final(b, req, r, final(r).sub(off + o, c), srcs)
                else:
                    b.reduce(r, acc(r).sub(off + o, c), srcs, req.kernel_op)
                ev[(r, s, i)] = b.signal(r)
    return ev


def _one_rank(b: PlanBuilder, req: PlanRequest, dst: Buf) -> None:
    """The plan of a ring of one rank: its input copied to ``dst`` unless in place."""
    if not req.in_place:
        b.copy(0, dst, Buf(0, IN, 0, dst.count))


@builds("ring", "all_reduce")
def ring_all_reduce(req: PlanRequest, b: PlanBuilder) -> None:
    """Ring reduce-scatter into the results, then a ring all-gather of the finished segments."""
    n, count = req.size, req.count

    def own(r: int) -> Buf:
        return Buf(r, IN, 0, count)

    def acc(r: int) -> Buf:
        return Buf(r, req.res_role, 0, count)

    if n == 1:
        _one_rank(b, req, acc(0))
        return
    segs = split(count, n, req.align)
    ev = _ring_reduce_scatter(b, req, segs, own, acc, shift=-1, final=acc)
    # all-gather: at step t rank r pulls segment (r - t) from rank r-1, which completed it
    # in the reduce-scatter (t = 0) or received it at step t-1.
    for t in range(n - 1):
        for r in range(n):
            p = (r - 1) % n
            off, cnt = segs[(r - t) % n]
            for i, (o, c) in enumerate(chunked(cnt, req.chunk)):
                key = (p, n - 2, i) if t == 0 else (p, n - 1 + t - 1, i)
                b.wait(r, ev[key])
                b.copy(r, acc(r).sub(off + o, c), acc(p).sub(off + o, c))
                ev[(r, n - 1 + t, i)] = b.signal(r)


@builds("ring", "reduce")
def ring_reduce(req: PlanRequest, b: PlanBuilder) -> None:
    """Ring reduce-scatter into scratch, then every segment owner sends its piece to root."""
    n, root, count = req.size, req.root, req.count
    if n == 1:
        _one_rank(b, req, Buf(0, OUT, 0, count))
        return

    def own(r: int) -> Buf:
        return Buf(r, IN, 0, count)

    segs = split(count, n, req.align)
    tmps = {r: b.alloc_scratch(r, count) for r in range(n)}
    tmp = tmps.__getitem__
    dst = Buf(root, req.res_role, 0, count)
    _ring_reduce_scatter(b, req, segs, own, tmp, shift=-1, final=tmp)
    for r in range(n):
        off, cnt = segs[(r + 1) % n]
        b.copy(r, dst.sub(off, cnt), tmp(r).sub(off, cnt))


@builds("ring", "broadcast")
def ring_broadcast(req: PlanRequest, b: PlanBuilder) -> None:
    """A chunked pipeline along the ring starting at root."""
    n, root, count = req.size, req.root, req.count

    def res(r: int) -> Buf:
        return Buf(r, req.res_role, 0, count)

    order = [(root + i) % n for i in range(n)]
    for off, c in chunked(count, req.chunk):
        if not req.in_place:
            b.copy(root, res(root).sub(off, c), Buf(root, IN, off, c))
        for prev, r in zip(order, order[1:]):
            src = Buf(prev, IN, off, c) if prev == root else res(prev).sub(off, c)
            b.copy(r, res(r).sub(off, c), src)
            if r != order[-1]:
                b.wait(order[order.index(r) + 1], b.signal(r))


@builds("ring", "all_gather")
def ring_all_gather(req: PlanRequest, b: PlanBuilder) -> None:
    """At step t rank r copies from rank r-1 the block that rank got at step t-1."""
    n, count = req.size, req.count

    def out(r: int) -> Buf:
        return Buf(r, OUT, 0, n * count)

    ev: dict[tuple[int, int], int] = {}
    for r in range(n):
        if not req.in_place:
            b.copy(r, out(r).sub(r * count, count), req.gather_input(r))
        ev[(r, -1)] = b.signal(r)
    for t in range(n - 1):
        for r in range(n):
            p = (r - 1) % n
            blk = (p - t) % n
            b.wait(r, ev[(p, t - 1)])
            for o, c in chunked(count, req.chunk):
                b.copy(r, out(r).sub(blk * count + o, c), out(p).sub(blk * count + o, c))
            ev[(r, t)] = b.signal(r)


@builds("ring", "reduce_scatter")
def ring_reduce_scatter(req: PlanRequest, b: PlanBuilder) -> None:
    """Ring reduce-scatter over the ranks' blocks through scratch; rank r finishes block r."""
    n, count = req.size, req.count
    total = n * count

    def own(r: int) -> Buf:
        return Buf(r, IN, 0, total)

    def final(r: int) -> Buf:
        # rank r finishes block r; address it in whole-input coordinates
        return Buf(r, IN, 0, total) if req.in_place else Buf(r, OUT, -r * count, total)

    if n == 1:
        _one_rank(b, req, Buf(0, OUT, 0, count))
        return
    tmps = {r: b.alloc_scratch(r, total) for r in range(n)}
    tmp = tmps.__getitem__
    segs = [(i * count, count) for i in range(n)]
    _ring_reduce_scatter(b, req, segs, own, tmp, shift=-2, final=final)
