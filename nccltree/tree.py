"""``build_tree(topology)``: a reduce/broadcast tree that uses slow links as little as possible.

Caffe's ``DevicePair::compute``, generalised. The ranks are paired level by level: at
each level every group leader that is still in play is paired with another one (an odd
one out waits for the next level instead of crashing), and of each pair one leader stays
while the other becomes its child. With N ranks that takes exactly ceil(log2 N) levels,
and a reduce runs level 0 first, a broadcast the last level first.

Which pairing? The one of least *cost*: the sum over the tree's edges of
``Link.cost`` (about 1200 / nominal GB/s of the link, doubled without peer access, so
one NVLink costs 48, a PCIe switch 96, a socket crossing without peer access 600). The
cost of a tree depends on all its levels at once — which member of a pair stays decides
the links available above — so the pairing is searched over whole trees, not level by
level:

- at most ``EXACT_LEADERS`` (8) leaders: an exact search over every level-by-level
  pairing, memoised on the set of leaders left (the cost of the levels above depends on
  nothing else). For N <= 8 the tree is therefore optimal (tests compare it with brute
  force). Ties go first to the tree whose levels cost least from level 0 up (slow links
  as high as they go: ranks of one node, linked to other nodes only by ``NET``, pair
  among themselves before one of them crosses, and a broadcast crosses first), then to
  the smallest sequence of (parent, child) edges, level 0 first, counted from the
  root: on a uniform topology the binomial tree.
- more leaders (a heuristic): the first levels one at a time — a minimum-cost pairing
  (exact over bitmasks up to ``MATCHING_DP_LEADERS`` leaders, else greedy by link rank
  then partner swaps), the member of a pair with the cheaper links to the other leaders
  staying. The level that leaves <= 8 leaders is judged with the exact search of the
  rest: every choice of the one who waits (odd counts, up to ``ODD_TRIALS_LEADERS``),
  partner exchanges (up to ``REPAIR_TRIALS_LEADERS``), pairs turned around. Last, a
  local search over the whole tree (``_improve``). Nested hierarchies (switches in
  sockets in nodes, in any rank order) come out optimal up to 64 ranks; on random link
  matrices of 9-11 ranks the cost averaged 0.1-2 % above the optimum.

``root=r`` keeps ``r`` the leader of every pair it is in, so it ends as the overall root.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import TypeVar

from ._validate import check_index
from .topology import Link, Topology

T = TypeVar("T")

EXACT_LEADERS = 8
MATCHING_DP_LEADERS = 16
ODD_TRIALS_LEADERS = 11
REPAIR_TRIALS_LEADERS = 12

Level = tuple[tuple[int, int], ...]  # the (parent, child) pairs of one level, sorted


@dataclass(frozen=True)
class Tree:
    """A reduce/broadcast tree over the ``topology``'s ``n`` ranks, rooted at ``root``,
    built level by level.

    ``levels[k]`` holds the (parent, child) pairs formed at level ``k``; a reduce runs
    the levels in order, a broadcast in reverse. Built by ``build_tree``; the
    constructor checks that the levels form a valid level-by-level pairing.
    """

    topology: Topology
    root: int
    levels: tuple[Level, ...]
    _parent: tuple[int | None, ...] = field(init=False, repr=False, compare=False)
    _children: tuple[tuple[int, ...], ...] = field(init=False, repr=False, compare=False)
    _level_of: tuple[int | None, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        n = self.topology.n
        parent: list[int | None] = [None] * n
        level_of: list[int | None] = [None] * n
        kids: list[list[tuple[int, int]]] = [[] for _ in range(n)]
        leaders = set(range(n))
        for k, pairs in enumerate(self.levels):
            seen: set[int] = set()
            for p, c in pairs:
                # Only current leaders pair, each at most once per level.
                if p == c or not {p, c} <= leaders or {p, c} & seen:
                    raise ValueError(f"level {k}: ({p}, {c}) does not pair two free leaders")
                seen.update((p, c))
            if len(pairs) != len(leaders) // 2:
                raise ValueError(
                    f"level {k} pairs {len(pairs)} of {len(leaders)} leaders, not all it can"
                )
            for p, c in pairs:
                leaders.discard(c)
                parent[c], level_of[c] = p, k
                kids[p].append((k, c))
        if leaders != {self.root}:
            raise ValueError(
                f"the levels leave {sorted(leaders)} as leaders, not the root {self.root}"
            )
        object.__setattr__(self, "_parent", tuple(parent))
        object.__setattr__(self, "_level_of", tuple(level_of))
        # Highest level first: the child across the slowest link heads the list, which is
        # the order a broadcast sends in.
        object.__setattr__(
            self, "_children", tuple(tuple(c for _, c in sorted(ks, reverse=True)) for ks in kids)
        )

    @property
    def n(self) -> int:
        """Number of ranks."""
        return self.topology.n

    @property
    def depth(self) -> int:
        """Number of levels, ceil(log2 n): the sequential steps of a reduce."""
        return len(self.levels)

    @property
    def edges(self) -> list[tuple[int, int, int]]:
        """Every (parent, child, level), level 0 first."""
        return [(p, c, k) for k, pairs in enumerate(self.levels) for p, c in pairs]

    @property
    def cost(self) -> int:
        """Sum of ``Link.cost`` over the edges."""
        return sum(self.topology.link(p, c).cost for p, c, _ in self.edges)

    def _check(self, r: int) -> int:
        return check_index(r, "rank", self.n)

    def parent(self, r: int) -> int | None:
        """The parent of rank ``r``; None for the root."""
        return self._parent[self._check(r)]

    def children(self, r: int) -> tuple[int, ...]:
        """The children of ``r``, most distant subtree (highest level) first."""
        return self._children[self._check(r)]

    def level(self, r: int) -> int | None:
        """The level at which ``r`` joined its parent; None for the root."""
        return self._level_of[self._check(r)]

    def subtree(self, r: int) -> tuple[int, ...]:
        """The ranks of ``r``'s subtree, ``r`` included, in ascending order."""
        out, stack = [], [self._check(r)]
        while stack:
            x = stack.pop()
            out.append(x)
            stack.extend(self._children[x])
        return tuple(sorted(out))

    def __str__(self) -> str:
        topo = self.topology
        lines = [
            f"tree of {self.n} ranks, root {self.root}, depth {self.depth}, cost {self.cost}",
            str(self.root),
        ]

        def walk(r: int, prefix: str) -> None:
            kids = self._children[r]
            for i, c in enumerate(kids):
                last = i == len(kids) - 1
                label = _link_label(topo.link(r, c))
                branch = "`-- " if last else "|-- "
                lines.append(f"{prefix}{branch}{c}  ({label}, level {self._level_of[c]})")
                walk(c, prefix + ("    " if last else "|   "))

        walk(self.root, "")
        return "\n".join(lines)


