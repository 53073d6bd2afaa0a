"""Plans as data: race-free by construction, and the copy pattern the backend records."""

from __future__ import annotations

import collections

import numpy as np
import pytest

import nccltree as nt
from nccltree.backends.host import record_transfers
from nccltree.comm.algorithms import build_plan
from nccltree.comm.plan import Buf, Plan, PlanBuilder, Step, check_races

COLLS = ("all_reduce", "reduce", "broadcast", "all_gather", "reduce_scatter")


def _trees(topo):
    cache = {}

    def get(root):
        if root not in cache:
            cache[root] = nt.build_tree(topo, root=root)
        return cache[root]

    return get


@pytest.mark.parametrize("topo", ["flat:1", "flat:2", "flat:3", "flat:4", "flat:5", "flat:7",
                                  "flat:12", "pcie2s8", "dgx1", "k80x4"])
@pytest.mark.parametrize("alg", ["tree", "ring", "direct"])
def test_every_plan_is_race_free(topo, alg):
    topology = nt.Topology.preset(topo)
    n = topology.n
    tree_for = _trees(topology)
    for coll in COLLS:
        for count in (0, 1, 5, 64):
            for in_place in (False, True):
                for root in sorted({0, n - 1}) if coll in ("reduce", "broadcast") else [0]:
                    plan = build_plan(alg, coll, size=n, count=count, op="mean", root=root,
                                      in_place=in_place, chunk=7, tree_for=tree_for)
                    assert check_races(plan) == [], (alg, coll, count, in_place, root)


@pytest.mark.parametrize("alg", ["tree", "ring", "direct"])
def test_mixed_in_place_all_reduce_is_race_free(alg):
    # An out-of-place plan stays correct when some ranks pass out == x: check it with
    # "in" and "out" treated as one buffer.
    n = 5
    plan = build_plan(alg, "all_reduce", size=n, count=50, op="sum", in_place=False, chunk=6,
                      tree_for=_trees(nt.Topology.preset(f"flat:{n}")))
    plan.same_buffer = True
    assert check_races(plan) == []


def test_race_checker_catches_a_missing_wait():
    # rank 1 reads rank 0's input while rank 0 overwrites it
    steps = [
        Step(1, "copy", Buf(1, "out", 0, 4), (Buf(0, "in", 0, 4),)),
        Step(0, "scale", Buf(0, "in", 0, 4), (Buf(0, "in", 0, 4),), alpha=2.0),
    ]
    racy = Plan(size=2, steps=list(steps), n_events=1)
    assert check_races(racy)
    # ordering the write after the read (record on rank 1, wait on rank 0) fixes it
    fixed = Plan(size=2, steps=[steps[0], Step(1, "record", event=0),
                                Step(0, "wait", event=0), steps[1]], n_events=1)
    assert check_races(fixed) == []
    # a wait on an event that is recorded only later is a bug on CUDA: it must be flagged
    early = Plan(size=2, steps=[Step(0, "wait", event=0), steps[1], steps[0],
                                Step(1, "record", event=0)], n_events=1)
    assert check_races(early)
    # and the builder's fences make the unordered version safe
    b = PlanBuilder(2)
    b.copy(1, Buf(1, "out", 0, 4), Buf(0, "in", 0, 4))
    b.scale(0, Buf(0, "in", 0, 4), 2.0)
    assert check_races(b.build())  # data flow inside one plan is the algorithm's job


def _bytes_by_pair(transfers):
    agg = collections.Counter()
    for t in transfers:
        agg[(t.src, t.dst, t.kind)] += t.nbytes
    return dict(agg)


