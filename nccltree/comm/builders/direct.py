"""direct: every rank reduces its 1/N slice reading all peers, then writes it to every
peer: about 2N buffer passes in total, the least traffic in shared memory (one host,
NVSwitch). Needs every pair of devices to reach each other.

gather, scatter and all_to_all move every block once, from where it is to where it goes,
which is all they need: their direct plans serve the tree and the ring too (across nodes
of a process group, each block crosses between nodes once either way)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from ..plan import IN, OUT, Buf, PlanBuilder, chunked, split
from ._base import PlanRequest, Steps, builds, reduce_final


def _slices(req: PlanRequest) -> Iterator[tuple[int, int, int]]:
    """(rank, offset, count) of every chunk of every rank's slice of the input."""
    for r, (off, cnt) in enumerate(split(req.count, req.size, req.align)):
        for o, c in chunked(cnt, req.chunk):
            yield r, off + o, c


def _inputs(req: PlanRequest, off: int, c: int) -> list[Buf]:
    return [Buf(q, IN, off, c) for q in range(req.size)]


def _peers(r: int, n: int) -> list[int]:
    """The ranks after ``r`` in ring order, so that ranks writing to every peer at once
    start at different destinations."""
    return [(r + i) % n for i in range(1, n)]


@builds("direct", "all_reduce")
def direct_all_reduce(req: PlanRequest, b: PlanBuilder) -> None:
    """Rank r reduces slice r of every input into its result, then writes it to every peer."""
    n, role = req.size, req.res_role
    for r, off, c in _slices(req):
        mine = Buf(r, role, off, c)
        reduce_final(b, req, r, mine, _inputs(req, off, c))
        # write the chunk to every peer right away
        for q in _peers(r, n):
            b.copy(r, Buf(q, role, off, c), mine)


@builds("direct", "reduce")
def direct_reduce(req: PlanRequest, b: PlanBuilder) -> None:
    """Rank r reduces slice r of every input straight into the root's result."""
    root = req.root
    for r, off, c in _slices(req):
        reduce_final(b, req, r, Buf(root, req.res_role, off, c), _inputs(req, off, c))


@builds("direct", "broadcast")
def direct_broadcast(req: PlanRequest, b: PlanBuilder) -> None:
    """Every rank reads the root's buffer itself."""
    root, count = req.root, req.count
    for r in range(req.size):
        if r == root and req.in_place:
            continue
        b.copy(r, Buf(r, req.res_role, 0, count), Buf(root, IN, 0, count))


@builds("direct", "all_gather")
def direct_all_gather(req: PlanRequest, b: PlanBuilder) -> None:
    """Every rank writes its block into every rank's output (its own too, unless in place)."""
    n, count = req.size, req.count
    for r in range(n):
        src = req.gather_input(r)
        for q in ([] if req.in_place else [r]) + _peers(r, n):
            b.copy(r, Buf(q, OUT, r * count, count), src)


@builds("direct", "reduce_scatter")
def direct_reduce_scatter(req: PlanRequest, b: PlanBuilder) -> None:
    """Rank r reduces block r of every input straight into its result."""
    n, count = req.size, req.count
    for r in range(n):
        dst = req.scatter_output(r)
        for o, c in chunked(count, req.chunk):
            reduce_final(b, req, r, dst.sub(o, c), _inputs(req, r * count + o, c))


def _moves(collective: str) -> Callable[[Steps], Steps]:
    """Register a data-movement plan under every algorithm (see the module docstring)."""
    return builds("direct", collective, also=("tree", "ring"))


@_moves("gather")
def direct_gather(req: PlanRequest, b: PlanBuilder) -> None:
    """Every rank writes its block into the root's output (the root's own block too,
    unless in place: then it is there already)."""
    n, count, root = req.size, req.count, req.root
    for r in [root, *_peers(root, n)]:
        if req.in_place and r == root:
            continue
        b.copy(r, Buf(root, OUT, r * count, count), req.gather_input(r))


@_moves("scatter")
def direct_scatter(req: PlanRequest, b: PlanBuilder) -> None:
    """Every rank reads its block of the root's input into its output (in place, the
    root's block is in place already)."""
    n, count, root = req.size, req.count, req.root
    for r in [root, *_peers(root, n)]:
        if req.in_place and r == root:
            continue
        b.copy(r, req.scatter_output(r), Buf(root, IN, r * count, count))


@_moves("all_to_all")
def direct_all_to_all(req: PlanRequest, b: PlanBuilder) -> None:
    """Rank r writes block q of its input into block r of rank q's output, starting with
    its own and then around the ring, so that ranks writing at once start at different
    destinations."""
    n, count = req.size, req.count
    for r in range(n):
        for q in [r, *_peers(r, n)]:
            b.copy(r, Buf(q, OUT, r * count, count), Buf(r, IN, q * count, count))


@_moves("sendrecv")
def direct_sendrecv(req: PlanRequest, b: PlanBuilder) -> None:
    """Rank r writes its input into the next rank's output."""
    n, count = req.size, req.count
    for r in range(n):
        b.copy(r, Buf((r + 1) % n, OUT, 0, count), Buf(r, IN, 0, count))
