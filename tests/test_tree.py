"""build_tree: structure properties, brute-force optimality for N <= 8, the presets' trees."""

from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import nccltree as nt
from nccltree.topology import Link, LinkKind, Topology
from nccltree.tree import Tree, build_tree

K = LinkKind
CHOICES = [
    Link(K.NVLINK, 1),
    Link(K.NVLINK, 2),
    Link(K.NVLINK, 4),
    Link(K.SAME_BOARD),
    Link(K.SAME_DEVICE),
    Link(K.PIX),
    Link(K.PIX, p2p=False),
    Link(K.PXB),
    Link(K.PHB),
    Link(K.NODE),
    Link(K.SYS),
    Link(K.SYS, p2p=False),
    Link(K.NET, p2p=False),
]


def random_topology(n: int, seed: int, clustered: bool = False) -> Topology:
    """Links drawn at random; ``clustered``: fast inside random groups, slow across."""
    rng = random.Random(seed)
    group = [rng.randrange(max(1, n // 3)) for _ in range(n)]
    links = [[Link(K.SELF)] * n for _ in range(n)]
    for i in range(n):
        for j in range(i + 1, n):
            if clustered:
                pool = CHOICES[:6] if group[i] == group[j] else CHOICES[7:]
            else:
                pool = CHOICES
            links[i][j] = rng.choice(pool)
    return Topology([[links[min(i, j)][max(i, j)] for j in range(n)] for i in range(n)])


@st.composite
def topologies(draw, max_n: int = 64) -> Topology:
    n = draw(st.integers(1, max_n))
    return random_topology(n, draw(st.integers(0, 2**32)), draw(st.booleans()))


def check_structure(tree: Tree, root: int | None = None) -> None:
    n = tree.n
    assert tree.depth == math.ceil(math.log2(n)) == len(tree.levels)
    if root is not None:
        assert tree.root == root
    # One root; every other rank has exactly one parent and appears once as a child.
    roots = [r for r in range(n) if tree.parent(r) is None]
    assert roots == [tree.root]
    all_children = [c for r in range(n) for c in tree.children(r)]
    assert sorted(all_children) == sorted(set(range(n)) - {tree.root})
    for r in range(n):
        for c in tree.children(r):
            assert tree.parent(c) == r
        # Most distant subtree first: children by descending level.
        levels = [tree.level(c) for c in tree.children(r)]
        assert levels == sorted(levels, reverse=True) and len(set(levels)) == len(levels)
    assert sorted(tree.edges) == sorted(
        (tree.parent(c), c, tree.level(c)) for c in range(n) if c != tree.root
    )
    # Level by level: every level pairs all the leaders it can.
    leaders = set(range(n))
    for k, pairs in enumerate(tree.levels):
        assert len(pairs) == len(leaders) // 2
        assert {x for pair in pairs for x in pair} <= leaders
        leaders -= {c for _, c in pairs}
        assert all(tree.level(c) == k for _, c in pairs)
    assert leaders == {tree.root}
    # A child that joined at level k has a subtree of height < k + 1 and size <= 2**k.
    for c in range(n):
        if c != tree.root:
            assert len(tree.subtree(c)) <= 2 ** tree.level(c)
    assert tree.subtree(tree.root) == tuple(range(n))
    assert tree.cost == sum(tree.topology.link(p, c).cost for p, c, _ in tree.edges)


@settings(max_examples=60, deadline=None)
@given(topologies(), st.data())
@pytest.mark.slow
def test_tree_structure(topo, data):
    tree = build_tree(topo)
    check_structure(tree)
    root = data.draw(st.integers(0, topo.n - 1))
    rooted = build_tree(topo, root=root)
    check_structure(rooted, root)
    # Deterministic: the same topology (even a copy) gives the same tree.
    assert build_tree(Topology.from_json(topo.to_json()), root=root) == rooted
    assert build_tree(topo) == tree


@pytest.mark.parametrize("n", [1, 2, 3, 5, 7, 9, 16, 17, 31, 33, 63, 64])
@pytest.mark.slow
def test_every_size(n):
    topo = random_topology(n, seed=n, clustered=True)
    check_structure(build_tree(topo))
    for root in {0, n // 2, n - 1}:
        check_structure(build_tree(topo, root=root), root)


# -- optimality -------------------------------------------------------------------------------


def brute_force_cost(topo: Topology, root: int | None) -> int:
    """Least cost over every level-by-level pairing, by plain enumeration.

    At each level every ordering of the leaders is a pairing: (o[0] keeps, o[1] joins),
    (o[2], o[3])...; with an odd count the last one waits. Distinct pairings are expanded
    once; nothing is memoised across branches.
    """
    cost = [[topo.link(i, j).cost for j in range(topo.n)] for i in range(topo.n)]
    best = math.inf

    def expand(leaders: tuple[int, ...], acc: int) -> None:
        nonlocal best
        if len(leaders) == 1:
            best = min(best, acc)
            return
        seen = set()
        m = len(leaders) // 2
        for order in itertools.permutations(leaders):
            pairs = frozenset((order[2 * k], order[2 * k + 1]) for k in range(m))
            rest = order[2 * m :]
            if (pairs, rest) in seen or any(c == root for _, c in pairs):
                continue
            seen.add((pairs, rest))
            here = sum(cost[p][c] for p, c in pairs)
            expand(tuple(sorted([p for p, _ in pairs] + list(rest))), acc + here)

    expand(tuple(range(topo.n)), 0)
    return best


@settings(max_examples=60, deadline=None)
@given(topologies(max_n=8), st.data())
@pytest.mark.slow
def test_optimal_for_small_n(topo, data):
    root = data.draw(st.none() | st.integers(0, topo.n - 1))
    assert build_tree(topo, root=root).cost == brute_force_cost(topo, root)


EIGHT = [
    "dgx1",
    "nvswitch8",
    "k80x4",
    "pcie2s8",
    random_topology(8, seed=1),
    random_topology(8, seed=2, clustered=True),
    random_topology(8, seed=3, clustered=True),
]


@pytest.mark.parametrize("topo", EIGHT, ids=lambda t: t if isinstance(t, str) else "random")
@pytest.mark.slow
def test_optimal_for_eight(topo):
    topo = Topology.preset(topo) if isinstance(topo, str) else topo
    assert build_tree(topo).cost == brute_force_cost(topo, None)
    assert build_tree(topo, root=5).cost == brute_force_cost(topo, 5)


def hierarchy(n: int, seed: int) -> tuple[Topology, int]:
    """Nested groups of 2, 4, 8... joined by ever slower links, ranks shuffled; and the
    cost of the tree that pairs within the innermost groups first (the optimum)."""
    kinds = [
        Link(K.PIX),
        Link(K.PXB),
        Link(K.PHB),
        Link(K.NODE),
        Link(K.SYS),
        Link(K.SYS, p2p=False),
    ]
    place = list(range(n))
    random.Random(seed).shuffle(place)
    links = [
        [
            Link(K.SELF) if i == j else kinds[(place[i] ^ place[j]).bit_length() - 1]
            for j in range(n)
        ]
        for i in range(n)
    ]
    levels = n.bit_length() - 1
    return Topology(links), sum((n >> (k + 1)) * kinds[k].cost for k in range(levels))


@pytest.mark.parametrize("n, seed", [(16, 0), (16, 1), (32, 2), (64, 3)])
@pytest.mark.slow
def test_large_hierarchies_pair_inside_groups_first(n, seed):
    topo, optimum = hierarchy(n, seed)
    assert build_tree(topo).cost == optimum
    assert build_tree(topo, root=7).cost == optimum


# -- clusters: nodes linked by the network ----------------------------------------------------


def node_of(sizes: list[int]) -> list[int]:
    return [k for k, size in enumerate(sizes) for _ in range(size)]


def crosses(tree: Tree, nodes: list[int]) -> list[tuple[int, int, int]]:
    return [(p, c, k) for p, c, k in tree.edges if nodes[p] != nodes[c]]


def hierarchical(tree: Tree, nodes: list[int]) -> bool:
    """Each node's ranks form one subtree (so nodes - 1 edges cross), every crossing is at
    a higher level than every edge within a node, and the root's first child is on
    another node whenever the root has a child there."""
    across = crosses(tree, nodes)
    within = [k for p, c, k in tree.edges if nodes[p] == nodes[c]]
    if len(across) != len(set(nodes)) - 1:
        return False
    if across and within and min(k for _, _, k in across) <= max(within):
        return False
    kids = tree.children(tree.root)
    home = nodes[tree.root]
    return all(nodes[c] == home for c in kids) or nodes[kids[0]] != home


CLUSTERS = [[2, 2], [2, 4], [2, 2, 2], [2, 2, 2, 2], [2, 3], [3, 2], [4, 4]]


@pytest.mark.parametrize("sizes", CLUSTERS, ids=lambda s: "+".join(map(str, s)))
def test_cluster_tree_crosses_nodes_once_per_node_at_the_top(sizes):
    nodes = node_of(sizes)
    topo = Topology.cluster(nodes)
    n = topo.n
    for root in [None, *range(n)]:
        tree = build_tree(topo, root=root)
        check_structure(tree, root)
        # nodes - 1 crossings: each node's ranks form a connected subtree
        assert len(crosses(tree, nodes)) == len(sizes) - 1, (root, tree.edges)
        for k in range(len(sizes)):
            inside = [c for p, c, _ in tree.edges if nodes[p] == nodes[c] == k]
            assert len(inside) == sizes[k] - 1
        # a broadcast sends across the network first: children are listed highest level
        # first (the order a broadcast sends in), and the crossings are the top levels
        assert hierarchical(tree, nodes), (root, str(tree))
        assert tree.cost == (len(sizes) - 1) * Link(K.NET, p2p=False).cost + n - len(sizes)
    # Negative control: were NET no worse than SAME_DEVICE, the links would be uniform
    # and the tree the binomial one turned by the root, which for some root crosses
    # between nodes more often or lower down.
    flat = Topology.uniform(n, Link(K.SAME_DEVICE))
    assert not all(hierarchical(build_tree(flat, root=r), nodes) for r in range(n))


@pytest.mark.parametrize("intra", ["dgx1", "pcie2s8", "k80x4", "nvswitch8"])
@pytest.mark.slow
def test_cluster_of_preset_nodes(intra):
    # 16 ranks: the heuristic search (more than EXACT_LEADERS), with slow links inside
    # the nodes too (pcie2s8: SYS without peer access, 600, the worst intra-node cost)
    inner = Topology.preset(intra)
    nodes = node_of([inner.n, inner.n])
    topo = Topology.cluster(nodes, inner)
    free = build_tree(inner).cost
    for root in [None, *range(topo.n)]:
        tree = build_tree(topo, root=root)
        check_structure(tree, root)
        assert hierarchical(tree, nodes), (root, str(tree))
        # each node's subtree as good as the node's own tree (rooted where the root is),
        # and one crossing on top
        home = free if root is None else build_tree(inner, root=root % inner.n).cost
        optimum = home + free + Link(K.NET, p2p=False).cost
        # The heuristic is not exact at 16 ranks: on two DGX-1 nodes, half the roots get
        # one NV1 link where an NV2 would do (24 more); the crossing is unaffected.
        slack = 24 if intra == "dgx1" else 0
        assert optimum <= tree.cost <= optimum + slack, root


def test_cluster_tree_lone_rank_crosses_at_level_zero():
    # 1 + 3 ranks: level 0 pairs all four, so the lone rank crosses there, below the
    # other node's second level (a level-by-level pairing cannot do better); still a
    # single crossing and each node one subtree, unless the lone rank is the root, which
    # stays a leader at both levels and so crosses at both.
    nodes = node_of([1, 3])
    topo = Topology.cluster(nodes)
    for root in [None, 1, 2, 3]:
        tree = build_tree(topo, root=root)
        assert [k for _, _, k in crosses(tree, nodes)] == [0]
        assert not hierarchical(tree, nodes)
    assert [k for _, _, k in crosses(build_tree(topo, root=0), nodes)] == [0, 1]


def test_cluster_tree_uneven_nodes_exact_choice():
    # 2 + 3 ranks: the slow link is the top level; ties in cost (every tree with one
    # crossing costs the same) go to the one with the crossing highest.
    tree = build_tree(Topology.cluster([0, 0, 1, 1, 1]))
    assert tree.levels == (((0, 1), (2, 3)), ((2, 4),), ((0, 2),))
    assert tree.children(0) == (2, 1)


# -- the presets, written out ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, root, levels",
    [
        ("dgx1", None, [[(0, 3), (1, 2), (4, 7), (5, 6)], [(0, 4), (1, 5)], [(0, 1)]]),
        ("dgx1", 5, [[(0, 3), (1, 2), (4, 7), (5, 6)], [(4, 0), (5, 1)], [(5, 4)]]),
        ("nvswitch8", None, [[(0, 1), (2, 3), (4, 5), (6, 7)], [(0, 2), (4, 6)], [(0, 4)]]),
        ("nvswitch8", 3, [[(1, 2), (3, 4), (5, 6), (7, 0)], [(3, 5), (7, 1)], [(3, 7)]]),
        ("k80x4", None, [[(0, 1), (2, 3), (4, 5), (6, 7)], [(0, 2), (4, 6)], [(0, 4)]]),
        ("k80x4", 7, [[(0, 1), (2, 3), (4, 5), (7, 6)], [(0, 2), (7, 4)], [(7, 0)]]),
        ("pcie2s8", None, [[(0, 1), (2, 3), (4, 5), (6, 7)], [(0, 2), (4, 6)], [(0, 4)]]),
        ("pcie2s8", 6, [[(0, 1), (2, 3), (4, 5), (6, 7)], [(0, 2), (6, 4)], [(6, 0)]]),
        ("flat:1", None, []),
        ("flat:2", 1, [[(1, 0)]]),
        ("flat:3", None, [[(0, 1)], [(0, 2)]]),
        ("flat:5", None, [[(0, 1), (2, 3)], [(0, 2)], [(0, 4)]]),
        ("flat:5", 4, [[(1, 2), (4, 0)], [(4, 1)], [(4, 3)]]),
    ],
)
def test_preset_trees(name, root, levels):
    tree = build_tree(Topology.preset(name), root=root)
    assert [list(level) for level in tree.levels] == levels
    check_structure(tree, root)


def test_preset_tree_children_and_costs():
    dgx1 = build_tree(Topology.preset("dgx1"))
    # NVLink only, and the slowest of them (NV1) only at the top.
    assert [dgx1.children(r) for r in range(8)] == [(1, 4, 3), (5, 2), (), (), (7,), (6,), (), ()]
    assert dgx1.cost == 24 * 6 + 48
    pcie = build_tree(Topology.preset("pcie2s8"))
    # One socket crossing, the last level; PIX pairs first, PXB next.
    assert [pcie.children(r) for r in range(8)] == [(4, 2, 1), (), (3,), (), (6, 5), (), (7,), ()]
    assert [pcie.topology.link(p, c).token for p, c, _ in pcie.edges] == [
        "PIX", "PIX", "PIX", "PIX", "PXB", "PXB", "SYS",
    ]  # fmt: skip
    assert pcie.parent(0) is None and pcie.parent(7) == 6 and pcie.depth == 3


def test_tree_str():
    text = str(build_tree(Topology.preset("pcie2s8"), root=6))
    assert text.splitlines() == [
        "tree of 8 ranks, root 6, depth 3, cost 1224",
        "6",
        "|-- 0  (SYS, no p2p, level 2)",
        "|   |-- 2  (PXB, level 1)",
        "|   |   `-- 3  (PIX, level 0)",
        "|   `-- 1  (PIX, level 0)",
        "|-- 4  (PXB, level 1)",
        "|   `-- 5  (PIX, level 0)",
        "`-- 7  (PIX, level 0)",
    ]
    assert str(build_tree(Topology.preset("flat:1"))).splitlines()[1:] == ["0"]


# -- arguments --------------------------------------------------------------------------------


def test_build_tree_rejects():
    topo = Topology.preset("flat:4")
    with pytest.raises(TypeError, match="Topology"):
        build_tree("flat:4")
    with pytest.raises(ValueError, match=r"root must be in \[0, 4\), got 4"):
        build_tree(topo, root=4)
    with pytest.raises(ValueError):
        build_tree(topo, root=-1)
    with pytest.raises(TypeError, match="root must be an integer"):
        build_tree(topo, root=True)
    with pytest.raises(TypeError, match="root must be an integer"):
        build_tree(topo, root=1.0)
    tree = build_tree(topo)
    with pytest.raises(ValueError, match=r"rank must be in \[0, 4\), got 4"):
        tree.children(4)
    with pytest.raises(TypeError, match="rank must be an integer"):
        tree.parent("0")
    with pytest.raises(TypeError, match="rank must be an integer"):
        tree.parent(np.bool_(True))


@pytest.mark.parametrize("n", [2, 5, 8])
def test_numpy_integer_roots_and_ranks(n):
    # the one argument rule: numpy integers are integers (World.comm took them already)
    topo = Topology.preset(f"flat:{n}")
    for r in range(n):
        tree = build_tree(topo, root=np.int64(r))
        assert tree == build_tree(topo, root=r)
        assert type(tree.root) is int and tree.root == r
        assert tree.children(np.int32(r)) == tree.children(r)
        assert tree.parent(np.uint8(r)) == tree.parent(r)
        assert tree.subtree(np.int64(r)) == tree.subtree(r)


def test_tree_constructor_checks_levels():
    topo = Topology.preset("flat:4")
    Tree(topo, 0, (((0, 1), (2, 3)), ((0, 2),)))
    with pytest.raises(ValueError, match="not all it can"):
        Tree(topo, 0, (((0, 1),), ((0, 2),), ((0, 3),)))
    with pytest.raises(ValueError, match="free leaders"):
        Tree(topo, 0, (((0, 1), (1, 2)), ((0, 3),)))
    with pytest.raises(ValueError, match="not the root 2"):
        Tree(topo, 2, (((0, 1), (2, 3)), ((0, 2),)))


def test_public_names():
    assert nt.build_tree is build_tree and nt.Tree is Tree