@pytest.mark.parametrize("preset", ["dgx1", "pcie2s8", "flat:5"])
def test_tree_copy_pattern_follows_tree_edges(preset):
    topo = nt.Topology.preset(preset)
    n = topo.n
    count = 10_000
    nbytes = count * 4
    with nt.World(nt.devices(f"cpu:{n}"), algorithm="tree", topology=topo,
                  chunk_bytes=8192, inline_bytes=0) as w:
        xs = [np.full(count, float(r), np.float32) for r in range(n)]
        with record_transfers() as log:
            w.all_reduce(xs)
        tree = w.tree(0)
    want = {}
    for parent, child, _level in tree.edges:
        if not topo.link(parent, child).p2p:
            continue  # staged through pinned host memory: no device-to-device transfer
        want[(child, parent, "peer_read")] = nbytes  # reduce: the parent reads the child
        want[(parent, child, "copy")] = nbytes  # broadcast: the parent writes the child
    assert _bytes_by_pair(log) == want
    if preset == "pcie2s8":
        assert any(not topo.link(p, c).p2p for p, c, _ in tree.edges)
    assert xs[0][0] == sum(range(n))


def test_broadcast_sends_most_distant_subtree_first():
    # one chunk: the parent writes into its children's buffers on its own stream, in the
    # tree's order
    topo = nt.Topology.preset("dgx1")
    with nt.World(nt.devices("cpu:8"), algorithm="tree", topology=topo,
                  inline_bytes=0) as w:
        xs = [np.full(16, float(r)) for r in range(8)]
        with record_transfers() as log:
            w.broadcast(xs, root=0)
        tree = w.tree(0)
        steps = w.plan("broadcast", 16, dtype=np.float64).steps
    sent_by_root = [t.dst for t in log if t.src == 0]
    assert sent_by_root == list(tree.children(0))
    assert all(s.rank == s.srcs[0].rank for s in steps if s.kind == "copy")
    assert all(np.all(x == 0.0) for x in xs)


@pytest.mark.parametrize("coll", ["broadcast", "all_reduce", "all_gather"])
def test_children_copy_from_their_parent_on_their_own_streams(coll):
    # Several chunks: over peer access a child copies on its own stream once its parent
    # has the chunk, so the parent's stream only reduces (and records) and goes on to its
    # next chunk while its children copy this one.
    topo = nt.Topology.preset("dgx1")
    with nt.World(nt.devices("cpu:8"), algorithm="tree", topology=topo, chunk_bytes=256) as w:
        plan = w.plan(coll, 200)
        tree = w.tree(0)
        owners = plan.event_owners()
        waited: dict[int, set[int]] = collections.defaultdict(set)  # rank -> ranks it waited on
        down = 0
        for st in plan.steps:
            if st.kind == "wait":
                waited[st.rank].add(owners[st.event])
            if st.kind != "copy" or st.srcs[0].rank == st.dst.rank:
                continue
            src, dst = st.srcs[0].rank, st.dst.rank
            if tree.parent(dst) == src:  # down the tree
                down += 1
                assert st.rank == dst, st
                assert src in waited[dst], st
        assert down > 0
        if coll == "broadcast":
            xs = [np.full(200, float(r)) for r in range(8)]
            w.broadcast(xs, root=0)
            assert all(np.all(x == 0.0) for x in xs)


def test_ring_copy_pattern():
    n, count = 4, 4000
    with nt.World(nt.devices(f"cpu:{n}"), algorithm="ring", chunk_bytes=1 << 20,
                  inline_bytes=0) as w:
        xs = [np.ones(count, np.float32) for _ in range(n)]
        with record_transfers() as log:
            w.all_reduce(xs)
    got = _bytes_by_pair(log)
    seg = count // n * 4
    want = {}
    for r in range(n):
        p = (r - 1) % n
        want[(p, r, "peer_read")] = (n - 1) * seg  # reduce-scatter reads the left neighbour
        want[(p, r, "copy")] = (n - 1) * seg  # all-gather pulls from the left neighbour
    assert got == want


def test_direct_copy_pattern():
    n, count = 3, 3000
    with nt.World(nt.devices(f"cpu:{n}"), algorithm="direct", inline_bytes=0) as w:
        xs = [np.ones(count) for _ in range(n)]
        with record_transfers() as log:
            w.all_reduce(xs)
    got = _bytes_by_pair(log)
    sl = count // n * 8
    want = {}
    for r in range(n):
        for q in range(n):
            if q != r:
                want[(q, r, "peer_read")] = sl  # r reduces its slice reading q
                want[(r, q, "copy")] = sl  # then writes it to q
    assert got == want