def build_tree(topology: Topology, root: int | None = None) -> Tree:
    """Pair the ranks of ``topology`` level by level into a least-cost tree.

    ``root=None`` lets the search choose the root; ``root=r`` makes ``r`` the root. See
    the module docstring for the cost and the search. Deterministic.
    """
    if not isinstance(topology, Topology):
        raise TypeError(f"build_tree needs a Topology, got {type(topology).__name__}")
    n = topology.n
    if root is not None:
        root = check_index(root, "root", n)
    # Search in ranks relative to the root, as MPI does, so that ties resolve the same way
    # for every root: on a uniform topology the tree for root r is the binomial tree of
    # root 0 turned by r.
    shift = 0 if root is None else root
    vroot = None if root is None else 0
    links = [[topology.link((a + shift) % n, (b + shift) % n) for b in range(n)] for a in range(n)]
    cost = [[link.cost for link in row] for row in links]
    rank = [[link.rank for link in row] for row in links]
    levels: list[Level] = []
    leaders = tuple(range(n))
    while len(leaders) > EXACT_LEADERS:
        if (len(leaders) + 1) // 2 <= EXACT_LEADERS:
            level = _last_heuristic_level(leaders, cost, vroot)
        else:
            level = _heuristic_level(leaders, cost, rank, vroot)
        levels.append(level)
        children = {c for _, c in level}
        leaders = tuple(x for x in leaders if x not in children)
    sub = tuple(tuple(cost[a][b] for b in leaders) for a in leaders)
    vsub = None if vroot is None else leaders.index(vroot)
    for level in _exact(tuple(range(len(leaders))), sub, vsub)[1]:
        levels.append(tuple(sorted((leaders[p], leaders[c]) for p, c in level)))
    if n > EXACT_LEADERS:
        levels = _improve(levels, cost, n, vroot)
    final = [x for x in range(n) if x not in {c for lv in levels for _, c in lv}]
    assert len(final) == 1, "only the root remains"
    return Tree(
        topology,
        (final[0] + shift) % n,
        tuple(tuple(sorted(((p + shift) % n, (c + shift) % n) for p, c in lv)) for lv in levels),
    )