@pytest.mark.parametrize("alg", ["tree", "ring", "direct"])
@pytest.mark.parametrize("coll", ["all_reduce", "reduce", "reduce_scatter"])
@pytest.mark.parametrize("n", [2, 3, 8])
def test_mean_is_folded_into_the_final_sums(alg, coll, n):
    tree_for = _trees(nt.Topology.preset(f"flat:{n}"))
    kw = dict(size=n, count=100 * n, chunk=16, tree_for=tree_for)
    mean = build_plan(alg, coll, op="mean", **kw)
    total = build_plan(alg, coll, op="sum", **kw)
    # no separate pass: the same steps as the sum, some of them scaled by 1/n
    assert [s.kind for s in mean.steps] == [s.kind for s in total.steps]
    assert not any(s.kind == "scale" for s in mean.steps)
    scaled = [s for s in mean.steps if s.alpha != 1.0]
    assert scaled and all(s.kind == "reduce" and s.alpha == 1.0 / n for s in scaled)
    assert all(s.alpha == 1.0 for s in total.steps)
    assert " * 0." in str(mean)


def test_finish_mean_keeps_the_scale_where_it_cannot_fold():
    from nccltree.comm.algorithms import _finish_mean

    a, b, c = Buf(0, "in", 0, 4), Buf(1, "in", 0, 4), Buf(0, "out", 0, 4)
    cases = {
        "after a copy": lambda pb: pb.copy(0, c, a),
        "after a reduce into another buffer": lambda pb: pb.reduce(0, a, [a, b], "sum"),
        "after a reduce on another rank": lambda pb: pb.reduce(1, c, [a, b], "sum"),
        "after an event": lambda pb: (pb.reduce(0, c, [a, b], "sum"), pb.signal(0)),
    }
    for what, steps in cases.items():
        pb = PlanBuilder(2)
        steps(pb)
        _finish_mean(pb, 0, c, "mean", 2)
        kinds = [s.kind for s in pb._steps]
        assert kinds[-1] == "scale" and all(s.alpha == 1.0 for s in pb._steps[:-1]), what
    pb = PlanBuilder(2)
    pb.reduce(0, c, [a, b], "sum")
    _finish_mean(pb, 0, c, "mean", 2)
    assert [(s.kind, s.alpha) for s in pb._steps] == [("reduce", 0.5)]
    # a scaled single-source reduce stays a reduce (a copy could not carry alpha)
    pb = PlanBuilder(2)
    pb.reduce(0, c, [a], "sum", alpha=0.5)
    assert [(s.kind, s.alpha) for s in pb._steps] == [("reduce", 0.5)]


def test_plan_str_and_transfers_are_readable():
    plan = build_plan("tree", "all_reduce", size=2, count=4, chunk=4,
                      tree_for=_trees(nt.Topology.preset("flat:2")))
    text = str(plan)
    assert "tree all_reduce" in text and "reduce(sum)" in text
    assert sorted(plan.transfers()) == [(0, 1, 4), (1, 0, 4)]


def test_links_without_peer_access_are_staged_through_bounded_host_memory():
    topo = nt.Topology.preset("pcie2s8")
    tree = nt.build_tree(topo)
    chunk = 100
    plan = build_plan("tree", "all_reduce", size=8, count=10_000, chunk=chunk,
                      tree_for=lambda root: tree)
    crossing = [(p, c) for p, c, _ in tree.edges if not topo.link(p, c).p2p]
    assert crossing, "the two-socket preset has edges without peer access"
    # no step reads or writes across a link without peer access...
    for s in plan.steps:
        for b in s.touches:
            if b.role != "stage" and b.rank != s.rank:
                assert topo.link(b.rank, s.rank).p2p, (s, b)
    # ...the staging memory is two chunks per sending rank, whatever the message size
    assert plan.stage and all(v == 2 * chunk for v in plan.stage.values())
    assert check_races(plan) == []