# -- exact search over level-by-level pairings (few leaders) --------------------------------


def _matchings(leaders: tuple[int, ...]) -> Iterator[list[tuple[int, int]]]:
    """Every pairing of ``leaders`` that leaves at most one out (the odd one)."""
    if len(leaders) % 2:
        for k in range(len(leaders)):
            yield from _perfect(leaders[:k] + leaders[k + 1 :])
    else:
        yield from _perfect(leaders)


def _perfect(xs: tuple[int, ...]) -> Iterator[list[tuple[int, int]]]:
    if not xs:
        yield []
        return
    a = xs[0]
    for k in range(1, len(xs)):
        rest = xs[1:k] + xs[k + 1 :]
        for m in _perfect(rest):
            yield [(a, xs[k]), *m]


def _pairings(
    leaders: tuple[int, ...], cost: Sequence[Sequence[int]], root: int | None
) -> Iterator[tuple[int, Iterator[tuple[Level, tuple[int, ...]]]]]:
    """Every way to pair ``leaders`` one level up (leaving at most one out), by pairing:
    its cost, and its levels with the leaders each leaves for the next one. Each pair may
    keep either member, except that the root always stays; the levels are made only when
    asked for (a search skips a pairing by its cost first) and their pairs are not
    sorted."""
    for pairs in _matchings(leaders):
        yield sum(cost[a][b] for a, b in pairs), _levels_of(leaders, pairs, root)


def _levels_of(
    leaders: tuple[int, ...], pairs: list[tuple[int, int]], root: int | None
) -> Iterator[tuple[Level, tuple[int, ...]]]:
    """The levels of one pairing of ``leaders`` (see :func:`_pairings`)."""
    paired = {x for pair in pairs for x in pair}
    out = tuple(x for x in leaders if x not in paired)
    options = [
        ((a, b),) if a == root else ((b, a),) if b == root else ((a, b), (b, a)) for a, b in pairs
    ]
    for level in _product(options):
        yield level, tuple(sorted(out + tuple(p for p, _ in level)))


_Best = tuple[int, tuple[int, ...], tuple[Level, ...]]


@lru_cache(maxsize=64)
def _exact(
    leaders: tuple[int, ...], cost: tuple[tuple[int, ...], ...], root: int | None
) -> tuple[int, tuple[Level, ...]]:
    """The least-cost levels pairing ``leaders`` down to one: (cost, levels).

    Among trees of equal cost, the one whose levels cost least from level 0 up (its
    slow links as high as they can be, where a broadcast sends first and a reduce sends
    last), then the smallest levels.
    """
    memo: dict[tuple[int, ...], _Best] = {}

    def best(ls: tuple[int, ...]) -> _Best:
        if len(ls) == 1:
            return (0, (), ())
        got = memo.get(ls)
        if got is not None:
            return got
        result = None
        for here, ways in _pairings(ls, cost, root):
            if result is not None and here > result[0]:
                continue  # the levels above cost >= 0: no better tree down this way
            for level, nxt in ways:
                rest_cost, rest_by_level, rest = best(nxt)
                cand = (here + rest_cost, (here, *rest_by_level), (tuple(sorted(level)), *rest))
                if result is None or cand < result:
                    result = cand
        assert result is not None
        memo[ls] = result
        return result

    total, _, levels = best(leaders)
    return total, levels


def _product(options: Sequence[tuple[T, ...]]) -> Iterator[tuple[T, ...]]:
    if not options:
        yield ()
        return
    for first in options[0]:
        for rest in _product(options[1:]):
            yield (first, *rest)


# -- one level at a time (many leaders) ----------------------------------------------------


def _heuristic_level(
    leaders: tuple[int, ...],
    cost: list[list[int]],
    rank: list[list[tuple[int, int, int]]],
    root: int | None,
) -> Level:
    if len(leaders) <= MATCHING_DP_LEADERS:
        pairs = _matching_dp(leaders, cost)
    else:
        pairs = _matching_greedy(leaders, cost, rank)
    return _stay_order(pairs, leaders, cost, root)


def _stay_order(
    pairs: list[tuple[int, int]], leaders: tuple[int, ...], cost: list[list[int]], root: int | None
) -> Level:
    level = []
    for a, b in pairs:
        if b == root or (
            a != root and _stay_key(b, a, leaders, cost) < _stay_key(a, b, leaders, cost)
        ):
            a, b = b, a
        level.append((a, b))
    return tuple(sorted(level))


def _stay_key(
    x: int, partner: int, leaders: tuple[int, ...], cost: list[list[int]]
) -> tuple[list[int], int]:
    """Who of a pair stays: the one better connected to the leaders of the next levels
    (its cheapest links first)."""
    return (sorted(cost[x][y] for y in leaders if y not in (x, partner)), x)


def _last_heuristic_level(
    leaders: tuple[int, ...], cost: list[list[int]], root: int | None
) -> Level:
    """The level after which the exact search takes over: judged with that search.

    With an odd count every choice of the one who waits is tried (up to
    ``ODD_TRIALS_LEADERS`` leaders); for each, a minimum-cost pairing of the rest, turned
    around pair by pair while the exact rest gets cheaper.
    """
    memo: dict[tuple[int, ...], int] = {}
    if len(leaders) % 2 and len(leaders) <= ODD_TRIALS_LEADERS:
        waiting: list[int | None] = list(leaders)
    else:
        waiting = [None]

    def judge(pairs: list[tuple[int, int]]) -> tuple[int, Level]:
        level = _stay_order(pairs, leaders, cost, root)
        level, rest = _orient_for_tail(level, leaders, cost, root, memo)
        return (sum(cost[p][c] for p, c in level) + rest, level)

    best = None
    for w in waiting:
        if w is None:
            pairs = _matching_dp(leaders, cost)
        else:
            pairs = _matching_dp(tuple(x for x in leaders if x != w), cost)
        cand = judge(pairs)
        if best is None or cand < best:
            best = cand
    assert best is not None
    if len(leaders) <= REPAIR_TRIALS_LEADERS:
        # Exchange partners between two pairs while the whole gets cheaper.
        improved = True
        while improved:
            improved = False
            pairs = [(min(a, b), max(a, b)) for a, b in best[1]]
            for i in range(len(pairs)):
                for j in range(i + 1, len(pairs)):
                    (a, b), (c, d) = pairs[i], pairs[j]
                    for x, y in (((a, c), (b, d)), ((a, d), (b, c))):
                        trial = pairs[:i] + [x] + pairs[i + 1 : j] + [y] + pairs[j + 1 :]
                        cand = judge(trial)
                        if cand[0] < best[0]:
                            best, improved = cand, True
                            break
                    if improved:
                        break
                if improved:
                    break
    return best[1]


def _orient_for_tail(
    level: Level,
    leaders: tuple[int, ...],
    cost: list[list[int]],
    root: int | None,
    memo: dict[tuple[int, ...], int],
) -> tuple[Level, int]:
    """Turn pairs around while the exact rest gets cheaper; the level and that rest.

    The pairs' own cost does not depend on who stays, only the levels above do, and
    those are searched exactly once at most ``EXACT_LEADERS`` leaders remain.
    """
    pairs = list(level)
    joined = {c for _, c in pairs}
    out = [x for x in leaders if x not in joined and all(x != p for p, _ in pairs)]

    def rest(ps: list[tuple[int, int]]) -> int:
        return _exact_cost(tuple(sorted(out + [p for p, _ in ps])), cost, root, memo)

    best = rest(pairs)
    improved = True
    while improved:  # only strict improvements are taken, so this ends
        improved = False
        for i, (a, b) in enumerate(pairs):
            if root in (a, b):
                continue
            turned = pairs[:i] + [(b, a)] + pairs[i + 1 :]
            c = rest(turned)
            if c < best:
                pairs, best, improved = turned, c, True
    return tuple(sorted(pairs)), best


def _exact_cost(
    leaders: tuple[int, ...],
    cost: list[list[int]],
    root: int | None,
    memo: dict[tuple[int, ...], int],
) -> int:
    """The least cost of the levels that pair ``leaders`` down to one (no tie-breaks)."""
    if len(leaders) == 1:
        return 0
    got = memo.get(leaders)
    if got is not None:
        return got
    best = None
    for here, ways in _pairings(leaders, cost, root):
        if best is not None and here >= best:
            continue
        for _, nxt in ways:
            total = here + _exact_cost(nxt, cost, root, memo)
            if best is None or total < best:
                best = total
    assert best is not None
    memo[leaders] = best
    return best


def _matching_dp(leaders: tuple[int, ...], cost: list[list[int]]) -> list[tuple[int, int]]:
    """Minimum-cost pairing leaving at most one out, exact, by a DP over bitmasks."""
    m = len(leaders)
    memo: dict[tuple[int, bool], tuple[int, tuple[tuple[int, int], ...]]] = {}

    def best(mask: int, may_skip: bool) -> tuple[int, tuple[tuple[int, int], ...]]:
        if mask == 0:
            return (0, ())
        key = (mask, may_skip)
        got = memo.get(key)
        if got is not None:
            return got
        i = (mask & -mask).bit_length() - 1
        rest = mask & ~(1 << i)
        a = leaders[i]
        result = None
        if may_skip:
            result = best(rest, False)
        for j in range(i + 1, m):
            if rest >> j & 1:
                c, pairs = best(rest & ~(1 << j), may_skip)
                cand = (c + cost[a][leaders[j]], ((a, leaders[j]), *pairs))
                if result is None or cand < result:
                    result = cand
        assert result is not None
        memo[key] = result
        return result

    return list(best((1 << m) - 1, m % 2 == 1)[1])


def _matching_greedy(
    leaders: tuple[int, ...], cost: list[list[int]], rank: list[list[tuple[int, int, int]]]
) -> list[tuple[int, int]]:
    """Best-ranked pairs first (Caffe's order), then swap partners while that helps."""
    cands = sorted((rank[a][b], a, b) for i, a in enumerate(leaders) for b in leaders[i + 1 :])
    taken: set[int] = set()
    pairs: list[tuple[int, int]] = []
    for _, a, b in cands:
        if a not in taken and b not in taken:
            taken.update((a, b))
            pairs.append((a, b))
    improved = True
    while improved:  # each swap lowers the total cost, so this ends
        improved = False
        for i in range(len(pairs)):
            for j in range(i + 1, len(pairs)):
                (a, b), (c, d) = pairs[i], pairs[j]
                now = cost[a][b] + cost[c][d]
                for p, q in (((a, c), (b, d)), ((a, d), (b, c))):
                    if cost[p[0]][p[1]] + cost[q[0]][q[1]] < now:
                        pairs[i], pairs[j] = (min(p), max(p)), (min(q), max(q))
                        improved = True
                        break
                if improved:
                    break
            if improved:
                break
    return pairs


def _improve(levels: list[Level], cost: list[list[int]], n: int, root: int | None) -> list[Level]:
    """Local search on a finished tree, keeping it a level-by-level pairing.

    Three moves, each accepted only if it lowers the cost (so the search ends):
    exchange the places of two ranks; exchange the parents of two ranks that joined at
    the same level; turn a pair around (the child stays, the parent joins it). They
    repair what choosing one level at a time missed.
    """
    par = [-1] * n
    lev = [-1] * n
    for k, pairs in enumerate(levels):
        for p, c in pairs:
            par[c], lev[c] = p, k
    improved = True
    while improved:
        kids: list[list[int]] = [[] for _ in range(n)]
        for c in range(n):
            if par[c] >= 0:
                kids[par[c]].append(c)
        search = _Search(par, lev, kids, cost, n, root)
        improved = _try_relabel(search) or _try_repair(search) or _try_turn(search)
    return [tuple(sorted((par[c], c) for c in range(n) if lev[c] == k)) for k in range(len(levels))]


@dataclass(frozen=True)
class _Search:
    """The tree the local search edits in place: parent and level of every rank (-1 for
    the root), the children lists of this round, the costs, the rank count and the root
    that must stay (None: any)."""

    par: list[int]
    lev: list[int]
    kids: list[list[int]]
    cost: list[list[int]]
    n: int
    root: int | None


def _try_relabel(s: _Search) -> bool:
    par, lev, kids, cost, n, root = s.par, s.lev, s.kids, s.cost, s.n, s.root

    def near(x: int) -> list[int]:
        return ([par[x]] if par[x] >= 0 else []) + kids[x]

    for x in range(n):
        for y in range(x + 1, n):
            if root in (x, y):
                continue
            nx, ny = near(x), near(y)
            before = sum(cost[x][q] for q in nx) + sum(cost[y][q] for q in ny)
            after = sum(cost[y][x if q == y else q] for q in nx)
            after += sum(cost[x][y if q == x else q] for q in ny)
            if after < before:
                swap = list(range(n))
                swap[x], swap[y] = y, x
                old_par, old_lev = list(par), list(lev)
                for c in range(n):
                    par[c] = -1 if old_par[swap[c]] < 0 else swap[old_par[swap[c]]]
                    lev[c] = old_lev[swap[c]]
                return True
    return False


def _try_repair(s: _Search) -> bool:
    par, lev, cost, n = s.par, s.lev, s.cost, s.n
    for x in range(n):
        for y in range(x + 1, n):
            px, py = par[x], par[y]
            if px < 0 or py < 0 or lev[x] != lev[y] or px == py:
                continue
            if cost[px][y] + cost[py][x] < cost[px][x] + cost[py][y]:
                par[x], par[y] = py, px
                return True
    return False


def _try_turn(s: _Search) -> bool:
    par, lev, kids, cost, n, root = s.par, s.lev, s.kids, s.cost, s.n, s.root
    for c in range(n):
        p = par[c]
        if p < 0 or p == root:
            continue
        k = lev[c]
        # The edges the parent has above level k move to the child.
        above = [q for q in kids[p] if lev[q] > k] + ([par[p]] if par[p] >= 0 else [])
        if sum(cost[c][q] for q in above) < sum(cost[p][q] for q in above):
            for q in kids[p]:
                if lev[q] > k:
                    par[q] = c
            par[c], lev[c] = par[p], lev[p]
            par[p], lev[p] = c, k
            return True
    return False


def _link_label(link: Link) -> str:
    return link.token if link.p2p else f"{link.token}, no p2p"
